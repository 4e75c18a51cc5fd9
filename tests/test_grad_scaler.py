"""Under ``torch.amp.GradScaler``, an overflow on one rank skips the step on every rank, and the
ranks' scales, which may then differ, never mix.

GradScaler hands ``step()`` its ``found_inf`` and scale on every rank (torch's
``_step_supports_amp_scaling`` protocol, no caller inspected); the ranks agree and all skip.
Each rank's scaler then backs off on its own finding, so the scales can differ from then on:
every full-precision average after that is taken of the gradients each rank unscaled itself (in
``step()``, not in backward or a DDP hook). Since unscaling by a power of two is exact, a run
with a GradScaler whose rank 1 overflows at some steps must end bit for bit where the same run
without a scaler ends when rank 1's gradients are non-finite at those steps (skipped on every
rank too): that is checked for 1-bit Adam (overflow in warmup and in the compression stage, then
full-precision warmup steps after the first) and 0/1 Adam (variance refreshes at full precision
after an overflow in a 1-bit step), standalone and under DDP. (1-bit Adam without its variance
tracking: the tracking's calibration, a ratio of second moments, is taken as backward made them,
in the scaler's units while the ranks share a scale and unscaled after: the same ratio, other
weights in its EMA, so not bit for bit the unscaled run's.)
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, ZeroOneAdam
from distributed import run_ranks
from optim_tasks import mlp, shard_batches

OVERFLOW = (1, 4)  # 0-based steps at which rank 1's gradient holds inf


def _run(rank, name, mode, scaled):
    model = mlp()
    net = nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    if name == "adam":
        opt = OnebitAdam(model.parameters(), lr=3e-3, freeze_step=3, overlap=mode != "sync", variance_tracking=False)
    else:
        opt = ZeroOneAdam(model.parameters(), lr=3e-3, var_freeze_step=12, var_update_scaler=1, overlap=mode != "sync")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaled else None
    taken = []
    for step, (x, y) in enumerate(shard_batches(rank, 2, 10, batch=16)):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        (scaler.scale(loss) if scaled else loss).backward()
        if step in OVERFLOW and rank == 1:
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        before = opt.global_step
        if scaled:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        taken.append(opt.global_step - before)
    return {"taken": taken, "params": [p.detach().clone() for p in model.parameters()],
            "scale": None if scaler is None else scaler.get_scale()}


def _both(rank, world, name, mode):
    return {"scaled": _run(rank, name, mode, True), "plain": _run(rank, name, mode, False)}


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,mode", [("adam", "overlap"), ("adam", "sync"), ("adam", "ddp"), ("zero_one", "overlap"),
                                       ("zero_one", "ddp")])
def test_an_overflow_on_one_rank_skips_everywhere_and_the_scales_never_mix(name, mode):
    runs = run_ranks(_both, 2, name, mode, timeout=180)
    for rank in range(2):
        scaled, plain = runs[rank]["scaled"], runs[rank]["plain"]
        assert scaled["taken"] == plain["taken"] and [scaled["taken"][i] for i in OVERFLOW] == [0, 0], scaled["taken"]
        for a, b in zip(scaled["params"], plain["params"]):
            assert torch.equal(a, b), (rank, (a - b).abs().max())
    assert runs[0]["scaled"]["scale"] != runs[1]["scaled"]["scale"]  # (each scaler backed off on its own finding)
    if name == "adam":  # 1-bit Adam's ranks hold the same parameters (0/1 Adam's differ between syncs)
        assert all(torch.equal(a, b) for a, b in zip(runs[0]["scaled"]["params"], runs[1]["scaled"]["params"]))
