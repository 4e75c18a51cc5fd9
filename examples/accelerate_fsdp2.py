"""A compressed optimizer under accelerate's FSDP2 plugin with HSDP (``ParallelismConfig(dp_replicate_size=2,
dp_shard_size=2)``): a tiny byte-level GPT-2 on Python's help texts, 4 CPU ranks, Gloo.

    torchrun --standalone --nproc-per-node 4 examples/accelerate_fsdp2.py --optimizer onebitadam --steps 200 --freeze-step 50

What accelerate builds: a ``("dp_replicate", "dp_shard")`` device mesh, and in ``prepare`` FSDP2's own
HSDP, ``fully_shard(module, mesh=mesh[("dp_replicate", "dp_shard_cp")])`` on each transformer block,
the embeddings, the tail and the root. The optimizer finds the replicate dimension in the parameters'
mesh (no ``backend=``): in the warmup FSDP all-reduces across the replicas, from the freeze on the
1-bit exchange does (docs/modes.md, "HSDP").

The recipe's one line of glue: under FSDP2 ``accelerator.prepare`` needs an optimizer with the model and
swaps that optimizer's parameters for their shards *after* making it, which a compressed optimizer
cannot follow (its buckets, hooks and exchange group come from its parameters). So ``prepare`` gets a
stand-in (``torch.optim.SGD``, no state), and the compressed optimizer is made from the sharded
model and put in its place, behind accelerate's ``AcceleratedOptimizer`` (``opt.optimizer = ...``).
Clipping is ``accelerator.clip_grad_norm_`` (FSDP2: the model's DTensor gradients; in the warmup the
global average, as HSDP + AdamW). ``--save-at``/``--resume`` use ``accelerator.save_state`` /
``load_state``, which under FSDP2 checkpoint the optimizer through torch's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict``.

On CPU ranks accelerate 1.15 does not turn FSDP on (``harness.accelerate_fsdp_on_cpu``, not part of
the recipe). The measurements (``harness.sharded_result``) are not part of the recipe either.
"""  # noqa: E501 - the torchrun command line above is kept whole, for copying
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under python -P

import torch  # noqa: E402
from accelerate import Accelerator, FullyShardedDataParallelPlugin  # noqa: E402
from accelerate.parallelism_config import ParallelismConfig  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

import harness  # noqa: E402


def main():
    args = harness.parse_args(__doc__)
    with harness.accelerate_fsdp_on_cpu():  # (CPU ranks only: see the module doc)
        # --- the recipe ---------------------------------------------------------------------------------
        accelerator = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
                                  parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
                                  mixed_precision="bf16" if args.bf16 else "no")
    set_seed(args.seed)
    model = GPT2LMHeadModel(harness.gpt2_config())
    loader = torch.utils.data.DataLoader(harness.ByteWindows(), batch_size=harness.BATCH, shuffle=True, drop_last=True)
    if args.optimizer == "adamw":  # the baseline: accelerate's own FSDP2 recipe, unchanged
        model, opt, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=args.lr), loader)
    else:
        model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.0), loader)
        opt.optimizer = harness.make_optimizer(args, model.parameters())  # (the sharded parameters)
        # e.g. opt.optimizer = compressed_opt.OnebitAdam(model.parameters(), lr=2e-3, freeze_step=50)
    start = 0
    if args.resume:
        accelerator.load_state(args.checkpoint)
        start = args.save_at
        loader = accelerator.skip_first_batches(loader, start)
    losses = []
    model.train()
    batches = iter(itertools.cycle(loader))
    for step in range(start + 1, args.steps + 1):
        batch = next(batches)
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == args.save_at and not args.resume:
            accelerator.save_state(args.checkpoint)
    # -------------------------------------------------------------------------------------------------
    mesh = accelerator.torch_device_mesh
    harness.sharded_result(args, "accelerate-fsdp2", losses, list(model.parameters()),
                           place=mesh["dp_shard"].get_local_rank(), replicas=mesh["dp_replicate"].size(),
                           optimizer=None if args.optimizer == "adamw" else opt.optimizer)
    accelerator.end_training()


if __name__ == "__main__":
    main()
