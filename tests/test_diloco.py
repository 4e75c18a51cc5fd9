"""DiLoCo (compressed_opt.diloco): the outer step's math, the replicas equal after each
synchronisation, the bytes per inner step, a checkpoint taken mid-round with an exchange in flight
resumed bit for bit in fresh processes, and ranks that disagree raising on every rank."""
from __future__ import annotations

import pytest
import torch

from distributed import run_ranks, spawn_ranks

H = 6


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _loss(model, step, rank):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * step + rank))
    return (model(x) - x[:, :1].sin()).square().mean()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_one_round_on_one_process_is_the_outer_nesterov_step():
    """One replica: after ``H`` inner steps the parameters are ``A - lr (D + mu u)`` with
    ``D = A - theta`` and ``u = D`` (the first round), computed here by hand; an LR scheduler on
    the inner optimizer schedules it as without DiLoCo."""
    from compressed_opt.diloco import DiLoCo

    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=2, gamma=0.5)
    opt = DiLoCo(model.parameters(), inner, sync_every=H, outer_lr=0.7, outer_momentum=0.9)
    anchor = _flat(model).clone()
    twin = _model()
    twin_inner = torch.optim.AdamW(twin.parameters(), lr=1e-2, fused=True)
    twin_sched = torch.optim.lr_scheduler.StepLR(twin_inner, step_size=2, gamma=0.5)
    for t in range(1, H + 1):
        for m, o, s in ((model, opt, sched), (twin, twin_inner, twin_sched)):
            o.zero_grad()
            _loss(m, t, 0).backward()
            o.step()
            s.step()
    assert inner.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    d = anchor - _flat(twin)
    expected = anchor.clone().sub_(d, alpha=0.7).sub_(d, alpha=0.7 * 0.9)
    assert torch.equal(_flat(model), expected)
    assert opt.syncs == 1 and opt.inner_step == H
    opt.close()


def test_bad_arguments_are_refused_up_front():
    from compressed_opt.diloco import DiLoCo

    model, other = _model(), _model(1)
    inner = torch.optim.AdamW(model.parameters())
    for kwargs, match in ((dict(compression="int3"), "compression"), (dict(fragments=7), "fragments"),
                          (dict(delay=6), "delay"), (dict(sync_every=0), "sync_every"), (dict(mixing=2.0), "mixing"),
                          (dict(outer_momentum=1.0), "outer_momentum"), (dict(error_feedback=1.5), "error_feedback"),
                          (dict(error_feedback=-0.1), "error_feedback"), (dict(warmup_steps=-1), "warmup_steps"),
                          (dict(warmup_steps=2.0), "warmup_steps")):
        with pytest.raises(ValueError, match=match):
            DiLoCo(model.parameters(), inner, **{"sync_every": H, **kwargs})
    with pytest.raises(ValueError, match="one param group"):
        DiLoCo([{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:], "lr": 0.1}],
               inner)
    with pytest.raises(ValueError, match="fixed when it is made"):
        DiLoCo(model.parameters(), inner, sync_every=H).add_param_group({"params": [torch.zeros(1)]})
    with pytest.raises(ValueError, match="exactly the inner optimizer's parameters"):
        DiLoCo(other.parameters(), inner)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        DiLoCo(model.parameters(), object())


def _train(rank, world, compression, fragments, delay, steps):
    import torch.distributed as dist

    from compressed_opt.diloco import DiLoCo

    model = _model(seed=rank)  # (different seeds: DiLoCo starts every replica from rank 0's)
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 compression=compression, fragments=fragments, delay=delay)
    equal, losses = [], []
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss = _loss(model, t, rank)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if t % H == 0 and fragments == 1 and delay == 0:  # a synchronisation: the replicas are equal
            flat = _flat(model)
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            equal.append(all(torch.equal(gathered[0], g) for g in gathered))
    stats = opt.comm_stats()
    opt.close()
    return dict(equal=equal, losses=losses, stats=stats)


@pytest.mark.parametrize("compression, least", [("fp32", 0.8), ("bf16", 1.6), ("4bit", 4.0), ("1bit", 5.0)])
def test_replicas_are_equal_after_each_sync_and_send_far_fewer_bytes(compression, least):
    """Two replicas, rounds of ``H`` steps: equal parameters after every synchronisation, the loss
    falls, and the bytes per inner step are ``H`` times fewer than DDP's fp32 all-reduce or better
    (fp32 ~H, bf16 ~2H, 4-bit ~6H, 1-bit ~10H on this 321-element model, whose scales and headers
    weigh)."""
    out = run_ranks(_train, 2, compression, 1, 0, 5 * H, timeout=90)
    for r in out:
        assert r["equal"] == [True] * 5
        assert r["stats"]["syncs"] == 5 and r["stats"]["inner_steps"] == 5 * H
        assert r["stats"]["ratio_to_ddp_fp32"] > least * H
        assert sum(r["losses"][-H:]) < 0.8 * sum(r["losses"][:H])


