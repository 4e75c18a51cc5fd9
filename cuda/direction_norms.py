"""Per-layer sums of squares of 1-bit LAMB's trust-ratio directions in one native pass (docs/design.md
2.4.1), where the composition formed each direction in a buffer first:

    sums[l] = sum over layer l of d^2,   d = wd p + (x / den) a_l     (den None: x a_l; params None: no p)

the composition being ``torch.div(x, den)``, ``torch._foreach_mul`` of its views by the scalars
``a_l``, ``torch._foreach_add_(direction, params, alpha=wd)`` and the native sums of squares
(:func:`compressed_opt.cuda.sumsq_each`'s order). The pass rounds each operation as those kernels
do (the add with alpha is one FMA in PyTorch's CPU kernels) and sums in the same order, so its sums
are the composition's bit for bit; a check at first use in the process compares the two on a small
case and refuses the pass where they differ. It reads ``x``, ``den`` and the parameters once and
writes nothing but the sums, where the composition also wrote and read the direction twice.
"""
from __future__ import annotations

import torch

from . import cpu, harness, reference
from .cpu import c_doubles, destination_addresses, plain_cpu_float
from .segments import Segments


def compose_direction_sumsq(x: torch.Tensor, den: torch.Tensor | None, scales: list[float], params: list | None,
                            wd: float, segments: Segments) -> torch.Tensor:
    """The composition (the module doc): the oracle of the check, and what runs elsewhere (the sums
    on ``x``'s device, as the norms it replaces)."""
    n = segments.numel
    q = x[:n] if den is None else torch.div(x[:n], den[:n])
    direction = torch._foreach_mul(segments.split(q), list(scales))
    if params is not None:
        torch._foreach_add_(direction, [p.detach().view(-1) for p in params], alpha=wd)
    out = torch.empty(len(segments), dtype=torch.float64, device=x.device)
    if x.is_cpu and cpu.library_allowed() and cpu.library() is not None:
        return cpu.sumsq_each(direction, segments, out)
    return reference.sumsq_each(direction, segments, out)


def direction_sumsq(x: torch.Tensor, den: torch.Tensor | None, scales: list[float], params: list | None,
                    wd: float, segments: Segments) -> torch.Tensor:
    """Per segment (layer), the float64 sum of squares of ``wd p + (x / den) a_l`` (the module doc):
    natively where the pass runs here (flat contiguous fp32 CPU ``x`` and ``den`` of the segments'
    elements, ``params`` each a plain fp32 CPU tensor of its segment's size), else composed; the same
    bits either way."""
    n = segments.numel
    if len(scales) != len(segments):
        raise ValueError(f"one scale per segment is needed ({len(segments)}), got {len(scales)}")
    flats = [x] if den is None else [x, den]
    lib = cpu.library() if cpu.library_allowed() else None
    if lib is not None and all(plain_cpu_float(t) and t.dim() == 1 and t.numel() >= n for t in flats):
        dests = None if params is None else destination_addresses(params, segments.sizes)
        if (params is None or dests is not None) and harness.agrees("direction_sumsq"):
            return _native(lib, x, den, scales, dests, wd, segments)
    return compose_direction_sumsq(x, den, scales, params, wd, segments)


def _native(lib, x, den, scales, dests, wd, segments: Segments) -> torch.Tensor:
    out = torch.empty(len(segments), dtype=torch.float64)
    _, a = c_doubles(scales, len(segments))
    lib.co_direction_sumsq(x.data_ptr(), None if den is None else den.data_ptr(), a,
                           None if dests is None else dests.data_ptr(), float(wd), segments.offsets.data_ptr(),
                           len(segments), out.data_ptr())
    return out


def _check(seed: int, divided: bool, decayed: bool, native: bool):
    """The harness's case: the pass against its composition."""
    lib = cpu.library()
    if lib is None:
        return None
    g = torch.Generator().manual_seed(seed)
    segments = Segments([37, 0, 1000, 5, 8, 64, 1, 17])
    n = segments.numel
    x = torch.randn(n, generator=g) * 3
    x[::11] = 0.0
    den = torch.rand(n, generator=g) + 1e-4 if divided else None
    params = [torch.randn(k, generator=g) for k in segments.sizes] if decayed else None
    scales = [0.37 * (i + 1) for i in range(len(segments))]
    dests = None if params is None else destination_addresses(params, segments.sizes)
    if native:
        return _native(lib, x, den, scales, dests, 0.01, segments)
    return compose_direction_sumsq(x, den, scales, params, 0.01, segments)


harness.register("direction_sumsq", harness.Check(((41, False, True), (42, True, True), (43, True, False)), _check))
