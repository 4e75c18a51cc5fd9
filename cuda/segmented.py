"""The segmented element-wise passes, checked: one pass over a flat fp32 buffer made of segments,
each with scalars of its own (docs/design.md 2.3.1, 2.3.2), for any caller.

A :class:`~compressed_opt.cuda.segments.Segments` is the partition of a flat buffer into
consecutive segments (for the optimizers: a bucket's parameters). The passes fuse what would
otherwise be one PyTorch call per operation and per segment:

``gather_(sources, out, segments, scale=None, sumsq_out=None)``
    segment ``s`` of ``out`` <- ``sources[s] * scale`` (zeros where ``None``); with ``sumsq_out``,
    the segments' sums of squares of what was written, in the same pass.
``segment_sumsq(x, segments, out)``
    ``out[s] = sum_{k in s} x_k^2``, accumulated in float64 (squares of gradients below ~1e-19
    underflow in fp32).
``lerp_scale_clamp_(x, m, weight, r, bounds, segments, scales=None)``
    ``x <- clamp(c_s * r * lerp(m, x, weight), -b_s, b_s)`` element-wise, ``b_s = bounds[s]``,
    ``c_s = scales[s]`` (1 without ``scales``).
``scale_clamp_(x, r, bounds, segments)``
    ``x <- clamp(r * x, -b_s, b_s)``.
``divide_where_nonzero_(y, r, out, zero_index=None, segments=None, divisors=None)``
    ``out <- y / r``, 0 where ``r == 0`` (``out`` may be ``y``); with ``segments`` and
    ``divisors``, then divided by ``divisors[s]`` on segment ``s``.
``lerp_scale_clamp(x, m, weight, r, bounds, segments, scales=None, sources=None)``
    the pass of ``lerp_scale_clamp_`` on ``x``, not run yet, for a compression to run inside its
    worker side (``compress_rows_(x, error, rows, chunk, block)``, one pass over memory that never
    writes ``x``, bit for bit as the two in turn) where it can; ``apply_()`` runs it alone. With
    ``sources`` (one tensor per segment: the gradients), ``x`` is ``gather_(sources, x, segments)``
    not run yet either. ``scale_clamp(x, r, bounds, segments, sources=None)`` and ``lerp(x, m,
    weight, sources=None, segments=None)`` (``torch.lerp(m, x, weight, out=x)``) the same.

Each checks its arguments, then runs the C pass (:mod:`~compressed_opt.cuda.cpu`) on contiguous
fp32 CPU tensors where the library is here and allowed, else the PyTorch composition
(:mod:`~compressed_opt.cuda.reference`); both compute in fp32 like PyTorch (the sums in float64),
and may differ in the last bit where the C pass contracts ``a + w * b`` into one FMA. A bucket's
step runs the same passes unchecked, bound once (:func:`compressed_opt.cuda.registry.kernels_for`).
"""
from __future__ import annotations

import torch

from . import cpu, reference
from .registry import kernels_for
from .segments import Segments, check, doubles


def gather_(sources: list, out: torch.Tensor, segments: Segments, scale: float | None = None,
            sumsq_out: torch.Tensor | None = None) -> None:
    """Segment ``s`` of ``out`` <- ``sources[s]`` (times ``scale``; zeros where ``None``), and with
    ``sumsq_out`` (float64) the per-segment sums of squares of what was written, in one pass."""
    if len(sources) != len(segments):
        raise ValueError(f"one source per segment is needed ({len(segments)}), got {len(sources)}")
    check(segments, out)
    if sumsq_out is not None and (sumsq_out.shape != (len(segments),) or sumsq_out.dtype != torch.float64):
        raise ValueError(f"sumsq_out must be float64 of shape ({len(segments)},)")
    plain = cpu.native(out) and (sumsq_out is None or (sumsq_out.is_cpu and sumsq_out.is_contiguous()))
    if plain:
        cpu.source_addresses(sources, segments.sizes)  # (the sizes checked, whichever pass runs)
    (cpu if plain else reference).gather_(sources, out, segments, scale, sumsq_out)


