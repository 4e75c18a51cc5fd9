"""A compressed optimizer under PyTorch Lightning's DDP strategy (which wraps the model in
DistributedDataParallel itself): a tiny byte-level GPT-2 on Python's help texts, 2 CPU ranks, Gloo.

    python examples/lightning_ddp.py --optimizer onebitadam --steps 200 --freeze-step 50

Lightning starts the second rank itself (``devices=2``: it runs this script again as a
subprocess); under ``torchrun --standalone --nproc-per-node 2`` it uses torchrun's ranks instead.
The recipe is ``configure_optimizers`` returning the optimizer, with ``gradient_clip_val=1.0``.
Lightning makes the optimizer after wrapping the model in DDP and after torch.distributed is up.
The measurements (``harness.Meter``, a callback) are not part of the recipe.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under python -P

import pytorch_lightning as pl  # noqa: E402
import torch  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

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
        self.args, self.meter = args, None

    def on_train_start(self, trainer, module):
        opt = trainer.optimizers[0]
        self.meter = harness.Meter(self.args, "lightning", None if self.args.optimizer == "adamw" else opt)
        self.meter.attach(trainer.strategy.model)

    def on_before_optimizer_step(self, trainer, module, optimizer):  # after backward, before clipping
        self.meter.after_backward()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.meter.step_end(outputs["loss"].item())


def main():
    args = harness.parse_args(__doc__)
    # --- the recipe -----------------------------------------------------------------------------
    pl.seed_everything(args.seed, verbose=False)
    model = ByteGPT(args)
    loader = torch.utils.data.DataLoader(harness.ByteWindows(), batch_size=harness.BATCH, shuffle=True, drop_last=True)
    measure = Measure(args)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps, gradient_clip_val=1.0,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[measure])
    trainer.fit(model, loader)
    # ---------------------------------------------------------------------------------------------
    measure.meter.finish(model.model)


if __name__ == "__main__":
    main()
