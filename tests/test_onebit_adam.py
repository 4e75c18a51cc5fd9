"""OnebitAdam: AdamW in warmup, the compression stage against a reference of the same math,
convergence on a real task, checkpoints, and the ordinary things PyTorch code does to optimizers."""
import io

import pytest
import torch
from torch import nn

from allreduce_reference import simulate
from compressed_opt import OnebitAdam, VarianceStabilityRule
from compressed_opt.comm import SingleProcessBackend, chunk_numel
from distributed import run_ranks, spawn_ranks
from tracking_reference import TrackingReference
from optim_tasks import (MODES, digits, full_loss, fusion, in_mode, mlp, resume_run, run_steps, shard_batches,
                         steps_with_overflow)

HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def gaussian_batches(rank, world, steps, batch=32):
    """Synthetic shards: every input coordinate varies, so no coordinate has a near-zero
    variance whose 1/sqrt(v) would amplify float rounding in a comparison."""
    g = torch.Generator().manual_seed(7)
    teacher = torch.randn(64, 10, generator=g)
    for _ in range(steps):
        x = torch.randn(world * batch, 64, generator=g)
        y = (x @ teacher).argmax(1)
        yield x[rank * batch : (rank + 1) * batch], y[rank * batch : (rank + 1) * batch]


def global_batches(world, steps):
    shards = [list(gaussian_batches(r, world, steps)) for r in range(world)]
    return [[shards[r][s] for r in range(world)] for s in range(steps)]


def rank_grads(model, xs_ys):
    """Per-rank gradients of the same model on each rank's shard."""
    out = []
    for x, y in xs_ys:
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


