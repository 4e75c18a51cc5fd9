"""A compression step whose exchange ``step()`` runs reads the gradients where they lie: the
gather's copy into the bucket's buffer is not made (only their sums, for the finiteness check and
the variance tracking), and the compression's fused pass reads ``p.grad`` itself. Bit for bit the
gathered path, step after step, through skipped steps and gradients the pass cannot read."""
import dataclasses
import warnings

import pytest
import torch

import compressed_opt
from compressed_opt import cuda as kernels
from compressed_opt import state as declared
from compressed_opt.comm import SingleProcessBackend
from compressed_opt.cuda import cpu, harness, reference, registry

pytestmark = pytest.mark.skipif(kernels.cpu.library() is None, reason="no C compiler here")


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (17,), (1,), (0,), (5, 300), (4097,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in shapes]


def _grads(params, step, plan):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.01
    if plan.get(step) == "nan":
        params[0].grad[3, 4] = float("nan")
    elif plan.get(step) == "none":
        params[1].grad = None  # a parameter without a gradient: gathered as zeros
    elif plan.get(step) == "strided":
        params[4].grad = torch.randn(300, 5, generator=g).t()  # not contiguous: gathered


def _run(name, in_place, plan, steps=12, **kw):
    """``in_place=False``: the gather's copy."""
    params = _model()
    kw.setdefault("bucket_cap_mb", 0.01)
    kw.setdefault("var_freeze_step" if name == "ZeroOneAdam" else "freeze_step", 3)
    opt = getattr(compressed_opt, name)(params, lr=1e-3, backend=SingleProcessBackend(), **kw)
    if not in_place:
        opt.engine.client.reads_in_place = lambda bucket, step, inline, native: False
    gathered, now = [], [0]  # the loop's steps whose buckets were gathered

    def spied(bound):  # (the engine's gather of a bucket's gradients into its buffer: bucket.kernels.gather_)
        def gather_(*a, **k):
            gathered.append(now[0])
            return bound.gather_(*a, **k)
        return dataclasses.replace(bound, gather_=gather_)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (the skipped step's warning)
        for step in range(1, steps + 1):
            now[0] = step
            _grads(params, step, plan)
            if plan.get(step) == "touch m":  # the loop changes the momentum between steps
                opt.state[params[0]]["exp_avg"].mul_(0.5)
            bound = [(b, b.kernels) for b in opt.engine.buckets]  # (the buckets, made at the first step)
            for b, k in bound:
                b.kernels = spied(k)
            try:
                opt.step()
            finally:
                for b, k in bound:
                    b.kernels = k
    state = [t.clone() for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params], state, gathered, opt.engine.nonfinite_steps


@pytest.mark.parametrize("name,kw,gathers", [
    ("OnebitAdam", {}, [7, 9]),
    ("OnebitAdam", {"variance_tracking": False}, [7, 9]),
    ("OnebitAdam", {"exchange": "momentum"}, [7, 9]),  # (torch.lerp's pass inside the compression)
    ("OnebitAdam", {"exchange": "momentum", "variance_tracking": False}, [7, 9]),
    ("OnebitLamb", {}, [4, 7, 9]),  # (its first compression step measures the live trust ratio on the buffer)
    ("ZeroOneAdam", {}, [7, 9]),  # phase B: every step synchronises (its default schedule)
    ("ZeroOneAdam", {"local_step_scaler": 1}, [7, 9]),  # local steps between synchronisations
    # phase A throughout: refreshes (full precision: gathered) at optimizer steps 1, 2, 4, 8 (the loop's
    # 9th: its 5th is skipped), compressed steps between
    ("ZeroOneAdam", {"var_update_scaler": 1, "var_freeze_step": 20}, [4, 7, 9]),
])
def test_reading_in_place_is_the_gathered_path_bit_for_bit(name, kw, gathers):
    plan = {5: "nan", 7: "none", 9: "strided", 11: "touch m"}
    fast, slow = _run(name, True, plan, **kw), _run(name, False, plan, **kw)
    for a, b in zip(fast[0] + fast[1], slow[0] + slow[1]):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b)
    assert fast[3] == slow[3] == 1  # the NaN step skipped on both
    # warmup gathers; in the compression stage only the steps the pass cannot read in place
    # (a missing gradient, a strided one) gather, where the other path gathers every step
    compression_gathers = sorted({s for s in fast[2] if s > 3})
    assert compression_gathers == gathers, fast[2]
    assert {s for s in slow[2] if s > 3} == set(range(4, 13))


