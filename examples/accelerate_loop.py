"""A compressed optimizer in a Hugging Face accelerate training loop (``accelerator.prepare`` wraps
the model in DistributedDataParallel): a tiny byte-level GPT-2 on Python's help texts, 2 CPU
ranks, Gloo.

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --optimizer onebitadam --steps 200 --freeze-step 50

(``accelerate launch --cpu`` would start a single process: it launches several CPU ranks only
through MPI.) The recipe is the optimizer passed to ``accelerator.prepare`` with the model and
the data; ``Accelerator`` must come first: it initialises torch.distributed, which the
optimizer's backend needs. The loop clips with ``accelerator.clip_grad_norm_(..., 1.0)`` as
accelerate's examples do. The measurements (``harness.Meter``) are not part of the recipe.
"""  # noqa: E501 - the torchrun command line above is kept whole, for copying
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # harness.py, also under python -P

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402

import harness  # noqa: E402


def main():
    args = harness.parse_args(__doc__)
    # --- the recipe -----------------------------------------------------------------------------
    accelerator = Accelerator(cpu=True)
    set_seed(args.seed)
    model = GPT2LMHeadModel(harness.gpt2_config())
    opt = harness.make_optimizer(args, model.parameters())
    # e.g. opt = compressed_opt.OnebitAdam(model.parameters(), lr=2e-3, freeze_step=50)
    loader = torch.utils.data.DataLoader(harness.ByteWindows(), batch_size=harness.BATCH, shuffle=True, drop_last=True)
    raw_opt = opt
    model, opt, loader = accelerator.prepare(model, opt, loader)
    meter = harness.Meter(args, "accelerate", None if args.optimizer == "adamw" else raw_opt)  # (measurements)
    meter.attach(model)
    model.train()
    for batch in itertools.islice(itertools.cycle(loader), args.steps):
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        meter.after_backward()
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        meter.step_end(loss.item())
    # ---------------------------------------------------------------------------------------------
    meter.finish(accelerator.unwrap_model(model))
    accelerator.end_training()  # (the recipe) destroys the process group: an orderly exit on every rank


if __name__ == "__main__":
    main()
