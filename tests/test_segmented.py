"""The segmented passes (compressed_opt.cuda.segmented): the native CPU pass against the PyTorch
composition and against the math written out per segment."""
import warnings

import pytest
import torch

from compressed_opt.cuda import cpu, harness, reference, registry, segmented
from compressed_opt.cuda.segmented import Segments

PATHS = ["native", "reference"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    if request.param == "native":
        if cpu.library() is None:
            pytest.skip("no C compiler here")
        monkeypatch.delenv("COMPRESSED_OPT_KERNELS", raising=False)
    else:
        monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    return request.param


def _case(seed: int, sizes=(5, 0, 17, 1, 64, 3)):
    g = torch.Generator().manual_seed(seed)
    segs = Segments(list(sizes))
    n = segs.numel + 4  # a tail past the segments that no pass may touch
    x, m = torch.randn(n, generator=g), torch.randn(n, generator=g)
    r = torch.rand(n, generator=g) * 3
    r[::7] = 0.0
    return segs, x, m, r, g


@pytest.mark.parametrize("seed", range(4))
def test_segment_sumsq(path, seed):
    segs, x, *_ = _case(seed)
    out = torch.full((len(segs),), -1.0, dtype=torch.float64)
    segmented.segment_sumsq(x, segs, out)
    expected = [float((v.double() ** 2).sum()) for v in segs.split(x)]
    assert out.tolist() == pytest.approx(expected, rel=1e-6, abs=0)
    assert out[1] == 0.0  # the empty segment


def test_segment_sumsq_of_tiny_gradients(path):
    """Squares of gradients around 1e-25 (GPT-2's key bias has ~1e-11) underflow in fp32; both
    paths sum them in float64."""
    segs = Segments([1000])
    x = torch.full((1000,), 1e-25)
    out = torch.empty(1, dtype=torch.float64)
    segmented.segment_sumsq(x, segs, out)
    assert out.item() == pytest.approx(1000 * float(x[0]) ** 2, rel=1e-9)


@pytest.mark.parametrize("scale", [None, 0.5])
@pytest.mark.parametrize("with_sums", [False, True])
def test_gather(path, scale, with_sums):
    sizes = [5, 0, 17, 1, 5000, 3]
    segs = Segments(sizes)
    g = torch.Generator().manual_seed(1)
    sources = [torch.randn(n, generator=g) for n in sizes]
    sources[3] = None  # a parameter without a gradient
    sources[4] = sources[4].view(50, 100)  # shaped like a parameter
    out = torch.full((segs.numel + 2,), 9.0)
    sums = torch.full((len(segs),), -1.0, dtype=torch.float64) if with_sums else None
    segmented.gather_(sources, out, segs, scale, sums)
    expected = torch.cat([torch.zeros(n) if src is None else src.reshape(-1) * (scale or 1.0)
                          for src, n in zip(sources, sizes)])
    assert torch.equal(out[: segs.numel], expected) and (out[segs.numel:] == 9.0).all()
    if with_sums:
        assert sums.tolist() == pytest.approx([float((v.double() ** 2).sum()) for v in segs.split(out)], rel=1e-9)


def test_gather_of_other_dtypes_and_strides(path):
    segs = Segments([6, 4])
    sources = [torch.arange(6, dtype=torch.bfloat16), torch.arange(8.0)[::2]]
    out = torch.zeros(10)
    sums = torch.zeros(2, dtype=torch.float64)
    segmented.gather_(sources, out, segs, None, sums)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 0, 2, 4, 6] and sums.tolist() == [55.0, 56.0]
    with pytest.raises(ValueError, match="one source per segment"):
        segmented.gather_(sources[:1], out, segs)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("scaled", [False, True])
