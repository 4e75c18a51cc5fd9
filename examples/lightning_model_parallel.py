"""A compressed optimizer under Lightning's ``ModelParallelStrategy(data_parallel_size=2,
tensor_parallel_size=2)``: a tiny byte-level transformer on Python's help texts, tensor parallel
inside each replica, 1-bit Adam across the replicas; 4 CPU ranks, Gloo.

    python examples/lightning_model_parallel.py --optimizer onebitadam --steps 200 --freeze-step 50

Lightning starts the other ranks itself (``devices=4``; under ``torchrun --standalone
--nproc-per-node 4`` it uses torchrun's ranks instead). What Lightning builds: a
``("data_parallel", "tensor_parallel")`` device mesh (``self.device_mesh``), a sampler giving each
data-parallel replica its own batches, and nothing else: the parallelism is the user's
``configure_model``. Here it is tensor parallel over ``self.device_mesh["tensor_parallel"]``
(``parallelize_module``: q/k/v and the first MLP layer ``ColwiseParallel``, the output projections
``RowwiseParallel``; embeddings, norms and the head stay plain), and nothing over
``"data_parallel"``: averaging the replicas is the optimizer's, made in ``configure_optimizers``
with ``backend=self.device_mesh["data_parallel"]`` (full precision in the warmup, the 1-bit
exchange from the freeze on; the DTensor parameters step on their local shards, docs/modes.md).

Clipping: ``gradient_clip_val=1.0`` with ``configure_gradient_clipping`` clipping the model's
parameters (their DTensor gradients: the norm of the replica's whole model; in the warmup each
replica's own, the optimizer averaging the replicas in ``step()``). Lightning's default clips the
optimizer's parameters with torch's ``clip_grad_norm_``, which refuses parameters on several meshes
(plain embeddings and norms beside tensor-parallel layers here; FSDP's 1-D and 2-D DTensors in
AdamW's FSDP + TP run): ``clip_grad_norm`` below makes each gradient's norm whole first.
``--save-at``/``--resume``: a ``ModelCheckpoint`` and ``fit(ckpt_path=...)``; the strategy checkpoints
the optimizer through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.

``--optimizer adamw`` is Lightning's own 2-D recipe instead, the baseline: the same tensor
parallel plan, then FSDP2 over ``"data_parallel"`` (``fully_shard``), which averages the replicas'
gradients for ``torch.optim.AdamW``. The measurements (a callback, ``harness.sharded_result``)
are not part of the recipe.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under python -P

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
from pytorch_lightning.strategies import ModelParallelStrategy  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

# (imported before Lightning loads a checkpoint, which it does before configure_optimizers:
# torch.load(weights_only=True) reads the optimizer's record once compressed_opt is imported)
import compressed_opt  # noqa: E402,F401
import harness  # noqa: E402

DIM, HEADS, LAYERS = 64, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        # (under tensor parallelism q, k, v hold this rank's heads: -1 is the local head count)
        q, k, v = (f(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class ByteTransformer(nn.Module):
    """A tiny byte-level causal transformer of nn.Linear layers (GPT-2's Conv1D layers take no
    tensor-parallel plan of torch's)."""

    def __init__(self):
        super().__init__()
        self.embed, self.pos = nn.Embedding(256, DIM), nn.Embedding(harness.SEQ_LEN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, 256, bias=False)

    def forward(self, ids):
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))


def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a model whose parameters live on several meshes (plain
    ones beside tensor-parallel DTensors, or FSDP's 1-D and 2-D DTensors), where torch's own stops
    at mixing them (for AdamW too): each gradient's norm made whole (``full_tensor``), then torch's
    clipping coefficient."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0).item()
    for g in grads:
        g.mul_(coef)
    return total


class ByteLM(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = ByteTransformer()

    def configure_model(self):
        tp = self.device_mesh["tensor_parallel"]
        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        for block in self.model.blocks:
            parallelize_module(block, tp, plan)
        if self.args.optimizer == "adamw":  # (the baseline: FSDP2 averages the replicas for AdamW)
            dp = self.device_mesh["data_parallel"]
            for block in self.model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(self.model, mesh=dp)

    def configure_optimizers(self):
        if self.args.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=self.args.lr)
        # e.g. return compressed_opt.OnebitAdam(self.parameters(), lr=2e-3, freeze_step=50,
        #                                       backend=self.device_mesh["data_parallel"])
        return harness.make_optimizer(self.args, self.parameters(), backend=self.device_mesh["data_parallel"])

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if gradient_clip_val:  # the model's (DTensor) gradients, not the optimizer's views of their shards
            clip_grad_norm(self.parameters(), gradient_clip_val)

    def training_step(self, batch, batch_idx):
        return self.model(batch)


class Measure(pl.Callback):
    """Measurements only: each optimizer step's loss on this rank."""

    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def main():
    args = harness.parse_args(__doc__)
    # --- the recipe -----------------------------------------------------------------------------
    pl.seed_everything(args.seed, verbose=False)
    module = ByteLM(args)
    loader = torch.utils.data.DataLoader(harness.ByteWindows(), batch_size=harness.BATCH, shuffle=True, drop_last=True)
    measure = Measure()
    callbacks, epochs = [measure], {}
    if args.save_at:  # (epochs of --save-at steps: Lightning resumes a plain DataLoader at an epoch's end)
        epochs = {"limit_train_batches": args.save_at}
        if not args.resume:
            callbacks.append(ModelCheckpoint(dirpath=args.checkpoint, filename="step{step}", save_top_k=-1,
                                             auto_insert_metric_name=False, every_n_train_steps=args.save_at))
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=args.steps, gradient_clip_val=1.0,
                         precision="bf16-mixed" if args.bf16 else "32-true", logger=False,
                         enable_checkpointing=len(callbacks) > 1, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, **epochs)
    ckpt = os.path.join(args.checkpoint, f"step{args.save_at}.ckpt") if args.resume else None
    trainer.fit(module, loader, ckpt_path=ckpt)
    # ---------------------------------------------------------------------------------------------
    mesh = strategy.device_mesh
    opt = trainer.optimizers[0]
    harness.sharded_result(args, "lightning-model-parallel", measure.losses, list(module.parameters()),
                           place=mesh["tensor_parallel"].get_local_rank(), replicas=mesh["data_parallel"].size(),
                           optimizer=None if args.optimizer == "adamw" else opt)


if __name__ == "__main__":
    main()
