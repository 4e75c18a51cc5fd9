"""The preconditioned exchange's last pass (compressed_opt.cuda.update): the momentum taken back
from the exchanged average and the update, in one pass, bit for bit as the two passes in turn."""
import pytest
import torch

from compressed_opt.cuda import (CompressedResult, Descend, Segments, compress_rows_, cpu, decompress_rows_,
                                 descend_scaled_, divide_descend_, divide_where_nonzero_, rows_layout)

CASES = [  # (segment sizes, elements past the segments)
    ([5, 0, 17, 1, 64, 3], 4),
    ([3000, 1, 2047, 0, 999], 0),
    ([1] * 300, 5),
    ([40_000, 7], 13),
]


def _inputs(g, sizes, past):
    segs = Segments(sizes)
    n = segs.numel + past
    y = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 2, (n,), generator=g)
    y[::7], y[3::11] = 0.0, -0.0
    r = torch.rand(n, generator=g) * 3
    r[::5] = 0.0  # no variance: the momentum is 0 there
    a = torch.rand(n, generator=g)
    params = [torch.randn(k, generator=g) for k in sizes]
    out = torch.full((n,), 7.0)  # elements past the segments: not written
    return segs, y, r, a, params, out


def _bits(ts):
    return [t.view(torch.int32).clone() for t in ts]


@pytest.mark.parametrize("sizes,past", CASES)
@pytest.mark.parametrize("decay", [1.0, 0.999])
@pytest.mark.parametrize("divided", [False, True])
def test_divide_descend_is_the_two_passes_bit_for_bit(sizes, past, decay, divided):
    assert cpu.library() is not None  # (the native pass is what this compares)
    g = torch.Generator().manual_seed(len(sizes) + past)
    segs, y, r, a, params, out = _inputs(g, sizes, past)
    divisors = [0.5 + 0.25 * (i % 5) for i in range(len(sizes))] if divided else None
    scales = [(-1e-3 if i % 2 else 2.5) for i in range(len(sizes))]
    y0 = y.clone()

    fused_p, fused_m = [p.clone() for p in params], out.clone()
    divide_descend_(y, r, fused_m, segs, divisors, Descend(fused_p, a, decay, scales))

    two_p, two_m = [p.clone() for p in params], out.clone()
    n = segs.numel
    divide_where_nonzero_(y[:n], r[:n], two_m[:n], None, *((segs, divisors) if divided else ()))
    descend_scaled_(two_p, y, a, segs, decay, scales)

    assert torch.equal(y.view(torch.int32), y0.view(torch.int32))  # y is only read
    assert torch.equal(fused_m.view(torch.int32), two_m.view(torch.int32))
    assert all(torch.equal(f, t) for f, t in zip(_bits(fused_p), _bits(two_p)))
    assert torch.all(fused_m[n:] == 7.0)
    assert torch.all(fused_m[:n][r[:n] == 0] == 0)
    want = torch.where(r[:n] == 0, torch.zeros(()), y[:n] / r[:n])
    if divided:
        want = torch.cat([w / d for w, d in zip(segs.split(want), divisors)])
    torch.testing.assert_close(fused_m[:n], want, rtol=0, atol=0)


def test_divide_descend_falls_back_to_the_two_passes(monkeypatch):
    """Where the C pass cannot run (the reference kernels forced; a destination not contiguous):
    the same results from the two passes in turn, within their documented rounding."""
    g = torch.Generator().manual_seed(3)
    segs, y, r, a, params, out = _inputs(g, [6, 0, 9], 2)
    scales, divisors = [0.5, 1.0, -2.0], [2.0, 1.0, 0.5]
    native_p, native_m = [p.clone() for p in params], out.clone()
    divide_descend_(y, r, native_m, segs, divisors, Descend(native_p, a, 0.9, scales))
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    ref_p, ref_m = [p.clone() for p in params], out.clone()
    divide_descend_(y, r, ref_m, segs, divisors, Descend(ref_p, a, 0.9, scales))
    torch.testing.assert_close(ref_m, native_m, rtol=2e-7, atol=0)
    for p, q in zip(ref_p, native_p):
        torch.testing.assert_close(p, q, rtol=2e-7, atol=1e-7)
    monkeypatch.delenv("COMPRESSED_OPT_KERNELS")
    strided = [torch.randn(2 * p.numel(), generator=g)[::2] for p in params]
    expect = [p.clone() for p in strided]
    divide_descend_(y, r, out.clone(), segs, None, Descend(strided, a, 1.0, scales))
    descend_scaled_(expect, y, a, segs, 1.0, scales)
    assert all(torch.equal(p, q) for p, q in zip(strided, expect))


