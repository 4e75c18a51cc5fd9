"""Per-layer variance tracking (compressed_opt.variance_tracking) in OnebitAdam and ZeroOneAdam:
steps that follow gradients shrinking after the freeze, checkpoints. The exact math, on 2 and 3
ranks and through 0/1 Adam's intervals, is checked in each optimizer's reference test."""
import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, ZeroOneAdam
from compressed_opt.comm import SingleProcessBackend
from layouts import legacy
from optim_tasks import mlp, run_steps, shard_batches

OPTIMIZERS = {
    "OnebitAdam": lambda ps, freeze, tracking, **hp: OnebitAdam(ps, freeze_step=freeze, variance_tracking=tracking,
                                                                backend=SingleProcessBackend(), **hp),
    "ZeroOneAdam": lambda ps, freeze, tracking, **hp: ZeroOneAdam(ps, var_freeze_step=freeze,
                                                                  variance_tracking=tracking,
                                                                  backend=SingleProcessBackend(), **hp),
}


def _step_sizes(make, steps=400, freeze=20, drop_at=40, scale=1 / 3, lr=1e-3, size=None):
    """Per step, the mean |update| of one parameter under a gradient that does not depend on it,
    ``s_t (d + 0.1 n_t)``, with ``s_t`` dropping from 1 to ``scale`` at step ``drop_at`` (or
    ``size(t)``)."""
    g = torch.Generator().manual_seed(3)
    d = torch.randn(512, generator=g)
    w = nn.Parameter(torch.zeros(512))
    opt = make([w], lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    sizes = []
    for t in range(1, steps + 1):
        before = w.detach().clone()
        s = size(t) if size is not None else (scale if t >= drop_at else 1.0)
        w.grad = s * (d + 0.1 * torch.randn(512, generator=g))
        opt.step()
        sizes.append((w.detach() - before).abs().mean().item())
    return sizes


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_steps_follow_gradients_that_shrink_after_the_freeze(name):
    """After the freeze the gradients shrink 3x: Adam's steps keep their size (its variance
    shrinks too), a frozen variance makes every step 3x smaller, the tracked one recovers Adam's."""
    make = OPTIMIZERS[name]
    runs = {
        "adamw": _step_sizes(torch.optim.AdamW),
        "frozen": _step_sizes(lambda ps, **hp: make(ps, 20, False, **hp)),
        "tracked": _step_sizes(lambda ps, **hp: make(ps, 20, True, **hp)),
    }
    adamw, frozen, tracked = (sum(runs[k][-100:]) for k in ("adamw", "frozen", "tracked"))
    assert frozen < 0.45 * adamw, (frozen, adamw)
    assert 0.85 * adamw < tracked < 1.15 * adamw, (tracked, adamw)
    # before the drop the tracking changes little
    a, t = sum(runs["adamw"][25:39]), sum(runs["tracked"][25:39])
    assert 0.9 * a < t < 1.1 * a, (t, a)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_quiet_start_of_the_compression_stage_does_not_shrink_the_steps(name):
    """Gradients 10x smaller for the 10 steps after the freeze, then as before: Adam's variance
    hardly notices (0.99: a 100-step memory) and its steps come back to their size. The tracking
    is calibrated at the warmup's own steps, not against those 10 quiet ones: it follows Adam's
    steps (a calibration from the first compression steps took every later gradient for 10x
    the freeze's and cut the steps to the factor's floor, 1/4)."""
    make = OPTIMIZERS[name]
    quiet = lambda t: 0.1 if 21 <= t <= 30 else 1.0  # noqa: E731
    adamw = _step_sizes(torch.optim.AdamW, size=quiet)
    tracked = _step_sizes(lambda ps, **hp: make(ps, 20, True, **hp), size=quiet)
    a, t = sum(adamw[60:120]), sum(tracked[60:120])
    assert 0.8 * a < t < 1.25 * a, (t, a)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_format_1_rows_are_extended_on_load(name):
    """A compression-stage checkpoint of format 1 (five numbers per layer, no local EMA) loads:
    its rows gain the new columns (no local EMA, the reference not fixed at the freeze) and the
    run trains on."""
    make = OPTIMIZERS[name]
    model = mlp()
    opt = make(model.parameters(), 2, True, lr=1e-3)
    run_steps(model, opt, list(shard_batches(0, 1, 5)))
    old = legacy(opt.state_dict())
    old["compressed_opt"]["format"] = 1
    del old["compressed_opt"]["scale_block"]
    old["state"] = {k: {**st, "layer_variance": st["layer_variance"][:5].clone()} for k, st in old["state"].items()}
    resumed = make(model.parameters(), 2, True, lr=1e-3)
    resumed.load_state_dict(old)
    run_steps(model, resumed, list(shard_batches(0, 1, 3)))
    rows = resumed.state[next(iter(model.parameters()))]["layer_variance"]
    assert rows.shape == (8,) and torch.isnan(rows[5]) and torch.isnan(rows[6]) and rows[7] == 0
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_format_2_errors_are_carried_to_the_exchange_factors(monkeypatch):
    """A compression-stage checkpoint of format 2 (before the tracked exchange: its error buffers
    hold errors of exchange factors 1, docs/design.md 2.3.3) loads; at the first exchange each
    layer's errors are multiplied by the factor that exchange applies, once, and the run trains on."""
    from compressed_opt import scaling

    model = mlp()
    opt = OPTIMIZERS["OnebitAdam"](model.parameters(), 2, True, lr=1e-3)
    run_steps(model, opt, list(shard_batches(0, 1, 6)))
    saved = legacy(opt.state_dict())
    assert saved["compressed_opt"]["format"] == 3
    assert all("exchange_factor" in st for st in saved["state"].values())
    # (as a file of format 2 was: no exchange_factor, and no count of the per-parameter fields)
    extra = {k: v for k, v in saved["compressed_opt"].items() if k != "param_fields"}
    old = {**saved, "compressed_opt": {**extra, "format": 2},
           "state": {k: {n: v for n, v in st.items() if n != "exchange_factor"} for k, st in saved["state"].items()}}
    calls = []
    carry = scaling.rescale_errors
    monkeypatch.setattr(scaling, "rescale_errors",
                        lambda b, r, a, c: (calls.append((list(a), list(c))), carry(b, r, a, c)))
    resumed = OPTIMIZERS["OnebitAdam"](model.parameters(), 2, True, lr=1e-3)
    resumed.load_state_dict(old)
    loaded = old["compressed_opt"]["buckets"][0]["worker_error"].clone()
    errors, seen = [], []
    exchange = resumed.engine.exchange
    real = exchange.run  # (every 1-bit exchange's requests pass here)
    monkeypatch.setattr(exchange, "run",
                        lambda requests: ([errors.append(r.feedback.worker_error.clone()) for r in requests],
                                          seen.append(resumed.engine._buckets[0].state.exchange_factors),
                                          real(requests))[2])
    run_steps(model, resumed, list(shard_batches(0, 1, 3)))
    factors = seen[-1]  # (the bucket's exchange factors exist during a step only)
    assert len(calls) == 1 and calls[0][0] == [1.0] * len(factors)  # once, from factors 1
    first = resumed.engine._buckets[0]
    expected = loaded.clone()
    torch._foreach_mul_(first.views(expected), calls[0][1])
    assert torch.equal(errors[0], expected)  # the first exchange compensates with the carried errors
    assert not any(b.state.unit_errors for b in resumed.engine.buckets)
    assert all(bool(p.isfinite().all()) for p in model.parameters())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_compression_stage_checkpoint_of_the_other_setting_is_refused(name):
    make = OPTIMIZERS[name]
    model = mlp()
    plain = make(model.parameters(), 2, False, lr=1e-3)
    run_steps(model, plain, list(shard_batches(0, 1, 1)))
    make(mlp().parameters(), 2, True, lr=1e-3).load_state_dict(plain.state_dict())  # warmup: starts from there
    run_steps(model, plain, list(shard_batches(0, 1, 3)))
    saved = plain.state_dict()
    assert saved["compressed_opt"]["variance_tracking"] is False
    with pytest.raises(ValueError, match="variance_tracking=False"):
        make(mlp().parameters(), 2, True, lr=1e-3).load_state_dict(saved)
    make(mlp().parameters(), 2, False, lr=1e-3).load_state_dict(saved)
    tracked = make(model.parameters(), 2, True, lr=1e-3)
    run_steps(model, tracked, list(shard_batches(0, 1, 4)))
    state = legacy(tracked.state_dict())["state"][0]
    assert state["layer_variance"].dtype == torch.float64 and state["layer_variance"].shape == (8,)
    bad = legacy(tracked.state_dict())
    bad["state"][0] = {**bad["state"][0], "layer_variance": torch.zeros(3)}
    with pytest.raises(ValueError, match="layer_variance"):
        make(mlp().parameters(), 2, True, lr=1e-3).load_state_dict(bad)
    with pytest.raises(TypeError, match="variance_tracking"):
        make(mlp().parameters(), 2, "yes", lr=1e-3)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_state_rows_survive_a_resume_bit_for_bit(name):
    """The per-layer rows are views of one tensor per bucket: after a load they are rebuilt from
    the checkpoint's rows, and the resumed run's parameters equal the uninterrupted run's."""
    make = OPTIMIZERS[name]
    batches = list(shard_batches(0, 1, 16))
    torch.manual_seed(0)
    model = mlp()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make(model.parameters(), 3, True, lr=1e-3)
    run_steps(model, opt, batches)
    straight = [p.detach().clone() for p in model.parameters()]
    model.load_state_dict(start)
    first = make(model.parameters(), 3, True, lr=1e-3)
    run_steps(model, first, batches[:7])  # mid-calibration (the freeze at 3, 10 calibration steps)
    saved = first.state_dict()
    second = make(model.parameters(), 3, True, lr=1e-3)
    second.load_state_dict(saved)
    run_steps(model, second, batches[7:])
    assert all(torch.equal(a, b) for a, b in zip(straight, model.parameters()))
    rows = second.state[next(iter(model.parameters()))]["layer_variance"]
    assert rows._base is not None  # a view of the bucket's rows again


def _bucket_by_bucket(opt):
    """What the tracking's ``_batches_of`` stands for: each bucket's rows updated alone, in place."""
    out, offset = {}, 0
    for i, b in enumerate(opt.engine.buckets):
        group, n = opt.param_groups[b.group_index], len(b.params)
        out[(group["betas"][1], group["bias_correction"], b.index)] = ([i], torch.arange(offset, offset + n),
                                                                        b.layer_numels)
        offset += n
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_buckets_of_one_beta2_track_at_once_as_each_alone(name, monkeypatch):
    """One step's tracking runs on the layers of every bucket of one ``beta2`` at once (their rows
    stacked, written back after); with two groups of other ``beta2`` interleaved over the model,
    several buckets each, the parameters and the tracked rows are bit for bit those of each
    bucket's rows updated alone."""
    def run(batched):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(24, 24) for _ in range(4)])
        params = list(model.parameters())
        first, second = params[0::3] + params[1::3], params[2::3]  # interleaved over the model
        opt = OPTIMIZERS[name]([{"params": first, "betas": (0.9, 0.99)}, {"params": second, "betas": (0.8, 0.999)}],
                               freeze=3, tracking=True, lr=1e-2, bucket_cap_mb=0.003)
        if not batched:
            tracking = opt.engine.client.tracking
            real = tracking._batches_of

            def alone(buckets, groups):  # (the tracking's batches, each bucket a batch of its own; kept as its own)
                found = real(buckets, groups)
                tracking._batches = (*found[:2], _bucket_by_bucket(opt), *found[3:])
                return tracking._batches

            monkeypatch.setattr(tracking, "_batches_of", alone)
        g = torch.Generator().manual_seed(1)
        for t in range(12):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * (1 + t % 3)
            opt.step()
        batches = opt.engine.client.tracking._batches_of(opt.engine.buckets, opt.param_groups)[2]
        assert len(opt.engine.buckets) >= 4 and len(batches) == (2 if batched else len(opt.engine.buckets))
        return [p.detach().clone() for p in params], [opt.state[p]["layer_variance"].clone() for p in params]

    (params, rows), (want_params, want_rows) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert all(torch.equal(a, b) for a, b in zip(rows, want_rows))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_warmup_step_averaged_in_step_sums_its_average_once(name, monkeypatch):
    """A full-precision step that step() averages takes the average's per-layer sums of squares
    once, for the calibration and for the tracking's EMA (one pass of them per bucket where two
    were made): the parameters and the tracked rows are bit for bit those with the sums made
    twice."""
    from compressed_opt import variance_tracking

    calls = []
    real = variance_tracking.segment_sumsq
    monkeypatch.setattr(variance_tracking, "segment_sumsq", lambda *a: (calls.append(1), real(*a))[1])

    def run(twice):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(24, 24) for _ in range(3)])
        params = list(model.parameters())
        opt = OPTIMIZERS[name](params, freeze=50, tracking=True, lr=1e-2, bucket_cap_mb=0.003)
        if twice:  # as if backward had averaged: the update sums its buffer again
            observe = opt.engine.client.observe_average
            monkeypatch.setattr(opt.engine.client, "observe_average",
                                lambda b, mean, stepped=False: observe(b, mean, False))
        g = torch.Generator().manual_seed(1)
        calls.clear()
        for t in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * (1 + t % 3)
            opt.step()
        assert len(calls) == 5 * len(opt.engine.buckets) * (2 if twice else 1) and len(opt.engine.buckets) >= 2
        return [p.detach().clone() for p in params], [opt.state[p]["layer_variance"].clone() for p in params]

    (params, rows), (want_params, want_rows) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(params, want_params))
    assert all(torch.equal(a, b) for a, b in zip(rows, want_rows))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_tracking_sums_the_gradient_the_loop_clipped_after_backward(name):
    """A full-precision step averaged in backward, then clipped by the loop: the tracking's EMA
    takes the sums of squares of the clipped gradients the update uses (its first step: ``(1 -
    0.9)`` times them), not of the average backward made."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 4))
    opt = OPTIMIZERS[name](model.parameters(), freeze=50, tracking=True, lr=1e-2)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    clipped = [p.grad.detach().double().pow(2).sum() for p in model.parameters()]
    opt.step()
    got = [opt.state[p]["layer_variance"][0].item() for p in model.parameters()]
    for sums, ema in zip(clipped, got):
        assert ema == pytest.approx(0.1 * sums.item(), rel=1e-6)
    assert max(got) < 0.1 * 1e-6 * 1.01  # (the average before clipping is far larger)