def _warmup(rank, world, warmup, steps):
    """``warmup`` steps of DiLoCo (1-bit, ``H``) beside a twin that runs AdamW on the mean of both
    ranks' losses (what data parallel training steps on): each step's parameters, both replicas'
    and the twin's, and the syncs taken."""
    import torch.distributed as dist

    from compressed_opt.diloco import DiLoCo

    model, twin = _model(seed=rank), _model()
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 warmup_steps=warmup)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    rows = []
    for t in range(1, steps + 1):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        opt.step()
        twin_opt.zero_grad()
        (sum(_loss(twin, t, r) for r in range(world)) / world).backward()
        twin_opt.step()
        flat = _flat(model)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        rows.append(dict(equal=all(torch.equal(gathered[0], g) for g in gathered),
                         off=float((flat - _flat(twin)).abs().max()), syncs=opt.syncs))
    stats = opt.comm_stats()
    opt.close()
    return rows, stats


def test_warmup_steps_step_as_data_parallel_then_the_rounds_start_from_there():
    """``warmup_steps=W``: steps 1..W are the data-parallel AdamW step on the replicas' mean
    gradient (the twin's, within fp32 rounding; the replicas bit for bit equal), then local steps
    (the replicas part) and the first synchronisation at ``W + H``, not at ``H``; the warmup's
    bytes are fp32 all-reduces of every parameter."""
    W = 4
    out = run_ranks(_warmup, 2, W, W + 2 * H, timeout=90)
    for rows, stats in out:
        assert all(r["equal"] and r["off"] < 1e-5 for r in rows[:W]), rows[:W]
        assert not rows[W]["equal"] and rows[W]["off"] > 1e-4  # (local steps: each replica on its own data)
        assert [r["syncs"] for r in rows] == [0] * (W + H - 1) + [1] * H + [2]
        assert rows[W + H - 1]["equal"] and rows[-1]["equal"]
        assert stats["inner_steps"] == W + 2 * H and stats["warmup_steps"] == W
        assert stats["bytes_sent"] >= W * 321 * 4  # (4 warmup all-reduces of the 321 fp32 gradients, at least)


def _outer_means(rank, world, runs):
    """Per run ``(kwargs, seeds)``: each round's exchanged mean ``D`` (outer lr 1, no momentum:
    ``D = A_old - A_new``) of the pseudo-gradients ``d_r`` (SGD with lr 1 on the gradient ``d_r``:
    ``theta = A - d_r``, ``d_r`` drawn from the round's seed and the rank), and its ``beta``."""
    from compressed_opt.diloco import DiLoCo

    out = []
    for kwargs, seeds in runs:
        p = torch.nn.Parameter(torch.zeros(3000))
        opt = DiLoCo([p], torch.optim.SGD([p], lr=1.0), sync_every=1, outer_lr=1.0, outer_momentum=0.0, **kwargs)
        means = []
        for seed in seeds:
            before = p.detach().clone()
            p.grad = torch.randn(3000, generator=torch.Generator().manual_seed(100 * seed + rank))
            opt.step()
            means.append(before - p.detach())
        opt.close()
        out.append((means, opt.error_feedback, opt.state_bytes()))
    return out


def test_the_1bit_exchange_feeds_back_half_its_errors_by_default():
    """``error_feedback`` (beta): with ``0.0`` each round's mean is that of its own pseudo-gradients
    alone, what a fresh exchange gives them (to the rounding of ``A - theta``): the last round's
    errors are dropped. With ``1.0`` the same second round differs (the errors fed back), and by
    default (1-bit: 0.5) by less; on both replicas the same mean. 4-bit keeps full error feedback
    by default."""
    runs = [(dict(error_feedback=0.0), [1, 2]), (dict(error_feedback=1.0), [1, 2]), ({}, [1, 2]), ({}, [2]),
            (dict(compression="4bit"), [1])]
    out = run_ranks(_outer_means, 2, runs, timeout=90)
    assert all(torch.equal(a, b) for a, b in zip(out[0][2][0], out[1][2][0]))  # (the same mean on both replicas)
    for (dropped, _, kept), (full, _, _), (default, beta, kept_default), (fresh, _, _), (_, four, _) in out:
        assert beta == 0.5 and four == 1.0
        # (A and u, 2 x 4 x 3000 bytes; with error feedback the errors too, about 4 x (3000 + 1500) bytes on 2
        # replicas, padded to whole chunks; with error_feedback=0 none are kept between the exchanges)
        assert kept == 24000 and 24000 + 18000 <= kept_default < 24000 + 18100, (kept, kept_default)
        assert torch.allclose(dropped[1], fresh[0], rtol=0, atol=1e-5)  # (no memory of round 1)
        assert torch.equal(full[0], default[0]) and torch.equal(dropped[0], default[0])  # (round 1: no errors yet)
        assert 0.1 < (default[1] - fresh[0]).norm() < (full[1] - fresh[0]).norm()