def test_lerp_scale_clamp(path, seed, scaled):
    segs, x, m, r, g = _case(seed)
    bounds = (torch.rand(len(segs), generator=g) * 2).tolist()
    scales = (0.25 + torch.rand(len(segs), generator=g) * 4).tolist() if scaled else None
    tail = x[segs.numel:].clone()
    expected = []
    for i, (xs, ms, rs, b) in enumerate(zip(segs.split(x), segs.split(m), segs.split(r), bounds)):
        v = rs * torch.lerp(ms, xs, 0.1)
        expected.append((v * scales[i] if scaled else v).clamp(-b, b))
    segmented.lerp_scale_clamp_(x, m, 0.1, r, bounds, segs, scales)
    torch.testing.assert_close(x[: segs.numel], torch.cat(expected), rtol=1e-6, atol=1e-7)
    assert torch.equal(x[segs.numel:], tail)
    assert all(abs(v) <= b for s, b in zip(segs.split(x), bounds) for v in s.tolist())


@pytest.mark.parametrize("seed", range(3))
def test_scale_clamp(path, seed):
    segs, x, _, r, g = _case(seed)
    bounds = (torch.rand(len(segs), generator=g) * 2).tolist()
    x0 = x.clone()
    segmented.scale_clamp_(x, r, bounds, segs)
    expected = [(rs * xs).clamp(-b, b) for xs, rs, b in zip(segs.split(x0), segs.split(r), bounds)]
    torch.testing.assert_close(x[: segs.numel], torch.cat(expected), rtol=0, atol=0)
    assert torch.equal(x[segs.numel:], x0[segs.numel:])


def test_lerp_scale_clamp_keeps_nan(path):
    segs = Segments([3])
    x = torch.tensor([float("nan"), 1.0, -1.0])
    segmented.lerp_scale_clamp_(x, torch.zeros(3), 0.5, torch.ones(3), [0.25], segs)
    assert torch.isnan(x[0]) and x[1:].tolist() == [0.25, -0.25]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("in_place", [False, True])
