"""End-to-end training benchmark: compressed optimizers against DDP + AdamW, fp16 and PowerSGD hooks.

A thin entry point: everything lives in :mod:`compressed_opt.bench` (installed, so
``python -P -m compressed_opt.bench`` is the same). Examples::

    python -P benchmarks/train.py --model tiny --methods ddp_adamw,onebit_adam --steps 100
    python -P benchmarks/train.py --model small --link 1gbit --batch 1 --seq-len 32 --breakdown   # root
    torchrun --nproc-per-node 2 benchmarks/train.py --methods ddp_adamw,onebit_adam

Run Python with ``-P`` (or from this folder) when the repository root would otherwise land on
``sys.path`` (its ``cuda/`` folder shadows NVIDIA's ``cuda`` package).
"""
import sys

from compressed_opt.bench import cli

if __name__ == "__main__":
    sys.exit(cli())