def test_the_1bit_rotation_is_orthonormal_and_leaves_the_tail():
    """The ``"1bit"`` exchange's rotation ``H S`` of each whole run of 1024 elements: the norm
    kept, the inverse giving the input back, the elements past the last whole run untouched, and
    ``H`` the Walsh-Hadamard matrix (its first row constant, rows orthogonal)."""
    from compressed_opt.diloco import ROTATION_BLOCK
    from compressed_opt.rotation import hadamard_ as _hadamard_, hadamard_runs_ as _hadamard_runs_, rotate_ as _rotate

    x = torch.randn(2 * ROTATION_BLOCK + 100, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    signs = torch.randint(0, 2, (2, ROTATION_BLOCK), generator=g, dtype=torch.int8) * 2 - 1  # (int8, as DiLoCo's)
    y = x.clone()
    _rotate(y, signs, forward=True)
    assert torch.equal(y[2 * ROTATION_BLOCK:], x[2 * ROTATION_BLOCK:])
    assert y.norm().item() == pytest.approx(x.norm().item(), rel=1e-5)
    _rotate(y, signs, forward=False)
    assert torch.allclose(y, x, atol=1e-5)
    h = torch.eye(ROTATION_BLOCK)
    _hadamard_(h)
    assert torch.allclose(h @ h.T, torch.eye(ROTATION_BLOCK), atol=1e-5)
    assert torch.allclose(h[0], torch.full((ROTATION_BLOCK,), ROTATION_BLOCK ** -0.5))
    # the rotation's two products with H_32 are the butterfly's H_1024
    x = torch.randn(3, ROTATION_BLOCK, generator=torch.Generator().manual_seed(2))
    fast = x.clone()
    _hadamard_runs_(fast)
    assert torch.allclose(fast, x @ h, atol=1e-5)


def _resume(rank, world, root, phase, warmup):
    """Fragments 3, delay 2, 1-bit: save at step 13 (with no warmup, fragment 0's exchange of step
    12 in flight, landing at 14; with a warmup of 16 steps, mid-warmup) and run to 24; or, fresh,
    load the step-13 checkpoint and run to 24."""
    import os

    from compressed_opt.diloco import DiLoCo

    model = _model(seed=0 if phase == "through" else 5)
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 compression="1bit", fragments=3, delay=2, warmup_steps=warmup)
    path = os.path.join(root, f"rank{rank}.pt")
    start = 1
    if phase == "resumed":
        saved = torch.load(path, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optim"])
        start = 14
    for t in range(start, 25):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        opt.step()
        if t == 13 and phase == "through":
            assert (opt.fragments[0].pending is not None) == (warmup == 0)  # (mid-round, an exchange in flight)
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    opt.synchronize()
    errors = [f.feedback.worker_error.clone() for f in opt.fragments]
    opt.close()
    return _flat(model), errors


@pytest.mark.parametrize("warmup", [0, 16], ids=["mid-round", "mid-warmup"])
def test_a_checkpoint_mid_round_with_an_exchange_in_flight_resumes_bit_for_bit(tmp_path, warmup):
    through = run_ranks(_resume, 2, str(tmp_path), "through", warmup, timeout=90)
    resumed = run_ranks(_resume, 2, str(tmp_path), "resumed", warmup, timeout=90)
    for (p1, e1), (p2, e2) in zip(through, resumed):
        assert torch.equal(p1, p2)
        assert all(torch.equal(a, b) for a, b in zip(e1, e2))
    assert not torch.equal(through[0][1][0], through[1][1][0])  # (each rank's own error buffers)


def test_a_checkpoint_of_other_options_is_refused():
    from compressed_opt.diloco import DiLoCo

    model = _model()
    a = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters()), sync_every=H)
    sd = a.state_dict()
    a.close()
    b = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters()), sync_every=H + 1)
    with pytest.raises(ValueError, match="sync_every"):
        b.load_state_dict(sd)
    c = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters()), sync_every=H, warmup_steps=10)
    with pytest.raises(ValueError, match="warmup_steps"):
        c.load_state_dict(sd)
    c.close()
    with pytest.raises(ValueError, match="'diloco'"):
        b.load_state_dict(torch.optim.AdamW(model.parameters()).state_dict())
    b.close()


def _disagree(rank, world, what):
    from compressed_opt.diloco import DiLoCo

    model = _model()
    kwargs = dict(sync_every=H, warmup_steps=2 if what in ("warmup_steps", "inner lr in the warmup") else 0)
    if rank == 1 and not what.startswith("inner lr"):
        kwargs = {"sync_every": dict(sync_every=H - 1), "outer_lr": dict(sync_every=H, outer_lr=0.5),
                  "warmup_steps": dict(sync_every=H, warmup_steps=3), "no warmup": dict(sync_every=H, warmup_steps=2)
                  }[what]
    inner_lr = 2e-3 if rank == 1 and what.startswith("inner lr") else 1e-3
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=inner_lr), **kwargs)
    for t in range(1, H + 1):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        opt.step()


