"""Hostile-user faults around the optimizer's hooks and thread: a discarded or replaced optimizer
stops communicating, one non-finite gradient skips the step on every rank without poisoning any
buffer, ranks that start or drift apart are made equal or raise on every rank."""
import gc
import threading
import time
import warnings

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam, state
from distributed import run_ranks, spawn_ranks
from optim_tasks import mlp, shard_batches

OPTIMIZERS = {
    "adam": (OnebitAdam, dict(lr=3e-3, freeze_step=3)),
    "lamb": (OnebitLamb, dict(lr=2e-2, freeze_step=3)),
    "zero_one": (ZeroOneAdam, dict(lr=3e-3, var_freeze_step=3, var_update_scaler=1)),
}


def _hooks(model):
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def _comm_threads():
    return sum(t.name.startswith("compressed_opt_comm") for t in threading.enumerate())


def _step(model, opt, x, y):
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _no_comm_threads_left_by_earlier_tests(seconds: float = 5.0) -> None:
    """Collect what earlier tests of this process left unclosed (an optimizer in a reference cycle
    lives until a collection, whose finalizer then stops its thread without waiting) and let those
    threads end, so that the count below is this test's own."""
    gc.collect()
    deadline = time.monotonic() + seconds
    while _comm_threads() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_discarded_optimizer_lets_go_of_hooks_and_thread():
    _no_comm_threads_left_by_earlier_tests()
    model = mlp()
    x, y = next(shard_batches(0, 1, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "the old one was closed" (tested below)
        for _ in range(20):
            opt = OnebitAdam(model.parameters(), freeze_step=2)
            for _ in range(3):
                _step(model, opt, x, y)
    gc.collect()
    assert _hooks(model) == 6  # one per parameter: the live optimizer's
    assert _comm_threads() <= 1
    alive = [o for o in gc.get_objects() if type(o) is OnebitAdam]
    assert alive == [opt]
    del opt, alive
    gc.collect()
    assert _hooks(model) == 0 and not [o for o in gc.get_objects() if type(o) is OnebitAdam]


def test_close_and_context_manager():
    model = mlp()
    x, y = next(shard_batches(0, 1, 1))
    with OnebitAdam(model.parameters(), freeze_step=1) as opt:
        _step(model, opt, x, y)
        _step(model, opt, x, y)  # compression stage: launched from backward
    assert _hooks(model) == 0
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    opt.close()  # idempotent


def test_a_new_optimizer_on_the_same_parameters_replaces_the_old_one():
    model = mlp()
    old = OnebitAdam(model.parameters())
    with pytest.warns(RuntimeWarning, match="old one was closed"):
        new = OnebitAdam(model.parameters())
    assert old.engine.closed and not new.engine.closed and _hooks(model) == 6


def _recreate(rank, world, name):
    cls, kwargs = OPTIMIZERS[name]
    model = mlp()
    batches = list(shard_batches(rank, world, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for i in range(3):  # a notebook cell re-run, a sweep: the old optimizer is just dropped
            opt = cls(model.parameters(), **kwargs)
            for x, y in batches[4 * i : 4 * i + 4]:
                _step(model, opt, x, y)
    return [p.detach().clone() for p in model.parameters()], _comm_threads(), _hooks(model)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_re_created_optimizers_train_on_every_rank(name):
    results = run_ranks(_recreate, 2, name, timeout=120)
    (p0, threads, hooks), (p1, _, _) = results
    assert threads <= 1 and hooks == 6
    if name != "zero_one":  # (0/1 Adam's local steps leave ranks apart between synchronisations)
        assert all(torch.equal(a, b) for a, b in zip(p0, p1))


def _nan_once(rank, world, name, mode, at_step):
    cls, kwargs = OPTIMIZERS[name]
    model = mlp()
    opt = cls(model.parameters(), overlap=mode != "sync", bucket_cap_mb=0.01, **kwargs)
    caught = []
    for i, (x, y) in enumerate(shard_batches(rank, world, 9)):
        opt.zero_grad()
        if i == at_step and rank == 1:  # a bad example: backward itself produces the NaN
            x = x.clone()
            x[0, 5] = float("nan")
        nn.functional.cross_entropy(model(x), y).backward()
        before = {k: v.clone() for k, v in _buffers(opt).items()}
        params_before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
        if i == at_step:
            caught = [str(m.message) for m in w]
            unchanged = all(torch.equal(a, b) for a, b in zip(params_before, model.parameters()))
            state_kept = all(torch.equal(before[k], v) for k, v in _buffers(opt).items())
    finite = all(_no_poison(k, v) for k, v in _buffers(opt).items()) and all(
        torch.isfinite(p).all() for p in model.parameters())
    return dict(skipped=opt.engine.nonfinite_steps, warned=caught, unchanged=unchanged, state_kept=state_kept,
                finite=finite, steps=opt.global_step, params=[p.detach().clone() for p in model.parameters()])


def _no_poison(name, t):
    # the frozen denominator is inf by design where the variance is 0 (the coordinate stays put)
    return not torch.isnan(t).any() if name.endswith("frozen_denominator") else bool(torch.isfinite(t).all())


def _buffers(opt):
    out = {}
    for b in opt.engine.buckets:  # every declared bucket buffer but the workspace (SCRATCH, and a step's STEP)
        for part in state.parts(b.state) + [b.feedback, b.sync]:
            for name in state.names(part, state.STATE, state.SAVED, state.LAYER, state.DERIVED):
                t = getattr(part, name)
                if isinstance(t, torch.Tensor):
                    out[f"{b.index}.{type(part).__name__}.{name}"] = t
    return out


def _nan_cases(rank, world, name):
    # at a warmup step (1) and at a compression-stage step (6: launched from backward with overlap)
    return {(mode, at): _nan_once(rank, world, name, mode, at) for mode in ("overlap", "sync") for at in (1, 6)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_one_nan_on_one_rank_skips_the_step_everywhere_and_poisons_nothing(name):
    runs = run_ranks(_nan_cases, 2, name, timeout=180)
    for (mode, at_step) in runs[0]:
        results = [r[mode, at_step] for r in runs]
        for r in results:
            assert r["skipped"] == 1 and r["steps"] == 8, (at_step, r["skipped"], r["steps"])
            assert any("non-finite gradient" in m for m in r["warned"]), r["warned"]
            assert r["unchanged"] and r["finite"], at_step
            if mode == "sync" or at_step == 1:
                assert r["state_kept"], at_step  # launched ahead: the exchange ran (on zeros)
        if name != "zero_one":
            assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"]))


def _lr_on_one_rank(rank, world):
    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=3)
    for i, (x, y) in enumerate(shard_batches(rank, world, 6)):
        if i == 4 and rank == 1:
            opt.param_groups[0]["lr"] = 0.1
        _step(model, opt, x, y)


def _differently_seeded(rank, world):
    model = mlp(seed=rank)
    opt = OnebitAdam(model.parameters(), freeze_step=3)
    for x, y in shard_batches(rank, world, 5):
        _step(model, opt, x, y)
    return [p.detach().clone() for p in model.parameters()]


def _requires_grad_on_one_rank(rank, world):
    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=10, bucket_cap_mb=0.01)
    for i, (x, y) in enumerate(shard_batches(rank, world, 4)):
        if i == 2 and rank == 1:
            model[0].bias.requires_grad_(False)
        _step(model, opt, x, y)


@pytest.mark.multiprocess
def test_ranks_that_drift_apart_raise_on_every_rank_or_are_made_equal():
    outcomes = spawn_ranks(_lr_on_one_rank, 2, timeout=60)
    assert all(s == "error" and "learning rate" in v and "step 5" in v for s, v in outcomes), outcomes
    outcomes = spawn_ranks(_requires_grad_on_one_rank, 2, timeout=60)
    assert all(s == "error" and "trainable parameters of rank(s) [1] differ" in v for s, v in outcomes), outcomes
    p0, p1 = run_ranks(_differently_seeded, 2, timeout=60)  # rank 0's initial parameters win
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
