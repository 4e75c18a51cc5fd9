"""The preconditioned exchange's last pass (compressed_opt.cuda.update): the momentum taken back
from the exchanged average and the update, in one pass, bit for bit as the two passes in turn."""
import pytest
import torch

from compressed_opt.cuda import Descend, Segments, cpu, descend_scaled_, divide_descend_, divide_where_nonzero_

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