@pytest.mark.parametrize("what, error", [("sync_every", "RanksOutOfStep"), ("outer_lr", "ValueError"),
                                         ("warmup_steps", "ValueError"), ("no warmup", "RanksOutOfStep"),
                                         ("inner lr", "ValueError"), ("inner lr in the warmup", "ValueError")])
def test_replicas_that_disagree_raise_on_every_rank(what, error):
    """One replica with another ``sync_every`` reaches its round at another inner step; one with
    another outer lr, or another inner lr: every rank raises at the synchronisation (or at the
    first warmup step), naming it, instead of hanging or training on apart.
    Another ``warmup_steps`` is met at the first step, where a warming replica checks with the
    others (one warming up against one that does not: the other's first round meets it)."""
    out = spawn_ranks(_disagree, 2, what, timeout=60, pg_timeout=30)
    assert [status for status, _ in out] == ["error", "error"], out
    for _, text in out:
        assert error in text and ("out of step" in text or "outer hyperparameters" in text)


def _skipping(rank, world, warmup, who, streamed=False):
    """A loop that skips ``step()`` after its backward at inner step 3 on rank 1 (``who="one"``) or
    on both ranks (``"all"``); ``streamed``: 2 fragments, each exchange on the thread for 2 steps."""
    import warnings

    from compressed_opt.diloco import DiLoCo

    warnings.simplefilter("ignore")
    model = _model()
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 warmup_steps=warmup, **(dict(fragments=2, delay=2) if streamed else {}))
    for t in range(1, warmup + 2 * H + 2):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        if t != 3 or (who == "one" and rank == 0):
            opt.step()
    opt.close()
    return opt.inner_step, opt.syncs, _flat(model)


@pytest.mark.parametrize("warmup, streamed", [(0, False), (4, False), (0, True)],
                         ids=["in-a-round", "in-the-warmup", "streamed"])
def test_a_replica_that_skips_step_makes_every_replica_raise_at_the_next_collective(warmup, streamed):
    """One replica's loop skips ``step()`` after a backward (``if torch.isfinite(loss): step()``).
    Before, in a round it ran a step behind the others, silently, until the others' last round
    waited for it (a Gloo "connection reset" or a hang at the end), and in the warmup its
    all-reduces paired with the others' of the next step without a word. Now it says so at its
    ``zero_grad()`` and every replica raises at the next collective, naming both (streamed: after
    the exchange on the thread, which holds the same communicator). Where every replica skips the
    same step, they all drop it and train on in step."""
    out = spawn_ranks(_skipping, 2, warmup, "one", streamed, timeout=60, pg_timeout=30)
    assert [status for status, _ in out] == ["error", "error"], out
    for _, text in out:
        assert "RanksOutOfStep" in text and "zero_grad() without step()" in text, text
    both = run_ranks(_skipping, 2, warmup, "all", streamed, timeout=60)
    assert [t for t, _, _ in both] == [warmup + 2 * H] * 2 and both[0][1] == both[1][1] == (3 if streamed else 2)
    assert torch.equal(both[0][2], both[1][2]) or streamed  # (streamed: the replicas differ between landings)


def _scaled(rank, world, scaler_mode, inf_at, warmup, steps):
    """DiLoCo (1-bit) under a CPU ``torch.amp.GradScaler`` (``scaler_mode``: ``None``, ``"step"``:
    ``scaler.step`` on scaled gradients, ``"unscale"``: ``unscale_`` first), the loss of rank 1 made
    inf at the steps ``inf_at``: per step the parameters, whether the replicas are equal, and the
    scale."""
    import torch.distributed as dist

    from compressed_opt.diloco import DiLoCo

    model = _model(seed=rank)
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 warmup_steps=warmup)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, enabled=scaler_mode is not None)
    rows = []
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss = _loss(model, t, rank) * (float("inf") if rank == 1 and t in inf_at else 1.0)
        scaler.scale(loss).backward()
        if scaler_mode == "unscale":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        flat = _flat(model)
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        rows.append(dict(flat=flat, equal=torch.equal(gathered[0], gathered[1]), scale=scaler.get_scale()))
    opt.close()
    return rows, opt.inner_step, opt.syncs


