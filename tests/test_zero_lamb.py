"""1-bit LAMB under ZeRO in native passes (compressed_opt.zero_lamb): they run on the compression
steps that do not measure the live trust ratio; the fresh variance is the composition's bit for
bit and the parameters follow the composition's within what the maxima's bound allows, on one
rank and on two; the passes check themselves and refuse what they cannot run."""
import contextlib
import warnings

import pytest
import torch

import compressed_opt
from compressed_opt import cuda as kernels
from compressed_opt.comm import SingleProcessBackend
from compressed_opt.cuda import harness, zero_passes

pytestmark = pytest.mark.skipif(kernels.cpu.library() is None, reason="no C compiler here")

_AGREED = ("zero_passes", torch.device("cpu"))  # (the harness's verdict on the ZeRO passes here)


@contextlib.contextmanager
def _agreement(native: bool):
    """The ZeRO passes checked afresh at first use (``native``), or found differing from their
    compositions (the composition runs); the harness's verdict as it was afterwards."""
    saved = harness._agreed.pop(_AGREED, None)
    if not native:
        harness._agreed[_AGREED] = False
    try:
        yield
    finally:
        harness._agreed.pop(_AGREED, None)
        if saved is not None:
            harness._agreed[_AGREED] = saved


def _run(rank, world, native, steps=16, backend=None, plan=()):
    """OnebitLamb, ZeRO stage 1, freeze at 3 (the live ratio measured at steps 4 and 14): the
    parameters, each bucket's fresh variance chunk, and which steps' updates ran natively."""
    g = torch.Generator().manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in ((33, 17), (17,), (0,), (5, 300), (4097,))]
    kw = {} if backend is None else {"backend": backend}
    opt = compressed_opt.OnebitLamb(params, lr=1e-3, freeze_step=3, bucket_cap_mb=0.01, zero_stage=1, overlap=False,
                                    **kw)
    ran, now = [], [0]
    descend = zero_passes.lamb_rows_descend_

    def spy(*args):
        ran.append((now[0], descend(*args)))
        return ran[-1][1]

    zero_passes.lamb_rows_descend_ = spy
    try:
        with _agreement(native), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for step in range(1, steps + 1):
                now[0] = step
                gen = torch.Generator().manual_seed(1000 * rank + step)
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen) * 0.01
                if step in plan:
                    params[0].grad[3, 4] = float("nan")
                opt.step()
    finally:
        zero_passes.lamb_rows_descend_ = descend
    fresh = [opt.engine.client.zero.moment(b, "exp_avg_sq_fresh").clone() for b in opt.engine._buckets]
    ran = sorted({s for s, done in ran if done})
    return [p.detach().clone() for p in params], fresh, ran, opt.engine.nonfinite_steps


def _compare(native, composed):
    for a, b in zip(native[1], composed[1]):  # (the momentum does not depend on the parameters here)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    for a, b in zip(native[0], composed[0]):  # (coefficients within 2^-20 of each other: ~1e-9 apart)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)


def test_the_native_passes_run_and_follow_the_composition():
    native = _run(0, 1, True, backend=SingleProcessBackend(), plan=(7,))
    composed = _run(0, 1, False, backend=SingleProcessBackend(), plan=(7,))
    _compare(native, composed)
    assert native[3] == composed[3] == 1  # the NaN step skipped on both
    # every compression step but the skipped one (loop step 7) and the first (the loop's 4: the
    # momentum gathered at the freeze is whole until that exchange keeps its rows); the steps that
    # measure the live ratio (the optimizer's 4 and 14: the loop's 4 and, after the skipped step, 15) too
    assert native[2] == [5, 6, 8, 9, 10, 11, 12, 13, 14, 15, 16] and composed[2] == []


def _both(rank, world):
    return _run(rank, world, True), _run(rank, world, False)