def test_lambs_momentum_exchange_still_gathers():
    """1-bit LAMB's paper exchange scales its local momentum by the layers' coefficients on the
    buffer (no pass inside the compression reads the gradients): gathered, every step."""
    _, _, gathered, _ = _run("OnebitLamb", True, {}, steps=6, exchange="momentum")
    assert {s for s in gathered if s > 3} == {4, 5, 6}


_KEEP_DESCEND = ("keep_descend", torch.device("cpu"))  # (the harness's verdict on the C pass, cached)


def _zero_run(rank, world, fused, steps=10, plan=None, backend=None, exchange="preconditioned"):
    """ZeRO stage 1, OnebitAdam: the two native passes (``fused``) or the layout's composition;
    what ran, per step (``(what, whether natively)``)."""
    from compressed_opt.cuda import zero_passes

    params = _model(rank)
    kw = {} if backend is None else {"backend": backend}
    opt = compressed_opt.OnebitAdam(params, lr=1e-3, freeze_step=3, bucket_cap_mb=0.01, zero_stage=1,
                                    overlap=False, exchange=exchange, **kw)
    ran = []
    compress, rows_descend = zero_passes.ZeroLocalMomentum.compress_rows_, zero_passes.rows_descend_
    # (the momentum exchange's update from the rows: the C pass the buckets' kernels bind, which falls back
    # to the composition where it cannot run; the composition bound instead where the harness's verdict is no)
    c_pass, composition, bound = cpu.keep_descend_, reference.keep_descend_, registry._bound
    verdict, in_c_pass = harness._agreed.get(_KEEP_DESCEND), []

    def compress_spy(self, *a):
        done = fused and compress(self, *a)
        ran.append(("momentum", done))
        return done

    def rows_descend_spy(*a):  # (the preconditioned exchange's update from the rows and R)
        done = fused and rows_descend(*a)
        ran.append(("update", done))
        return done

    def c_pass_spy(*a):
        in_c_pass.append(True)
        try:
            c_pass(*a)
        finally:
            ran.append(("update", in_c_pass.pop()))

    def composition_spy(*a):
        if in_c_pass:
            in_c_pass[-1] = False  # (the C pass fell back)
        else:
            ran.append(("update", False))
        composition(*a)

    harness.agrees("keep_descend")  # (its check at first use, which runs the composition, before the spies)
    zero_passes.ZeroLocalMomentum.compress_rows_ = compress_spy
    zero_passes.rows_descend_ = rows_descend_spy
    cpu.keep_descend_, reference.keep_descend_ = c_pass_spy, composition_spy
    if not fused:
        harness._agreed[_KEEP_DESCEND] = False
    registry._bound = {}  # (the buckets' kernels bound afresh: the spies, the verdict)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in range(1, steps + 1):
                _grads(params, step + 100 * rank, plan or {})
                opt.step()
    finally:
        zero_passes.ZeroLocalMomentum.compress_rows_ = compress
        zero_passes.rows_descend_ = rows_descend
        cpu.keep_descend_, reference.keep_descend_ = c_pass, composition
        if verdict is None:
            harness._agreed.pop(_KEEP_DESCEND, None)
        else:
            harness._agreed[_KEEP_DESCEND] = verdict
        registry._bound = bound
    return [p.detach().clone() for p in params], ran, opt.engine.nonfinite_steps


def _bits(ts):
    return [t.view(torch.int32) for t in ts]


@pytest.mark.parametrize("exchange", ["preconditioned", "momentum"])
def test_zero_passes_are_the_composition_bit_for_bit(exchange):
    """ZeRO stage 1's local momentum inside the compression and its update from the kept rows give
    the layout's PyTorch composition's parameters bit for bit, through a skipped step, a missing
    gradient (its layer's momentum decays alone) and a strided one (composed that step)."""
    plan = {5: "nan", 7: "none", 9: "strided"}
    fused = _zero_run(0, 1, True, plan=plan, backend=SingleProcessBackend(), exchange=exchange)
    composed = _zero_run(0, 1, False, plan=plan, backend=SingleProcessBackend(), exchange=exchange)
    assert all(torch.equal(a, b) for a, b in zip(_bits(fused[0]), _bits(composed[0])))
    assert fused[2] == composed[2] == 1
    momentum = [done for what, done in fused[1] if what == "momentum"]
    update = [done for what, done in fused[1] if what == "update"]
    # 6 compression steps taken (4-10 but the NaN one), each updated natively; the local momentum
    # natively in 4: not the first (it forms m from the momentum gathered at the freeze), nor the
    # strided gradient's (composed)
    assert all(momentum) and all(update) and momentum and len(momentum) * 6 == len(update) * 4, fused[1]


