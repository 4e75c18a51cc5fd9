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