def segment_sumsq(x: torch.Tensor, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """``out[s]`` <- the sum of squares of segment ``s`` of ``x`` (``out``: float64, on ``x``'s device)."""
    check(segments, x)
    if out.shape != (len(segments),) or out.dtype != torch.float64:
        raise ValueError(f"out must be float64 of shape ({len(segments)},)")
    plain = cpu.native(x) and out.device.type == "cpu" and out.is_contiguous()
    return (cpu if plain else reference).segment_sumsq(x, segments, out)


def sumsq_each(sources: list, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """``out[s]`` <- the sum of squares of ``sources[s]`` (``segments.sizes[s]`` elements; 0 for
    ``None``), in float64 (``out``, on their device): natively as :func:`gather_` sums, else
    PyTorch's float64 norm (which may differ in the last bit)."""
    if len(sources) != len(segments):
        raise ValueError(f"one source per segment is needed ({len(segments)}), got {len(sources)}")
    if out.shape != (len(segments),) or out.dtype != torch.float64:
        raise ValueError(f"out must be float64 of shape ({len(segments)},)")
    plain = out.is_cpu and out.is_contiguous() and cpu.library_allowed() and cpu.library() is not None
    if plain:
        cpu.source_addresses(sources, segments.sizes)  # (the sizes checked)
    return (cpu if plain else reference).sumsq_each(sources, segments, out)


def sumsq_native_(sources: list, segments: Segments, out: torch.Tensor) -> bool:
    """:func:`sumsq_each`'s C pass alone: ``True`` where it ran (contiguous fp32 CPU sources, the
    library here and allowed), else ``False`` with nothing done."""
    if len(sources) != len(segments):
        raise ValueError(f"one source per segment is needed ({len(segments)}), got {len(sources)}")
    if out.shape != (len(segments),) or out.dtype != torch.float64:
        raise ValueError(f"out must be float64 of shape ({len(segments)},)")
    if not (out.is_cpu and out.is_contiguous() and cpu.library_allowed() and cpu.library() is not None
            and cpu.plain_cpu_floats(sources)):
        return False
    cpu.source_addresses(sources, segments.sizes)  # (the sizes checked)
    cpu.sumsq_each(sources, segments, out)
    return True


def lerp_scale_clamp_(x: torch.Tensor, m: torch.Tensor, weight: float, r: torch.Tensor, bounds,
                      segments: Segments, scales=None) -> None:
    """``x`` <- ``clamp(c_s * (r * lerp(m, x, weight)), -bounds[s], bounds[s])`` on each segment
    ``s`` (``c_s = scales[s]``; 1, exactly the unscaled result, without ``scales``)."""
    check(segments, x, m, r)
    doubles(bounds, len(segments))
    if scales is not None:
        doubles(scales, len(segments))
    (cpu if cpu.native(x, m, r) else reference).lerp_scale_clamp_(x, m, weight, r, bounds, segments, scales)


def scale_clamp_(x: torch.Tensor, r: torch.Tensor, bounds, segments: Segments) -> None:
    """``x`` <- ``clamp(r * x, -bounds[s], bounds[s])`` on each segment ``s``."""
    check(segments, x, r)
    doubles(bounds, len(segments))
    (cpu if cpu.native(x, r) else reference).scale_clamp_(x, r, bounds, segments)


def divide_where_nonzero_(y: torch.Tensor, r: torch.Tensor, out: torch.Tensor,
                          zero_index: torch.Tensor | None = None, segments: Segments | None = None,
                          divisors=None) -> None:
    """``out`` <- ``y / r``, 0 where ``r == 0`` (``out`` may be ``y``; all three the same shape).
    ``zero_index``: where known, the indices of ``r``'s zeros (1-D int64), which spares the
    composed path a mask pass; the native pass needs none. ``segments`` and ``divisors``: then
    ``out`` divided by ``divisors[s]`` on each segment ``s``, in the same pass (only the segments'
    elements are written then)."""
    if not (y.shape == r.shape == out.shape):
        shapes = ", ".join(str(tuple(t.shape)) for t in (y, r, out))
        raise ValueError(f"y, r and out must have one shape, got {shapes}")
    if (segments is None) != (divisors is None):
        raise ValueError("segments and divisors go together")
    if segments is not None:
        check(segments, y)
        doubles(divisors, len(segments))
    impl = cpu if cpu.native(y, r, out) else reference
    impl.divide_where_nonzero_(y, r, out, zero_index, segments, divisors)


# --- the updates from an exchange's result -----------------------------------------------------------
def _update_impl(dests: list, segments: Segments, *flats: torch.Tensor):
    """The kernels of the flat buffers' device (the C passes only where every buffer is theirs)."""
    if len(dests) != len(segments):
        raise ValueError(f"one destination per segment is needed ({len(segments)}), got {len(dests)}")
    check(segments, *flats)
    if all(t.is_cpu for t in flats) and not cpu.native(*flats):
        return reference
    return kernels_for(flats[0].device)


def divide_descend_(y, r: torch.Tensor, out: torch.Tensor, segments: Segments, divisors,
                    descend: reference.Descend, zero_index: torch.Tensor | None = None) -> None:
    """The preconditioned exchange's last pass (:func:`compressed_opt.cuda.reference.divide_descend_`):
    ``out <- y / r`` (0 where ``r == 0``; then ``/ divisors[s]`` on segment ``s`` unless ``divisors``
    is ``None``), the momentum, and ``descend``'s update ``dests[s] <- dests[s] * decay + alpha (y /
    (r eps + c_s)) f_s`` with the same ``y``, in one pass over memory where the C pass runs (``y``
    read from its rows where it is a :class:`~compressed_opt.cuda.rows.CompressedResult`), bit for
    bit the two passes. ``out`` not ``y``; ``y`` overwritten where the two passes run."""
    flat = isinstance(y, torch.Tensor)
    impl = _update_impl(descend.dests, segments, r, out, *((y,) if flat else ()))
    if not flat and y.rows.shape[0] * y.chunk < segments.numel:
        raise ValueError(f"{y.rows.shape[0]} rows of {y.chunk} elements for {segments.numel} elements")
    for values in (descend.coeffs, descend.factors, *(() if divisors is None else (divisors,))):
        doubles(values, len(segments))
    impl.divide_descend_(y, r, out, segments, divisors, descend, zero_index)


def keep_descend_(y, den: torch.Tensor, m: torch.Tensor | None, factors, dests: list, segments: Segments,
                  decay: float, alpha: float) -> None:
    """The momentum exchange's update (:func:`compressed_opt.cuda.reference.keep_descend_`): ``m <-
    y``, ``dests[s] <- dests[s] * decay + alpha (y / den) f_s``, in one pass from the result's 1-bit
    rows where the C pass runs, bit for bit the composition."""
    impl = _update_impl(dests, segments, den, *(() if m is None else (m,)))
    if not isinstance(y, torch.Tensor) and y.rows.shape[0] * y.chunk < segments.numel:
        raise ValueError(f"{y.rows.shape[0]} rows of {y.chunk} elements for {segments.numel} elements")
    if factors is not None:
        doubles(factors, len(segments))
    impl.keep_descend_(y, den, m, factors, dests, segments, decay, alpha)


# --- passes not run yet, for a compression (compressed_opt.comm.Producer) ------------------------------
def _sources_checked(sources, segments: Segments) -> None:
    if sources is not None and (len(sources) != len(segments) or any(s is None for s in sources)):
        raise ValueError(f"one source tensor per segment is needed ({len(segments)})")


def _serving(name: str, x: torch.Tensor, *tensors: torch.Tensor) -> type:
    """The class of pass ``name`` that serves ``x``'s device: the C or CUDA one where the tensors
    are that implementation's, else the reference's (whose compression declines)."""
    if x.device.type == "cpu" and not cpu.native(x, *tensors):
        return getattr(reference, name)
    return getattr(kernels_for(x.device), name)


def lerp_scale_clamp(x: torch.Tensor, m: torch.Tensor, weight: float, r: torch.Tensor, bounds, segments: Segments,
                     scales=None, sources: list | None = None) -> reference.LerpScaleClamp:
    """:func:`lerp_scale_clamp_` on ``x``, not run yet (the module doc): a pass whose result only a
    compression reads (the local momentum of the preconditioned exchange) runs inside that
    compression and never travels to memory. The arguments are kept, not copied."""
    check(segments, x, m, r)
    _sources_checked(sources, segments)
    return _serving("LerpScaleClamp", x, m, r)(x, m, float(weight), r, bounds, segments, scales, sources)


def scale_clamp(x: torch.Tensor, r: torch.Tensor, bounds, segments: Segments,
                sources: list | None = None) -> reference.ScaleClamp:
    """:func:`scale_clamp_` on ``x``, not run yet (0/1 Adam's exchanged ``R x``, bounded), as
    :func:`lerp_scale_clamp`."""
    check(segments, x, r)
    _sources_checked(sources, segments)
    return _serving("ScaleClamp", x, r)(x, r, bounds, segments, sources)


def lerp(x: torch.Tensor, m: torch.Tensor, weight: float, sources: list | None = None,
         segments: Segments | None = None) -> reference.Lerp:
    """``torch.lerp(m, x, weight, out=x)`` not run yet (the momentum exchange's local momentum), as
    :func:`lerp_scale_clamp`; ``x`` and ``m`` flat, of one size; ``sources`` need ``segments`` that
    cover ``x``. The fused C pass runs only where the harness found it rounding as ``torch.lerp``."""
    if x.dim() != 1 or x.shape != m.shape:
        raise ValueError(f"x and m must be flat buffers of one size, got {tuple(x.shape)} and {tuple(m.shape)}")
    if sources is not None and (segments is None or segments.numel != x.numel() or len(sources) != len(segments)
                                or any(s is None for s in sources)):
        raise ValueError(f"sources need segments that cover x ({x.numel()} elements) and one tensor per segment")
    return _serving("Lerp", x, m)(x, m, float(weight), segments or Segments([x.numel()]), sources)
