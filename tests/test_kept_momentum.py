"""The stage-0 momentum formed from the last result's kept rows (compressed_opt.cuda.update
``KeptMomentum``, ``co_lerp_scale_clamp_compress_kept``): the local momentum's pass forms ``m = (y
/ r) / s_l`` (OnebitAdam's update) or ``m = y / r`` (OnebitLamb's first pass) from the rows the pass
that wrote it read, instead of reading it, bit for bit, and reads ``m`` again wherever it may have
changed (a write through ``optimizer.state``, a skipped step whose exchange ran from backward)."""
import pytest
import torch

import compressed_opt
from compressed_opt import cuda as kernels
from compressed_opt.comm import SingleProcessBackend
from compressed_opt.cuda import (CompressedResult, Descend, LerpScaleClamp, Segments, compress_rows_, cpu,
                                 divide_descend_, rows_layout, update)

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="no C compiler: the kept rows are the C pass's")

CASES = [  # (segment sizes, elements past the segments)
    ([5, 0, 17, 1, 64, 3], 4),
    ([3000, 1, 2047, 0, 999], 0),
    ([40_000, 7], 13),
]


def _counted(monkeypatch, name):
    update.kept_compress_agrees()  # (its check at first use, before the count)
    lib, calls = cpu.library(), []
    original = getattr(lib, name)

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(lib, name, counting)
    return calls