@pytest.mark.multiprocess
def test_the_native_passes_on_two_ranks_follow_the_composition():
    """Each rank's chunk of the variance from its own row of the result, the maxima over both."""
    from distributed import run_ranks

    results = run_ranks(_both, 2, timeout=120)
    for native, composed in results:
        _compare(native, composed)
        assert native[2] == [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # (the measuring step 14 too)
    assert all(torch.equal(a, b) for a, b in zip(results[0][0][0], results[1][0][0]))  # replicas agree


def test_the_lamb_passes_check_themselves_and_refuse_what_they_cannot_run(monkeypatch):
    """The check at first use finds them the compositions' bits here; a parameter they cannot
    write, rows too short, an unaligned chunk or the reference kernels: nothing done, ``False``."""
    from compressed_opt.cuda.segmented import Segments

    assert zero_passes.agrees()
    segs, chunk, block = Segments([5, 300]), 320, 256
    rows = torch.zeros(1, kernels.rows_layout(chunk, block)[1], dtype=torch.uint8)
    kernels.compress_rows_(torch.randn(305), torch.zeros(305), rows, chunk, block)
    result, r = kernels.CompressedResult(rows, chunk, block, torch.zeros(305)), torch.rand(305) + 0.5
    params, out = [torch.ones(5), torch.ones(300)], torch.full((305,), 3.0)
    args = (r, 1e-8, [1.0, 2.0], params, segs, None, [-0.1, -0.1])
    assert not zero_passes.lamb_rows_descend_(result, r, 1e-8, [1.0, 2.0], [params[0], torch.ones(600)[::2]],
                                              segs, None, [-0.1, -0.1])
    short = kernels.CompressedResult(torch.zeros(1, kernels.rows_layout(64, 256)[1], dtype=torch.uint8), 64, 256, out)
    assert not zero_passes.lamb_rows_descend_(short, *args)
    assert not zero_passes.previous_momentum_(result, r, 4, 100, out)  # (not a whole byte of bits)
    assert not zero_passes.previous_momentum_(result, r, 0, 400, out)  # (past the rows)
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    assert not zero_passes.lamb_rows_descend_(result, *args) and not zero_passes.previous_momentum_(result, r, 0, 305,
                                                                                                     out)
    assert all(bool((p == 1).all()) for p in params) and bool((out == 3.0).all())


def _tiny(rank, world):
    """A bucket of 40 elements on 3 ranks: chunks of 32, so rank 2 holds none of it."""
    out = []
    for native in (True, False):
        g = torch.Generator().manual_seed(rank)
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in ((7, 5), (5,))]
        opt = compressed_opt.OnebitLamb(params, lr=1e-3, freeze_step=3, zero_stage=1, overlap=False)
        ran, descend = [], zero_passes.lamb_rows_descend_
        zero_passes.lamb_rows_descend_ = lambda *args: ran.append(descend(*args)) or ran[-1]
        try:
            with _agreement(native):
                for step in range(1, 12):
                    gen = torch.Generator().manual_seed(1000 * rank + step)
                    for p in params:
                        p.grad = torch.randn(p.shape, generator=gen) * 0.01
                    opt.step()
        finally:
            zero_passes.lamb_rows_descend_ = descend
        out.append(([p.detach().clone() for p in params], sum(ran)))
    return out


@pytest.mark.multiprocess
def test_a_rank_that_holds_no_element_of_a_bucket_steps_with_the_others():
    from distributed import run_ranks

    results = run_ranks(_tiny, 3, timeout=120)
    for (native, ran), (composed, ran_composed) in results:
        assert ran == 7 and ran_composed == 0  # steps 5-11 (4, the first compression step, measures)
        for a, b in zip(native, composed):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0][0][0], r[0][0]))


