"""ZeRO's compression step with the preconditioned exchange in native passes
(:mod:`compressed_opt.zero`, docs/design.md 2.5; 1-bit LAMB's: 2.4.2): every rank keeps the momentum
as the last result's 1-bit rows (``R m`` times the last exchange factor) and steps its whole replica.

``ZeroLocalMomentum(x, prev, r, keep, gain, bounds, segments, sources, compose)``
    the local momentum ``x = clamp(t k_s + (h_s r) g, -b_s, b_s)`` (0 where ``r == 0``; ``t`` the
    kept rows' values, ``g`` segment ``s``'s gradient ``sources[s]``, none: ``t k_s``), not run
    yet, as a pending pass of the exchange (:func:`compressed_opt.comm.compressed.compress_pending_`):
    its :meth:`~ZeroLocalMomentum.compress_rows_` runs it inside the worker's compression, reading
    the rows, ``r``, each gradient and the error once (``x`` is never written); its ``apply_`` is
    ``compose``, the layout's own PyTorch composition into ``x``; its
    :meth:`~ZeroLocalMomentum.form_` runs it alone into ``x`` natively (a local momentum formed
    before its exchange: an exchange launched from backward, 1-bit LAMB's measuring steps).
``rows_descend_(result, r, eps, coeffs, factors, dests, segments, decay, alpha)``
    the update from the result's rows: ``p <- p decay + alpha q``, ``q = (y / (r eps + c_s)) f_s``
    (0 where ``r == 0``), ``y`` decompressed tile by tile in cache; ``False``, with nothing done,
    where the C pass cannot run (the caller decompresses and composes).

``previous_momentum_(prev, r, lo, hi, out)``
    1-bit LAMB's previous momentum of this rank's chunk ``[lo, hi)``, ``m = t / r`` (0 where not
    finite: ``nan_to_num``) from the kept rows ``prev``, into ``out``; ``False`` where it cannot run.
``lamb_rows_descend_(result, r, eps, coeffs, dests, segments, decays, alphas)``
    1-bit LAMB's update of the whole replica from the result's rows: ``p <- p decay_s + (m / denom)
    alpha_s``, ``m = y / r`` (0 where ``r == 0``), ``denom = (1 / r) c_s + eps`` (``sqrt(v_f) + eps``
    made from ``R = c_s / sqrt(v_f)``); ``False`` where it cannot run.

All are bit for bit the composition the layout runs with PyTorch (:func:`compose_momentum_`,
:func:`compose_descend_`, :func:`compose_previous_momentum_`, :func:`compose_lamb_descend_`: every
operation rounded on its own, torch's add-with-alpha one FMA in its
vector kernels); the harness (:func:`agrees`) compares the two on this machine, tails of
its vector loops included, and the composition runs wherever they differ.
"""
from __future__ import annotations

import torch

from . import cpu, harness
from .cpu import c_doubles, destination_addresses, native, plain_cpu_floats, source_addresses
from .reference import compose_descend_, zero_where_no_variance
from .rows import CompressedResult
from .segments import Segments


def compose_momentum_(x: torch.Tensor, t: torch.Tensor, r: torch.Tensor, keep, gain, bounds, segments: Segments,
                      sources: list) -> None:
    """The local momentum's composition (as :mod:`compressed_opt.zero` runs it): ``x`` <- ``t``
    (the kept rows, decompressed), times ``keep[s]``, plus ``gain[s] r g`` where segment ``s`` has
    a gradient, 0 where ``r == 0``, clamped to ``+-bounds[s]``; ``r`` ``None`` (the momentum
    exchange): ``t keep[s] + gain g``, one ``gain`` for every segment, neither zeroed nor clamped."""
    n = segments.numel
    x[:n].copy_(t[:n])
    views = segments.split(x)
    torch._foreach_mul_(views, list(keep))
    present = [i for i, g in enumerate(sources) if g is not None]
    if r is None:  # the momentum exchange (as the layout: one gain for every layer)
        if present:
            torch._foreach_add_([views[i] for i in present], [sources[i].view(views[i].shape) for i in present],
                                alpha=gain[present[0]])
        return
    if present:
        r_views = segments.split(r)
        torch._foreach_addcmul_([views[i] for i in present], [r_views[i] for i in present],
                                [sources[i].view(views[i].shape) for i in present], [gain[i] for i in present])
    x[:n].masked_fill_(r[:n] == 0, 0.0)
    torch._foreach_clamp_max_(views, list(bounds))
    torch._foreach_clamp_min_(views, [-b for b in bounds])