@pytest.mark.parametrize("sizes,past", CASES)
@pytest.mark.parametrize("world,block", [(1, 256), (2, 256), (3, 512)])
@pytest.mark.parametrize("divided", [False, True])
@pytest.mark.parametrize("weight", [0.1, 0.9])
@pytest.mark.parametrize("in_place", [False, True])
def test_the_pass_from_the_kept_rows_is_the_pass_on_m(sizes, past, world, block, divided, weight, in_place,
                                                      monkeypatch):
    """``m`` written by the update from a result's rows; the next compression's fused pass, with
    ``m`` formed from those rows, gives the error and rows of the same pass reading ``m``."""
    g = torch.Generator().manual_seed(world * 13 + len(sizes) + int(divided))
    segs = Segments(sizes)
    n = segs.numel + past
    chunk = -(-max(-(-n // world), 1) // 32) * 32
    rows = torch.zeros(world, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    r = torch.rand(n, generator=g) * 3
    r[::5] = 0.0
    divisors = [1.5 - 0.125 * (i % 4) for i in range(len(sizes))] if divided else None
    m, params = torch.full((n,), 7.0), [torch.zeros(k) for k in sizes]
    kept = divide_descend_(CompressedResult(rows, chunk, block, torch.empty(n)), r, m, segs, divisors,
                           Descend(params, 1e-3, [1.0] * len(sizes), [1.0] * len(sizes), 1.0, -1e-3))
    assert isinstance(kept, kernels.KeptMomentum)
    x = torch.randn(n, generator=g)
    sources = [t.clone() for t in segs.split(x)] if in_place else None
    bounds, scales = [0.5 + 0.25 * i for i in range(len(sizes))], [1.0 + 0.1 * i for i in range(len(sizes))]
    error0 = torch.randn(world * chunk, generator=g)[:n]
    calls = _counted(monkeypatch, "co_lerp_scale_clamp_compress_kept")
    out = []
    for use in (None, kept):
        error, into = error0.clone(), torch.zeros_like(rows)
        p = LerpScaleClamp(x, m, weight, r, bounds, segs, scales, sources=sources, kept=use)
        assert p.compress_rows_(x, error, into, chunk, block)
        out.append((error.view(torch.int32), into))
    assert len(calls) == 1
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_kept_rows_are_refused_once_m_may_have_changed():
    g = torch.Generator().manual_seed(3)
    segs = Segments([100, 28])
    n, chunk, block = segs.numel, 128, 256
    rows = torch.zeros(1, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    r, m = torch.rand(n, generator=g) + 0.5, torch.empty(n)
    kept = divide_descend_(CompressedResult(rows, chunk, block, torch.empty(n)), r, m, segs, None,
                           Descend([torch.zeros(100), torch.zeros(28)], 1e-3, [1.0, 1.0], [1.0, 1.0], 1.0, -1e-3))
    assert kept.usable(m, r, segs, 1, chunk, block)
    assert not kept.usable(m, r.clone(), segs, 1, chunk, block)  # another preconditioner
    assert not kept.usable(m, r, segs, 2, chunk, block)  # another geometry
    assert not kept.usable(m.clone(), r, segs, 1, chunk, block)  # another buffer
    m[:100].view(10, 10)[0].mul_(1.0)  # an in-place write through a view moves the version counter
    assert not kept.usable(m, r, segs, 1, chunk, block)
    # a flat y (no rows): nothing to form m from
    assert divide_descend_(torch.randn(n, generator=g), r, m, segs, None,
                           Descend([torch.zeros(100), torch.zeros(28)], 1e-3, [1.0, 1.0], [1.0, 1.0], 1.0,
                                   -1e-3)) is None


def _run(kept: bool, monkeypatch, *, name="OnebitAdam", poke_at=None, nan_at=None, overlap=False, steps=24):
    """A seeded stage-0 job (defaults: the preconditioned exchange, weight decay; the model trained
    with backward, so that ``overlap=True`` launches its exchanges from backward): its parameters,
    state and error buffers, and how often the kept rows were read."""
    monkeypatch.setattr(update, "_kept_compress", [] if kept else [False])
    monkeypatch.setattr(kernels.lamb_passes, "_kept_agreement", [] if kept else [False])
    if kept:
        kernels.lamb_passes.kept_agrees()  # (its check at first use, before the count)
    calls = _counted(monkeypatch, "co_lerp_scale_clamp_compress_kept")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3))
    opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, freeze_step=4, weight_decay=0.01,
                                        backend=SingleProcessBackend(), overlap=overlap, bucket_cap_mb=0.004)
    g = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 20, generator=g), torch.randint(0, 3, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step == nan_at:
            loss = loss * float("nan")
        opt.zero_grad()
        loss.backward()
        if step == poke_at:  # a user's write to the momentum, through the state
            for p in model.parameters():
                opt.state[p]["exp_avg"].mul_(0.5)
        if step == nan_at:
            with pytest.warns(RuntimeWarning, match="non-finite"):
                opt.step()
        else:
            opt.step()
    state = [t for p in model.parameters() for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    errors = [t for b in opt._buckets for t in b.flats.values() if t.dtype == torch.float32]
    return [t.detach().clone().view(torch.int32) for t in [*model.parameters(), *state, *errors]], len(calls)


@pytest.mark.parametrize("case", [{}, {"poke_at": 12}, {"overlap": True}, {"overlap": True, "nan_at": 12},
                                  {"nan_at": 12}, {"name": "OnebitLamb"}, {"name": "OnebitLamb", "poke_at": 13},
                                  {"name": "OnebitLamb", "overlap": True, "nan_at": 13}])
def test_a_job_steps_to_the_bit_with_and_without_the_kept_rows(case, monkeypatch):
    """The job's bits are the same whether its compressions read ``m`` or form it from the kept
    rows: with a user's write to ``exp_avg`` between backward and ``step()`` (the rows no longer
    hold it: ``m`` is read), and with a non-finite gradient in a step whose exchange ran from
    backward (its result replaced the kept rows, its update was skipped: ``m`` is read)."""
    fused, used = _run(True, monkeypatch, **case)
    composed, unused = _run(False, monkeypatch, **case)
    assert unused == 0 and used >= 12  # (the compression steps' buckets; 1-bit LAMB's measuring steps read m)
    assert len(fused) == len(composed)
    assert all(torch.equal(a, b) for a, b in zip(fused, composed))
    if "poke_at" in case:  # the write took effect
        plain, _ = _run(True, monkeypatch, name=case.get("name", "OnebitAdam"))
        assert not all(torch.equal(a, b) for a, b in zip(fused, plain))


def test_the_checks_at_first_use_leave_the_callers_random_numbers_alone(monkeypatch):
    """The two checks run inside a user's first compression step: they draw from generators of
    their own, so a seeded job's random numbers (dropout, data) do not depend on whether they ran."""
    monkeypatch.setattr(update, "_kept_compress", [])
    monkeypatch.setattr(kernels.lamb_passes, "_kept_agreement", [])
    torch.manual_seed(5)
    expected = torch.rand(4)
    torch.manual_seed(5)
    assert update.kept_compress_agrees() and kernels.lamb_passes.kept_agrees()
    assert torch.equal(torch.rand(4), expected)


def _ranks_with_and_without_the_kept_rows(rank, world, name):
    """``name`` with its defaults on Gloo ranks, a param group per tensor, buckets small enough to be
    coalesced into exchange groups (each bucket's rows a column of the packed buffer, the kept rows
    a buffer of their own), run twice from the same start: the kept rows read, then not; the
    parameters of both, and how often the rows stood for ``m`` in the first."""
    from compressed_opt.cuda import lamb_passes
    from compressed_opt.exchanges import exchange_groups

    lib, out = cpu.library(), []
    original = lib.co_lerp_scale_clamp_compress_kept
    calls = []

    def counting(*args):
        calls.append(1)
        return original(*args)

    for kept in (True, False):
        update._kept_compress[:] = [] if kept else [False]
        lamb_passes._kept_agreement[:] = [] if kept else [False]
        if kept:
            update.kept_compress_agrees(), lamb_passes.kept_agrees()
            lib.co_lerp_scale_clamp_compress_kept = counting
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1)
                  for s in [(33, 17), (17,), (5, 30), (409,), (8, 64), (3000,)]]
        groups = [{"params": [p]} for p in params]  # (a bucket per group: small ones coalesce)
        opt = getattr(compressed_opt, name)(groups, lr=1e-3, freeze_step=3, bucket_cap_mb=0.01)
        g = torch.Generator().manual_seed(100 + rank)  # (each rank its own gradients)
        for _ in range(12):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 0.01
            opt.step()
        groups = exchange_groups(opt._buckets, opt.bucket_cap_bytes)
        assert opt.compressing and any(len(group) > 1 for group in groups)  # (coalesced)
        opt.close()
        lib.co_lerp_scale_clamp_compress_kept = original
        out.append([p.detach().view(torch.int32).clone() for p in params])
    return out, len(calls)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb"])
def test_ranks_step_to_the_bit_with_and_without_the_kept_rows(name):
    from distributed import run_ranks

    results = run_ranks(_ranks_with_and_without_the_kept_rows, 2, name, timeout=180)
    for (with_rows, without), used in results:
        assert used >= 20  # (9 compression steps, 6 buckets)
        assert all(torch.equal(a, b) for a, b in zip(with_rows, without))
    assert all(torch.equal(a, b) for a, b in zip(results[0][0][0], results[1][0][0]))  # (the replicas agree)
