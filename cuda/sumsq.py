"""Per-tensor sums of squares in float64, accumulated as the gather's (:func:`gather_`'s
``sumsq_out``), each tensor read once where it is: PyTorch's float64 norm of an fp32 tensor
would first copy it to float64. Float64 keeps the squares of gradients down to 1e-160
representable, where fp32 ones would underflow.
"""
from __future__ import annotations

import torch

from . import cpu
from .addresses import plain_cpu_floats, source_addresses
from .segmented import Segments, _library_allowed


def sumsq_native_(sources: list, segments: Segments, out: torch.Tensor) -> bool:
    """:func:`sumsq_each`'s C pass alone: ``True`` where it ran (contiguous fp32 CPU sources, the
    library here and allowed), else ``False`` with nothing done."""
    if len(sources) != len(segments):
        raise ValueError(f"one source per segment is needed ({len(segments)}), got {len(sources)}")
    if out.shape != (len(segments),) or out.dtype != torch.float64:
        raise ValueError(f"out must be float64 of shape ({len(segments)},)")
    lib = cpu.library() if out.is_cpu and out.is_contiguous() and _library_allowed() else None
    if lib is None or not plain_cpu_floats(sources):
        return False
    addresses = source_addresses(sources, segments.sizes)
    lib.co_sumsq_each(addresses.data_ptr(), segments.offsets.data_ptr(), len(segments), out.data_ptr())
    return True


def sumsq_each(sources: list, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """``out[s]`` <- the sum of squares of ``sources[s]`` (``segments.sizes[s]`` elements; 0 for
    ``None``), in float64 (``out``, on their device): natively as :func:`gather_` sums, else
    PyTorch's float64 norm (which may differ in the last bit)."""
    if sumsq_native_(sources, segments, out):
        return out
    out.zero_()
    have = [i for i, src in enumerate(sources) if src is not None and src.numel()]
    if have:
        norms = torch._foreach_norm([sources[i] for i in have], 2, dtype=torch.float64)
        out[have] = torch.stack(norms).to(out).square_()
    return out
