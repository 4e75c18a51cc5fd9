"""What a user gets with default arguments: the same result every run, told what happens, AdamW's
defaults.

* reproducible: the README's job (a plain model, every argument left at its default but the
  freeze step) gives bit-identical parameters in two separate launches, overlapped and not;
* visible: rank 0 writes one WARNING line at the first step (what the optimizer will do) and one
  at the first compression step (what compression does, with the bytes counted), nothing on
  other ranks; ``optimizer.comm_stats()`` has bytes per step by stage against an fp32 all-reduce;
  a ``freeze_step`` left at its default is called out;
* AdamW's defaults: ``lr``, ``betas``, ``eps`` and ``weight_decay`` as ``torch.optim.AdamW``'s.
"""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam
from distributed import run_ranks


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _job(rank, world, freeze, steps, overlap=True):
    """The README's loop on a 66k-parameter MLP, defaults but ``freeze_step``."""
    lines = _Lines()
    logging.getLogger("compressed_opt").addHandler(lines)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 64))
    opt = OnebitAdam(model.parameters(), overlap=overlap, **({} if freeze is None else {"freeze_step": freeze}))
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), x.roll(1, dims=1)).backward()
        opt.step()
    logging.getLogger("compressed_opt").removeHandler(lines)
    report = opt.comm_stats()
    return {"report": report.as_dict(), "text": str(report), "lines": lines.lines, "stats": repr(opt.backend.stats),
            "params": [p.detach().clone() for p in model.parameters()]}


def _twice(rank, world):
    return {"overlap": _job(rank, world, 4, 10), "sync": _job(rank, world, 4, 10, overlap=False)}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_default_job_reproduces_bit_for_bit_and_says_what_it_does():
    first, second = run_ranks(_twice, 2, timeout=150), run_ranks(_twice, 2, timeout=150)
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))  # noqa: E731
    for rank in range(2):
        assert same(first[rank]["overlap"], second[rank]["overlap"]), "two launches of the same job differ"
        assert same(first[rank]["overlap"], first[rank]["sync"]), "overlap=True differs from overlap=False"
        assert same(first[rank]["overlap"], first[0]["overlap"]), "the ranks differ"
    run = first[0]["overlap"]
    report = run["report"]
    assert (report["warmup_steps"], report["compression_steps"], report["freeze_step"]) == (4, 6, 4)
    assert report["stage"] == "compression" and report["paths"] == {"1bit": 1}
    assert report["exchange"] == "flat 1-bit over 2 ranks"
    # warmup: the fp32 all-reduce (plus the small per-step agreements); compression: >20x fewer bytes
    assert report["fp32_allreduce_bytes_per_step"] <= report["warmup_bytes_per_step"] < (
        1.05 * report["fp32_allreduce_bytes_per_step"])
    assert report["compression_ratio"] > 20, report
    assert report["setup_bytes"] >= 4 * sum(p.numel() for p in run["params"])  # rank 0's parameter broadcast
    assert "compression sends" in run["text"] and "x fewer" in run["text"], run["text"]
    assert run["stats"].startswith("CommStats(total ") and "all_to_all: " in run["stats"], run["stats"]
    # rank 0 says what happens, once each, at WARNING (shown without any logging set up); rank 1 says nothing
    lines = run["lines"]
    assert len(lines) == 2, lines
    assert "OnebitAdam on 2 ranks" in lines[0] and "full precision through step 4" in lines[0], lines
    assert "NOTE" not in lines[0], lines
    assert "compresses from step 5" in lines[1] and "1 bucket(s) on the 1-bit exchange, 0 on fp32" in lines[1], lines
    assert "x fewer than an fp32 all-reduce" in lines[1], lines
    assert first[1]["overlap"]["lines"] == []


def _default_freeze(rank, world):
    return _job(rank, world, None, 2)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_freeze_step_left_at_its_default_is_called_out():
    run = run_ranks(_default_freeze, 2, timeout=90)[0]
    assert len(run["lines"]) == 1 and "left at its default (100000 steps)" in run["lines"][0], run["lines"]
    assert run["report"]["compression_steps"] == 0 and run["report"]["compression_ratio"] is None
    assert "compression: 0 steps, - per step" in run["text"], run["text"]


@pytest.mark.parametrize("cls", [OnebitAdam, OnebitLamb, ZeroOneAdam])
def test_defaults_are_adamws(cls):
    adamw = torch.optim.AdamW([nn.Parameter(torch.zeros(2))]).defaults
    ours = cls([nn.Parameter(torch.zeros(2))]).defaults
    for key in ("lr", "betas", "eps", "weight_decay"):
        assert ours[key] == adamw[key], (key, ours[key], adamw[key])


def test_a_report_before_any_step_and_on_one_rank():
    opt = OnebitAdam([nn.Parameter(torch.zeros(10))], freeze_step=1)
    report = opt.comm_stats()
    assert report.warmup_steps == report.compression_steps == 0 and report.compression_ratio is None
    assert report.exchange == "none (one rank)" and report.fp32_allreduce_bytes_per_step == 0
    assert "step 0, warmup stage" in str(report)
