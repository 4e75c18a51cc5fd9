"""End-to-end training benchmark: compressed optimizers against DDP + AdamW, fp16 and PowerSGD hooks.

The entry point of the package ``e2e`` beside this file (``e2e/__init__.py`` says what is
measured and how; ``make demo`` and ``make bench`` run it). Examples::

    python -P benchmarks/train.py --model tiny --methods ddp_adamw,onebit_adam --steps 100
    python -P benchmarks/train.py --model small --link 1gbit --batch 1 --seq-len 32 --breakdown
    python -P benchmarks/train.py --model tiny --link 100mbit --steps 120   # make demo's link (no root needed)
    torchrun --nproc-per-node 2 benchmarks/train.py --methods ddp_adamw,onebit_adam

This folder goes on ``sys.path`` (for ``e2e`` and ``common``); the repository root must not (its
``cuda/`` folder shadows NVIDIA's ``cuda`` package): run Python with ``-P``, as the Makefile does
(torchrun runs a script without the current folder on ``sys.path``, so it is safe too).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e.cli import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli())