# --- multi-rank runs (one spawn each, several checks) --------------------------------------
def _warmup_and_compression(rank, world, steps, freeze_step, exchange="preconditioned", tracking=True):
    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=freeze_step, exchange=exchange, variance_tracking=tracking, **HP)
    snapshots = []
    for x, y in gaussian_batches(rank, world, steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        snapshots.append([p.detach().clone() for p in model.parameters()])
    stats = opt.backend.stats.snapshot()
    return snapshots, stats, opt.compressing


def preconditioned_exchange(m, v_f, sizes, eps, betas):
    """The preconditioned exchange's fixed factors, written out from the module doc: per element
    ``R = c_l / sqrt(v_f)`` and ``A = sqrt(v_f) / (sqrt(v_f) + eps) / c_l`` (both 0 where
    ``v_f == 0``), per element the bound ``K c_l`` (``K = 1.25``, ``compressed_opt.adam.COMPRESSED_STEP_BOUND``,
    on the exchanged ``s_l R m_i``); ``c_l = mean_k s_k / s_l`` with
    ``s_l`` the RMS of ``m / sqrt(v_f)`` over layer ``l`` (1 for an all-zero layer)."""
    denom = (v_f.sqrt() + eps).masked_fill(v_f == 0, float("inf"))
    root = (denom - eps).clamp(min=eps * 2.0**-20)
    rms = [(piece.pow(2).mean().sqrt().item()) for piece in (m / root).split(sizes)]
    mean = sum(rms) / len(rms)
    coeff = [mean / r if r > 0 else 1.0 for r in rms]
    per_element = torch.cat([torch.full((n,), c) for n, c in zip(sizes, coeff)])
    k = 1.25
    return per_element / root, torch.nan_to_num(root / denom, nan=0.0) / per_element, k * per_element


def reference_run(world, steps, freeze_step, exchange="preconditioned", tracking=True):
    """AdamW on the averaged gradient for the warmup, then the compression stage by hand."""
    model = mlp()
    params = list(model.parameters())
    ref = torch.optim.AdamW(params, **HP)
    flat_order = list(reversed(params))  # one bucket, reverse registration order
    n = sum(p.numel() for p in params)
    m = torch.zeros(n)
    we = [torch.zeros(n) for _ in range(world)]
    se = [torch.zeros(chunk_numel(n, world)) for _ in range(world)]
    b1, b2 = HP["betas"]
    track = TrackingReference(flat_order)
    last_factor = torch.ones(n)  # per element: its layer's tracking factor of the last update
    snapshots = []
    for t, batches in enumerate(global_batches(world, steps), start=1):
        grads = rank_grads(model, batches)
        if t <= freeze_step:
            for p, *gs in zip(params, *grads):
                p.grad = sum(gs) / world
            ref.step()
            track.warmup([p.grad for p in flat_order], [list(reversed(g)) for g in grads])
            if t == freeze_step:
                track.freeze([ref.state[p]["exp_avg_sq"] for p in flat_order])
                m = torch.cat([ref.state[p]["exp_avg"].reshape(-1) for p in flat_order])
                v_f = torch.cat([ref.state[p]["exp_avg_sq"].reshape(-1) for p in flat_order]) / (1 - b2**t)
                if exchange == "preconditioned":
                    r, a, bound = preconditioned_exchange(m, v_f, [p.numel() for p in flat_order], HP["eps"],
                                                          HP["betas"])
        else:
            local = [b1 * m + (1 - b1) * torch.cat([g[i].reshape(-1) for i in reversed(range(len(params)))])
                     for g in grads]
            if exchange == "preconditioned":  # the tracked exchange: s = the last update's factor
                s = last_factor
                y = simulate([torch.minimum(torch.maximum(s * (r * x), -bound), bound) for x in local], we, se)
                m = torch.where(v_f == 0, 0.0, y / r / s)
                direction = y * a / (1 - b1**t) / s
            else:
                m = simulate(local, we, se)
                direction = (m / (1 - b1**t)) / (v_f.sqrt() + HP["eps"])
                direction[v_f == 0] = 0  # coordinates that never had a gradient stay put
            factors = [1.0] * len(flat_order)
            if tracking:
                factors = track.factors([list(reversed(g)) for g in grads], t - freeze_step, t, freeze_step, b2)
                last_factor = torch.cat([torch.full((p.numel(),), f) for p, f in zip(flat_order, factors)])
            with torch.no_grad():
                offset = 0
                for p, f in zip(flat_order, factors):
                    p.mul_(1 - HP["lr"] * HP["weight_decay"])
                    p.sub_(HP["lr"] * f * direction[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()
        snapshots.append([p.detach().clone() for p in params])
    return snapshots


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,exchange,tracking", [(2, "preconditioned", True), (3, "preconditioned", True),
                                                     (2, "momentum", True), (2, "preconditioned", False)])
def test_warmup_is_adamw_and_compression_matches_reference(world, exchange, tracking):
    steps, freeze = 17, 4  # (past the tracking's 10 calibration steps)
    results = run_ranks(_warmup_and_compression, world, steps, freeze, exchange, tracking)
    ref = reference_run(world, steps, freeze, exchange, tracking)
    for snaps, _, frozen in results:
        assert frozen
        warm = max((a - b).abs().max().item() for s in range(freeze) for a, b in zip(snaps[s], ref[s]))
        assert warm < 1e-6, f"warmup differs from AdamW by {warm}"
        comp = max(((a - b).abs() / (b.abs() + 1e-3)).max().item()
                   for s in range(freeze, steps) for a, b in zip(snaps[s], ref[s]))
        assert comp < 1e-4, f"compression stage differs from the reference by {comp} (relative)"
        for s in range(steps):  # every rank holds the same parameters
            assert all(torch.equal(a, b) for a, b in zip(snaps[s], results[0][0][s]))
    # the compression stage sends no full-precision gradients: all-reduce only in warmup
    stats = results[0][1]
    assert stats["calls"]["all_reduce"] == freeze
    assert stats["calls"]["all_to_all"] == steps - freeze


def make_optimizer(model, mode, **kwargs):
    """OnebitAdam in one of the modes (returns the module to call and the optimizer)."""
    return in_mode(OnebitAdam, model, mode, **kwargs)


def _convergence(rank, world, steps, freeze_step, lr):
    """Final full-data loss of OnebitAdam in every mode, and of the same optimizer never leaving
    warmup (AdamW on the averaged gradient), on the same batches."""
    losses = {}
    for mode in (*MODES, "adamw"):
        model = mlp()
        freeze = 10**9 if mode == "adamw" else freeze_step
        net, opt = make_optimizer(model, "overlap" if mode == "adamw" else mode, lr=lr, freeze_step=freeze)
        for x, y in shard_batches(rank, world, steps):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        losses[mode] = full_loss(model)
    return losses


@pytest.mark.multiprocess
def test_converges_like_adamw_on_digits_in_every_mode():
    results = run_ranks(_convergence, 2, 150, 40, 1e-3, timeout=240)
    assert results[0] == results[1]
    losses = results[0]
    assert losses["adamw"] < 0.5, "did not learn"
    for mode in MODES:
        assert losses[mode] / losses["adamw"] < 1.05, (f"{mode}: final loss {losses[mode]:.4f} "
                                                      f"vs AdamW {losses['adamw']:.4f}")


def _resume(rank, world, total, stop_at, freeze, mode="overlap"):
    def fresh():
        model = mlp()
        return (model, *make_optimizer(model, mode, freeze_step=freeze, **HP))

    return resume_run(fresh, list(shard_batches(rank, world, total)), stop_at)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stop_at", [3, 7])  # before the freeze, and in the compression stage
def test_resume_is_bit_exact(stop_at):
    results = run_ranks(_resume, 2, 10, stop_at, 4)
    for diff, _ in results:
        assert diff == 0.0
    if stop_at == 7:
        saved = results[1][1]["compressed_opt"]
        assert saved["rank"] == 1 and saved["frozen"] and saved["buckets"][0]["worker_error"].abs().sum() > 0


def _resume_every_mode(rank, world):
    return {mode: _resume(rank, world, 9, 6, 4, mode)[0] for mode in MODES}


@pytest.mark.multiprocess
def test_resume_is_bit_exact_in_every_mode():
    for diffs in run_ranks(_resume_every_mode, 2, timeout=240):
        assert diffs == {mode: 0.0 for mode in MODES}


@pytest.mark.multiprocess
def test_checkpoint_from_another_world_size_resets_error_buffers_with_a_warning():
    _, ckpt = run_ranks(_resume, 2, 10, 7, 4)[0]
    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=4, **HP)
    with pytest.warns(RuntimeWarning, match="error-feedback buffers .* were reset to zero"):
        opt.load_state_dict(ckpt)
    assert opt.compressing and opt.global_step == 7
    x, y = digits()
    nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
    opt.step()
    assert opt.global_step == 8