def _warmup_params(zero_stage: int, backend=None, steps: int = 6) -> list[torch.Tensor]:
    """The parameters after ``steps`` LAMB warmup steps (the freeze never comes), several buckets,
    the same gradients on every rank."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in ((37,), (16, 9), (1000,), (5,), (1,), (300, 7))]
    kw = {} if backend is None else {"backend": backend}
    opt = compressed_opt.OnebitLamb(params, lr=1e-2, weight_decay=0.01, freeze_step=50, zero_stage=zero_stage,
                                    bucket_cap_mb=0.002, overlap=False, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    assert len(opt.engine.buckets) >= 3
    opt.close()
    return [p.detach().clone() for p in params]


def _warmups_by_stage(rank, world):
    return [_warmup_params(stage) for stage in (0, 1, 2)]


def test_the_lamb_warmup_under_zero_on_one_rank_is_stage_0s_bit_for_bit():
    """ZeRO's LAMB warmup takes its per-layer norms as float64 sums of squares of each layer's piece
    of the chunk (the C pass stage 0's whole-layer norms use) and steps each piece as stage 0 steps
    a layer: on one rank, where every piece is a whole layer, stage 1 and 2 give stage 0's
    parameters bit for bit."""
    by_stage = [_warmup_params(stage, SingleProcessBackend()) for stage in (0, 1, 2)]
    for other in by_stage[1:]:
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(by_stage[0], other))


@pytest.mark.multiprocess
def test_the_lamb_warmup_under_zero_on_two_ranks_follows_stage_0():
    """On two ranks a layer's pieces are summed apart and added over the ranks: the parameters stay
    within float rounding of stage 0's, the same on both ranks."""
    from distributed import run_ranks

    per_rank = run_ranks(_warmups_by_stage, 2)
    for stage0, stage1, stage2 in per_rank:
        for other in (stage1, stage2):
            for a, b in zip(stage0, other):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert all(torch.equal(a, b) for a, b in zip(sum(per_rank[0], []), sum(per_rank[1], [])))


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("preconditioned", [True, False])
def test_the_local_momentum_formed_alone_is_the_composition_and_compresses_as_the_fused_pass(world, preconditioned):
    """``ZeroLocalMomentum.form_`` (a local momentum formed before its exchange under ZeRO: launched
    from backward, or 1-bit LAMB's measuring steps, which read it whole): ``x`` is the composition's
    bit for bit (kept rows times ``keep``, plus ``gain r g``, 0 where ``r == 0``, clamped; the
    momentum exchange: ``t keep + gain g``; a layer without a gradient), and compressing it gives
    what the pass fused into the compression gives, rows and error."""
    from compressed_opt.comm import chunk_numel
    from compressed_opt.cuda.segmented import Segments

    assert zero_passes.agrees()
    g = torch.Generator().manual_seed(7 + world)
    segs, block = Segments([37, 0, 300, 5, 1025]), 256
    n = segs.numel
    chunk = chunk_numel(n, world)
    rows = torch.zeros(world, kernels.rows_layout(chunk, block)[1], dtype=torch.uint8)
    kernels.compress_rows_(torch.randn(world * chunk, generator=g), torch.zeros(world * chunk), rows, chunk, block)
    r = torch.rand(n, generator=g) + 0.1
    r[::9] = 0.0
    sources = [torch.randn(k, generator=g) * 3 for k in segs.sizes]
    sources[3] = None  # (a layer without a gradient)
    keep, gain, bounds = [0.9, 0.8, 0.85, 0.9, 0.95], [0.1, 0.2, 0.15, 0.1, 0.05], [1.0, 2.0, 0.5, 1.5, 1.25]
    if not preconditioned:  # (the momentum exchange: no R, no bound, one gain)
        r, gain, bounds = None, [0.1] * 5, None
    t = torch.empty(world * chunk)
    kernels.decompress_rows_(rows, t, chunk, block)
    composed = torch.zeros(n)
    zero_passes.compose_momentum_(composed, t, r, keep, gain, bounds, segs, sources)
    x = torch.full((n,), 7.0)
    pending = zero_passes.ZeroLocalMomentum(x, kernels.CompressedResult(rows, chunk, block, torch.zeros(n)), r, keep,
                                            gain, bounds, segs, sources, compose=lambda: None)
    assert pending.form_()
    assert torch.equal(x.view(torch.int32), composed.view(torch.int32))
    error0 = torch.randn(n, generator=g) * 0.01
    plain, fused = torch.zeros_like(rows), torch.zeros_like(rows)
    e_plain, e_fused = error0.clone(), error0.clone()
    kernels.compress_rows_(x.clone(), e_plain, plain, chunk, block)  # (the local momentum formed, then compressed)
    assert pending.compress_rows_(x, e_fused, fused, chunk, block)  # (formed inside the compression)
    assert torch.equal(plain, fused) and torch.equal(e_plain.view(torch.int32), e_fused.view(torch.int32))