def test_a_gradscaler_skip_counts_as_a_step_alone_in_a_round_and_on_every_replica_in_the_warmup():
    """``GradScaler.step`` calls ``DiLoCo.step()`` on every step (``_step_supports_amp_scaling``).
    Without inf it trains bit for bit as without a scaler, whether the scaler unscaled the gradients
    (``unscale_``) or DiLoCo did (``grad_scale``). With inf on one replica: in a round that replica
    alone skips its inner step and the step still counts, so the rounds stay on one schedule and the
    replicas meet at each sync; in the warmup every replica skips alike and stays equal. Before,
    the scaler skipped ``step()`` on that replica, shifting its rounds (a Gloo error at the end)."""
    W, steps = 4, 4 + 3 * H
    plain, stepped, unscaled = (run_ranks(_scaled, 2, mode, (), W, steps, timeout=90)
                                for mode in (None, "step", "unscale"))
    for rank in range(2):
        assert torch.equal(plain[rank][0][-1]["flat"], stepped[rank][0][-1]["flat"])
        assert torch.equal(plain[rank][0][-1]["flat"], unscaled[rank][0][-1]["flat"])
    inf_at = (2, W + H + 2)  # (a warmup step, a local step of the second round)
    out = run_ranks(_scaled, 2, "step", inf_at, W, steps, timeout=90)
    (rows0, t0, syncs0), (rows1, t1, syncs1) = out
    assert t0 == t1 == steps and syncs0 == syncs1 == 3
    assert all(r["equal"] for r in rows0[:W])  # (the warmup: data parallel, the skip taken together)
    for rows in (rows0, rows1):
        assert torch.equal(rows[0]["flat"], rows[1]["flat"])  # (step 2 skipped on both)
    local = W + H + 2 - 1  # (the row of the local step with inf on rank 1)
    assert torch.equal(rows1[local - 1]["flat"], rows1[local]["flat"])
    assert not torch.equal(rows0[local - 1]["flat"], rows0[local]["flat"])
    assert [i + 1 for i, r in enumerate(rows0) if r["equal"] and i >= W] == [W + H, W + 2 * H, W + 3 * H]
    assert rows1[-1]["scale"] < rows0[-1]["scale"]  # (each replica's scaler backs off on its own inf)


def _under_ddp(rank, world, wrapped):
    """DiLoCo around a model that DDP wraps over the same ranks (``wrapped``; as accelerate and
    Lightning's DDP strategy do) or around the bare model: the warnings of ``H + 1`` steps."""
    import warnings

    from compressed_opt.diloco import DiLoCo

    model = _model()
    net = torch.nn.parallel.DistributedDataParallel(model) if wrapped else model
    opt = DiLoCo(net.parameters(), torch.optim.AdamW(net.parameters(), lr=1e-2), sync_every=H)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in range(1, H + 2):
            opt.zero_grad()
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1000 * t + rank))
            (net(x) - x[:, :1].sin()).square().mean().backward()
            opt.step()
    opt.close()
    return [str(w.message) for w in caught if "first local step" in str(w.message)]


def test_gradients_averaged_across_the_replicas_by_ddp_are_warned_about_at_the_first_local_step():
    """DDP over the replicas' own ranks averages every gradient across them: no step is local and
    ``comm_stats()`` would count DiLoCo's bytes only. The first local step compares a checksum of
    the gradients and warns, on every rank, where they are the same bit for bit; the bare model's
    differ, and nothing is said."""
    wrapped = run_ranks(_under_ddp, 2, True, timeout=90)
    assert all(len(w) == 1 and "DDP over the same ranks" in w[0] for w in wrapped), wrapped
    assert run_ranks(_under_ddp, 2, False, timeout=90) == [[], []]


def _one_file(rank, world, root, sharded, consolidated=False):
    """Every rank loads rank 0's ``state_dict()`` (one file, as a framework that saves rank 0's
    optimizer state writes it), taken mid-round; ``sharded``: FSDP2 inside a single replica
    (DTensor parameters, each rank's state its shard's); ``consolidated``: after
    ``consolidate_state_dict()`` on every rank, rank 0's model saved beside it, and the resumed
    run's parameters against the uninterrupted run's. The warnings, the error buffers before and
    after, and whether the replicas meet at the next sync."""
    import os
    import warnings

    import torch.distributed as dist

    from compressed_opt.diloco import DiLoCo

    model, backend = _model(), None
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh["shard"])
        backend = mesh["replicate"]
    make = lambda: DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2),  # noqa: E731
                          sync_every=H, backend=backend)
    opt = make()
    for t in range(1, H + 3):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        opt.step()
    path = os.path.join(root, "optim.pt")
    if consolidated:
        opt.consolidate_state_dict()
    if rank == 0:
        torch.save(opt.state_dict(), path)
        torch.save(model.state_dict(), path + ".model")
    dist.barrier()
    mine = opt.fragments[0].feedback.worker_error  # (None on one replica: nothing to feed back)
    mine = None if mine is None else mine.clone()
    if consolidated:
        for t in range(H + 3, 2 * H + 1):
            opt.zero_grad()
            _loss(model, t, rank).backward()
            opt.step()
        through = _flat(model)
        opt.close()
        model = _model(seed=1)
        model.load_state_dict(torch.load(path + ".model"))
    opt.close()
    fresh = make()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fresh.load_state_dict(torch.load(path, weights_only=False))
        except ValueError as exc:
            return "refused", str(exc)
    if sharded:  # (rank 1 refused it: no more steps of the shard group)
        return "loaded", ""
    said = [str(w.message) for w in caught if "rank 0's, loaded on" in str(w.message)]
    error = fresh.fragments[0].feedback.worker_error
    kept = error is not None and torch.equal(error, mine)
    for t in range(H + 3, 2 * H + 1):
        fresh.zero_grad()
        _loss(model, t, rank).backward()
        fresh.step()
    flat = _flat(model)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    fresh.close()
    if consolidated:
        return said, kept, torch.equal(flat, through)
    return said, kept, error is None, torch.equal(gathered[0], gathered[1])


