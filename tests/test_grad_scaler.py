"""Under ``torch.amp.GradScaler``, an overflow on one rank skips the step on every rank, and the
ranks' scales stay equal.

``_step_supports_amp_scaling`` is ``False``, as for torch's optimizers: GradScaler unscales
``p.grad`` in place and calls ``step()`` only where it found no inf/NaN. In a full-precision step
the average carries an inf to every rank; in a compression step each rank keeps its own gradient,
so at the end of backward the ranks share whether any holds inf/NaN and every rank's gets a NaN:
every rank's scaler then skips and backs off alike. Since scaling by a power of two is exact, such
a run must end bit for bit where the same run without a scaler ends (its overflowing steps
skipped as non-finite, on every rank too, and its loop touching ``p.grad`` as the scaler does):
checked for 1-bit Adam (overflow in warmup and in the
compression stage; without its variance tracking, whose calibration takes second moments as
backward made them, in the scaler's units: the same ratio, other weights in its EMA once the scale
changes) and 0/1 Adam (overflow in a 1-bit step of phase A, full-precision refreshes after it),
standalone, synchronous and under DDP; also that a compression step launched from backward under
a GradScaler is refused loudly (GradScaler touches ``p.grad``: the exchange runs in ``step()``).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, ZeroOneAdam
from distributed import run_ranks
from optim_tasks import mlp, shard_batches

OVERFLOW = (1, 4)  # 0-based steps at which rank 1's backward overflows


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
        if step in OVERFLOW and rank == 1:
            x = x.clone()
            x[0, 0] = float("inf")
        loss = nn.functional.cross_entropy(net(x), y)
        (scaler.scale(loss) if scaled else loss).backward()
        before = opt.global_step
        if scaled:
            scaler.step(opt)
            scaler.update()
        else:  # (touching p.grad as the scaler's unscale_ does: the exchange runs in step() alike)
            torch._foreach_mul_([p.grad for p in model.parameters()], 1.0)
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
def test_an_overflow_on_one_rank_skips_everywhere_and_the_scales_stay_equal(name, mode):
    runs = run_ranks(_both, 2, name, mode, timeout=180)
    for rank in range(2):
        scaled, plain = runs[rank]["scaled"], runs[rank]["plain"]
        assert scaled["taken"] == plain["taken"] and [scaled["taken"][i] for i in OVERFLOW] == [0, 0], scaled["taken"]
        for a, b in zip(scaled["params"], plain["params"]):
            assert torch.equal(a, b), (rank, (a - b).abs().max())
    assert runs[0]["scaled"]["scale"] == runs[1]["scaled"]["scale"] == 2.0**8  # (backed off twice, on every rank)
    if name == "adam":  # 1-bit Adam's ranks hold the same parameters (0/1 Adam's differ between syncs)
        assert all(torch.equal(a, b) for a, b in zip(runs[0]["scaled"]["params"], runs[1]["scaled"]["params"]))


def _inf_found_on_one_rank(rank, world):
    """Rank 1's loop writes an inf into a gradient after backward (a value its scaler alone then
    finds): its ``scaler.step`` skips ``step()`` there only."""
    model = mlp()
    opt = OnebitAdam(model.parameters(), lr=3e-3, freeze_step=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for step, (x, y) in enumerate(shard_batches(rank, 2, 6, batch=16)):
        try:
            opt.zero_grad()
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            if step == 2 and rank == 1:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_scaler_that_finds_inf_on_one_rank_only_makes_every_rank_raise_clearly():
    """Where only one rank's scaler found inf (its loop changed the gradient after the average),
    that rank skips ``step()`` alone: every rank raises the library's error naming it, instead of
    a Gloo abort."""
    errors = run_ranks(_inf_found_on_one_rank, 2, timeout=90)
    for error in errors:
        assert error is not None and error.startswith("RanksOutOfStep"), errors
        assert "rank(s) [1] ran the backward of step 3 and then zero_grad() without step()" in error
