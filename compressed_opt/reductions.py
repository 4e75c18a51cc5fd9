"""Per-layer reductions, written once: each layer's norm or maximum, one fused call per dtype.

Norms accumulate in float64 whatever the tensors' dtype: fp32 squares of values below ~1e-19
underflow (a gradient of 1e-20 would read as 0), and half precision would lose more. The 2-norms
of contiguous fp32 CPU tensors are the square roots of the C pass's float64 sums of squares
(:func:`compressed_opt.cuda.sumsq_native_`, one read of each tensor): PyTorch's float64 norm of an
fp32 tensor took 4-8x as long at 4.5M elements and 68 ms at 16M, a fifth of a LAMB warmup step.
"""
from __future__ import annotations

import torch

from compressed_opt import cuda as kernels


def norms(tensors: list[torch.Tensor | None], order: int = 2, device=None, segments=None) -> torch.Tensor:
    """Per tensor, its ``order``-norm as float64 on ``device`` (default: the first tensor's; 0 for
    ``None`` or an empty tensor). ``segments``: the tensors' sizes as
    :class:`~compressed_opt.cuda.Segments` where the caller keeps them (a bucket's), else made here."""
    if device is None:
        device = next((t.device for t in tensors if t is not None), torch.device("cpu"))
    if order == 2 and device.type == "cpu" and tensors:
        sums = torch.empty(len(tensors), dtype=torch.float64)
        if segments is None:
            segments = kernels.Segments([0 if t is None else t.numel() for t in tensors])
        if kernels.sumsq_native_(list(tensors), segments, sums):
            return sums.sqrt_()
    out = torch.zeros(len(tensors), dtype=torch.float64, device=device)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is not None and t.numel():
            by_dtype.setdefault(t.dtype, []).append(i)
    for where in by_dtype.values():
        found = torch._foreach_norm([tensors[i] for i in where], order, dtype=torch.float64)
        out[where] = torch.stack(found).to(out)
    return out


def maxima(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each (non-empty) tensor's maximum; fused where torch has ``_foreach_max`` (2.4+)."""
    if hasattr(torch, "_foreach_max"):
        return list(torch._foreach_max(tensors))
    return [t.max() for t in tensors]