def _amp_overflow_on_one_rank(rank, world):
    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=3, **HP)
    return steps_with_overflow(model, opt, rank, shard_batches(rank, world, 8))


@pytest.mark.multiprocess
def test_grad_scaler_overflow_on_one_rank_skips_the_step_everywhere():
    results = run_ranks(_amp_overflow_on_one_rank, 2, timeout=90)
    for taken, _ in results:
        assert taken == [1, 1, 0, 1, 1, 0, 1, 1]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


def _unused_parameters_and_groups(rank, world):
    torch.manual_seed(0)
    trunk, head_a, head_b = nn.Linear(64, 32), nn.Linear(32, 10), nn.Linear(32, 10)
    opt = OnebitAdam(
        [{"params": trunk.parameters()}, {"params": head_a.parameters(), "lr": 1e-3}],
        freeze_step=2, **HP,
    )
    opt.add_param_group({"params": head_b.parameters(), "weight_decay": 0.0})
    for step, (x, y) in enumerate(shard_batches(rank, world, 5)):
        opt.zero_grad(set_to_none=True)
        head = head_a if (rank + step) % 2 == 0 else head_b  # each rank uses a different head
        nn.functional.cross_entropy(head(torch.tanh(trunk(x))), y).backward()
        opt.step()
    return [p.detach().clone() for m in (trunk, head_a, head_b) for p in m.parameters()]


@pytest.mark.multiprocess
def test_parameters_without_gradients_on_some_ranks_and_param_groups():
    results = run_ranks(_unused_parameters_and_groups, 2)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))


def _disagreeing_shapes(rank, world):
    model = nn.Linear(8, 4 if rank == 0 else 5)
    opt = OnebitAdam(model.parameters(), freeze_step=2)
    model(torch.ones(1, 8)).sum().backward()
    opt.step()


