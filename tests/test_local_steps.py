"""0/1 Adam's phase-B C passes (compressed_opt.cuda.local_steps, docs/design.md 2.5): each pass
against the PyTorch composition it replaces (ZeroOneAdam's, compressed_opt/zero_one_local.py) bit
for bit, on segments with vector tails, empty segments, coordinates without variance, with and
without weight decay, both of lerp's formulas; the lerp against float64 within its stated bound;
the optimizer end to end (one process and two ranks) with the passes and with the composition."""
import contextlib

import pytest
import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import SingleProcessBackend
from compressed_opt.cuda import Segments
from compressed_opt.cuda.cpu import library
from compressed_opt.zero_one_adam import ZeroOneAdam
from distributed import run_ranks
from optim_tasks import mlp, run_steps, shard_batches

pytestmark = pytest.mark.skipif(library() is None, reason="no C library here (no C compiler)")

SIZES = [37, 0, 144, 1003, 5, 0, 8]  # tails of every length mod 8, empty segments
#: torch's CPU kernels use FMA in their vector lerp on these: the passes give its bits there
FMA_CAPABLE = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _bits(t):
    return t.view(torch.int32)


def _same(a, b):
    return torch.equal(_bits(a), _bits(b))


def _inputs(seed, extra=0):
    """Flat g, m, v, acc, anchor, r over SIZES (plus ``extra`` elements past the segments),
    ``v == 0`` on every 7th coordinate (``r`` 0 there, as the preconditioner), a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    n = sum(SIZES) + extra
    grad, m, acc, anchor = (torch.randn(n, generator=g) for _ in range(4))
    v = torch.rand(n, generator=g) * 1e-2
    v[::7] = 0.0
    grad[::11] = 0.0
    m[v == 0] = 0.0
    acc *= 1e-3
    r = torch.where(v == 0, torch.zeros(()), 1.0 / torch.sqrt(v)) * 0.7
    return grad, m, v, acc, anchor, r


def _params(seed):
    g = torch.Generator().manual_seed(seed + 100)
    return [torch.randn(n, generator=g) for n in SIZES]


def _denominators(v, eps):
    plain = torch.sqrt(v).add_(eps)  # as zero_one_local.frozen_denominator makes it
    return plain, kernels.signed_denominator(v, plain.clone())


def _composed_momentum(grad, m, v, weight):
    m.lerp_(grad, weight)
    m.masked_fill_(v == 0, 0.0)


@pytest.mark.parametrize("weight", [0.1, 0.75])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("extra", [0, 13])
def test_local_step_pass_is_the_composition_bit_for_bit(weight, wd, extra):
    grad, m, v, acc, _, _ = _inputs(1, extra)
    params, lr, eps = _params(1), 3e-3, 1e-8
    factors = [1.0, 2.0, 0.5, 1.5, 0.75, 1.0, 1.25]
    steps, decay = [-lr * f for f in factors], 1 - lr * wd if wd else 1.0
    den, sden = _denominators(v, eps)
    seg = Segments(SIZES)
    m1, acc1, p1 = m.clone(), acc.clone(), [p.clone() for p in params]
    _composed_momentum(grad, m1, v, weight)
    acc1.addcdiv_(m1, den, value=lr)
    if wd:
        torch._foreach_mul_(p1, decay)
    torch._foreach_addcdiv_(p1, seg.split(m1), seg.split(den), steps)
    m2, acc2, p2 = m.clone(), acc.clone(), [p.clone() for p in params]
    assert kernels.zero_one_local_step_(p2, grad, m2, sden, acc2, seg, weight, lr, decay, steps)
    if not FMA_CAPABLE:
        pytest.skip(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}: its lerp rounds otherwise")
    assert _same(m1, m2) and _same(acc1, acc2)
    assert all(_same(a, b) for a, b in zip(p1, p2))


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("extra", [0, 13])
def test_pass_before_the_exchange_is_the_composition_bit_for_bit(scaled, extra):
    grad, m, v, acc, _, _ = _inputs(2, extra)
    lr, eps, weight = 2e-3, 1e-8, 0.1
    den, sden = _denominators(v, eps)
    seg = Segments(SIZES)
    scales = [1.5, 0.5, 0.75, 1.25, 3.0, 1.0, 0.3] if scaled else None
    m1, acc1 = m.clone(), acc.clone()
    _composed_momentum(grad, m1, v, weight)
    acc1.addcdiv_(m1, den, value=lr)
    acc1.mul_(den)
    if scaled:
        torch._foreach_mul_(seg.split(acc1), scales)
    m2, acc2 = m.clone(), acc.clone()
    assert kernels.zero_one_sync_before_(_params(2), grad, m2, sden, acc2, seg, weight, lr, scales)
    if not FMA_CAPABLE:
        pytest.skip(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}: its lerp rounds otherwise")
    assert _same(m1, m2) and _same(acc1, acc2)


@pytest.mark.parametrize("divide", ["r", "coefficients", None])
@pytest.mark.parametrize("decay", [1.0, 0.999])
@pytest.mark.parametrize("extra", [0, 13])
def test_pass_after_the_exchange_is_the_composition_bit_for_bit(divide, decay, extra):
    y, _, v, _, anchor, r = _inputs(3, extra)
    params, lr_sum, eps = _params(3), 7e-3, 1e-8
    den, sden = _denominators(v, eps)
    seg = Segments(SIZES)
    factors = [1.0, 2.0, 0.5, 1.5, 0.75, 1.0, 1.25]
    coeffs = [1.5, 0.5, 0.75, 1.25, 3.0, 1.0, 0.3]
    y1, a1, m1 = y.clone(), anchor.clone(), torch.empty_like(y)
    if divide == "r":
        y1.div_(r)
    elif divide == "coefficients":
        torch._foreach_div_(seg.split(y1), coeffs)
    y1.masked_fill_(v == 0, 0.0)
    torch.div(y1, lr_sum, out=m1)
    if decay != 1.0:
        a1.mul_(decay)
    torch._foreach_addcdiv_(seg.split(a1), seg.split(y1), seg.split(den), [-f for f in factors])
    p1 = [t.clone() for t in seg.split(a1)]
    y2, a2, m2, p2 = y.clone(), anchor.clone(), torch.full_like(y, 5.0), params
    assert kernels.zero_one_sync_after_(p2, y2, sden, m2, a2, seg, lr_sum, decay, [-f for f in factors],
                                        r if divide == "r" else None, coeffs if divide == "coefficients" else None)
    assert _same(m1, m2) and _same(a1, a2) and all(_same(a, b) for a, b in zip(p1, p2))
    assert not y2.any() and not torch.signbit(y2).any()  # the accumulator restarts at +0


@pytest.mark.parametrize("variant", ["preconditioned", "momentum", "plain"])
@pytest.mark.parametrize("extra", [0, 13])
def test_pass_before_the_exchange_inside_the_compression_is_both_in_turn_bit_for_bit(variant, extra):
    """``ZeroOneSyncBefore.compress_rows_`` (the pass, the clamp, the worker side of the compression
    in one pass) against ``apply_()`` then the compression: m, the error and the rows bit for bit,
    over 3 rows whose chunks and blocks cut segments."""
    from compressed_opt.cuda import cpu, reference

    grad, m, v, acc, _, r = _inputs(6, extra)
    _, sden = _denominators(v, 1e-8)
    seg, n, world, block = Segments(SIZES), sum(SIZES) + extra, 3, 256
    chunk = -(-n // (world * 32)) * 32
    error = torch.randn(n, generator=torch.Generator().manual_seed(7)) * 1e-3
    bounds = [0.5, 1.0, 2.0, 0.25, 3.0, 1.0, 0.1]
    kw = {"preconditioned": dict(r=r, bounds=bounds), "momentum": dict(scales=[1.5, 0.5, 0.75, 1.25, 3.0, 1.0, 0.3]),
          "plain": {}}[variant]
    got = []
    for fused in (True, False):
        m_, acc_, e_ = m.clone(), acc.clone(), error.clone()
        rows = torch.zeros(world, reference.rows_layout(chunk, block)[1], dtype=torch.uint8)
        pending = kernels.ZeroOneSyncBefore(grad, m_, sden, acc_, seg, 0.1, 2e-3, **kw)
        if fused:
            assert pending.compress_rows_(acc_, e_, rows, chunk, block)
            assert torch.equal(acc_, acc)  # read, not written
        else:
            pending.apply_()
            cpu.compress_rows_(acc_, e_, rows, chunk, block)
        got.append((m_, e_, rows))
    (m1, e1, rows1), (m2, e2, rows2) = got
    assert _same(m1, m2) and _same(e1, e2) and torch.equal(rows1, rows2)
    assert not kernels.ZeroOneSyncBefore(grad, m, sden, acc, seg, 0.1, 2e-3).compress_rows_(
        acc[:-1], error[:-1], rows1, chunk, block)  # not the whole buffer: refused, nothing done


@pytest.mark.parametrize("variant", ["preconditioned", "momentum"])
def test_a_zero_accumulator_before_the_exchange_is_both_in_turn_bit_for_bit(variant):
    """An accumulator of ``+0`` (what the last synchronisation left it: an interval of one step) and
    ``-0`` quotients (``+0 + -0`` is ``+0``): the fused pass gives what ``apply_()`` then the
    compression give, m, the error and the rows bit for bit, and reads the accumulator without
    writing it."""
    from compressed_opt.cuda import cpu, reference

    grad, m, v, _, _, r = _inputs(9, 13)
    grad[5::13] = -0.0  # (m and grad -0: a -0 quotient)
    m[5::13] = -0.0
    _, sden = _denominators(v, 1e-8)
    seg, n, world, block = Segments(SIZES), sum(SIZES) + 13, 2, 256
    chunk = -(-n // (world * 32)) * 32
    error = torch.randn(n, generator=torch.Generator().manual_seed(3)) * 1e-3
    kw = {"preconditioned": dict(r=r, bounds=[0.5, 1.0, 2.0, 0.25, 3.0, 1.0, 0.1]),
          "momentum": dict(scales=[1.5, 0.5, 0.75, 1.25, 3.0, 1.0, 0.3])}[variant]
    got = []
    for fused in (True, False):
        acc, m_, e_ = torch.zeros(n), m.clone(), error.clone()
        rows = torch.zeros(world, reference.rows_layout(chunk, block)[1], dtype=torch.uint8)
        pending = kernels.ZeroOneSyncBefore(grad, m_, sden, acc, seg, 0.1, 2e-3, **kw)
        if fused:
            assert pending.compress_rows_(acc, e_, rows, chunk, block)
            assert _same(acc, torch.zeros(n))  # read, not written (+0 still)
        else:
            pending.apply_()
            cpu.compress_rows_(acc, e_, rows, chunk, block)
        got.append((m_, e_, rows))
    (m1, e1, rows1), (m2, e2, rows2) = got
    assert _same(m1, m2) and _same(e1, e2) and torch.equal(rows1, rows2)


ROW_SIZES = [300, 0, 1, 700, 0, 129, 2000, 5, 0]  # across tiles (256), blocks (256, 512) and chunks


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("block", [256, 512])
@pytest.mark.parametrize("divide", ["r", "coefficients", "both", None])
@pytest.mark.parametrize("decay", [1.0, 0.999])
@pytest.mark.parametrize("extra", [0, 37])
def test_pass_after_the_exchange_from_the_rows_is_decompressing_then_the_pass_bit_for_bit(world, block, divide, decay,
                                                                                         extra):
    """``zero_one_sync_after_`` on a ``CompressedResult`` (the rows decompressed tile by tile inside
    the pass) against ``decompress_rows_`` into the accumulator then the pass on it: m, the anchor,
    the parameters bit for bit, the accumulator +0 (written, whatever it held); rows ``row_stride``
    apart as a coalesced exchange's."""
    from compressed_opt.cuda import CompressedResult, cpu, reference

    seg = Segments(ROW_SIZES)
    n = seg.numel + extra
    g = torch.Generator().manual_seed(world * 1000 + block + extra)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-3, 2, (n,), generator=g)
    v = torch.rand(n, generator=g) * 1e-2
    v[::7] = 0.0
    r = torch.where(v == 0, torch.zeros(()), 1.0 / torch.sqrt(v)) * 0.7
    _, sden = _denominators(v, 1e-8)
    anchor = torch.randn(n, generator=g)
    params = [torch.randn(k, generator=g) for k in ROW_SIZES]
    chunk = -(-n // (world * 32)) * 32
    row_len = reference.rows_layout(chunk, block)[1]
    rows = torch.zeros(world, row_len + 24, dtype=torch.uint8)[:, 8:8 + row_len]  # (rows apart, as coalesced)
    cpu.compress_rows_(x, torch.randn(n, generator=g) * 1e-2, rows, chunk, block)
    coeffs = [1.5, 0.5, 0.75, 1.25, 3.0, 1.0, 0.3, 2.0, 0.9]
    steps = [-1.0, -2.0, -0.5, -1.5, -0.75, -1.0, -1.25, -0.6, -3.0]
    kw = dict(r=r if divide in ("r", "both") else None, divisors=coeffs if divide in ("coefficients", "both") else None)
    got = []
    for from_rows in (True, False):
        acc = torch.full((n + 1,), -5.0)[world % 2:][:n]  # (1, 3 rows: acc not 32-byte aligned: a scalar head)
        m, a, p = torch.full((n,), 5.0), anchor.clone(), [t.clone() for t in params]
        if from_rows:
            y = CompressedResult(rows, chunk, block, acc)
        else:
            cpu.decompress_rows_(rows, acc, chunk, block)
            y = acc
        assert kernels.zero_one_sync_after_(p, y, sden, m, a, seg, 7e-3, decay, steps, **kw)
        got.append((acc, m, a, p))
    (acc1, m1, a1, p1), (acc2, m2, a2, p2) = got
    assert _same(m1, m2) and _same(a1, a2) and all(_same(s, t) for s, t in zip(p1, p2))
    assert _same(acc1, acc2) and not acc1.any() and not torch.signbit(acc1).any()
    assert not torch.equal(a1, anchor) and (m1[v == 0] == 0).all()  # (it did move, and masked)


def test_the_lerp_is_within_its_bound_of_the_exact_one():
    """``|m - lerp| <= ulp(m) / 2 + |c| ulp(g - m) / 2`` (the module doc; ``c``: ``w``, or ``w - 1`` for
    ``|w| >= 1/2``), both formulas, in float64."""
    g = torch.Generator().manual_seed(4)
    n = 20000
    grad, m = torch.randn(n, generator=g), torch.randn(n, generator=g)
    grad[: n // 2] *= 1e-3  # cancellation: m and w (g - m) of different sizes
    seg, sden = Segments([n]), torch.ones(n)
    for weight in (0.1, 0.75):
        out = m.clone()
        assert kernels.zero_one_sync_before_([torch.zeros(n)], grad, out, sden, torch.zeros(n), seg, weight, 0.0)
        w = torch.tensor(weight, dtype=torch.float32).double()
        exact = m.double() + w * (grad.double() - m.double())
        diff = grad - m

        def ulp(t):
            return (torch.nextafter(t.abs(), torch.tensor(float("inf"))) - t.abs()).double()

        c = w if abs(weight) < 0.5 else w - 1
        bound = ulp(out) / 2 + c.abs() * ulp(diff) / 2
        assert ((out.double() - exact).abs() <= bound).all()


def test_passes_refuse_what_they_cannot_serve(monkeypatch):
    grad, m, v, acc, anchor, r = _inputs(5)
    seg = Segments(SIZES)
    params = _params(5)
    params[2] = torch.randn(12, 12).t()  # not contiguous
    before = [t.clone() for t in (m, acc, anchor)]
    steps = [0.1] * len(SIZES)
    assert not kernels.zero_one_local_step_(params, grad, m, v, acc, seg, 0.1, 1e-3, 1.0, steps)
    assert not kernels.zero_one_sync_before_(params, grad, m, v, acc, seg, 0.1, 1e-3)
    assert not kernels.zero_one_sync_after_(params, acc, v, m, anchor, seg, 1.0, 1.0, steps, r)
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    ok = _params(5)
    assert not kernels.zero_one_local_step_(ok, grad, m, v, acc, seg, 0.1, 1e-3, 1.0, steps)
    assert not kernels.zero_one_sync_after_(ok, acc, v, m, anchor, seg, 1.0, 1.0, steps, r)
    assert all(torch.equal(a, b) for a, b in zip(before, (m, acc, anchor)))
    with pytest.raises(ValueError, match="segment"):
        kernels.zero_one_local_step_(_params(5)[:3], grad, m, v, acc, seg, 0.1, 1e-3, 1.0, steps)


@contextlib.contextmanager
def passes(on: bool, ran: list):
    """Within: the phase-B C passes counted in ``ran[0]`` when ``on`` (each local step's pass, and
    each synchronisation's fused compression and pass after the exchange; in ``ran[1]``, where given,
    the passes after the exchange that read its result rows), refused (the PyTorch composition runs)
    when not."""
    originals = {name: getattr(kernels, name) for name in ("zero_one_local_step_", "zero_one_sync_after_",
                                                            "zero_one_passes_serve")}
    fused = kernels.ZeroOneSyncBefore.compress_rows_

    def counted(f):
        def run(*args, **kwargs):
            done = f(*args, **kwargs)
            ran[0] += bool(done)
            if len(ran) > 1 and f is originals["zero_one_sync_after_"]:
                ran[1] += bool(done) and isinstance(args[1], kernels.CompressedResult)
            return done
        return run

    if on:
        kernels.zero_one_local_step_ = counted(originals["zero_one_local_step_"])
        kernels.zero_one_sync_after_ = counted(originals["zero_one_sync_after_"])
        kernels.ZeroOneSyncBefore.compress_rows_ = counted(fused)
    else:
        kernels.zero_one_passes_serve = lambda *args, **kwargs: False
    try:
        yield
    finally:
        for name, f in originals.items():
            setattr(kernels, name, f)
        kernels.ZeroOneSyncBefore.compress_rows_ = fused


def _job(exchange, wd, tracking, steps=16, **options):
    """A seeded job through both phases (phase B: syncs at growing intervals, an interval of lr 0):
    its parameters and state after every step, and the step kinds (``options``: more of
    ZeroOneAdam's arguments)."""
    torch.manual_seed(0)
    shapes = [(37,), (0,), (16, 9), (1000,), (5,)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    opt = ZeroOneAdam(params, lr=1e-2, weight_decay=wd, var_freeze_step=3, local_step_scaler=2, local_step_clipper=4,
                      backend=SingleProcessBackend(), exchange=exchange, overlap=False, variance_tracking=tracking,
                      **options)
    g = torch.Generator().manual_seed(1)
    record = []
    for t in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
            p.grad.view(-1)[:3] = 0.0  # coordinates that never get a gradient: v == 0
        opt.param_groups[0]["lr"] = 0.0 if 8 <= t < 10 else 1e-2
        opt.step()
        record.append((opt.schedule.last_step_kind, [p.detach().clone() for p in params],
                       [opt.state[p][k].clone() for p in params for k in ("exp_avg", "momentum_accumulator")]))
    opt.close()
    return record


@pytest.mark.parametrize("exchange", ["preconditioned", "momentum"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("tracking", [True, False])
def test_the_optimizer_with_the_passes_is_the_composition_bit_for_bit(exchange, wd, tracking):
    if not FMA_CAPABLE:
        pytest.skip(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}: its lerp rounds otherwise")
    ran = [0, 0]
    with passes(True, ran):
        fused = _job(exchange, wd, tracking)
    with passes(False, [0]):
        composed = _job(exchange, wd, tracking)
    kinds = [k for k, _, _ in fused]
    # every local step one pass, every synchronisation two (but the first: its exchange, which agrees
    # the size, runs the pass before alone), and every pass after an exchange reads its result rows
    # (the first one's: a copy the exchange returns)
    assert {"local", "sync"} <= set(kinds) and ran[0] == kinds.count("local") + 2 * kinds.count("sync") - 1
    assert ran[1] == kinds.count("sync")
    for (kind, p1, s1), (_, p2, s2) in zip(fused, composed):
        assert all(_same(a, b) for a, b in zip(p1 + s1, p2 + s2)), kind
    again = _job(exchange, wd, tracking)  # the same seeded job: the same bits
    assert all(_same(a, b) for (_, p1, s1), (_, p2, s2) in zip(fused, again) for a, b in zip(p1 + s1, p2 + s2))


@pytest.mark.parametrize("touch", [False, True])
def test_syncs_one_step_apart_are_the_composition_bit_for_bit(touch):
    """Intervals of one step (``local_step_scaler`` 8): every synchronisation runs its fused pass
    before the exchange and its pass after, on the accumulator the last one left at ``+0``, bit for
    bit the composition; a user's in-place write to ``state[p]["momentum_accumulator"]`` between two
    of them is read as the composition reads it."""
    if not FMA_CAPABLE:
        pytest.skip(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}: its lerp rounds otherwise")

    def job():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in (37, 1000, 5)]
        opt = ZeroOneAdam(params, lr=1e-2, var_freeze_step=3, local_step_scaler=8, backend=SingleProcessBackend(),
                          overlap=False)
        g = torch.Generator().manual_seed(1)
        kinds = []
        for t in range(9):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            if touch and t == 6:
                opt.state[params[1]]["momentum_accumulator"].add_(1e-3)
            opt.step()
            kinds.append(opt.schedule.last_step_kind)
        assert opt.schedule.last_step_kind == "sync" and opt.schedule.local_step_interval == 1
        return kinds, [p.detach().clone() for p in params] + [opt.state[p][k].clone() for p in params
                                                              for k in ("exp_avg", "momentum_accumulator")]

    ran = [0, 0]
    with passes(True, ran):
        kinds, fused = job()
    # after the freeze every step synchronises: each two passes (but the first, whose exchange agrees
    # the size: the pass before alone), each pass after reading the exchange's result rows
    assert kinds[3:] == ["sync"] * 6
    assert ran == [2 * kinds.count("sync") - 1, kinds.count("sync")]
    with passes(False, [0]):
        _, composed = job()
    assert all(_same(a, b) for a, b in zip(fused, composed))


def test_where_the_exchange_returns_no_rows_the_pass_after_reads_acc():
    """``path="fp32"``: the exact average, no rows (the result is in ``acc``): the pass after reads
    ``acc``, bit for bit the composition."""
    if not FMA_CAPABLE:
        pytest.skip(f"torch's CPU capability {torch.backends.cpu.get_cpu_capability()}: its lerp rounds otherwise")
    ran = [0, 0]
    with passes(True, ran):
        fused = _job("preconditioned", 0.1, True, path="fp32")
    with passes(False, [0]):
        composed = _job("preconditioned", 0.1, True, path="fp32")
    kinds = [k for k, _, _ in fused]
    assert ran == [kinds.count("local") + kinds.count("sync"), 0]  # (no compression: the pass before alone)
    assert all(_same(a, b) for (_, p1, s1), (_, p2, s2) in zip(fused, composed) for a, b in zip(p1 + s1, p2 + s2))


def _two_rank_job(rank, world):
    ran, finals = [0, 0], []
    for on in (True, False):
        with passes(on, ran):
            torch.manual_seed(0)
            model = mlp()
            opt = ZeroOneAdam(model.parameters(), lr=1e-2, weight_decay=0.01, var_freeze_step=8, var_update_scaler=2,
                              local_step_scaler=2, local_step_clipper=3)
            kinds = []
            for batch in shard_batches(rank, world, 24):
                run_steps(model, opt, [batch])
                kinds.append(opt.schedule.last_step_kind)
            finals.append([p.detach().clone() for p in model.parameters()])
            opt.close()
    return finals, ran, kinds


@pytest.mark.multiprocess
def test_two_ranks_with_the_passes_are_the_composition_and_agree_after_syncs():
    results = run_ranks(_two_rank_job, 2)
    for finals, (ran, from_rows), kinds in results:
        # every local step one pass, every synchronisation two (its compression fused on 2 ranks too),
        # every pass after an exchange reading its result rows
        assert kinds[-1] == "sync" and ran == kinds.count("local") + 2 * kinds.count("sync")
        assert from_rows == kinds.count("sync")
        if FMA_CAPABLE:
            assert all(_same(a, b) for a, b in zip(*finals))
    assert all(_same(a, b) for a, b in zip(results[0][0][0], results[1][0][0]))  # ranks agree after the sync