class ZeroLocalMomentum:
    """The local momentum, not run yet (see the module doc); the arguments are kept, not copied."""

    def __init__(self, x: torch.Tensor, prev: CompressedResult, r: torch.Tensor, keep, gain, bounds,
                 segments: Segments, sources: list, compose):
        self.x, self.prev, self.r, self.segments, self.sources = x, prev, r, segments, sources
        self.keep, self.gain, self.bounds, self.compose = keep, gain, bounds, compose

    def apply_(self) -> None:
        """Run the pass alone into ``x`` (the layout's composition)."""
        self.compose()

    def _native_args(self, buffer: torch.Tensor):
        """``(library, the pass's C arguments: the gradients' addresses and the per-segment scalars,
        each with what keeps it alive)`` for a native run over ``buffer`` (``x`` or the error), or
        ``(None, None)`` where it cannot run here (the library, a buffer or a gradient the C cannot
        take, the check at first use)."""
        lib = native(buffer, *(() if self.r is None else (self.r,)))
        if lib is None or not plain_cpu_floats(self.sources) or not agrees():
            return None, None
        nseg = len(self.segments)
        scalars = [(None, None) if v is None else c_doubles(v, nseg) for v in (self.keep, self.gain, self.bounds)]
        return lib, (source_addresses(self.sources, self.segments.sizes), scalars)

    def form_(self) -> bool:
        """The pass alone into ``x`` (its segments' elements), in one native pass: the values
        :meth:`compress_rows_` compensates with, stored, and what ``apply_`` composes, bit for bit;
        ``False``, with nothing done, where it cannot run here."""
        prev = self.prev
        if not prev.rows.is_cpu or prev.rows.shape[0] * prev.chunk < self.segments.numel:
            return False
        lib, args = self._native_args(self.x)
        if lib is None:
            return False
        addresses, scalars = args
        lib.co_zero_local_momentum(prev.rows.data_ptr(), prev.rows.stride(0), prev.chunk, prev.block,
                                   None if self.r is None else self.r.data_ptr(), addresses.data_ptr(),
                                   *(a for _, a in scalars), self.segments.offsets.data_ptr(), len(self.segments),
                                   self.x.data_ptr())
        return True

    def compress_rows_(self, x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, chunk: int, block: int) -> bool:
        """The pass, then ``compress_rows_(x, error, rows, chunk, block)``, in one native pass (``x``
        read nowhere, not written); ``False``, with nothing done, where it cannot run here."""
        prev = self.prev
        if (x.data_ptr() != self.x.data_ptr() or error.numel() != self.segments.numel or chunk != prev.chunk
                or block != prev.block or tuple(rows.shape) != tuple(prev.rows.shape)
                or rows.stride() != prev.rows.stride() or not prev.rows.is_cpu or not rows.is_cpu):
            return False
        lib, args = self._native_args(error)
        if lib is None:
            return False
        addresses, scalars = args
        lib.co_zero_momentum_compress_rows(prev.rows.data_ptr(), None if self.r is None else self.r.data_ptr(),
                                           addresses.data_ptr(), *(a for _, a in scalars),
                                           self.segments.offsets.data_ptr(), len(self.segments),
                                           error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0],
                                           chunk, block)
        return True


def _update_targets(result: CompressedResult, r: torch.Tensor, dests: list, segments: Segments) -> tuple:
    """``(library, the parameters' addresses)`` for an update pass from the result's rows and ``r``,
    or ``(None, None)`` where it cannot run (rows short or not on the CPU, ``r`` or a parameter the
    C cannot take, the check at first use failed)."""
    if not result.rows.is_cpu or result.rows.shape[0] * result.chunk < segments.numel or r.numel() < segments.numel:
        return None, None
    lib = native(r)
    addresses = destination_addresses(dests, segments.sizes) if lib is not None else None
    if addresses is None or not agrees():
        return None, None
    return lib, addresses


