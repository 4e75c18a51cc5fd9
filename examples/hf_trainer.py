"""A compressed optimizer under the Hugging Face transformers ``Trainer`` (which wraps the model in
DistributedDataParallel itself): a tiny byte-level GPT-2 on Python's help texts, 2 CPU ranks, Gloo.

    torchrun --standalone --nproc-per-node 2 examples/hf_trainer.py --optimizer onebitadam --steps 200 --freeze-step 50

The recipe is the optimizer passed as ``optimizers=(opt, None)`` and one callback,
``compressed_opt.integrations.ConsolidateBeforeSave()``, which makes the Trainer's checkpoints hold
every rank's optimizer state (rank 0 saves, every rank resumes from that file); everything else is
the Trainer's defaults (its linear LR schedule, ``max_grad_norm=1.0`` clipping); ``--accumulation``, ``--bf16`` and
``--save-at``/``--resume`` set the Trainer's ``gradient_accumulation_steps``, ``bf16``, ``save_steps``
and ``resume_from_checkpoint``. ``TrainingArguments`` must come
first: it initialises torch.distributed, which the optimizer's backend needs.
``--optimizer adamw`` leaves the optimizer to the Trainer (its default AdamW). The measurements
(``harness.Meter``, a callback) are not part of the recipe.
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under python -P

import torch  # noqa: E402
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import compressed_opt  # noqa: E402
import harness  # noqa: E402


def main():
    args = harness.parse_args(__doc__)
    with tempfile.TemporaryDirectory(prefix="co-hf-trainer-") as scratch:  # nothing is saved there
        # --- the recipe -------------------------------------------------------------------------
        saving = {"save_strategy": "steps", "save_steps": args.save_at} if args.save_at else {"save_strategy": "no"}
        training_args = TrainingArguments(
            output_dir=args.checkpoint or scratch, max_steps=args.steps, per_device_train_batch_size=harness.BATCH,
            gradient_accumulation_steps=args.accumulation, bf16=args.bf16,
            learning_rate=args.lr, seed=args.seed, use_cpu=True, ddp_backend="gloo",
            logging_steps=1, report_to="none", disable_tqdm=True, **saving,
        )  # (max_grad_norm=1.0 by default)
        torch.manual_seed(args.seed)
        model = GPT2LMHeadModel(harness.gpt2_config())
        opt = None if args.optimizer == "adamw" else harness.make_optimizer(args, model.parameters())
        # e.g. opt = compressed_opt.OnebitAdam(model.parameters(), lr=2e-3, freeze_step=50)
        callback = Measure(args, opt)  # (measurements)
        trainer = Trainer(model=model, args=training_args, train_dataset=harness.ByteWindows(as_dict=True),
                          optimizers=(opt, None),
                          callbacks=[callback, compressed_opt.integrations.ConsolidateBeforeSave()])
        callback.trainer = trainer
        resume = os.path.join(args.checkpoint, f"checkpoint-{args.save_at}") if args.resume else None
        trainer.train(resume_from_checkpoint=resume)  # every rank loads the one saved optimizer file
        # ---------------------------------------------------------------------------------------
        callback.meter.finish(trainer.model, losses=callback.losses)


class Measure(TrainerCallback):
    """Measurements only: the DDP module is ``trainer.model_wrapped`` once training begins."""

    def __init__(self, args, opt):
        self.args, self.opt, self.trainer, self.meter, self.losses = args, opt, None, None, []

    def on_train_begin(self, args, state, control, **kwargs):
        self.meter = harness.Meter(self.args, "hf_trainer", self.opt)
        self.meter.attach(self.trainer.model_wrapped)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):  # after backward and clipping
        self.meter.after_backward()

    def on_step_end(self, args, state, control, **kwargs):
        self.meter.step_end()

    def on_save(self, args, state, control, **kwargs):
        self.meter.checkpoint_done()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:  # the Trainer's loss, averaged over the ranks
            self.losses.append(float(logs["loss"]))


if __name__ == "__main__":
    main()
