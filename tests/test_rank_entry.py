"""Ranks that call different things end with an error on every rank, within seconds, not a hang.

One rank calls ``step()`` without a backward since the last step while the other runs backward
(whose hooks communicate: the warmup's averages, the compression stage's exchanges launched from
backward, a DDP model's reducer). Every step's first collective is an agreement on where each
rank entered the step (``ENTRY_BACKWARD``/``ENTRY_STEP`` in compressed_opt.optimizer): both
ranks raise there. Gloo's own timeout is left at its 30-minute default, as users have it, so a
hang fails the test by its deadline instead.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam
from distributed import spawn_ranks

FREEZE = 2
OPTIMIZERS = {"adam": (OnebitAdam, {"freeze_step": FREEZE}), "lamb": (OnebitLamb, {"freeze_step": FREEZE}),
              "zero_one": (ZeroOneAdam, {"var_freeze_step": FREEZE, "var_update_scaler": 1})}


def _skip_backward(rank, world, name, mode, skipped_step):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    net = nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    cls, kwargs = OPTIMIZERS[name]
    opt = cls(model.parameters(), overlap=mode != "sync", **kwargs)
    g = torch.Generator().manual_seed(rank)
    start = None
    for step in range(1, skipped_step + 1):
        opt.zero_grad()
        x = torch.randn(4, 8, generator=g)
        if step == skipped_step:
            start = time.monotonic()
        try:
            loss = net(x).square().mean()  # (every rank runs forward: DDP's own collectives are there)
            if not (rank == 1 and step == skipped_step):  # rank 1: step() without a backward
                loss.backward()
            opt.step()
        except Exception as exc:  # (rank 0 raises from backward, where its hooks communicate)
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start,
                    "compressing": opt.compressing, "step": step}
    return {"error": None, "step": skipped_step}


# warmup: step 2 (the freeze comes at its end); compression stage: step 5 (launched from backward)
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode,skipped_step", [("overlap", 1), ("overlap", 2), ("overlap", 5), ("sync", 2),
                                               ("sync", 5), ("ddp", 1), ("ddp", 2), ("ddp", 5)])
def test_step_without_backward_on_one_rank_raises_on_every_rank(mode, skipped_step):
    outcomes = spawn_ranks(_skip_backward, 2, "adam", mode, skipped_step, timeout=90)
    results = [value for status, value in outcomes]
    assert [status for status, _ in outcomes] == ["ok", "ok"], outcomes
    for rank, r in enumerate(results):
        assert r["error"] is not None, (rank, r)
        assert r["step"] == skipped_step, (rank, r)
        # the library's own message where it decided; a rank whose peer raised first may instead see the peer
        # leave (Gloo: connection closed) -- but never a hang
        assert "without a backward" in r["error"] or "Connection" in r["error"] or "closed" in r["error"], r
        assert r["seconds"] < 30, r
    assert any("without a backward" in r["error"] for r in results), results
    assert results[0]["compressing"] == (skipped_step > FREEZE)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["lamb", "zero_one"])
def test_every_optimizer_refuses_a_step_without_backward_on_one_rank(name):
    outcomes = spawn_ranks(_skip_backward, 2, name, "overlap", 5, timeout=60)  # (the compression stage)
    assert all(status == "ok" and value["error"] and value["seconds"] < 30 for status, value in outcomes), outcomes
    assert any("without a backward" in value["error"] for _, value in outcomes), outcomes


def _no_backward_anywhere(rank, world):
    """Every rank calls step() with gradients it set itself (no backward): allowed, as in torch."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = OnebitAdam(model.parameters(), freeze_step=1)
    for _ in range(3):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * (rank + 1))
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_gradients_set_by_hand_on_every_rank_still_step():
    a, b = (value for _, value in spawn_ranks(_no_backward_anywhere, 2, timeout=60))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _skipping(model, opt, rank, batch, skipped_step, who):
    """Every rank runs backward (on its ``batch``'s data); the ranks in ``who`` skip ``step()`` at
    ``skipped_step`` (a per-rank ``if torch.isfinite(loss): optimizer.step()``), then the loop goes
    on. The error where one was raised, else the steps taken and the bytes each ``zero_grad()``
    sent (across the replicas)."""
    start, sent = None, []
    for step in range(1, skipped_step + 3):
        try:
            if step == skipped_step:
                start = time.monotonic()
            before = opt.backend.stats.total_bytes
            opt.zero_grad()
            sent.append(opt.backend.stats.total_bytes - before)
            g = torch.Generator().manual_seed(100 * step + batch)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            if not (rank in who and step == skipped_step):
                opt.step()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - (start or 0.0),
                    "step": step}
    return {"error": None, "taken": opt.global_step, "sent": sent}