def test_divide_where_nonzero(path, seed, in_place):
    _, y, _, r, _ = _case(seed)
    y0 = y.clone()
    q = y if in_place else torch.full_like(y, 7.0)
    segmented.divide_where_nonzero_(y, r, q)
    expected = torch.where(r != 0, y0 / r, torch.zeros_like(y0))
    torch.testing.assert_close(q, expected, rtol=1e-6, atol=0)
    assert (q[r == 0] == 0).all() and not torch.signbit(q[r == 0]).any()
    if not in_place:
        assert torch.equal(y, y0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("known_zeros", [False, True])
def test_divide_where_nonzero_per_segment(path, seed, in_place, known_zeros):
    """``(y / r) / d_s`` on segment ``s``, 0 where ``r == 0``; past the segments nothing is written."""
    segs, y, _, r, g = _case(seed)
    divisors = (0.25 + torch.rand(len(segs), generator=g) * 4).tolist()
    y0 = y.clone()
    q = y if in_place else torch.full_like(y, 7.0)
    tail = q[segs.numel:].clone()
    zeros = torch.nonzero(r == 0).view(-1) if known_zeros else None
    segmented.divide_where_nonzero_(y, r, q, zeros, segs, divisors)
    expected = torch.cat([torch.where(rs != 0, ys / rs, torch.zeros_like(ys)) / d
                          for ys, rs, d in zip(segs.split(y0), segs.split(r), divisors)])
    torch.testing.assert_close(q[: segs.numel], expected, rtol=1e-6, atol=0)
    assert torch.equal(q[segs.numel:], tail)
    with pytest.raises(ValueError, match="go together"):
        segmented.divide_where_nonzero_(y, r, q, None, segs)


def test_divide_where_nonzero_with_known_zeros(path):
    _, y, _, r, _ = _case(2)
    expected = torch.where(r != 0, y / r, torch.zeros_like(y))
    q = torch.full_like(y, 7.0)
    segmented.divide_where_nonzero_(y, r, q, torch.nonzero(r == 0).view(-1))
    torch.testing.assert_close(q, expected, rtol=1e-6, atol=0)


def test_native_and_reference_agree(monkeypatch):
    if cpu.library() is None:
        pytest.skip("no C compiler here")
    results = {}
    for p in PATHS:
        monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference" if p == "reference" else "native")
        segs, x, m, r, g = _case(5, sizes=(1000, 7, 33333, 0, 2))
        bounds = [0.5, 1.0, 2.0, 1.0, 0.1]
        scales = [1.5, 0.3, 1.0, 2.0, 0.7]
        segmented.lerp_scale_clamp_(x, m, 0.1, r, bounds, segs, scales)
        q = torch.zeros_like(x)
        segmented.divide_where_nonzero_(x, r, q)
        q2 = torch.zeros_like(x)
        segmented.divide_where_nonzero_(x, r, q2, None, segs, scales)
        out = torch.empty(len(segs), dtype=torch.float64)
        segmented.segment_sumsq(x, segs, out)
        results[p] = (x, q, q2, out)
    for a, b in zip(results["native"], results["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_input_is_refused():
    segs = Segments([4, 4])
    with pytest.raises(ValueError, match="at least 8"):
        segmented.segment_sumsq(torch.zeros(5), segs, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="float64"):
        segmented.segment_sumsq(torch.zeros(8), segs, torch.zeros(2))
    with pytest.raises(ValueError, match="one value per segment"):
        segmented.lerp_scale_clamp_(torch.zeros(8), torch.zeros(8), 0.1, torch.ones(8), [1.0], segs)
    with pytest.raises(ValueError, match="one shape"):
        segmented.divide_where_nonzero_(torch.zeros(8), torch.ones(7), torch.zeros(8))
    with pytest.raises(ValueError, match="non-negative"):
        Segments([3, -1])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _chunk(n: int, world: int) -> int:
    """The compression's chunk for ``n`` elements on ``world`` ranks (a multiple of 32)."""
    return -(-max(-(-n // world), 1) // 32) * 32


def _fusion_input(g, sizes, past, world):
    """``(segments, n, chunk, x)``: the segments, ``past`` elements beyond them, and an ``x`` of
    magnitudes over five decades with zeros and -0.0, drawn from ``g``."""
    segs = Segments(sizes)
    n = segs.numel + past
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 2, (n,), generator=g)
    x[::7], x[3::11] = 0.0, -0.0
    return segs, n, _chunk(n, world), x


FUSED_CASES = [  # (segment sizes, elements past the segments, world, block, weight, scaled)
    ([5, 0, 17, 1, 64, 3], 4, 1, 256, 0.1, True),           # tiny, an empty tensor, tails of blocks
    ([3000, 1, 2047, 0, 999], 0, 2, 256, 0.1, False),        # tensors across blocks and chunks
    ([1025, 1023, 4096, 7], 37, 3, 1024, 0.9, True),         # weight >= 1/2: lerp's other formula
    ([20_000, 333, 1, 12_345], 61, 4, 512, 0.5, True),       # weight exactly 1/2
    ([1] * 300, 5, 2, 256, 0.1, False),                      # many one-element tensors
    ([777], 0, 1, 1024, -0.25, True),                        # one tensor, less than a block
]


@pytest.mark.parametrize("sizes,past,world,block,weight,scaled", FUSED_CASES)
@pytest.mark.parametrize("seed", range(3))
def test_lerp_scale_clamp_fused_into_compression_is_bit_identical(sizes, past, world, block, weight, scaled, seed):
    """The local momentum's pass run inside the worker's compression (one pass over memory) gives
    the error and the rows of ``lerp_scale_clamp_`` then ``compress_rows_`` on the native path bit
    for bit (zeros, -0.0, negatives, values beyond the bounds, r == 0, odd sizes, blocks and chunks
    cut inside tensors, elements past the segments, a gap between the rows), and leaves ``x`` as it was."""
    from compressed_opt import cuda as kernels

    if cpu.library() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(seed)
    segs, n, chunk, x = _fusion_input(g, sizes, past, world)
    m = torch.randn(n, generator=g) * 0.5
    r = torch.rand(n, generator=g) * 4
    r[::5] = 0.0
    error = torch.randn(n, generator=g) * 0.1
    error[::13] = 0.0
    bounds = (torch.rand(len(segs), generator=g) * 2 + 0.05).tolist()
    scales = (torch.rand(len(segs), generator=g) + 0.5).tolist() if scaled else None
    nb, row_len = kernels.rows_layout(chunk, block)
    stride = row_len + 3

    x1, e1 = x.clone(), error.clone()
    rows1 = torch.zeros(world, stride, dtype=torch.uint8)
    segmented.lerp_scale_clamp_(x1, m, weight, r, bounds, segs, scales)
    cpu.compress_rows_(x1, e1, rows1[:, :row_len], chunk, block)

    x2, e2 = x.clone(), error.clone()
    rows2 = torch.zeros(world, stride, dtype=torch.uint8)
    fused = segmented.lerp_scale_clamp(x2, m, weight, r, bounds, segs, scales)
    assert fused.compress_rows_(x2, e2, rows2[:, :row_len], chunk, block)
    assert torch.equal(_bits(e2), _bits(e1))
    assert torch.equal(rows2, rows1)
    assert torch.equal(_bits(x2), _bits(x))  # read, never written

    fused.apply_()  # alone: the pass itself
    assert torch.equal(_bits(x2), _bits(x1))


@pytest.mark.parametrize("sizes,past,world,block,weight,scaled", FUSED_CASES)
def test_lerp_scale_clamp_reads_its_sources_where_they_lie(sizes, past, world, block, weight, scaled):
    """With ``sources`` (the gradients, one tensor per segment), the fused pass reads each where it
    lies: bit for bit ``gather_`` into ``x`` then the pass then the compression, whatever the flat
    buffer holds in the segments (NaN here: it is never read there), its elements past the segments
    its own; ``apply_`` gathers first."""
    from compressed_opt import cuda as kernels

    if cpu.library() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(7)
    segs, n, chunk, x = _fusion_input(g, sizes, past, world)
    sources = [v.clone().view(-1, 1) if v.numel() % 2 else v.clone() for v in segs.split(x)]  # any shape
    m, r = torch.randn(n, generator=g) * 0.5, torch.rand(n, generator=g) * 4
    r[::5] = 0.0
    error = torch.randn(n, generator=g) * 0.1
    bounds = (torch.rand(len(segs), generator=g) * 2 + 0.05).tolist()
    scales = (torch.rand(len(segs), generator=g) + 0.5).tolist() if scaled else None
    _, row_len = kernels.rows_layout(chunk, block)

    x1, e1 = x.clone(), error.clone()
    rows1 = torch.zeros(world, row_len, dtype=torch.uint8)
    segmented.lerp_scale_clamp_(x1, m, weight, r, bounds, segs, scales)
    cpu.compress_rows_(x1, e1, rows1, chunk, block)

    x2, e2 = x.clone(), error.clone()
    x2[: segs.numel] = float("nan")
    rows2 = torch.zeros(world, row_len, dtype=torch.uint8)
    fused = segmented.lerp_scale_clamp(x2, m, weight, r, bounds, segs, scales, sources=sources)
    assert kernels.readable_in_place(sources)
    assert fused.compress_rows_(x2, e2, rows2, chunk, block)
    assert torch.equal(_bits(e2), _bits(e1)) and torch.equal(rows2, rows1)
    assert bool(x2[: segs.numel].isnan().all())  # not written either

    fused.apply_()  # alone: gathered, then the pass
    assert torch.equal(_bits(x2), _bits(x1))
    assert not kernels.readable_in_place([*sources[:-1], None])
    assert not kernels.readable_in_place([sources[0].double(), *sources[1:]])
    with pytest.raises(ValueError, match="one source tensor per segment"):
        segmented.lerp_scale_clamp(x2, m, weight, r, bounds, segs, scales, sources=sources[:-1])


def test_lerp_scale_clamp_pass_falls_back_where_it_cannot_fuse(monkeypatch):
    """Another buffer, or the reference kernels (the pass made where they are forced is the
    reference's): nothing done, ``False`` (the caller applies the pass, then compresses); through
    ``comm.compressed._compress`` (the worker side with its producer) the result is the same."""
    from compressed_opt import cuda as kernels
    from compressed_opt.comm.compressed import _compress

    segs, x, m, r, _ = _case(1)
    error = torch.randn(x.numel())
    nb, row_len = kernels.rows_layout(64, 256)
    rows = torch.zeros(2, row_len, dtype=torch.uint8)
    pending = segmented.lerp_scale_clamp(x, m, 0.1, r, [1.0] * len(segs), segs)
    assert isinstance(pending, cpu.LerpScaleClamp) == (cpu.library() is not None)  # (the C pass where it is here)
    before = (x.clone(), error.clone(), rows.clone())
    assert not pending.compress_rows_(x.clone(), error, rows, 64, 256)
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    pending = segmented.lerp_scale_clamp(x, m, 0.1, r, [1.0] * len(segs), segs)
    assert type(pending) is reference.LerpScaleClamp
    assert not pending.compress_rows_(x, error, rows, 64, 256)
    for a, b in zip((x, error, rows), before):
        assert torch.equal(a, b)
    expected = x.clone(), error.clone(), rows.clone()
    segmented.lerp_scale_clamp_(expected[0], m, 0.1, r, [1.0] * len(segs), segs)
    kernels.reference.compress_rows_(expected[0], expected[1], expected[2], 64, 256)
    _compress(kernels.reference, x, error, rows, 64, 256, pending)
    for a, b in zip((x, error, rows), expected):
        assert torch.equal(a, b)


def _emulated_cuda_kernel(x, m, weight, r, scalars, offsets, error, rows, chunk, block):
    """``gpu.lerp_scale_clamp_compress_rows_``'s contract on the CPU: the pass (``m is None``:
    ``scale_clamp_``; ``r is None``: ``torch.lerp``) with the bounds and scales it is given (fp32,
    ``nseg`` of each) over a copy of ``x``, then the compression."""
    nseg = offsets.numel() - 1
    segs = Segments(offsets.diff().tolist())
    v = x.clone()
    if r is None:  # torch.lerp alone, over the one segment that is the whole buffer
        assert scalars is None and offsets.tolist() == [0, x.numel()]
        torch.lerp(m, v, weight, out=v)
        cpu.compress_rows_(v, error, rows, chunk, block)
        return
    assert torch.equal(offsets, segs.offsets) and scalars.dtype == torch.float32 and scalars.numel() == 2 * nseg
    if m is None:  # scale_clamp_
        segmented.scale_clamp_(v, r, scalars[:nseg].double(), segs)
    else:
        segmented.lerp_scale_clamp_(v, m, weight, r, scalars[:nseg].double(), segs, scalars[nseg:].double())
    cpu.compress_rows_(v, error, rows, chunk, block)


def test_the_cuda_dispatch_hands_the_kernel_its_scalars_and_checks_it_once(monkeypatch):
    """Without a GPU, the CUDA path's Python (``gpu.LerpScaleClamp``, ``gpu.ScaleClamp``,
    ``gpu.Lerp``) with the kernel emulated on the CPU: the bounds then the scales (1 without scales)
    as fp32, the offsets, the compression's arguments; the harness's check of the kernel
    (``"lerp_scale_clamp_compress"``) compares it with the two passes once per device, and a kernel
    that rounds otherwise is refused (the registry binds the reference's passes: the two passes run)
    with one warning."""
    from compressed_opt import cuda as kernels
    from compressed_opt.cuda import gpu

    if cpu.library() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setattr(gpu, "is_available", lambda device=None: True)
    monkeypatch.setattr(gpu, "lerp_scale_clamp_compress_rows_", _emulated_cuda_kernel)
    monkeypatch.setattr(gpu, "compress_rows_", cpu.compress_rows_)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)  # (no CUDA host memory here)
    monkeypatch.setattr(harness, "_agreed", {})
    segs, x, m, r, g = _case(5, sizes=(700, 0, 333, 1, 64))
    error = torch.randn(x.numel(), generator=g)
    chunk, block = 576, 256
    _, row_len = kernels.rows_layout(chunk, block)
    for scales in ([0.5, 2.0, 1.5, 0.75, 1.25], None):
        bounds = [1.0, 0.5, 2.0, 0.25, 0.1]
        want_e, want_rows = error.clone(), torch.zeros(2, row_len, dtype=torch.uint8)
        want_x = x.clone()
        segmented.lerp_scale_clamp_(want_x, m, 0.1, r, bounds, segs, scales)
        cpu.compress_rows_(want_x, want_e, want_rows, chunk, block)
        e, rows = error.clone(), torch.zeros(2, row_len, dtype=torch.uint8)
        pending = gpu.LerpScaleClamp(x, m, 0.1, r, bounds, segs, scales)
        assert pending.compress_rows_(x, e, rows, chunk, block)
        assert torch.equal(e, want_e) and torch.equal(rows, want_rows)
    e, rows = error.clone(), torch.zeros(2, row_len, dtype=torch.uint8)
    assert gpu.ScaleClamp(x, r, [1.0, 0.5, 2.0, 0.25, 0.1], segs).compress_rows_(x, e, rows, chunk, block)
    want_x, want_e, want_rows = x.clone(), error.clone(), torch.zeros(2, row_len, dtype=torch.uint8)
    segmented.scale_clamp_(want_x, r, [1.0, 0.5, 2.0, 0.25, 0.1], segs)
    cpu.compress_rows_(want_x, want_e, want_rows, chunk, block)
    assert torch.equal(e, want_e) and torch.equal(rows, want_rows)
    e, rows = error.clone(), torch.zeros(2, row_len, dtype=torch.uint8)
    assert gpu.Lerp(x, m, 0.9, Segments([x.numel()])).compress_rows_(x, e, rows, chunk, block)
    want_x, want_e, want_rows = x.clone(), error.clone(), torch.zeros(2, row_len, dtype=torch.uint8)
    torch.lerp(m, want_x, 0.9, out=want_x)
    cpu.compress_rows_(want_x, want_e, want_rows, chunk, block)
    assert torch.equal(e, want_e) and torch.equal(rows, want_rows)
    check = ("lerp_scale_clamp_compress", torch.device("cpu"))  # (the emulated device)
    assert harness.agrees(*check)
    assert harness._agreed == {check: True}
    cuda = ("lerp_scale_clamp_compress", torch.device("cuda", 0))
    harness._agreed[cuda] = True  # (as the check found there)
    bound = registry._bind(cuda[1], "cuda")
    assert (bound.LerpScaleClamp, bound.ScaleClamp, bound.Lerp) == (gpu.LerpScaleClamp, gpu.ScaleClamp, gpu.Lerp)

    def off_by_one_ulp(x, m, weight, r, scalars, offsets, error, rows, chunk, block):
        calls.append(1)
        _emulated_cuda_kernel(x, m, weight, r, scalars, offsets, error, rows, chunk, block)
        error[0] = torch.nextafter(error[0], torch.tensor(float("inf")))

    calls = []
    monkeypatch.setattr(gpu, "lerp_scale_clamp_compress_rows_", off_by_one_ulp)
    monkeypatch.setattr(harness, "_agreed", {})
    with pytest.warns(RuntimeWarning, match="running the reference instead"):
        assert not harness.agrees(*check)
    ran = len(calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (checked once: no second warning)
        assert not harness.agrees(*check)
    assert ran and len(calls) == ran
    harness._agreed[cuda] = False  # (as the check found there)
    bound = registry._bind(cuda[1], "cuda")
    assert (bound.LerpScaleClamp, bound.ScaleClamp, bound.Lerp) == (
        reference.LerpScaleClamp, reference.ScaleClamp, reference.Lerp)  # (the two passes: apply_, then compress)


@pytest.mark.parametrize("sizes,past,world,block,weight,scaled", FUSED_CASES)
def test_scale_clamp_fused_into_compression_is_bit_identical(sizes, past, world, block, weight, scaled):
    """0/1 Adam's ``clamp(R x)`` run inside the compression: ``scale_clamp_`` then
    ``compress_rows_`` on the native path bit for bit, ``x`` not written."""
    from compressed_opt import cuda as kernels

    if cpu.library() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(11)
    segs, n, chunk, x = _fusion_input(g, sizes, past, world)
    r = torch.rand(n, generator=g) * 4
    r[::5] = 0.0
    error = torch.randn(n, generator=g) * 0.1
    bounds = (torch.rand(len(segs), generator=g) * 2 + 0.05).tolist()
    _, row_len = kernels.rows_layout(chunk, block)
    x1, e1, rows1 = x.clone(), error.clone(), torch.zeros(world, row_len, dtype=torch.uint8)
    segmented.scale_clamp_(x1, r, bounds, segs)
    cpu.compress_rows_(x1, e1, rows1, chunk, block)
    x2, e2, rows2 = x.clone(), error.clone(), torch.zeros(world, row_len, dtype=torch.uint8)
    assert segmented.scale_clamp(x2, r, bounds, segs).compress_rows_(x2, e2, rows2, chunk, block)
    assert torch.equal(_bits(e2), _bits(e1)) and torch.equal(rows2, rows1) and torch.equal(_bits(x2), _bits(x))
    segmented.scale_clamp(x2, r, bounds, segs).apply_()
    assert torch.equal(_bits(x2), _bits(x1))


@pytest.mark.parametrize("n,world,block,weight", [(7, 1, 256, 0.1), (5000, 3, 256, 0.9), (20_011, 2, 1024, 0.1),
                                                  (4097, 4, 512, 0.5), (1, 1, 256, 0.25)])
def test_lerp_fused_into_compression_is_torch_lerp_then_compression(n, world, block, weight, monkeypatch):
    """The momentum exchange's ``torch.lerp(m, x, w, out=x)`` inside the compression: where the
    first-use check (the harness's ``"lerp_compress"``) finds the C pass rounds as torch.lerp does (here
    it must: the library contracts as PyTorch's vector kernels do), the error and rows of torch.lerp
    then ``compress_rows_`` bit for bit, ``x`` not written; where the check fails, refused (the pass
    bound is the reference's, whose compression declines)."""
    from compressed_opt import cuda as kernels

    if cpu.library() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(n)
    x, m, error = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.3, torch.randn(n, generator=g) * 0.1
    x[::7], m[::5], x[2::11] = 0.0, 0.0, -0.0
    chunk = _chunk(n, world)
    _, row_len = kernels.rows_layout(chunk, block)
    x1, e1, rows1 = x.clone(), error.clone(), torch.zeros(world, row_len, dtype=torch.uint8)
    torch.lerp(m, x1, weight, out=x1)
    cpu.compress_rows_(x1, e1, rows1, chunk, block)
    x2, e2, rows2 = x.clone(), error.clone(), torch.zeros(world, row_len, dtype=torch.uint8)
    assert segmented.lerp(x2, m, weight).compress_rows_(x2, e2, rows2, chunk, block)
    assert torch.equal(_bits(e2), _bits(e1)) and torch.equal(rows2, rows1) and torch.equal(_bits(x2), _bits(x))
    monkeypatch.setitem(harness._agreed, ("lerp_compress", torch.device("cpu")), False)  # (the check failed)
    monkeypatch.setattr(registry, "_bound", {})  # (the kernels bound again, from that verdict)
    assert not segmented.lerp(x2, m, weight).compress_rows_(x2, error.clone(), rows2, chunk, block)


def _lanes_sumsq(values: list[float]) -> float:
    """The native sums' order, written out (cuda/segmented_cpu.c): element ``i`` into lane ``i % 8``
    in order, the lanes added as a fixed tree, then the last ``n % 8`` squares one by one."""
    n8 = len(values) // 8 * 8
    acc = [0.0] * 8
    for i in range(n8):
        acc[i % 8] += values[i] * values[i]
    total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
    for v in values[n8:]:
        total += v * v
    return total


def test_native_sums_of_squares_follow_one_order_whatever_their_neighbours():
    """Native sums of squares of many segments, summed side by side (several at once over their
    common length), are each segment's sum in the one documented order, bit for bit: alone, among
    segments of other lengths, with empty and missing ones between, flat or where they lie."""
    from compressed_opt.cuda import sumsq_each

    if cpu.library() is None:
        pytest.skip("no C compiler here")
    g = torch.Generator().manual_seed(5)
    sizes = [37, 0, 8, 129, 1, 64, 64, 200, 15, 16, 17, 3, 250, 9]
    sources = [torch.randn(n, generator=g).mul_(10.0 ** (i - 7)) for i, n in enumerate(sizes)]
    sources[4] = None
    segments = Segments([0 if s is None else s.numel() for s in sources])
    expected = [0.0 if s is None else _lanes_sumsq([float(v) for v in s.tolist()]) for s in sources]
    where_they_lie = sumsq_each(sources, segments, torch.full((len(sizes),), -1.0, dtype=torch.float64))
    flat = torch.cat([torch.zeros(0) if s is None else s for s in sources])
    flat_out = segmented.segment_sumsq(flat, segments, torch.full((len(sizes),), -1.0, dtype=torch.float64))
    assert where_they_lie.tolist() == expected
    assert flat_out.tolist() == expected
    for i, s in enumerate(sources):  # each alone
        alone = sumsq_each([s], Segments([segments.sizes[i]]), torch.empty(1, dtype=torch.float64))
        assert alone.item() == expected[i]


def test_sumsq_each_sums_as_the_gather_does_and_as_torch_within_rounding(monkeypatch):
    """Per tensor, the float64 sum of squares that the gather's ``sumsq_out`` gives for the same
    values (bit for bit), within float64 rounding of torch's norm, 0 for ``None`` and empty
    tensors; tiny values do not underflow (their fp32 squares would)."""
    from compressed_opt.cuda import Segments, gather_, sumsq_each

    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(n, generator=g) for n in (1, 7, 8, 9, 1000, 4097)] + [None, torch.empty(0)]
    sources[2] = sources[2] * 1e-30
    sizes = [0 if s is None else s.numel() for s in sources]
    segments = Segments(sizes)
    out = sumsq_each(sources, segments, torch.empty(len(sources), dtype=torch.float64))
    gathered = torch.zeros(len(sources), dtype=torch.float64)
    gather_(sources, torch.empty(sum(sizes)), segments, sumsq_out=gathered)
    assert torch.equal(out, gathered)
    expected = torch.tensor([0.0 if s is None else s.double().square().sum().item() for s in sources],
                            dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=0)
    assert out[2] > 0 and out[6] == 0 and out[7] == 0
    with pytest.raises(ValueError, match="float64 of shape"):
        sumsq_each(sources, segments, torch.empty(2, dtype=torch.float64))
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")  # (PyTorch's float64 norms)
    reference = sumsq_each(sources, segments, torch.full((len(sources),), -1.0, dtype=torch.float64))
    torch.testing.assert_close(reference, expected, rtol=1e-12, atol=0)