def rows_descend_(result: CompressedResult, r: torch.Tensor, eps: float, coeffs, factors, dests: list,
                  segments: Segments, decay: float, alpha: float) -> bool:
    """The update from the result's rows in one native pass (see the module doc); ``False``, with
    nothing done, where it cannot run here."""
    lib, addresses = _update_targets(result, r, dests, segments)
    if lib is None:
        return False
    nseg = len(segments)
    c, f = c_doubles(coeffs, nseg), c_doubles(factors, nseg)  # (kept alive through the call)
    lib.co_zero_rows_descend(result.rows.data_ptr(), result.rows.stride(0), result.chunk, result.block, r.data_ptr(),
                             float(eps), c[1], f[1], segments.offsets.data_ptr(), nseg, addresses.data_ptr(),
                             float(decay), decay != 1.0, float(alpha))
    return True


def compose_previous_momentum_(t: torch.Tensor, r: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> None:
    """:func:`previous_momentum_` composed (as :mod:`compressed_opt.zero` forms it), from the kept
    rows' values ``t`` (whole)."""
    torch.div(t[lo:hi], r[lo:hi], out=out[: hi - lo]).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def previous_momentum_(prev: CompressedResult, r: torch.Tensor, lo: int, hi: int, out: torch.Tensor) -> bool:
    """``out[:hi - lo]`` <- ``t / r`` over ``[lo, hi)`` (0 where not finite), ``t`` the values of
    the kept rows ``prev``, in one native pass (``lo`` a multiple of 8: a whole byte of bits, as a
    chunk's start is); ``False``, with nothing done, where it cannot run."""
    if (not prev.rows.is_cpu or prev.rows.shape[0] * prev.chunk < hi or r.numel() < hi or out.numel() < hi - lo
            or not 0 <= lo <= hi or lo % 8):
        return False
    lib = native(r, out)
    if lib is None or not agrees():
        return False
    lib.co_rows_quotient_finite(prev.rows.data_ptr(), prev.rows.stride(0), prev.chunk, prev.block, r.data_ptr(),
                                lo, hi, out.data_ptr())
    return True


def compose_lamb_descend_(y: torch.Tensor, r: torch.Tensor, eps: float, coeffs, dests: list, segments: Segments,
                          decays, alphas, zero_index: torch.Tensor | None = None) -> None:
    """:func:`lamb_rows_descend_` composed (as 1-bit LAMB's step composes it under ZeRO) from the
    decompressed ``y`` (overwritten: ``m``, then the direction's step)."""
    n = segments.numel
    torch.div(y[:n], r[:n], out=y[:n])  # m = y / R, 0 where R == 0 (the momentum from the exchange)
    zero_where_no_variance(y, r, n, zero_index)
    denom = torch.reciprocal(r[:n])  # sqrt(v_f) + eps, made from R = c_l / sqrt(v_f)
    torch._foreach_mul_(segments.split(denom), list(coeffs))
    denom.add_(eps)
    torch.div(y[:n], denom, out=y[:n])
    views = [v.view(p.shape) for v, p in zip(segments.split(y), dests)]
    if decays is not None:
        torch._foreach_mul_(dests, list(decays))
    torch._foreach_mul_(views, list(alphas))
    torch._foreach_add_(dests, views)


def lamb_rows_descend_(result: CompressedResult, r: torch.Tensor, eps: float, coeffs, dests: list,
                       segments: Segments, decays, alphas) -> bool:
    """1-bit LAMB's update from the result's rows in one native pass (the module doc); ``False``,
    with nothing done, where it cannot run here."""
    lib, addresses = _update_targets(result, r, dests, segments)
    if lib is None:
        return False
    nseg = len(segments)
    c, a = c_doubles(coeffs, nseg), c_doubles(alphas, nseg)  # (kept alive through the call)
    d = (None, None) if decays is None else c_doubles(decays, nseg)
    lib.co_zero_lamb_rows_descend(result.rows.data_ptr(), result.rows.stride(0), result.chunk, result.block,
                                  r.data_ptr(), float(eps), c[1], segments.offsets.data_ptr(), nseg,
                                  addresses.data_ptr(), d[1], a[1])
    return True


def agrees() -> bool:
    """Whether the C passes give their compositions' bits here (the harness's check, once per process)."""
    return harness.agrees("zero_passes")


def _check_case(seed: int, native: bool):
    """The harness's case: segments of sizes with and without vector tails, ``r == 0``, a missing
    gradient, values beyond the bounds; both exchanges' local momentum compressed, the update with
    decay and without, then 1-bit LAMB's two passes."""
    lib = cpu.library()
    if lib is None:
        return None
    g, segs, chunk, block, prev, t = harness.rows_case(seed)
    sizes, n, count, (world, row_len) = segs.sizes, segs.numel, segs.count, prev.shape
    r = torch.rand(n, generator=g) * 3
    r[::9] = 0.0
    sources = [torch.randn(k, generator=g) * 2 for k in sizes]
    sources[3] = None
    keep, gain = [0.9 * (1 + 0.1 * i) for i in range(count)], [0.1 * (1 - 0.05 * i) for i in range(count)]
    bounds = [0.3 + 0.2 * i for i in range(count)]
    coeffs, factors = [1.0 + 0.3 * i for i in range(count)], [1.0 - 0.01 * i for i in range(count)]
    error = torch.randn(n, generator=g) * 0.1
    held = [c_doubles(v, count) for v in (keep, gain, bounds, coeffs, factors, [0.1] * count)]  # (alive)
    addresses, outs = source_addresses(sources, sizes), []
    for rr, gains, bounded in ((r, gain, bounds), (None, [0.1] * count, None)):  # (the momentum exchange's: one gain)
        e, rows = error.clone(), torch.zeros(world, row_len, dtype=torch.uint8)
        if native:
            lib.co_zero_momentum_compress_rows(prev.data_ptr(), None if rr is None else rr.data_ptr(),
                                               addresses.data_ptr(), held[0][1], held[1 if rr is not None else 5][1],
                                               None if bounded is None else held[2][1], segs.offsets.data_ptr(), count,
                                               e.data_ptr(), rows.data_ptr(), rows.stride(0), world, chunk, block)
        else:
            x = torch.empty(n)
            compose_momentum_(x, t, rr, keep, gains, bounded, segs, sources)
            cpu.compress_rows_(x, e, rows, chunk, block)
        outs += [e, rows]
    for decay in (1.0, 0.999):
        params = [torch.randn(k, generator=g) for k in sizes]
        if native:
            dests = destination_addresses(params, sizes)
            lib.co_zero_rows_descend(prev.data_ptr(), prev.stride(0), chunk, block, r.data_ptr(), 1e-8, held[3][1],
                                     held[4][1], segs.offsets.data_ptr(), count, dests.data_ptr(), decay, decay != 1.0,
                                     -1e-3)
        else:
            compose_descend_(t.clone(), r, 1e-8, coeffs, factors, params, segs, decay, -1e-3)
        outs += params
    return outs + _lamb_case(lib, g, segs, prev, t, r, chunk, block, native)


def _lamb_case(lib, g, segs: Segments, prev: torch.Tensor, t: torch.Tensor, r: torch.Tensor, chunk: int, block: int,
               native: bool) -> list:
    """1-bit LAMB's two passes or their compositions (see :func:`_check_case`)."""
    sizes, n, count, outs = segs.sizes, segs.numel, segs.count, []
    for lo, hi in ((0, n), (chunk, n), (8, chunk + 3)):
        out = torch.full((n + 2,), 3.0)
        if native:
            lib.co_rows_quotient_finite(prev.data_ptr(), prev.stride(0), chunk, block, r.data_ptr(), lo, hi,
                                        out.data_ptr())
        else:
            compose_previous_momentum_(t, r, lo, hi, out)
        outs.append(out)
    coeffs = [0.5 + 0.25 * i for i in range(count)]
    alphas = [-1e-3 * (1 + 0.1 * i) for i in range(count)]
    for decays in (None, [1.0 - 1e-4 * (i + 1) for i in range(count)]):
        params = [torch.randn(k, generator=g) for k in sizes]
        if native:
            held = [c_doubles(v, count) for v in (coeffs, alphas, decays or [1.0] * count)]  # (alive through the call)
            dests = destination_addresses(params, sizes)
            lib.co_zero_lamb_rows_descend(prev.data_ptr(), prev.stride(0), chunk, block, r.data_ptr(), 1e-8,
                                          held[0][1], segs.offsets.data_ptr(), count, dests.data_ptr(),
                                          None if decays is None else held[2][1], held[1][1])
        else:
            compose_lamb_descend_(t.clone(), r, 1e-8, coeffs, params, segs, decays, alphas)
        outs += params
    return outs


harness.register("zero_passes", harness.Check(((31,),), _check_case))
