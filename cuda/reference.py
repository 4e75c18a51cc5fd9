"""The reference implementation of the passes in plain PyTorch: the compression kernels and the
segmented passes around them.

Readable, allocating, slow: the definition the native passes (:mod:`~compressed_opt.cuda.cpu`,
:mod:`~compressed_opt.cuda.gpu`) give bit for bit (checked by the harness of
:mod:`~compressed_opt.cuda.registry`), and what runs where no native pass does. The compression's
math (docs/design.md 2.1, 2.2):

A buffer of ``world`` chunks of ``chunk`` elements travels as ``world`` *rows*, row ``j`` holding
chunk ``j``: ``nb = ceil(chunk / block)`` fp32 scales, then ``chunk / 8`` bytes of sign bits
(:func:`rows_layout`). Block ``b`` of a chunk is its elements ``[b block, min((b + 1) block,
chunk))``; of those, only the valid ones (below ``n`` in the whole buffer) count.

* compress (worker): ``u = x + e``; per block ``s = sqrt(sum u^2 / count)`` over its valid
  elements (0 when it has none); ``bit_k = [u_k >= 0]``; ``e <- u - s (2 bit - 1)``.
* average-compress (server, one chunk): ``z = e + sum_i (s_ib / world) (2 bit_ik - 1)``, ``s_ib``
  the scale of row ``i``'s block ``b``; then compress ``z`` with ``e`` into one row.
* decompress: ``out_k = s_rb (2 bit_k - 1)``, ``r = k // chunk``, ``b = (k % chunk) // block``.

Bit ``k`` of a row's bits is bit ``k % 8`` (least significant first) of byte ``k // 8``; bits of
invalid elements are 1. Scales are the fp32 values, the errors subtract exactly those.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .segments import Segments, doubles

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def rows_layout(chunk: int, block: int) -> tuple[int, int]:
    """``(blocks per chunk, bytes per row)``: ``ceil(chunk / block)`` scales of 4 bytes, then
    ``chunk / 8`` bytes of bits."""
    nb = -(-chunk // block)
    return nb, 4 * nb + chunk // 8


def pack_bits(bits: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Pack a bool vector into ``nbytes`` bytes, little bit order; missing bits are 1."""
    padded = torch.ones(nbytes * 8, dtype=torch.bool, device=bits.device)
    padded[: bits.numel()] = bits
    weights = _BIT_WEIGHTS.to(bits.device)
    return (padded.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Bool vector of the ``8 * numel`` bits of ``packed``, little bit order."""
    weights = _BIT_WEIGHTS.to(packed.device)
    return (packed.reshape(-1, 1) & weights).ne(0).reshape(-1)


def row_scales(rows: torch.Tensor, nb: int) -> torch.Tensor:
    """The ``[R, nb]`` fp32 scales at the start of each row of ``rows`` (``[R, row_len]`` bytes)."""
    # (a copy: a view of the rows may start at any byte, and fp32 needs 4-byte alignment)
    scales = rows[:, : 4 * nb].clone(memory_format=torch.contiguous_format).reshape(-1)
    return scales.view(torch.float32).view(rows.shape[0], nb)


def _blocks(chunk: int, block: int, valid: int):
    """``(b, lo, hi, end)`` per block of a chunk: its elements ``[lo, end)`` of the chunk, of
    which ``[lo, hi)`` are valid (``valid`` elements of the chunk are)."""
    for b, lo in enumerate(range(0, chunk, block)):
        end = min(lo + block, chunk)
        yield b, lo, max(lo, min(end, valid)), end


def _compress_chunk(u: torch.Tensor, chunk: int, block: int, row: torch.Tensor) -> None:
    """``u`` (the chunk's valid elements, in place) -> row ``row`` (scales, bits); ``u`` becomes
    the error ``u - C(u)``."""
    nb, _ = rows_layout(chunk, block)
    scales = torch.zeros(nb, dtype=torch.float32, device=u.device)
    bits = torch.ones(chunk, dtype=torch.bool, device=u.device)
    for b, lo, hi, _ in _blocks(chunk, block, u.numel()):
        if hi > lo:
            part = u[lo:hi]
            scales[b] = (torch.linalg.vector_norm(part.double()) / (hi - lo) ** 0.5).float()
            bits[lo:hi] = part >= 0
            part.sub_(torch.where(part >= 0, scales[b], -scales[b]))
    row[: 4 * nb].copy_(scales.view(torch.uint8))
    row[4 * nb:].copy_(pack_bits(bits, chunk // 8))


def compress_rows_(x, error, rows, chunk, block):
    if x is not None:
        error.add_(x)
    n = error.numel()
    for j in range(rows.shape[0]):
        lo = min(n, j * chunk)
        _compress_chunk(error[lo: min(n, lo + chunk)], chunk, block, rows[j])


def _signs(rows: torch.Tensor, nb: int, chunk: int) -> torch.Tensor:
    """``[R, chunk]`` +-1 of the rows' bits."""
    return unpack_bits(rows[:, 4 * nb:].contiguous().reshape(-1)).view(rows.shape[0], chunk).float() * 2 - 1


def average_compress_rows_(rows, error, out_row, chunk, block):
    world = rows.shape[0]
    nb, _ = rows_layout(chunk, block)
    m = error.numel()
    weights = row_scales(rows, nb) / world  # [world, nb], fp32 as the kernels form them
    per_element = weights.repeat_interleave(block, dim=1)[:, :chunk]
    terms = (per_element * _signs(rows, nb, chunk))[:, :m]
    for i in range(world):  # in rank order, as the kernels add them
        error.add_(terms[i])
    _compress_chunk(error, chunk, block, out_row)


def decompress_rows_(rows, out, chunk, block):
    nb, _ = rows_layout(chunk, block)
    n = out.numel()
    r = -(-n // chunk) if n else 0
    scales = row_scales(rows[:r], nb).repeat_interleave(block, dim=1)[:, :chunk]
    out.copy_((scales * _signs(rows[:r], nb, chunk)).reshape(-1)[:n])


# --- the segmented passes around the compression (the compositions the C and CUDA passes give) ------
# Each the definition of the pass of that name in :mod:`~compressed_opt.cuda.cpu` and
# :mod:`~compressed_opt.cuda.gpu` (where they have one), in PyTorch's fused multi-tensor ops, which
# on CUDA launch a few kernels per pass whatever the number of segments. ``segments``: a
# :class:`~compressed_opt.cuda.segments.Segments` of the flat buffers; arguments unchecked (the
# checked forms: :mod:`compressed_opt.cuda.segmented`).
def sources(grads: list, sizes: list[int]) -> None:
    """The gradients as a native pass reads them where they lie: never here (``None``: the reference
    passes take the tensors themselves)."""
    return None


def segment_sumsq(x: torch.Tensor, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """``out[s]`` <- the float64 sum of squares of segment ``s`` of ``x`` (PyTorch's float64 norm,
    squared)."""
    out.zero_()
    views = segments.split(x)
    nonempty = [i for i, n in enumerate(segments.sizes) if n]
    if nonempty:
        norms = torch._foreach_norm([views[i] for i in nonempty], 2, dtype=torch.float64)
        out[nonempty] = torch.stack(norms).to(out).square_()
    return out


def sumsq_each(sources: list, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """``out[s]`` <- the float64 sum of squares of ``sources[s]`` (0 for ``None``)."""
    out.zero_()
    have = [i for i, src in enumerate(sources) if src is not None and src.numel()]
    if have:
        norms = torch._foreach_norm([sources[i] for i in have], 2, dtype=torch.float64)
        out[have] = torch.stack(norms).to(out).square_()
    return out


def gather_(sources: list, out: torch.Tensor, segments: Segments, scale: float | None = None,
            sumsq_out: torch.Tensor | None = None) -> None:
    """Segment ``s`` of ``out`` <- ``sources[s]`` (times ``scale``; zeros where ``None``); with
    ``sumsq_out``, the segments' sums of squares of what was written (:func:`segment_sumsq`)."""
    views = segments.split(out)
    have = [(v, src) for v, src in zip(views, sources) if src is not None]
    for v, src in zip(views, sources):
        if src is None:
            v.zero_()
    if have:
        torch._foreach_copy_([v for v, _ in have], [src.reshape(v.shape) for v, src in have])
    if scale is not None:
        out[: segments.numel].mul_(scale)
    if sumsq_out is not None:
        segment_sumsq(out, segments, sumsq_out)


def _clamp_segments_(x: torch.Tensor, bounds: list[float], segments: Segments) -> None:
    views = segments.split(x)
    if views:
        torch._foreach_clamp_max_(views, bounds)
        torch._foreach_clamp_min_(views, [-v for v in bounds])


def lerp_scale_clamp_(x: torch.Tensor, m: torch.Tensor, weight: float, r: torch.Tensor, bounds,
                      segments: Segments, scales=None) -> None:
    """``x`` <- ``clamp(c_s * (r * lerp(m, x, weight)), -bounds[s], bounds[s])`` on each segment
    ``s`` (``c_s = scales[s]``; without ``scales``, exactly the unscaled value)."""
    b = doubles(bounds, segments.count)
    c = None if scales is None else doubles(scales, segments.count)
    n = segments.numel
    torch.lerp(m[:n], x[:n], weight, out=x[:n])
    x[:n].mul_(r[:n])
    if c is not None:
        views = segments.split(x)
        if views:
            torch._foreach_mul_(views, [float(v) for v in c.to(torch.float32).tolist()])
    _clamp_segments_(x, b.tolist(), segments)


def scale_clamp_(x: torch.Tensor, r: torch.Tensor, bounds, segments: Segments) -> None:
    """``x`` <- ``clamp(r * x, -bounds[s], bounds[s])`` on each segment ``s``."""
    b = doubles(bounds, segments.count)
    x[: segments.numel].mul_(r[: segments.numel])
    _clamp_segments_(x, b.tolist(), segments)


def divide_where_nonzero_(y: torch.Tensor, r: torch.Tensor, out: torch.Tensor,
                          zero_index: torch.Tensor | None = None, segments: Segments | None = None,
                          divisors=None) -> None:
    """``out`` <- ``y / r``, 0 where ``r == 0`` (``zero_index``: those indices, known: no mask
    pass); with ``segments`` and ``divisors``, then divided by ``divisors[s]`` on segment ``s``
    (only the segments' elements written)."""
    d = None if segments is None else doubles(divisors, segments.count)
    if d is not None:  # only the segments' elements
        n = segments.numel
        y, r, out = y[:n], r[:n], out[:n]
        if zero_index is not None:
            zero_index = zero_index[zero_index < n]
    if zero_index is not None:
        torch.div(y, r, out=out)
        out.view(-1).index_fill_(0, zero_index, 0.0)
    else:
        zero = r == 0
        torch.div(y, r, out=out)
        out.masked_fill_(zero, 0.0)
    if d is not None:
        views = segments.split(out)
        if views:
            torch._foreach_div_(views, [float(v) for v in d.to(torch.float32).tolist()])


# --- a pass not run yet, for a compression to run inside its worker side (comm.Producer) -----------
class LerpScaleClamp(NamedTuple):
    """:func:`lerp_scale_clamp_` on ``x``, not run yet: a pass whose result only a compression reads
    (the preconditioned exchange's local momentum). ``sources`` (one tensor per segment: the
    gradients): ``x``'s segments, not gathered into it yet. Its arguments are kept, not copied: they
    must not change before it runs. Here :meth:`compress_rows_` declines (the compression then runs
    :meth:`apply_` and compresses); the C and CUDA forms of the class run it inside the compression."""

    x: torch.Tensor
    m: torch.Tensor
    weight: float
    r: torch.Tensor
    bounds: object
    segments: Segments
    scales: object = None
    sources: list | None = None

    def apply_(self) -> None:
        """Run the pass on its ``x``, alone (its sources gathered into ``x`` first)."""
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        lerp_scale_clamp_(self.x, self.m, self.weight, self.r, self.bounds, self.segments, self.scales)

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        """The pass fused with the compression of ``x``: not here (``False``, nothing done)."""
        return False


class ScaleClamp(NamedTuple):
    """:func:`scale_clamp_` on ``x``, not run yet (0/1 Adam's exchanged ``R x``, bounded), as
    :class:`LerpScaleClamp`, ``sources`` included (phase A's gradients, read where they lie)."""

    x: torch.Tensor
    r: torch.Tensor
    bounds: object
    segments: Segments
    sources: list | None = None

    def apply_(self) -> None:
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        scale_clamp_(self.x, self.r, self.bounds, self.segments)

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        return False


class Lerp(NamedTuple):
    """``torch.lerp(m, x, weight, out=x)`` on the flat ``x``, not run yet (the momentum exchange's
    local momentum), as :class:`LerpScaleClamp`; ``sources``: ``x``'s segments (``segments``
    cover ``x``), not gathered yet."""

    x: torch.Tensor
    m: torch.Tensor
    weight: float
    segments: Segments
    sources: list | None = None

    def apply_(self) -> None:
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        torch.lerp(self.m, self.x, self.weight, out=self.x)

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        return False


# --- the updates from an exchange's result ------------------------------------------------------------
class Descend(NamedTuple):
    """The preconditioned update's arguments but ``y``, ``r`` and ``segments``
    (:func:`divide_descend_`): ``dests[s] <- dests[s] * decay + alpha (y / (r eps + c_s)) f_s`` (0
    where ``r == 0``; ``c_s = coeffs[s]``, ``f_s = factors[s]``, one per segment)."""

    dests: list
    eps: float
    coeffs: object
    factors: object
    decay: float
    alpha: float


def zero_where_no_variance(y: torch.Tensor, r: torch.Tensor, n: int, zero_index: torch.Tensor | None) -> None:
    """``y[:n]`` <- 0 where ``r == 0`` (``v_f == 0``; ``zero_index``: those indices, known)."""
    if zero_index is None:
        y[:n].masked_fill_(r[:n] == 0, 0.0)
    elif zero_index.numel():
        y.index_fill_(0, zero_index, 0.0)


def compose_descend_(y: torch.Tensor, r: torch.Tensor, eps: float, coeffs, factors, dests: list,
                     segments: Segments, decay: float, alpha: float, zero_index: torch.Tensor | None = None) -> None:
    """``y`` <- ``(y / (r eps + c_s)) f_s`` (0 where ``r == 0``; ``zero_index``: those indices,
    known), then ``p <- p decay + alpha y`` (``y`` overwritten: the direction)."""
    views = segments.split(y)
    if views:
        a_inv = torch._foreach_mul(segments.split(r), eps)
        torch._foreach_add_(a_inv, list(coeffs))
        torch._foreach_div_(views, a_inv)
    zero_where_no_variance(y, r, segments.numel, zero_index)
    if views and any(f != 1.0 for f in factors):
        torch._foreach_mul_(views, list(factors))
    if dests:
        if decay != 1.0:
            torch._foreach_mul_(dests, decay)
        torch._foreach_add_(dests, [v.view(p.shape) for v, p in zip(views, dests)], alpha=alpha)


def divide_descend_(y, r: torch.Tensor, out: torch.Tensor, segments: Segments, divisors, descend: Descend,
                    zero_index: torch.Tensor | None = None) -> None:
    """The preconditioned exchange's last pass: ``out <- y / r`` (0 where ``r == 0``; then ``/
    divisors[s]`` on segment ``s`` unless ``divisors`` is ``None``), the momentum; and the update
    ``descend`` with the same ``y`` (:func:`compose_descend_`; ``y`` overwritten with the
    direction). ``y``: a flat tensor, or a :class:`~compressed_opt.cuda.rows.CompressedResult`
    (decompressed into its buffer first)."""
    if not isinstance(y, torch.Tensor):
        y = y.expand_()
    n = segments.numel
    with_divisors = () if divisors is None else (segments, divisors)
    divide_where_nonzero_(y[:n], r[:n], out[:n], zero_index, *with_divisors)
    compose_descend_(y, r, descend.eps, descend.coeffs, descend.factors, descend.dests, segments, descend.decay,
                     descend.alpha, zero_index)


def keep_descend_(y, den: torch.Tensor, m: torch.Tensor | None, factors, dests: list, segments: Segments,
                  decay: float, alpha: float) -> None:
    """The momentum exchange's update from its result ``y`` (a flat tensor, or a
    :class:`~compressed_opt.cuda.rows.CompressedResult`, decompressed into its buffer first):
    ``m <- y`` (``m`` ``None``: not kept, ZeRO's momentum is the rows), then ``dests[s] <- dests[s]
    * decay + alpha (y / den) f_s`` (``factors`` ``None``: 1); ``y`` overwritten with the
    direction."""
    if not isinstance(y, torch.Tensor):
        y = y.expand_()
    n = segments.numel
    if m is not None:
        m[:n].copy_(y[:n])
    torch.div(y[:n], den[:n], out=y[:n])
    views = segments.split(y)
    if factors is not None and views:
        torch._foreach_mul_(views, list(factors))
    if dests:
        if decay != 1.0:
            torch._foreach_mul_(dests, decay)
        torch._foreach_add_(dests, [v.view(p.shape) for v, p in zip(views, dests)], alpha=alpha)
