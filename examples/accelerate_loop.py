"""A compressed optimizer in a Hugging Face accelerate training loop (``accelerator.prepare`` wraps
the model in DistributedDataParallel): a tiny byte-level GPT-2 on Python's help texts, 2 CPU
ranks, Gloo.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --optimizer onebitadam --steps 200 --freeze-step 50

(``accelerate launch --cpu`` would start a single process: it launches several CPU ranks only
through MPI.) The recipe is the optimizer passed to ``accelerator.prepare`` with the model and
the data, then one line that makes ``accelerator.save_state`` write every rank's optimizer state
(``compressed_opt.integrations.consolidate_before_save_state(accelerator, opt)``: rank 0 writes,
every rank resumes from that file); ``Accelerator`` must come first: it initialises
torch.distributed, which the optimizer's backend needs. The loop clips with
``accelerator.clip_grad_norm_(..., 1.0)`` as accelerate's examples do; ``--accumulation``, ``--bf16`` and ``--save-at``/``--resume`` use
accelerate's gradient accumulation, mixed precision and ``save_state``/``load_state``. The measurements (``harness.Meter``) are not part of the recipe.
"""  # noqa: E501 - the torchrun command line above is kept whole, for copying
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under python -P

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

import compressed_opt  # noqa: E402
import harness  # noqa: E402


def main():
    args = harness.parse_args(__doc__)
    # --- the recipe -----------------------------------------------------------------------------
    accelerator = Accelerator(cpu=True, mixed_precision="bf16" if args.bf16 else "no",
                              gradient_accumulation_steps=args.accumulation)
    set_seed(args.seed)
    model = GPT2LMHeadModel(harness.gpt2_config())
    opt = harness.make_optimizer(args, model.parameters())
    # e.g. opt = compressed_opt.OnebitAdam(model.parameters(), lr=2e-3, freeze_step=50)
    loader = torch.utils.data.DataLoader(harness.ByteWindows(), batch_size=harness.BATCH, shuffle=True, drop_last=True)
    raw_opt = opt
    model, opt, loader = accelerator.prepare(model, opt, loader)
    if args.optimizer != "adamw":  # (AdamW, the baseline, has nothing per rank to consolidate)
        compressed_opt.integrations.consolidate_before_save_state(accelerator, opt)
    start = 0
    if args.resume:  # every rank loads the one saved state (the optimizer: each rank's own part of it)
        accelerator.load_state(args.checkpoint)
        start = args.save_at
        loader = accelerator.skip_first_batches(loader, start * args.accumulation)
    meter = harness.Meter(args, "accelerate", None if args.optimizer == "adamw" else raw_opt)  # (measurements)
    meter.attach(model)
    model.train()
    batches = iter(itertools.cycle(loader))
    for step in range(start + 1, args.steps + 1):
        for _ in range(args.accumulation):
            batch = next(batches)
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    meter.after_backward()
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
        meter.step_end(loss.item())
        if step == args.save_at and not args.resume:
            accelerator.save_state(args.checkpoint)  # on every rank: accelerate writes from rank 0
            meter.checkpoint_done()
    # ---------------------------------------------------------------------------------------------
    meter.finish(accelerator.unwrap_model(model))
    accelerator.end_training()  # (the recipe) destroys the process group: an orderly exit on every rank


if __name__ == "__main__":
    main()