def test_divide_descend_refuses_bad_input():
    g = torch.Generator().manual_seed(4)
    segs, y, r, a, params, out = _inputs(g, [6, 3], 0)
    with pytest.raises(ValueError, match="one destination per segment"):
        divide_descend_(y, r, out, segs, None, Descend(params[:1], a, 1.0, [1.0, 1.0]))
    with pytest.raises(ValueError, match="a destination of 4 elements"):
        divide_descend_(y, r, out, segs, None, Descend([params[0], torch.zeros(4)], a, 1.0, [1.0, 1.0]))
    with pytest.raises(ValueError, match="flat buffer"):
        divide_descend_(y[:4], r, out, segs, None, Descend(params, a, 1.0, [1.0, 1.0]))


@pytest.mark.parametrize("sizes,past", CASES)
@pytest.mark.parametrize("world,block", [(1, 256), (2, 256), (3, 512)])
@pytest.mark.parametrize("divided", [False, True])
def test_the_pass_from_the_compressed_rows_is_decompression_then_the_pass(sizes, past, world, block, divided):
    """With ``y`` as the 1-bit rows it travelled as, the C pass decompresses it tile by tile
    (tiles across segments, blocks and chunks) and gives what decompression then the pass give,
    bit for bit; the other path (the reference kernels) decompresses into the scratch buffer."""
    g = torch.Generator().manual_seed(world * 7 + len(sizes))
    segs, _, r, a, params, out = _inputs(g, sizes, past)
    n = segs.numel
    chunk = -(-max(-(-n // world), 1) // 32) * 32
    rows = torch.zeros(world, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    result = CompressedResult(rows, chunk, block, torch.empty(n))
    divisors = [1.5 - 0.125 * (i % 4) for i in range(len(sizes))] if divided else None
    scales = [0.25 * (i + 1) for i in range(len(sizes))]

    fused_p, fused_m = [p.clone() for p in params], out.clone()
    divide_descend_(result, r, fused_m, segs, divisors, Descend(fused_p, a, 0.99, scales))

    y = torch.empty(n)
    decompress_rows_(rows, y, chunk, block)
    two_p, two_m = [p.clone() for p in params], out.clone()
    divide_descend_(y, r, two_m, segs, divisors, Descend(two_p, a, 0.99, scales))
    assert torch.equal(fused_m.view(torch.int32), two_m.view(torch.int32))
    assert all(torch.equal(f, t) for f, t in zip(_bits(fused_p), _bits(two_p)))


def test_a_compressed_result_without_the_c_pass_is_decompressed_into_its_buffer(monkeypatch):
    g = torch.Generator().manual_seed(11)
    segs, _, r, a, params, out = _inputs(g, [300, 0, 45], 3)
    n, chunk, block = segs.numel, 352, 256
    rows = torch.zeros(1, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    native_p, native_m, untouched = [p.clone() for p in params], out.clone(), torch.full((n + 5,), 3.0)
    divide_descend_(CompressedResult(rows, chunk, block, untouched), r, native_m, segs, None,
                    Descend(native_p, a, 1.0, [1.0] * 3))
    assert torch.all(untouched == 3.0)  # (the C pass decompressed nothing into the buffer)
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    ref_p, ref_m, buffer = [p.clone() for p in params], out.clone(), torch.empty(n)
    divide_descend_(CompressedResult(rows, chunk, block, buffer), r, ref_m, segs, None,
                    Descend(ref_p, a, 1.0, [1.0] * 3))
    y = torch.empty(n)
    decompress_rows_(rows, y, chunk, block)
    assert torch.equal(buffer, y)
    torch.testing.assert_close(ref_m, native_m, rtol=2e-7, atol=0)
    for p, q in zip(ref_p, native_p):
        torch.testing.assert_close(p, q, rtol=2e-7, atol=1e-7)
    with pytest.raises(ValueError, match="rows of"):
        CompressedResult(rows[:, :10].contiguous(), chunk, block, torch.empty(n))