def _zero_both(rank, world, exchange):
    return _zero_run(rank, world, True, exchange=exchange), _zero_run(rank, world, False, exchange=exchange)


@pytest.mark.multiprocess
@pytest.mark.parametrize("exchange", ["preconditioned", "momentum"])
def test_zero_passes_on_two_ranks_are_the_composition_bit_for_bit(exchange):
    from distributed import run_ranks

    for fused, composed in run_ranks(_zero_both, 2, exchange, timeout=120):
        assert all(torch.equal(a, b) for a, b in zip(_bits(fused[0]), _bits(composed[0])))
        assert any(what == "momentum" and done for what, done in fused[1])
        assert all(done for what, done in fused[1] if what == "update")


def test_zero_passes_check_themselves_and_refuse_what_they_cannot_run(monkeypatch):
    """The check at first use finds the C passes the composition's bits here; other geometry, the
    reference kernels or a parameter the pass cannot write: nothing done, ``False``."""
    from compressed_opt.cuda import zero_passes
    from compressed_opt.cuda.segmented import Segments

    assert zero_passes.agrees()
    segs = Segments([5, 300])
    chunk, block = 320, 256
    _, row_len = kernels.rows_layout(chunk, block)
    rows, r = torch.zeros(1, row_len, dtype=torch.uint8), torch.rand(305)
    result = kernels.CompressedResult(rows, chunk, block, torch.zeros(305))
    params = [torch.ones(5), torch.ones(300)]
    args = (result, r, 1e-8, [1.0, 2.0], [1.0, 1.0], params, segs, 0.9, -0.1)
    assert not zero_passes.rows_descend_(result, r, 1e-8, [1.0, 2.0], [1.0, 1.0],
                                         [params[0], torch.ones(300, dtype=torch.float64)], segs, 0.9, -0.1)
    pending = zero_passes.ZeroLocalMomentum(torch.zeros(305), result, r, [0.9] * 2, [0.1] * 2, [1.0] * 2, segs,
                                            [torch.ones(5), torch.ones(300)], compose=lambda: None)
    error = torch.zeros(305)
    assert not pending.compress_rows_(torch.zeros(305), error, rows.clone(), chunk, block)  # another buffer
    assert not pending.compress_rows_(pending.x, error, rows.clone(), chunk, 512)  # another block
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    assert not zero_passes.rows_descend_(*args) and not pending.compress_rows_(pending.x, error, rows, chunk, block)
    assert all(bool((p == 1).all()) for p in params) and bool((error == 0).all())


@pytest.mark.parametrize("kw,pass_name", [({}, "co_zo_sync_before_compress_rows"),
                                          ({"local_step_scaler": 1}, "co_zo_local_step")])
def test_zero_one_adams_passes_read_the_gradients_where_they_lie(monkeypatch, kw, pass_name):
    """0/1 Adam's phase-B passes (a synchronisation's pass inside the compression, a local step)
    are given each gradient's address (``srcs``), never the flat buffer's gathered copy."""
    from compressed_opt.cuda import cpu

    lib, seen = cpu.library(), []

    class Spy:
        def __getattr__(self, name):
            f = getattr(lib, name)
            if name != pass_name:
                return f

            def call(*a):
                seen.append(a[2 if name == "co_zo_local_step" else 1] is not None)
                return f(*a)
            return call

    monkeypatch.setattr(cpu, "library", lambda *a, **k: Spy())
    _run("ZeroOneAdam", True, {}, **kw)
    assert seen and all(seen), seen


@pytest.mark.parametrize("name,kw", [("OnebitAdam", {}), ("OnebitAdam", {"zero_stage": 1}), ("ZeroOneAdam", {})])
def test_no_gradient_stays_referenced_after_a_skipped_step(name, kw):
    """A step skipped for a non-finite gradient after its gather left the gradients in place (and
    ZeRO made its pass from them) keeps no reference to them: the loop's ``zero_grad`` frees them."""
    import weakref

    params = _model()
    kw["var_freeze_step" if name == "ZeroOneAdam" else "freeze_step"] = 2
    opt = getattr(compressed_opt, name)(params, lr=1e-3, backend=SingleProcessBackend(), bucket_cap_mb=0.01, **kw)
    for step in range(1, 6):
        _grads(params, step, {5: "nan"})
        refs = [weakref.ref(p.grad) for p in params]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            opt.step()
    assert opt.engine.nonfinite_steps == 1
    assert all(getattr(part, n) is None for b in opt.engine.buckets
               for part in declared.parts(b.state) + [b.feedback, b.sync] for n in declared.names(part, declared.STEP))
    opt.zero_grad()
    assert all(r() is None for r in refs)
