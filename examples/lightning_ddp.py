"""A compressed optimizer under PyTorch Lightning's DDP strategy (which wraps the model in
DistributedDataParallel itself): a tiny byte-level GPT-2 on Python's help texts, 2 CPU ranks, Gloo.

    python examples/lightning_ddp.py --optimizer onebitadam --steps 200 --freeze-step 50

Lightning starts the second rank itself (``devices=2``: it runs this script again as a
subprocess); under ``torchrun --standalone --nproc-per-node 2`` it uses torchrun's ranks instead.
The recipe is ``configure_optimizers`` returning the optimizer, with ``gradient_clip_val=1.0``;
``--accumulation``, ``--bf16`` and ``--save-at``/``--resume`` set ``accumulate_grad_batches``,
``precision="bf16-mixed"``, a ``ModelCheckpoint`` and ``fit(ckpt_path=...)``; Lightning consolidates
the optimizer's per-rank state before it saves by itself (no line to add).
Lightning makes the optimizer after wrapping the model in DDP and after torch.distributed is up.
The measurements (``harness.Meter``, a callback) are not part of the recipe.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under python -P

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import ModelCheckpoint  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

# (imported before Lightning loads a checkpoint, which it does before configure_optimizers:
# torch.load(weights_only=True) reads the optimizer's record once compressed_opt is imported)
import compressed_opt  # noqa: E402,F401
import harness  # noqa: E402


class ByteGPT(pl.LightningModule):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.model = GPT2LMHeadModel(harness.gpt2_config())

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self):
        # e.g. return compressed_opt.OnebitAdam(self.parameters(), lr=2e-3, freeze_step=50)
        return harness.make_optimizer(self.args, self.parameters())


class Measure(pl.Callback):
    """Measurements only: the DDP module is ``trainer.strategy.model`` once fitting starts."""

    def __init__(self, args):
        self.args, self.meter, self.step = args, None, None

    def on_train_start(self, trainer, module):
        self.step = trainer.global_step  # (resumed: the checkpoint's)
        opt = trainer.optimizers[0]
        self.meter = harness.Meter(self.args, "lightning", None if self.args.optimizer == "adamw" else opt)
        self.meter.attach(trainer.strategy.model)

    def on_before_optimizer_step(self, trainer, module, optimizer):  # after backward, before clipping
        self.meter.after_backward()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:  # an optimizer step (not a micro-batch of one)
            self.step = trainer.global_step
            self.meter.step_end(outputs["loss"].item())

    def on_save_checkpoint(self, trainer, module, checkpoint):  # after the optimizer's state was taken
        self.meter.checkpoint_done()


def main():
    args = harness.parse_args(__doc__)
    # --- the recipe -----------------------------------------------------------------------------
    pl.seed_everything(args.seed, verbose=False)
    model = ByteGPT(args)
    loader = torch.utils.data.DataLoader(harness.ByteWindows(), batch_size=harness.BATCH, shuffle=True, drop_last=True)
    measure = Measure(args)
    callbacks, epochs = [measure], {}
    if args.save_at:  # epochs of --save-at steps, a checkpoint after the first one's last step (Lightning
        # cannot resume a plain DataLoader mid-epoch, and resuming from an epoch-end checkpoint
        # replays one batch: either way AdamW itself would not resume exactly)
        epochs = {"limit_train_batches": args.save_at * args.accumulation}
        if not args.resume:
            callbacks.append(ModelCheckpoint(dirpath=args.checkpoint, filename="step{step}", save_top_k=-1,
                                             auto_insert_metric_name=False, every_n_train_steps=args.save_at))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, gradient_clip_val=1.0,
                         accumulate_grad_batches=args.accumulation, precision="bf16-mixed" if args.bf16 else "32-true",
                         logger=False, enable_checkpointing=len(callbacks) > 1, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks, **epochs)
    ckpt = os.path.join(args.checkpoint, f"step{args.save_at}.ckpt") if args.resume else None
    # (no line to add for the checkpoints: Lightning calls optimizer.consolidate_state_dict() on every rank
    # before saving, so its file holds every rank's optimizer state)
    trainer.fit(model, loader, ckpt_path=ckpt)
    # ---------------------------------------------------------------------------------------------
    measure.meter.finish(model.model)


if __name__ == "__main__":
    main()