def test_one_file_of_rank_0_loaded_on_every_rank_drops_the_other_ranks_errors_or_is_refused_if_sharded(tmp_path):
    """A framework that saves rank 0's optimizer state and loads it on every rank gave rank 1 rank
    0's error-feedback buffers without a word (its own lost, rank 0's counted twice). Now the state
    dict names its rank: on plain replicas rank 1 warns and starts its errors from zero (rank 0
    keeps its own), and the replicas still meet at the next sync; with sharded parameters, where
    every rank's anchor is its shard's, rank 1 refuses it."""
    plain = run_ranks(_one_file, 2, str(tmp_path), False, timeout=90)
    assert plain[0] == ([], True, False, True)
    said, kept, zero, met = plain[1]
    assert len(said) == 1 and "start again from zero" in said[0] and not kept and zero and met
    sharded = run_ranks(_one_file, 2, str(tmp_path), True, timeout=90)
    assert sharded[0][0] != "refused"
    assert sharded[1][0] == "refused" and "rank 0's and this is rank 1" in sharded[1][1]


def test_consolidate_state_dict_makes_one_file_resume_every_replica_bit_for_bit(tmp_path):
    """``consolidate_state_dict()`` on every rank before rank 0 saves (as the 1-bit optimizers',
    what accelerate's ``save_state`` line and Lightning call): each rank loads its own record from
    the one file, its parameters (which differ mid-round) and error buffers included, and the
    resumed run equals the uninterrupted one bit for bit on both replicas, without a warning."""
    out = run_ranks(_one_file, 2, str(tmp_path), False, True, timeout=90)
    assert out == [([], True, True), ([], True, True)]


def _defaults(rank, world, steps, kwargs):
    from compressed_opt.diloco import DiLoCo

    model = _model(seed=rank)
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters()), **kwargs)  # ({}: H=30, 1-bit)
    for t in range(1, steps + 1):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        opt.step()
    opt.close()
    return _flat(model)


@pytest.mark.parametrize("kwargs", [{}, dict(compression="4bit", fragments=2, delay=3)],
                         ids=["defaults", "4bit-streamed"])
def test_the_same_seeded_job_twice_is_bit_for_bit_the_same_with_default_arguments(kwargs):
    """Two rounds of DiLoCo with every default (the 1-bit exchange, H=30), and streamed with the
    4-bit exchange on its thread, run twice in fresh processes: the same parameters, bit for bit
    (with defaults the replicas equal; streamed they differ by their local steps since the last
    landing)."""
    first = run_ranks(_defaults, 2, 60, kwargs, timeout=90)
    second = run_ranks(_defaults, 2, 60, kwargs, timeout=90)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    assert torch.equal(first[0], first[1]) == (not kwargs)


