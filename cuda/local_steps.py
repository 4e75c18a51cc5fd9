"""0/1 Adam's passes (docs/design.md 2.5): phase B's local step and the work before and after a
synchronisation's exchange, and phase A's compressed step after its exchange, each one pass over a
bucket's flat buffers (C on CPU).

Segment ``s`` of the flat fp32 buffers is parameter ``s`` (:class:`~compressed_opt.cuda.Segments`);
``params[s]`` is that parameter, written through its own memory. ``sden`` is the frozen
denominator ``sqrt(v) + eps`` with its sign bit set where ``v == 0`` (:func:`signed_denominator`):
``den = |sden|``, and a negative ``sden`` marks a coordinate without variance, one stream for both.
Per element of segment ``s``:

``zero_one_local_step_(params, g, m, sden, acc, segments, weight, lr, decay, steps)``
    ``m <- lerp(m, g, weight)`` (0 where ``v == 0``); ``acc <- acc + (lr m) / den``;
    ``p <- p decay + (steps[s] m) / den`` (no multiplication where ``decay`` is 1).
``zero_one_sync_before_(params, g, m, sden, acc, segments, weight, lr, scales=None)``
    ``m`` as above; ``acc <- ((acc + (lr m) / den) den) scales[s]`` (what the exchange averages:
    ``sum lr m``, times the layer's coefficient with ``scales``).
``ZeroOneSyncBefore(g, m, sden, acc, segments, weight, lr, scales=None, r=None, bounds=None)``
    that pass, then (with ``r``) the exchange's ``clamp(r acc, -bounds[s], bounds[s])``, not run
    yet: the exchange's compression runs both inside its worker side (``compress_rows_``, one pass
    over memory; ``acc`` read, not written), bit for bit as the passes then the compression.
``zero_one_sync_after_(params, y, sden, m, anchor, segments, lr_sum, decay, steps, r=None, divisors=None)``
    ``y <- y / r / divisors[s]`` (each where given), 0 where ``v == 0``; ``m <- y / lr_sum``;
    ``anchor <- anchor decay + (steps[s] y) / den``; ``p <- anchor``; ``y <- 0``. ``y`` may be
    the exchange's result as its 1-bit rows (a :class:`~compressed_opt.cuda.CompressedResult`
    whose buffer is the accumulator): they are then decompressed tile by tile inside the pass
    and the accumulator only written (``<- 0``), bit for bit as decompressing them into it first.
    ``m`` and the parameters are only written: the C passes store them
    without reading them for ownership (non-temporal stores where the CPU has AVX2).
``zero_one_phase_a_update_(params, result, r, sden, m, segments, weight, decay, alpha)``
    phase A: ``g = y / r`` (0 where ``v == 0``); ``m`` as above from ``g``; ``p <- p decay + alpha m /
    den``, from the result's 1-bit rows (``sden``: phase A's denominator, fixed between refreshes).

Elements past the segments (up to the buffers' size) get what has no per-segment scalar (``m``,
``acc``, ``anchor decay``; no parameter, no step), as the PyTorch composition treats them.

Each returns ``True`` when it ran, ``False`` (nothing done) where the C library does not serve:
not contiguous fp32 CPU tensors (parameters included), no library, or
``COMPRESSED_OPT_KERNELS=reference``; the caller then runs its PyTorch composition
(:mod:`compressed_opt.zero_one_local`). Rounding: every operation rounded on its own in that
composition's order (no FMA contraction), the denominator PyTorch's own (``torch.sqrt`` is not
correctly rounded on every build), and the lerp as torch's vector kernel computes it on CPUs with
FMA (``fma(w, g - m, m)``; for ``|w| >= 1/2`` ``fma(w - 1, g - m, g)``): bit for bit the
composition wherever torch's CPU kernels use FMA (``torch.backends.cpu.get_cpu_capability()``
AVX2, AVX512; ``tests/test_local_steps.py`` checks it). Elsewhere (a torch whose lerp does not
contract) only ``m`` may differ from the composition, in the lerp's rounding: the pass's ``m`` is
within ``ulp(m) / 2 + |c| ulp(g - m) / 2`` of the exact lerp of the fp32 inputs (``c`` the
formula's coefficient, ``w`` or ``w - 1``; tested against float64), and every other value is the
composition's arithmetic on that ``m``.
"""
from __future__ import annotations