def _skip_step(rank, world, name, mode, skipped_step, who):
    """:func:`_skipping` on a plain model; with no error, the parameters too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    cls, kwargs = OPTIMIZERS[name]
    opt = cls(model.parameters(), overlap=mode != "sync", **kwargs)
    out = _skipping(model, opt, rank, rank, skipped_step, who)
    return out if out["error"] else dict(out, params=[p.detach().clone() for p in model.parameters()])


# warmup (averaged in backward, or in step()), the freeze step, the compression stage (launched from
# backward, or exchanged in step()); each optimizer once in the compression stage
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name,mode,skipped_step", [("adam", "overlap", 1), ("adam", "sync", 2), ("adam", "overlap", 5),
                                                    ("adam", "sync", 5), ("lamb", "overlap", 5),
                                                    ("zero_one", "overlap", 5)])
def test_a_rank_that_skips_step_after_its_backward_raises_on_every_rank(name, mode, skipped_step):
    """Rank 1 skips ``step()`` after its backward: at its next ``zero_grad()`` it says so, where
    rank 0 waits in ``step()``; both raise the library's error, naming the ranks and the fix,
    within seconds (no Gloo abort, no step number decoded from another collective)."""
    outcomes = spawn_ranks(_skip_step, 2, name, mode, skipped_step, (1,), timeout=90)
    assert [status for status, _ in outcomes] == ["ok", "ok"], outcomes
    for rank, r in enumerate(v for _, v in outcomes):
        assert r["error"] is not None and r["error"].startswith("RanksOutOfStep"), (rank, r)
        assert f"rank(s) [1] ran the backward of step {skipped_step} and then zero_grad() without step()" in r["error"]
        assert f"rank(s) [0] called step() for step {skipped_step}" in r["error"]
        assert "every rank must call step() after its backward, or none" in r["error"]
        # (rank 0 raises in that step's step(), rank 1 at the next step's zero_grad())
        assert r["step"] == skipped_step + rank and r["seconds"] < 30, (rank, r)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("skipped_step", [2, 5])
def test_every_rank_skipping_step_together_drops_the_step_and_trains_on(skipped_step):
    """Every rank skips ``step()`` at the same step (a decision taken alike, e.g. a GradScaler
    that found inf after the average): the step is dropped on every rank and training goes on,
    the replicas equal."""
    a, b = (value for _, value in spawn_ranks(_skip_step, 2, "adam", "overlap", skipped_step, (0, 1), timeout=90))
    assert a["error"] is None and b["error"] is None, (a, b)
    assert a["taken"] == b["taken"] == skipped_step + 1
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def _skip_step_under_hsdp(rank, world, name, skipped_step, who):
    """:func:`_skipping` under FSDP2's own HSDP (2 replicas x 2 shards, or x 2 tp with 8 ranks),
    which assigns the gradients itself after backward: no hook of the optimizer sees it. With no
    error, this rank's shards too."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    from sharding import fsdp2_hsdp

    warnings.simplefilter("ignore")
    shape = (2, 2) if world == 4 else (2, 2, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp")[:len(shape)])
    torch.manual_seed(0)
    model = fsdp2_hsdp(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), mesh)
    cls, kwargs = OPTIMIZERS[name]
    opt = cls(model.parameters(), **kwargs)
    out = _skipping(model, opt, rank, rank // (world // 4), skipped_step, who)  # (a tp pair: one batch)
    if not out["error"]:
        out["params"] = [p.to_local().detach().clone() for p in model.parameters()]
        opt.close()
    return out


# the first step (before the ranks' first agreement), the warmup, the compression stage; the 3-D mesh
@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,name,skipped_step", [(4, "adam", 1), (4, "zero_one", 2), (4, "adam", 5),
                                                     (8, "lamb", 5)])
def test_a_rank_that_skips_step_under_fsdps_own_hsdp_ends_the_job_in_seconds(world, name, skipped_step):
    """Rank 1 skips ``step()`` after its backward under FSDP2's own HSDP. It and its replica peer
    raise the library's error at once, naming the job's ranks (not the replica group's); the
    other replica group, already in FSDP's next collectives with them, sees them leave (Gloo:
    connection closed, as torchrun then stops the job). Before, every rank hung."""
    outcomes = spawn_ranks(_skip_step_under_hsdp, world, name, skipped_step, (1,), timeout=90)
    assert [status for status, _ in outcomes] == ["ok"] * world, outcomes
    results = [value for _, value in outcomes]
    peer = 1 + world // 2  # (rank 1's replica across dp_replicate)
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["seconds"] < 30, (rank, r)
        if rank in (1, peer):
            assert r["error"].startswith("RanksOutOfStep"), (rank, r)
            assert f"rank(s) [1] ran the backward of step {skipped_step} and then zero_grad() without step()" in r[
                "error"], r
            assert f"rank(s) [{peer}] called step() for step {skipped_step}" in r["error"], r
        else:
            assert "RanksOutOfStep" in r["error"] or "Connection closed" in r["error"], (rank, r)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("skipped_step", [1, 5])
def test_every_rank_skipping_step_together_under_fsdps_own_hsdp_drops_the_step(skipped_step):
    """Every rank skips ``step()`` at the same step under FSDP2's own HSDP (at the first step too,
    before the ranks' first agreement): the step is dropped on every rank, training goes on, and
    the replicas hold the same shards. Only the ``zero_grad()`` after the skip communicates."""
    results = [value for _, value in spawn_ranks(_skip_step_under_hsdp, 4, "adam", skipped_step, (0, 1, 2, 3),
                                                 timeout=90)]
    assert all(r["error"] is None for r in results), results
    assert [r["taken"] for r in results] == [skipped_step + 1] * 4
    # zero_grad() communicates only where it tells the skip (after a step taken, it sends nothing)
    assert all([bool(b) for b in r["sent"]] == [i == skipped_step for i in range(skipped_step + 2)]
               for r in results), [r["sent"] for r in results]
    for shard in (0, 1):  # (rank r and r + 2: the same shard of the two replicas)
        assert all(torch.equal(x, y) for x, y in zip(results[shard]["params"], results[shard + 2]["params"]))