def _disagreeing_lr(rank, world):
    model = nn.Linear(8, 4)
    opt = OnebitAdam(model.parameters(), lr=1e-3 * (rank + 1), freeze_step=2)
    model(torch.ones(1, 8)).sum().backward()
    opt.step()


@pytest.mark.multiprocess
@pytest.mark.parametrize("fn, message", [(_disagreeing_shapes, "parameter shapes"),
                                         (_disagreeing_lr, "hyperparameters differ")])
def test_ranks_that_disagree_raise_on_every_rank(fn, message):
    for status, value in spawn_ranks(fn, 2, timeout=60):
        assert status == "error" and message in value


def _auto_freeze(rank, world):
    model = mlp()
    rule = VarianceStabilityRule(window=5, rtol=0.05, min_step=10, max_step=60)
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=rule)
    for x, y in shard_batches(rank, world, 70):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt.freeze_step, opt.state_dict()["compressed_opt"]["freeze_step"]


@pytest.mark.multiprocess
def test_auto_freeze_picks_the_same_step_on_every_rank():
    results = run_ranks(_auto_freeze, 2)
    assert results[0] == results[1]
    step, saved = results[0]
    assert 10 <= step <= 60 and saved == step


# --- single process ------------------------------------------------------------------------
def test_closure_lr_scheduler_and_betas_scheduler():
    model = mlp()
    opt = OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10, cycle_momentum=True)
    x, y = digits()
    losses = []
    for _ in range(10):
        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[:128]), y[:128])
            loss.backward()
            return loss
        losses.append(opt.step(closure).item())
        sched.step()
    assert losses[-1] < losses[0]
    assert opt.param_groups[0]["betas"][0] != 0.9  # the scheduler moved beta1 and we read it


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_parameters(dtype):
    model = mlp(dtype=dtype)
    opt = OnebitAdam(model.parameters(), lr=3e-3, freeze_step=10)
    x, y = digits()
    start = full_loss(model)
    for i in range(40):
        run_steps(model, opt, [(x[i * 32 : (i + 1) * 32].to(dtype), y[i * 32 : (i + 1) * 32])])
    assert all(p.dtype == dtype for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert full_loss(model) < start


def test_torch_compile_model():
    model = mlp()
    compiled = torch.compile(model, backend="aot_eager")
    opt = OnebitAdam(compiled.parameters(), lr=3e-3, freeze_step=3)
    x, y = digits()
    start = full_loss(model)
    for i in range(8):
        run_steps(compiled, opt, [(x[i * 64 : (i + 1) * 64], y[i * 64 : (i + 1) * 64])])
    assert opt.compressing and full_loss(model) < start


def test_zero_grad_keeps_or_drops_gradients():
    model = nn.Linear(4, 2)
    opt = OnebitAdam(model.parameters(), freeze_step=1)
    model(torch.ones(1, 4)).sum().backward()
    opt.zero_grad(set_to_none=False)
    assert model.weight.grad is not None and not model.weight.grad.any()
    opt.zero_grad()
    assert model.weight.grad is None


def test_state_is_visible_per_parameter_and_loads_with_weights_only():
    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=2)
    x, y = digits()
    for _ in range(3):
        run_steps(model, opt, [(x[:64], y[:64])])
    for p in model.parameters():
        assert opt.state[p]["exp_avg"].shape == p.shape
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    assert loaded["compressed_opt"]["frozen"] and loaded["compressed_opt"]["global_step"] == 3


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(lr=-1.0), ValueError, "Invalid learning rate"),
        (dict(eps=-1e-8), ValueError, "Invalid epsilon value"),
        (dict(weight_decay=-0.1), ValueError, "Invalid weight_decay"),
        (dict(betas=(1.0, 0.999)), ValueError, "beta parameter at index 0"),
        (dict(betas=(0.9, -0.1)), ValueError, "beta parameter at index 1"),
        (dict(betas=0.9), TypeError, "betas must be a pair"),
        (dict(freeze_step=-3), ValueError, "Invalid freeze_step"),
        (dict(freeze_step=0), ValueError, "Invalid freeze_step"),
        (dict(freeze_step="soon"), TypeError, "freeze_step must be an int or 'auto'"),
        (dict(bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
        (dict(backend="nccl"), TypeError, "backend must be"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        OnebitAdam(nn.Linear(2, 2).parameters(), **kwargs)


def test_sparse_and_complex_are_rejected():
    emb = nn.Embedding(10, 3, sparse=True)
    opt = OnebitAdam(emb.parameters(), freeze_step=1)
    with pytest.raises(TypeError, match="sparse gradients"):  # at the end of backward, before any exchange
        emb(torch.tensor([1, 2])).sum().backward()
        opt.step()
    with pytest.raises(TypeError, match="complex parameters"):
        OnebitAdam([nn.Parameter(torch.zeros(2, dtype=torch.complex64))])


def test_single_process_backend_by_default_and_the_auto_string():
    opt = OnebitAdam(nn.Linear(2, 2).parameters(), freeze_step="auto")
    assert isinstance(opt.backend, SingleProcessBackend)
    assert isinstance(opt.engine.client.schedule_.rule, VarianceStabilityRule) and opt.freeze_step is None


def test_rejected_param_group_is_not_kept():
    opt = OnebitAdam(nn.Linear(2, 2).parameters(), freeze_step=1)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        opt.add_param_group({"params": nn.Linear(2, 2).parameters(), "lr": -1.0})
    assert len(opt.param_groups) == 1


def _group_of(opt, p):
    """The param group of ``p``, as the optimizer looks it up: through the bucket holding it."""
    b = next(b for b in opt.engine.buckets if any(q is p for q in b.params))
    return opt.param_groups[b.group_index]


def test_group_of_follows_load_state_dict():
    """load_state_dict replaces the group dicts: lookups must see the new ones (the DDP exchange
    reads beta1 through them)."""
    model = nn.Linear(3, 2)
    opt = OnebitAdam(model.parameters(), betas=(0.9, 0.999), freeze_step=2)
    assert _group_of(opt, model.weight)["betas"] == (0.9, 0.999)  # looked up before the load
    sd = opt.state_dict()
    sd["param_groups"][0]["betas"] = (0.5, 0.9)
    opt.load_state_dict(sd)
    assert _group_of(opt, model.weight) is opt.param_groups[0]
    assert _group_of(opt, model.bias)["betas"] == (0.5, 0.9)
    extra = nn.Parameter(torch.zeros(2))
    opt.add_param_group({"params": [extra], "betas": (0.8, 0.99)})
    assert _group_of(opt, extra)["betas"] == (0.8, 0.99) and opt.engine.param_index(extra) == 2


# --- coordinates of tiny variance (GPT-2's key bias) ---------------------------------------------
def _tiny_variance_run(exchange, steps=40, freeze=10, lr=1e-3):
    """One tensor like GPT-2's ``c_attn.bias``: 32 coordinates with O(1) gradients, 32 with
    gradients of ~1e-11 (a softmax-invariant key bias), in one bucket with a larger weight.
    Returns (max |update| per step, max |p_tiny| per step) of OnebitAdam (world 1, 1-bit
    compression all the same) and of AdamW on the same gradients."""
    g = torch.Generator().manual_seed(3)
    grads = []
    for _ in range(steps):
        bias = torch.randn(64, generator=g)
        bias[32:] *= 1e-11
        grads.append((torch.randn(256, generator=g) * 0.1 + 0.02, bias))
    out = {}
    for name in ("onebit", "adamw"):
        w, b = torch.zeros(256, requires_grad=True), torch.zeros(64, requires_grad=True)
        opt = (OnebitAdam([w, b], lr=lr, freeze_step=freeze, exchange=exchange, backend=SingleProcessBackend())
               if name == "onebit" else torch.optim.AdamW([w, b], lr=lr))
        updates, tiny = [], []
        for gw, gb in grads:
            before = torch.cat([w.detach(), b.detach()]).clone()
            w.grad, b.grad = gw.clone(), gb.clone()
            opt.step()
            updates.append((torch.cat([w.detach(), b.detach()]) - before).abs().max().item())
            tiny.append(b.detach()[32:].abs().max().item())
        out[name] = updates, tiny
    return out


@pytest.mark.parametrize("exchange", ["preconditioned", "momentum"])
def test_tiny_variance_coordinates_move_no_more_than_adam_would(exchange):
    lr, freeze = 1e-3, 10
    out = _tiny_variance_run(exchange, freeze=freeze, lr=lr)
    (updates, tiny), (_, tiny_adamw) = out["onebit"], out["adamw"]
    adam_bound = lr * max(1.0, 0.1 / 0.001**0.5)  # lr (1 - b1) / sqrt(1 - b2): Adam's worst step
    worst_update = max(updates[freeze:])
    worst_ratio = max(a / b for a, b in zip(tiny[freeze:], tiny_adamw[freeze:]))
    if exchange == "momentum":  # the paper's exchange: +-scale / eps throws them far away
        assert worst_update > 1e3 * adam_bound and worst_ratio > 1e6
    else:
        assert worst_update <= 1.5 * adam_bound, worst_update
        assert worst_ratio <= 2.0, worst_ratio


def test_a_gradient_that_grew_after_the_freeze_steps_no_further_than_the_bound():
    """4 coordinates whose gradient grows 4x at the freeze and stays (``|m / sqrt(v_f)|`` -> 4,
    where Adam's own ``v`` would catch up) in a layer of 1,024 whose other gradients shrink 10x
    after the tracking's calibration (its factor grows to ~3, and multiplies the step after the
    exchange): no coordinate steps further than ``lr K`` (``K = COMPRESSED_STEP_BOUND``, 1.5; the
    1-bit scale's error feedback adds a few percent). With the bound of Adam's spike, not divided
    by the factor, the grown coordinates stepped 3.8 ``lr``. They still step: over ``lr``."""
    from compressed_opt.adam import COMPRESSED_STEP_BOUND

    lr, freeze, steps = 1e-3, 10, 200
    gen = torch.Generator().manual_seed(5)
    b = torch.zeros(1024, requires_grad=True)
    opt = OnebitAdam([b], lr=lr, freeze_step=freeze, backend=SingleProcessBackend())
    worst, grown = 0.0, []
    for t in range(1, steps + 1):
        g = 0.1 * torch.randn(1024, generator=gen) + 0.05
        if t > freeze:
            g[:4] = 4 * 0.05
        if t > freeze + 10:
            g[4:] *= 0.1
        before = b.detach().clone()
        b.grad = g
        opt.step()
        move = (b.detach() - before).abs()
        if t > freeze:
            worst = max(worst, move.max().item())
            grown.append(move[:4].min().item())
    bucket = opt.engine.buckets[0]
    factor = opt.engine.client.tracking.last_factors(bucket, bucket.state.tracked, opt.param_groups[bucket.group_index],
                                                   opt.global_step)[0]
    assert factor > 2.5, factor  # the tracking does amplify this layer's steps
    assert worst <= 1.1 * COMPRESSED_STEP_BOUND * lr, worst / lr
    assert sum(grown[-20:]) / 20 >= lr, [x / lr for x in grown[-20:]]


@pytest.mark.parametrize("make", [
    lambda ps, ex: OnebitAdam(ps, lr=1e-3, freeze_step=2, exchange=ex, backend=SingleProcessBackend()),
    lambda ps, ex: __import__("compressed_opt").OnebitLamb(ps, lr=1e-3, freeze_step=2, exchange=ex,
                                                           backend=SingleProcessBackend()),
    lambda ps, ex: __import__("compressed_opt").ZeroOneAdam(ps, lr=1e-3, var_freeze_step=2, exchange=ex,
                                                            backend=SingleProcessBackend()),
], ids=["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_a_checkpoint_of_the_other_exchange_is_refused_and_of_the_same_one_loads(make):
    """Error buffers of the paper's exchange hold errors of m, the preconditioned exchange's of R m: a
    compression-stage checkpoint moves only between optimizers of the same exchange."""
    model = mlp()
    opt = make(list(model.parameters()), "momentum")
    run_steps(model, opt, list(shard_batches(0, 1, 4)))
    saved = opt.state_dict()
    assert saved["compressed_opt"]["exchange"] == "momentum"
    with pytest.raises(ValueError, match="exchange='momentum'"):
        make(list(mlp().parameters()), "preconditioned").load_state_dict(saved)
    again = make(list(mlp().parameters()), "momentum")
    again.load_state_dict(saved)  # the same exchange: fine
    with pytest.raises(ValueError, match="Invalid exchange"):
        make(list(mlp().parameters()), "sign")



def _fused_and_unfused_runs(rank, world):
    """Per configuration, the parameters after a seeded job with the local momentum's pass fused
    into the exchange's compression, and with it run alone first (the fusion refused), and how
    many compressions ran it fused (the preconditioned exchange's ``LerpScaleClamp``, the momentum
    exchange's ``Lerp``: the classes the CPU buckets bind)."""
    out = []
    for kwargs in (dict(), dict(overlap=False, bucket_cap_mb=0.004, scale_block=256), dict(zero_stage=1),
                   dict(exchange="momentum", bucket_cap_mb=0.004)):
        ran, finals = [0], []
        for fuse in (True, False):
            with fusion(("LerpScaleClamp", "Lerp"), fuse, ran):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(64, 40), nn.Tanh(), nn.Linear(40, 10), nn.LayerNorm(10))
                opt = OnebitAdam(model.parameters(), freeze_step=3, **HP, **kwargs)
                for x, y in gaussian_batches(rank, world, 12):
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                finals.append([p.detach().clone() for p in model.parameters()])
        out.append((finals, ran[0]))
    return out


@pytest.mark.multiprocess
def test_the_fused_local_momentum_pass_changes_no_bit():
    """The preconditioned exchange's local momentum formed inside the compression (one native pass)
    and formed before it (two): the same parameters bit for bit, with exchange groups and overlap,
    and the momentum exchange's (torch.lerp's rounding); ZeRO forms it while gathering and never fuses."""
    for per_rank in run_ranks(_fused_and_unfused_runs, 2):
        (default, ran_default), (groups, ran_groups), (zero, ran_zero), (momentum, ran_momentum) = per_rank
        for finals in (default, groups, zero, momentum):
            assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(*finals))
        assert ran_default > 0 and ran_groups > 0 and ran_zero == 0 and ran_momentum > 0


WARMUP_SHAPES = [(37,), (16, 9), (1000,), (5,), (1,)]
WARMUP_HP = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-8)


def _fused_adamw_on_flat_buckets(opt, params: list, hp: dict):
    """An oracle of ZeRO's warmup on one rank (its chunk: the whole bucket): ``torch._fused_adamw_``
    on each bucket's parameters, gradients and state concatenated into one flat tensor each, as the
    optimizer's buckets order them; a step of it on ``params`` (copies of the optimizer's) and a
    state of its own per bucket."""
    state = {}
    index = {id(p): i for i, p in enumerate(opt.param_groups[0]["params"])}

    def step(t):
        for b in opt.engine.buckets:
            mine = [params[index[id(p)]] for p in b.params]
            flat = torch.cat([p.detach().reshape(-1) for p in mine])
            grad = torch.cat([p.grad.reshape(-1) for p in mine])
            m, v = state.setdefault(b.index, (torch.zeros_like(flat), torch.zeros_like(flat)))
            torch._fused_adamw_([flat], [grad], [m], [v], [], [torch.tensor(float(t))], lr=hp["lr"],
                                beta1=hp["betas"][0], beta2=hp["betas"][1], weight_decay=hp["weight_decay"],
                                eps=hp["eps"], amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
            for p, piece in zip(mine, flat.split([p.numel() for p in mine])):
                p.data.copy_(piece.view_as(p))
    return step


def _warmup_against_fused_adamw(opt_kwargs: dict, hp: dict, steps: int = 6, exact: str = "per tensor") -> int:
    """Warmup steps of OnebitAdam and of torch's fused AdamW on the same gradients (the same on
    every rank, so that their average is themselves), compared after every step: ``exact="per
    tensor"``: ``torch.optim.AdamW(fused=True)``, the parameters, ``exp_avg`` and ``exp_avg_sq``
    equal bit for bit; ``"per bucket"``: the kernel on each bucket's flat concatenation
    (:func:`_fused_adamw_on_flat_buckets`), the parameters bit for bit; ``"close"``:
    ``AdamW(fused=True)`` up to the kernel's own rounding differences between a tensor's vectorised
    body and its scalar tail, which fall elsewhere on a flat chunk. Returns the number of buckets."""
    torch.manual_seed(0)
    mine = [nn.Parameter(torch.randn(s) * 0.1) for s in WARMUP_SHAPES]
    theirs = [nn.Parameter(p.detach().clone()) for p in mine]
    opt = OnebitAdam(mine, freeze_step=50, overlap=False, **hp, **opt_kwargs)
    ref = torch.optim.AdamW(theirs, fused=True, **hp)
    flat_step = _fused_adamw_on_flat_buckets(opt, theirs, hp) if exact == "per bucket" else None
    g = torch.Generator().manual_seed(1)
    for t in range(1, steps + 1):
        for p, q in zip(mine, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        if flat_step is None:
            ref.step()
        else:
            flat_step(t)
        for p, q in zip(mine, theirs):
            if exact == "close":
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
                continue
            assert torch.equal(p, q), opt_kwargs
            if exact == "per tensor":
                assert torch.equal(opt.state[p]["exp_avg"], ref.state[q]["exp_avg"])
                assert torch.equal(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
    buckets = len(opt.engine.buckets)
    opt.close()
    return buckets


@pytest.mark.parametrize("wd", [0.0, 0.01])
def test_the_warmup_is_torchs_fused_adamw_bit_for_bit(wd, monkeypatch):
    """The warmup step runs torch's fused AdamW kernel once per bucket and step: in stage 0 on the
    parameters and the bucket's state, the parameters, ``exp_avg`` and ``exp_avg_sq`` after every
    warmup step ``torch.optim.AdamW(fused=True)``'s on the same gradients bit for bit; under ZeRO
    (stage 1 and 2) on this rank's flat chunk, the parameters bit for bit that kernel's on each
    bucket's flat concatenation. ``bias_correction=False`` composes AdamW instead (no kernel)."""
    calls, ours = [], [False]
    kernel = torch._fused_adamw_

    def counted(*a, **k):
        if ours[0]:
            calls.append(True)
        return kernel(*a, **k)

    monkeypatch.setattr(torch, "_fused_adamw_", counted)
    hp = dict(WARMUP_HP, weight_decay=wd)
    for kw, exact in ((dict(), "per tensor"), (dict(zero_stage=1), "per bucket"),
                      (dict(zero_stage=2, bucket_cap_mb=0.002), "per bucket")):
        calls.clear()
        ours[0] = True
        buckets = _warmup_against_fused_adamw(dict(backend=SingleProcessBackend(), **kw), hp, exact=exact)
        ours[0] = False
        # (the oracle's own calls are counted too: AdamW's one per step, the flat one per bucket and step)
        assert len(calls) == 6 * (buckets + (1 if exact == "per tensor" else buckets)), kw
    calls.clear()
    params = [nn.Parameter(torch.randn(s)) for s in WARMUP_SHAPES]
    other = OnebitAdam(params, freeze_step=50, backend=SingleProcessBackend(), overlap=False, bias_correction=False,
                       **hp)
    for p in params:
        p.grad = torch.randn(p.shape)
    ours[0] = True
    other.step()
    ours[0] = False
    assert not calls
    other.close()


def _zero_warmup_against_fused_adamw(rank, world):
    for stage in (1, 2):  # buckets of 6, 1000 and 181 elements: chunks that cut through parameters
        _warmup_against_fused_adamw(dict(zero_stage=stage, bucket_cap_mb=0.002), dict(WARMUP_HP, weight_decay=0.01),
                                    exact="close")
    return True


@pytest.mark.multiprocess
def test_zero_warmup_on_two_ranks_is_torchs_fused_adamw():
    """Under ZeRO on 2 ranks each rank runs the fused kernel on its chunk and the chunks are
    all-gathered: the parameters follow ``AdamW(fused=True)``'s to the kernel's own rounding."""
    assert run_ranks(_zero_warmup_against_fused_adamw, 2) == [True, True]