def _hsdp(rank, world, steps, warmup, own_hsdp, skipping_rank=None):
    """FSDP2 inside each replica (a 2 x 2 mesh: 2 replicas of 2 shards), DiLoCo's exchange over
    the replicate group, after ``warmup`` steps on gradients averaged over it. ``own_hsdp``: FSDP2's
    own HSDP on the 2-D mesh (as torchtitan shards), DiLoCo given no backend; else FSDP2 on the
    shard dimension and ``backend=mesh["replicate"]``. ``skipping_rank``'s loop skips ``step()`` at
    inner step 3."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compressed_opt.diloco import DiLoCo

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _model(seed=rank)
    shard_mesh = mesh if own_hsdp else mesh["shard"]
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 backend=None if own_hsdp else mesh["replicate"], warmup_steps=warmup)
    replicate = mesh.get_group("replicate")
    equal_at_sync, equal_mid_round, equal_in_warmup, losses = [], [], [], []
    for t in range(1, steps + 1):
        opt.zero_grad()
        loss = _loss(model, t, rank)
        loss.backward()
        if not (rank == skipping_rank and t == 3):
            opt.step()
        losses.append(loss.item())
        if t <= warmup or (t - warmup) % H in (0, H // 2):
            flat = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
            gathered = [torch.empty_like(flat) for _ in range(2)]
            dist.all_gather(gathered, flat, group=replicate)
            where = (equal_in_warmup if t <= warmup else equal_at_sync if (t - warmup) % H == 0
                     else equal_mid_round)
            where.append(torch.equal(*gathered))
    shard_numel = sum(p.to_local().numel() for p in model.parameters())
    outer = dict(anchor=sum(f.anchor.numel() for f in opt.fragments),
                 momentum=sum(f.momentum.numel() for f in opt.fragments))
    stats = opt.comm_stats()
    opt.close()
    return dict(equal_at_sync=equal_at_sync, equal_mid_round=equal_mid_round, equal_in_warmup=equal_in_warmup,
                losses=losses, stats=stats,
                shard_numel=shard_numel, whole_numel=sum(p.numel() for p in model.parameters()), outer=outer)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("warmup, own_hsdp", [(0, False), (3, False), (3, True)],
                         ids=["no-warmup", "warmup", "fsdps-own-hsdp"])
def test_fsdp2_inside_each_replica_trains_and_the_replicas_meet_at_each_sync(warmup, own_hsdp):
    """HSDP 2 x 2 (FSDP2 over the shard group inside each replica, DiLoCo's 1-bit exchange over the
    replicate group): the replicas' shards differ mid-round and are equal after every
    synchronisation (and at every warmup step: HSDP's data parallel step), the outer state is the
    size of the shard, and the loss falls. Under FSDP2's own HSDP (torchtitan's layout) the same:
    FSDP all-reduces across the replicas in the warmup only (before, it did at every step, and the
    replicas never took a local step)."""
    out = run_ranks(_hsdp, 4, warmup + 4 * H, warmup, own_hsdp, timeout=150)
    for r in out:
        assert r["equal_in_warmup"] == [True] * warmup
        assert r["equal_at_sync"] == [True] * 4
        assert r["equal_mid_round"] == [False] * 4
        assert r["outer"] == dict(anchor=r["shard_numel"], momentum=r["shard_numel"])
        assert r["shard_numel"] < r["whole_numel"]
        assert r["stats"]["syncs"] == 4 and r["stats"]["world_size"] == 2
        assert sum(r["losses"][-H:]) < 0.8 * sum(r["losses"][warmup:warmup + H])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_under_fsdp2_a_replica_that_skips_step_makes_its_replica_group_raise():
    """FSDP2 assigns the gradients itself, where no hook sees them: ``zero_grad()`` finds the
    backward that no ``step()`` followed by the gradients (other tensors than the last step left),
    and rank 2 and its replica partner, rank 0, raise at rank 0's next synchronisation, naming it;
    the other replica group's ranks see them leave (Gloo: connection closed), as under the 1-bit
    optimizers' HSDP."""
    out = spawn_ranks(_hsdp, 4, 3 * H, 0, True, 2, timeout=90, pg_timeout=30)
    assert [status for status, _ in out] == ["error"] * 4, out
    for rank in (0, 2):
        assert "RanksOutOfStep" in out[rank][1] and "zero_grad() without step()" in out[rank][1], out[rank][1]