import torch

from .cpu import c_doubles, destination_addresses, native, readable_in_place, source_addresses
from .rows import CompressedResult
from .segmented import gather_, scale_clamp_
from .segments import Segments, check


def _flat_buffers(segments: Segments, *tensors: torch.Tensor) -> int:
    check(segments, *tensors)
    n = tensors[0].numel()
    if any(t.numel() != n for t in tensors):
        raise ValueError(f"flat buffers of one size are needed, got {[t.numel() for t in tensors]}")
    return n


def zero_one_passes_serve(params: list, segments: Segments, *tensors: torch.Tensor) -> bool:
    """Whether the passes run here on these parameters and flat buffers (contiguous fp32 CPU tensors,
    the C library allowed and loaded)."""
    return native(*tensors) is not None and destination_addresses(params, segments.sizes) is not None


def signed_denominator(v: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
    """``denom`` (``sqrt(v) + eps``, made by PyTorch) negated where ``v == 0``, in place: the passes'
    ``sden``. Made once while ``v`` is frozen."""
    zero = v == 0
    denom[zero] = denom[zero].neg_()
    return denom


def _sources(sources, segments: Segments):
    """``(what keeps them alive, their addresses)`` of the gradients a pass reads where they lie
    (``sources``: one tensor per segment, or ``None``: the flat ``g``), or ``None`` where the C
    passes cannot read them (the caller gathers them into ``g``)."""
    if sources is None:
        return (None, None)
    if not readable_in_place(sources):
        return None
    addresses = source_addresses(sources, segments.sizes)
    return addresses, addresses.data_ptr()


def zero_one_local_step_(params: list, g: torch.Tensor, m: torch.Tensor, sden: torch.Tensor, acc: torch.Tensor,
                         segments: Segments, weight: float, lr: float, decay: float, steps, sources=None) -> bool:
    """A phase-B local step in one pass (see the module doc): ``m``, ``acc`` and the parameters.
    ``steps[s]`` is ``-lr f_s`` (the step's scalar of segment ``s``). ``sources``: the gradients
    where they lie, one per segment, in place of ``g``'s segments (not gathered into it)."""
    n = _flat_buffers(segments, g, m, sden, acc)
    lib = native(g, m, sden, acc)
    dests = destination_addresses(params, segments.sizes)
    srcs = _sources(sources, segments)
    if lib is None or dests is None or srcs is None:
        return False
    c, cp = c_doubles(steps, len(segments))
    lib.co_zo_local_step(dests.data_ptr(), g.data_ptr(), srcs[1], m.data_ptr(), sden.data_ptr(), acc.data_ptr(),
                         segments.offsets.data_ptr(), len(segments), n, float(weight), float(lr), float(decay),
                         decay != 1.0, cp)
    return True


def zero_one_sync_before_(params: list, g: torch.Tensor, m: torch.Tensor, sden: torch.Tensor, acc: torch.Tensor,
                          segments: Segments, weight: float, lr: float, scales=None, sources=None) -> bool:
    """A synchronising step's pass before its exchange (see the module doc): ``m``, and ``acc``
    becomes what the exchange averages. ``scales``: per segment (``None``: none). ``params`` are
    only checked: ``False`` (nothing done) where :func:`zero_one_sync_after_` could not write them.
    ``sources``: as for :func:`zero_one_local_step_`."""
    _flat_buffers(segments, g, m, sden, acc)
    lib = native(g, m, sden, acc)
    if destination_addresses(params, segments.sizes) is None or lib is None or _sources(sources, segments) is None:
        return False
    _sync_before(lib, g, m, sden, acc, segments, weight, lr, scales, sources)
    return True


def _sync_before(lib, g, m, sden, acc, segments: Segments, weight: float, lr: float, scales, sources=None) -> None:
    c, cp = (None, None) if scales is None else c_doubles(scales, len(segments))
    srcs = _sources(sources, segments)
    if srcs is None:  # (not readable where they lie: gathered)
        gather_(sources, g, segments)
        srcs = (None, None)
    lib.co_zo_sync_before(g.data_ptr(), srcs[1], m.data_ptr(), sden.data_ptr(), acc.data_ptr(),
                          segments.offsets.data_ptr(), len(segments), acc.numel(), float(weight), float(lr), cp)


def zero_one_sync_after_(params: list, y, sden: torch.Tensor, m: torch.Tensor, anchor: torch.Tensor,
                         segments: Segments, lr_sum: float, decay: float, steps, r: torch.Tensor | None = None,
                         divisors=None) -> bool:
    """A synchronising step's pass after its exchange (``y``: its result; see the module doc):
    ``m``, ``anchor``, the parameters, and ``y <- 0``. ``steps[s]`` is ``-f_s``; ``r``: the
    element-wise divisor of the preconditioned exchange; ``divisors``: per segment.

    ``y`` may be a :class:`~compressed_opt.cuda.CompressedResult`, the result as the 1-bit rows it
    travelled as, whose ``buffer`` is the accumulator: the pass then decompresses the rows tile by
    tile into the stack (``co_zo_sync_after_rows``; ``y`` never travels to memory) and writes the
    buffer's ``+0`` without reading it, bit for bit as decompressing them into the buffer then the
    pass on it."""
    compressed = isinstance(y, CompressedResult)
    acc = y.buffer if compressed else y
    n = _flat_buffers(segments, acc, sden, m, anchor, *(() if r is None else (r,)))
    if compressed and y.rows.shape[0] * y.chunk < n:
        raise ValueError(f"{y.rows.shape[0]} rows of {y.chunk} elements for {n} elements")
    lib = native(acc, sden, m, anchor, *(() if r is None else (r,)))
    dests = destination_addresses(params, segments.sizes)
    if lib is None or dests is None or (compressed and not y.rows.is_cpu):
        return False
    c, cp = c_doubles(steps, len(segments))
    d, dp = (None, None) if divisors is None else c_doubles(divisors, len(segments))
    rp = None if r is None else r.data_ptr()
    tail = (sden.data_ptr(), m.data_ptr(), anchor.data_ptr(), segments.offsets.data_ptr(), len(segments), n,
            float(lr_sum), float(decay), decay != 1.0, dp, cp)
    if compressed:
        lib.co_zo_sync_after_rows(dests.data_ptr(), y.rows.data_ptr(), y.rows.stride(0), y.chunk, y.block,
                                  acc.data_ptr(), rp, *tail)
    else:
        lib.co_zo_sync_after(dests.data_ptr(), acc.data_ptr(), rp, *tail)
    return True


def zero_one_phase_a_update_(params: list, result: CompressedResult, r: torch.Tensor, sden: torch.Tensor,
                             m: torch.Tensor, segments: Segments, weight: float, decay: float, alpha: float) -> bool:
    """Phase A's compressed step after its preconditioned exchange, in one pass from the result's
    1-bit rows (decompressed tile by tile into the stack: ``y`` never travels to memory; the
    gradient buffer is neither read nor written): per element of segment ``s``, ``g = y / r`` (0
    where ``v == 0``); ``m <- lerp(m, g, weight)`` (0 where ``v == 0``); ``p <- p decay + alpha m /
    den`` (no multiplication where ``decay`` is 1). ``sden``: phase A's denominator ``sqrt(v) /
    bc2_sqrt + eps`` as PyTorch made it (fixed between refreshes), its sign bit set where ``v ==
    0`` (:func:`signed_denominator`). Bit for bit (the module doc's rounding) the decompression,
    ``y / r``, the zeroing, ``m.lerp_(g, weight)``, the zeroing and ``m / den`` then
    :func:`~compressed_opt.adam.descend_` on the parameters. ``False``, nothing done, where it
    cannot run here."""
    n = _flat_buffers(segments, r, sden, m)
    if not result.rows.is_cpu or result.rows.shape[0] * result.chunk < n:
        return False
    lib = native(r, sden, m)
    dests = destination_addresses(params, segments.sizes)
    if lib is None or dests is None:
        return False
    lib.co_zo_phase_a_rows(dests.data_ptr(), result.rows.data_ptr(), result.rows.stride(0), result.chunk, result.block,
                           r.data_ptr(), sden.data_ptr(), m.data_ptr(), segments.offsets.data_ptr(), len(segments),
                           float(weight), float(decay), decay != 1.0, float(alpha))
    return True


class ZeroOneSyncBefore:
    """:func:`zero_one_sync_before_` then, with ``r``, the exchange's ``scale_clamp_(acc, r, bounds,
    segments)``, not run yet: the pending pass of a synchronisation's exchange (as
    :class:`~compressed_opt.cuda.reference.LerpScaleClamp`). Its :meth:`compress_rows_` runs both inside the
    worker side of the compression of ``acc`` (one pass over memory, ``acc`` read and not written,
    ``m`` written), bit for bit as :meth:`apply_` then the compression; :meth:`apply_` runs them
    alone. Made only where :func:`zero_one_passes_serve` (the caller checks); the arguments are
    kept, not copied."""

    def __init__(self, g: torch.Tensor, m: torch.Tensor, sden: torch.Tensor, acc: torch.Tensor, segments: Segments,
                 weight: float, lr: float, scales=None, r: torch.Tensor | None = None, bounds=None, sources=None):
        _flat_buffers(segments, g, m, sden, acc, *(() if r is None else (r,)))
        if (r is None) != (bounds is None):
            raise ValueError("r and bounds go together")
        self.g, self.m, self.sden, self.acc, self.segments = g, m, sden, acc, segments
        self.weight, self.lr, self.scales, self.r, self.bounds = float(weight), float(lr), scales, r, bounds
        self.sources = sources  # (the gradients where they lie, in place of g's segments)

    def apply_(self) -> None:
        """The passes on ``acc``, alone (the C passes, or where they cannot run, which the caller
        has excluded, a ``RuntimeError``)."""
        lib = native(self.g, self.m, self.sden, self.acc)
        if lib is None:
            raise RuntimeError("0/1 Adam's pass before the exchange cannot run here")
        _sync_before(lib, self.g, self.m, self.sden, self.acc, self.segments, self.weight, self.lr, self.scales,
                     self.sources)
        if self.r is not None:
            scale_clamp_(self.acc, self.r, self.bounds, self.segments)

    def compress_rows_(self, x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, chunk: int, block: int) -> bool:
        """The passes, then ``compress_rows_(x, error, rows, chunk, block)`` (:mod:`compressed_opt.cuda`),
        in one native pass: ``x`` (this pass's ``acc``) read, not written. ``False``, with nothing
        done, where it does not run here (another buffer, or not the whole of it; rows elsewhere)."""
        n = error.numel()
        if (x.dim() != 1 or x.data_ptr() != self.acc.data_ptr() or x.numel() != self.acc.numel() or n != x.numel()
                or rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or not rows.is_cpu):
            return False
        lib = native(x, self.g, self.m, self.sden, error, *(() if self.r is None else (self.r,)))
        srcs = _sources(self.sources, self.segments)
        if lib is None or srcs is None:
            return False
        nseg = len(self.segments)
        c, cp = (None, None) if self.scales is None else c_doubles(self.scales, nseg)
        b, bp = (None, None) if self.bounds is None else c_doubles(self.bounds, nseg)
        lib.co_zo_sync_before_compress_rows(
            self.g.data_ptr(), srcs[1], self.m.data_ptr(), self.sden.data_ptr(), x.data_ptr(), self.weight, self.lr, cp,
            None if self.r is None else self.r.data_ptr(), bp, self.segments.offsets.data_ptr(), nseg,
            error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, n)
        return True
