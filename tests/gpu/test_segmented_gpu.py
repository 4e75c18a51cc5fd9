"""The segmented passes (compressed_opt.cuda.segmented) on CUDA tensors (PyTorch's multi-tensor
ops) against the same passes on the CPU. Skips where there is no CUDA device."""
from __future__ import annotations

import pytest
import torch

from compressed_opt.cuda import segmented
from compressed_opt.cuda.segmented import Segments

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

SIZES = [[5, 0, 17, 1, 64, 3], [1 << 20, 7, 0, 33_333], [1] * 2000]


def _inputs(sizes, seed):
    g = torch.Generator().manual_seed(seed)
    segs = Segments(sizes)
    n = segs.numel + 3
    x, m, a = (torch.randn(n, generator=g) for _ in range(3))
    r = torch.rand(n, generator=g) * 3
    r[::5] = 0.0
    per_segment = (torch.rand(len(segs), generator=g) + 0.25).tolist()
    return segs, x, m, a, r, per_segment


@pytest.mark.parametrize("sizes", SIZES)
def test_passes_agree_with_the_cpu(sizes):
    segs, x, m, a, r, per_segment = _inputs(sizes, 0)
    results = {}
    for device in ("cpu", "cuda"):
        x_, m_, a_, r_ = (t.to(device) for t in (x, m, a, r))
        out = torch.empty(len(segs), dtype=torch.float64, device=device)
        segmented.segment_sumsq(x_, segs, out)
        scaled = x_.clone()
        segmented.lerp_scale_clamp_(scaled, m_, 0.1, r_, per_segment, segs, per_segment[::-1])
        segmented.lerp_scale_clamp_(x_, m_, 0.1, r_, per_segment, segs)
        y = x_.clone()
        segmented.scale_clamp_(y, r_, per_segment, segs)
        q = torch.zeros_like(x_)
        segmented.divide_where_nonzero_(x_ * a_, r_, q)
        q2 = torch.zeros_like(x_)
        segmented.divide_where_nonzero_(x_ * a_, r_, q2, None, segs, per_segment)
        results[device] = [t.cpu() for t in (out, x_, y, q, scaled, q2)]
    for c, g in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(g, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", SIZES + [[1025, 1023, 4096, 7]])
@pytest.mark.parametrize("weight,scaled", [(0.1, True), (0.1, False), (0.9, True), (0.5, False)])
@pytest.mark.parametrize("world,block", [(1, 1024), (3, 256)])
def test_local_momentum_fused_into_compression_is_bit_identical(sizes, weight, scaled, world, block):
    """The CUDA kernel that forms the local momentum inside the compression (the pass the factories
    give on CUDA, ``gpu.LerpScaleClamp``, ``gpu.ScaleClamp``, ``gpu.Lerp``: bound where the harness's
    check found the kernel giving PyTorch's bits) against that pass (PyTorch's ops on CUDA) then the
    CUDA compression: the same error and rows bit for bit; ``x`` not written. Against the CPU's fused
    pass: the same bits of the rows where the errors agree."""
    from compressed_opt.cuda import cpu, gpu, rows_layout

    if not gpu.is_available():
        pytest.skip("the CuPy kernels cannot run here")
    segs, x, m, _, r, per_segment = _inputs(sizes, 3)
    x[::9], x[4::13] = 0.0, -0.0
    g = torch.Generator().manual_seed(4)
    error = torch.randn(x.numel(), generator=g) * 0.1
    scales = per_segment[::-1] if scaled else None
    n = x.numel()
    per_rank = -(-n // world)
    chunk = -(-per_rank // 32) * 32
    _, row_len = rows_layout(chunk, block)
    results = {}
    for fused in (False, True):
        x_, m_, r_, e_ = (t.to("cuda") for t in (x, m, r, error))
        rows = torch.zeros(world, row_len + 5, dtype=torch.uint8, device="cuda")
        pending = segmented.lerp_scale_clamp(x_, m_, weight, r_, per_segment, segs, scales)
        if weight == 0.5 and not scaled:  # (this case: 0/1 Adam's scale_clamp_ instead)
            pending = segmented.scale_clamp(x_, r_, per_segment, segs)
        if weight == 0.1 and not scaled:  # (this case: the momentum exchange's torch.lerp instead)
            pending = segmented.lerp(x_, m_, 0.1)
        if fused:
            assert pending.compress_rows_(x_, e_, rows[:, :row_len], chunk, block)
            assert torch.equal(x_.cpu(), x)
        else:
            pending.apply_()
            gpu.compress_rows_(x_, e_, rows[:, :row_len], chunk, block)
        torch.cuda.synchronize()
        results[fused] = (e_.cpu(), rows.cpu())
    assert torch.equal(results[True][0].view(torch.int32), results[False][0].view(torch.int32))
    assert torch.equal(results[True][1], results[False][1])
    if cpu.library() is not None and scaled:  # the CPU's fused pass (it may round
        # a lerp otherwise, by an ulp: the errors within rounding)
        e_cpu, rows_cpu = error.clone(), torch.zeros(world, row_len, dtype=torch.uint8)
        assert segmented.lerp_scale_clamp(x.clone(), m, weight, r, per_segment, segs, scales).compress_rows_(
            x.clone(), e_cpu, rows_cpu, chunk, block) is False  # (another buffer: refused)
        xc = x.clone()
        assert segmented.lerp_scale_clamp(xc, m, weight, r, per_segment, segs, scales).compress_rows_(
            xc, e_cpu, rows_cpu, chunk, block)
        torch.testing.assert_close(e_cpu, results[True][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("sizes", SIZES)
def test_direction_sums_stay_on_the_device_and_agree_with_the_cpu(sizes):
    """1-bit LAMB's trust-ratio direction sums (``direction_sumsq``, composed on CUDA): on the
    tensors' device, where the norms they replaced were, and the CPU pass's within rounding."""
    from compressed_opt.cuda import direction_sumsq

    segs, x, m, a, r, per_segment = _inputs(sizes, 1)
    den = r + 0.5
    params = [torch.randn(k) for k in segs.sizes]
    cpu_sums = direction_sumsq(x, den, per_segment, params, 0.01, segs)
    gpu_sums = direction_sumsq(x.cuda(), den.cuda(), per_segment, [p.cuda() for p in params], 0.01, segs)
    assert gpu_sums.device.type == "cuda"
    torch.testing.assert_close(gpu_sums.cpu(), cpu_sums, rtol=1e-9, atol=0)