def _dcp_resume(rank, world, root, phase, api):
    """HSDP 2 x 2 (4 ranks; 2 ranks: plain replicas) with fragments 2 and delay 1: a DCP checkpoint
    at step 9 (fragment 1's exchange of step 9 in flight, landing at 10), or, fresh, that checkpoint
    loaded and run on to step 16; through ``OptimizerState`` or torch's ``get/set_*_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from compressed_opt.dcp import OptimizerState
    from compressed_opt.diloco import DiLoCo

    from torch.distributed.checkpoint.state_dict import StateDictOptions

    model = _model(seed=0 if phase == "through" else 7)
    backend, torchs = None, api.startswith("torch")
    # (torch's options: "torch-flat" flattened, as torchtitan saves)
    options = StateDictOptions(flatten_optimizer_state_dict=api == "torch-flat")
    if world == 4:  # (FSDP2 on the shard dimension; with torch's functions, FSDP2's own HSDP on the 2-D mesh)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(model, mesh=mesh if torchs else mesh["shard"])
        backend = None if torchs else mesh["replicate"]
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 fragments=2, delay=1, backend=backend)
    def states():
        if torchs:
            return {"model": get_model_state_dict(model, options=options),
                    "optim": get_optimizer_state_dict(model, opt, options=options)}
        return {"model": model.state_dict(), "optim": OptimizerState(opt)}

    start = 1
    if phase == "resumed":
        state = states()
        dcp.load(state, checkpoint_id=root)
        if torchs:
            set_model_state_dict(model, state["model"], options=options)
            set_optimizer_state_dict(model, opt, state["optim"], options=options)
        else:
            model.load_state_dict(state["model"])
        assert opt.inner_step == 9
        start = 10
    for t in range(start, 17):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        opt.step()
        if t == 9 and phase == "through":
            assert opt.fragments[1].pending is not None  # (mid-round, an exchange in flight)
            before = _flat_local(model)
            dcp.save(states(), checkpoint_id=root)
            assert opt.inner_step == 9 and torch.equal(_flat_local(model), before)  # (torch's API took no step)
    opt.synchronize()
    local = [(v.to_local() if hasattr(v, "to_local") else v) for st in opt.inner.state.values() for v in st.values()]
    inner = [v.clone() for v in local if v.dim() > 0]
    out = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]
    out += [f.feedback.worker_error.clone() for f in opt.fragments] + [f.momentum.clone() for f in opt.fragments]
    opt.close()
    return out, inner


def _flat_local(model):
    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
                      for p in model.parameters()]).clone()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("world, api", [(4, "OptimizerState"), (4, "torch"), (2, "OptimizerState"), (2, "torch"),
                                        (4, "torch-flat")],
                         ids=lambda v: {4: "hsdp-2x2", 2: "replicas"}.get(v, v))
def test_a_dcp_checkpoint_mid_round_resumes_bit_for_bit(tmp_path, world, api):
    """A ``dcp.save`` of the model and the optimizer, ``OptimizerState(diloco)`` or torch's
    ``get_optimizer_state_dict`` (as accelerate, Lightning and torchtitan save), taken mid-round
    with an exchange in flight, loaded in fresh processes (FSDP2 inside each replica, or plain
    replicas): the parameters, the inner AdamW's moments, the error buffers and the outer momenta
    equal the uninterrupted run's, bit for bit. Mid-round the replicas' parameters differ and DCP
    writes the model's once per shard: the optimizer's entry puts each rank's own back. torch's
    functions take no step (they step an optimizer whose state is empty). On 4 ranks, torch's
    functions are tried under FSDP2's own HSDP (torchtitan's layout), the other under FSDP2 on the
    shard dimension. torch's functions also flattened (``flatten_optimizer_state_dict=True``, as
    torchtitan saves: the record travels as a ``RankRecord``, an int to torch's flattening)."""
    through = run_ranks(_dcp_resume, world, str(tmp_path), "through", api, timeout=100)
    resumed = run_ranks(_dcp_resume, world, str(tmp_path), "resumed", api, timeout=100)
    for (a, inner_a), (b, inner_b) in zip(through, resumed):
        assert len(a) == len(b) and len(inner_a) == len(inner_b) > 0
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert all(torch.equal(x, y) for x, y in zip(inner_a, inner_b))


def _full_state_dict(rank, world):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    from compressed_opt.diloco import DiLoCo

    model = _model()
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters()), sync_every=H)
    for t in range(1, H + 3):
        opt.zero_grad()
        _loss(model, t, rank).backward()
        opt.step()
    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt, options=options), options=options)


def test_a_full_state_dict_through_torchs_api_is_refused_on_every_rank():
    """torch's load of a full state dict (``full_state_dict=True``) takes the device from the
    tensors of the optimizer's own state dict, and DiLoCo's holds none outside its records: torch
    raises on every rank, before DiLoCo loads anything (docs/guarantees.md: save it sharded or
    flattened). A canary: where torch takes it, DiLoCo's records resume as the 1-bit optimizers'."""
    out = spawn_ranks(_full_state_dict, 2, timeout=60, pg_timeout=30)
    assert [status for status, _ in out] == ["error", "error"], out
    assert all("Expected device to be set" in text for _, text in out), out


def _loop_collectives(rank, world):
    """Delayed exchanges in flight on DiLoCo's thread while the loop all-reduces its loss on the
    default group every step (logging), and evaluates with another all-reduce at the end."""
    import torch.distributed as dist

    from compressed_opt.diloco import DiLoCo

    model = _model(seed=rank)
    opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=H,
                 fragments=2, delay=2)
    logged = []
    for t in range(1, 3 * H + 1):
        opt.zero_grad()
        loss = _loss(model, t, rank)
        loss.backward()
        opt.step()
        both = torch.tensor([loss.item(), float(rank)])
        dist.all_reduce(both)
        logged.append(both[1].item())
    final = torch.tensor([1.0])
    dist.all_reduce(final)  # (an exchange of the last step is still in flight here)
    opt.synchronize()
    anchors = torch.cat([f.anchor for f in opt.fragments])
    gathered = [torch.empty_like(anchors) for _ in range(world)]
    dist.all_gather(gathered, anchors)
    opt.close()
    return logged, final.item(), all(torch.equal(gathered[0], g) for g in gathered)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_the_loops_own_collectives_during_a_delayed_exchange_neither_hang_nor_mix():
    """With ``delay`` the exchange runs on a thread, on a communicator of its own
    (``Backend.duplicate``): the loop's all-reduces on the same ranks meanwhile (logging, an
    evaluation) used to interleave with it on the one group, and the job hung; now each gets
    its own sums and the anchors agree."""
    for logged, final, anchors_equal in run_ranks(_loop_collectives, 2, timeout=90):
        assert logged == [1.0] * (3 * H) and final == 2.0 and anchors_equal
