"""The preconditioned exchange's last pass: the momentum taken back from the exchanged average and
the update it makes, in one pass over memory (docs/design.md 2.3.1).

``divide_descend_(y, r, out, segments, divisors, descend, zero_index=None)``
    ``out <- y / r`` (0 where ``r == 0``), divided by ``divisors[s]`` on segment ``s`` (none:
    ``None``): the momentum; and ``descend`` (a :class:`Descend`) with the same ``y``: ``dests[s] <-
    dests[s] * decay + alpha q``, ``q = (y / (r eps + c_s)) f_s`` (0 where ``r == 0``), Adam's
    direction ``m / (sqrt(v_f) + eps)`` made from ``y`` and ``R = c_l / sqrt(v_f)`` alone, as ZeRO's
    update makes it (:func:`~compressed_opt.cuda.zero_passes.rows_descend_`, the same element).

``rows_keep_descend_(result, den, m, factors, dests, segments, decay, alpha)``
    the momentum exchange's update from the result's 1-bit rows (a :class:`CompressedResult`), in
    one pass: ``m <- y`` and ``dests[s] <- dests[s] * decay + alpha (y / den) f_s`` (``factors``
    ``None``: 1), ``y`` decompressed tile by tile in cache; bit for bit the decompression then
    :func:`compose_keep_descend_` (PyTorch's operations, its add-with-alpha one FMA on CPUs: checked
    once per process, :func:`keep_descend_agrees`; ``m`` ``None`` under ZeRO, whose momentum is the
    rows). ``False``, with nothing done, where the C pass cannot run (the caller decompresses and
    composes).

``y`` may also be a :class:`CompressedResult`, the 1-bit rows a compressed allreduce's result
travelled as: the C pass then decompresses them tile by tile into the stack (``y`` never travels to
memory), where the other passes decompress them into the result's buffer first. Where it did,
:func:`divide_descend_` returns a :class:`KeptMomentum`: the momentum it wrote is ``(y / r) /
divisors`` of those rows, so the next local momentum's pass may form it from them instead of
reading it (:class:`~compressed_opt.cuda.segmented.LerpScaleClamp`'s ``kept``), as long as neither
the rows nor the momentum changed.

It is :func:`~compressed_opt.cuda.segmented.divide_where_nonzero_` then :func:`compose_descend_`, bit
for bit: on contiguous fp32 CPU tensors ``zero_cpu.c`` runs both in one loop (``y``, ``r`` and each
destination read once, ``y`` from the result's rows where it travelled as them; every operation
rounded on its own, torch's add-with-alpha one FMA, as PyTorch's CPU kernels round them; the element
of ZeRO's update; checked at first use, :func:`divide_descend_agrees`), elsewhere the two passes run in
turn.
So a rank whose parameters the C pass cannot write (or that has no compiler) keeps the others' bits.
"""
from __future__ import annotations

import torch

from . import cpu, reference
from .addresses import destination_addresses, source_addresses
from .segmented import Segments, _c_doubles, _check, _native, divide_where_nonzero_


class CompressedResult:
    """A compressed allreduce's result as its 1-bit rows: ``rows`` (uint8 ``[world, row_len]``, each
    row contiguous, the layout of :func:`~compressed_opt.cuda.rows_layout`) of ``chunk`` elements each, one
    scale per ``block``; :meth:`expand_` decompresses them (``decompress_rows_``) into ``buffer`` (a
    flat fp32 tensor of the result's size, where a pass that cannot read the rows takes it)."""

    def __init__(self, rows: torch.Tensor, chunk: int, block: int, buffer: torch.Tensor):
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or rows.stride(0) < rows.shape[1]:
            raise ValueError(f"rows must be uint8 [world, row_len] with contiguous, non-overlapping rows, got "
                             f"{rows.dtype} {tuple(rows.shape)} strides {rows.stride()}")
        from . import check_rows_geometry, rows_layout

        check_rows_geometry(chunk, block)
        if rows.shape[1] < rows_layout(chunk, block)[1]:
            raise ValueError(f"rows of {rows.shape[1]} bytes for chunks of {chunk} elements in blocks of {block}")
        self.rows, self.chunk, self.block, self.buffer = rows, int(chunk), int(block), buffer

    def expand_(self) -> torch.Tensor:
        """The result, decompressed into :attr:`buffer` (returned)."""
        from . import decompress_rows_

        decompress_rows_(self.rows, self.buffer, self.chunk, self.block)
        return self.buffer


class Descend:
    """The preconditioned update's arguments but ``y``, ``r`` and ``segments`` (:func:`divide_descend_`):
    ``dests[s] <- dests[s] * decay + alpha (y / (r eps + c_s)) f_s`` (0 where ``r == 0``; ``c_s =
    coeffs[s]``, ``f_s = factors[s]``, one per segment)."""

    def __init__(self, dests: list, eps: float, coeffs, factors, decay: float, alpha: float):
        self.dests, self.eps, self.coeffs, self.factors = dests, float(eps), coeffs, factors
        self.decay, self.alpha = float(decay), float(alpha)


class KeptMomentum:
    """A momentum ``out`` that a pass wrote from a result's rows (:func:`divide_descend_`, 1-bit
    LAMB's pass 1: :func:`compressed_opt.cuda.lamb_passes.kept_momentum`): ``out = (y / r) /
    divisors[s]`` (0 where ``r == 0``; no divisors: ``y / r``), ``y`` the values of ``rows``.
    :meth:`usable` says whether a pass may still form ``out`` from the rows in place of reading it:
    ``out`` not written since (its version counter, which every PyTorch in-place write moves, and
    its memory), the same ``r``, and the rows unchanged, which only their owner knows (it drops this
    object when it writes them). A write that bypasses the version counter (``.data``, NumPy) is not
    seen."""

    def __init__(self, rows: torch.Tensor, chunk: int, block: int, r: torch.Tensor, out: torch.Tensor,
                 segments: Segments, divisors, agrees=None):
        self.rows, self.chunk, self.block, self.r, self.segments = rows, chunk, block, r, segments
        #: the divisors as the pass that wrote ``out`` took them (``_c_doubles``: kept alive here), or ``None``
        self.divisors = divisors
        self._out = (out.data_ptr(), out._version, out.numel())
        #: whether the pass that wrote ``out`` and the one that forms it from the rows agree here
        #: (checked once per process; :func:`kept_compress_agrees` for :func:`divide_descend_`'s)
        self.agrees = kept_compress_agrees if agrees is None else agrees

    @property
    def divisors_address(self):
        return None if self.divisors is None else self.divisors[1]

    def usable(self, m: torch.Tensor, r: torch.Tensor, segments: Segments, world: int, chunk: int,
               block: int) -> bool:
        """Whether ``m`` is still this momentum, for a compression of ``world`` rows of ``chunk``
        elements in blocks of ``block`` over ``segments`` (the rows' geometry), and the native pass
        forms it as the pass that wrote it did (:attr:`agrees`)."""
        return (self._out == (m.data_ptr(), m._version, m.numel()) and r is self.r and segments is self.segments
                and self.rows.shape[0] == world and self.chunk == chunk and self.block == block and self.agrees())


def compose_descend_(y: torch.Tensor, r: torch.Tensor, eps: float, coeffs, factors, dests: list,
                     segments: Segments, decay: float, alpha: float, zero_index: torch.Tensor | None = None) -> None:
    """The update's composition (the layouts', and the oracle of the native passes): ``y`` <- ``(y /
    (r eps + c_s)) f_s`` (0 where ``r == 0``; ``zero_index``: those indices, known), then ``p <- p
    decay + alpha y`` (``y`` overwritten: the direction)."""
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


def zero_where_no_variance(y: torch.Tensor, r: torch.Tensor, n: int, zero_index: torch.Tensor | None) -> None:
    """``y[:n]`` <- 0 where ``r == 0`` (``v_f == 0``; ``zero_index``: those indices, known)."""
    if zero_index is None:
        y[:n].masked_fill_(r[:n] == 0, 0.0)
    elif zero_index.numel():
        y.index_fill_(0, zero_index, 0.0)


def divide_descend_(y, r: torch.Tensor, out: torch.Tensor, segments: Segments, divisors, descend: Descend,
                    zero_index: torch.Tensor | None = None) -> KeptMomentum | None:
    """``out <- y / r`` (0 where ``r == 0``; then ``/ divisors[s]`` on segment ``s`` unless
    ``divisors`` is ``None``) and ``descend`` (the module doc), over the segments' elements of the
    flat ``y``, ``r`` and ``out`` (``out`` not ``y``; ``y`` overwritten where the two passes run).
    ``y``: a flat tensor, or a :class:`CompressedResult` (decompressed into its buffer first where
    the C pass cannot run). ``zero_index``: as for :func:`divide_where_nonzero_` (the mask).
    Returns a :class:`KeptMomentum` where the C pass formed ``out`` from the result's rows, else
    ``None``."""
    if len(descend.dests) != len(segments):
        raise ValueError(f"one destination per segment is needed ({len(segments)}), got {len(descend.dests)}")
    compressed = isinstance(y, CompressedResult)
    _check(segments, r, out, *(() if compressed else (y,)))
    if compressed and y.rows.shape[0] * y.chunk < segments.numel:
        raise ValueError(f"{y.rows.shape[0]} rows of {y.chunk} elements for {segments.numel} elements")
    n, nseg = segments.numel, len(segments)
    c, f = _c_doubles(descend.coeffs, nseg), _c_doubles(descend.factors, nseg)  # (their number checked; alive)
    v = None if divisors is None else _c_doubles(divisors, nseg)
    if compressed:
        lib = _native(r, out) if y.rows.is_cpu else None
    else:
        lib = _native(y, r, out) if out.data_ptr() != y.data_ptr() else None
    ready = lib is not None and divide_descend_agrees()
    addresses = destination_addresses(descend.dests, segments.sizes) if ready else None
    if addresses is None:
        if compressed:
            y = y.expand_()
        with_divisors = () if divisors is None else (segments, divisors)
        divide_where_nonzero_(y[:n], r[:n], out[:n], zero_index, *with_divisors)
        compose_descend_(y, r, descend.eps, descend.coeffs, descend.factors, descend.dests, segments, descend.decay,
                         descend.alpha, zero_index)
        return None
    tail = (descend.eps, c[1], f[1], segments.offsets.data_ptr(), nseg, addresses.data_ptr(), descend.decay,
            descend.decay != 1.0, descend.alpha, out.data_ptr(), None if v is None else v[1])
    if not compressed:
        lib.co_divide_zero_descend(y.data_ptr(), r.data_ptr(), *tail)
        return None
    lib.co_rows_divide_zero_descend(y.rows.data_ptr(), y.rows.stride(0), y.chunk, y.block, r.data_ptr(), *tail)
    return KeptMomentum(y.rows, y.chunk, y.block, r, out, segments, v)


_divide_descend: list = []  # [whether the stage-0 update passes gave the composition's bits here]


def divide_descend_agrees() -> bool:
    """Whether the native passes of :func:`divide_descend_` (from the rows and from a flat ``y``)
    give the two passes' bits on this machine, checked once per process at first use: segments
    with and without vector tails, an empty one, ``r == 0``, with and without decay and divisors."""
    if not _divide_descend:
        lib = cpu.library()
        _divide_descend.append(lib is not None and _divide_descend_check(lib))
    return _divide_descend[0]


def _divide_descend_check(lib) -> bool:
    g, segs, chunk, block, rows, t = check_case(41)
    sizes, n, ok = segs.sizes, segs.numel, True
    r = torch.rand(n, generator=g) * 3
    r[::9] = 0.0
    coeffs = _c_doubles([1.0 + 0.3 * i for i in range(len(sizes))], len(sizes))  # (alive through the calls)
    factors = _c_doubles([1.0 - 0.01 * i for i in range(len(sizes))], len(sizes))
    for decay, divisors in ((1.0, None), (0.999, [1.0 + 0.05 * i for i in range(len(sizes))])):
        params = [torch.randn(k, generator=g) for k in sizes]
        expected, m_expected, y = [p.clone() for p in params], torch.full((n + 3,), 7.0), t.clone()
        divide_where_nonzero_(y, r, m_expected[:n], None, *(() if divisors is None else (segs, divisors)))
        compose_descend_(y, r, 1e-3, coeffs[0], factors[0], expected, segs, decay, -1e-3)
        v = None if divisors is None else _c_doubles(divisors, len(sizes))
        for flat in (False, True):
            mine, m = [p.clone() for p in params], torch.full((n + 3,), 7.0)
            dests = destination_addresses(mine, sizes)
            tail = (1e-3, coeffs[1], factors[1], segs.offsets.data_ptr(), len(sizes), dests.data_ptr(), decay,
                    decay != 1.0, -1e-3, m.data_ptr(), None if v is None else v[1])
            if flat:
                lib.co_divide_zero_descend(t.data_ptr(), r.data_ptr(), *tail)
            else:
                lib.co_rows_divide_zero_descend(rows.data_ptr(), rows.stride(0), chunk, block, r.data_ptr(), *tail)
            ok = ok and torch.equal(m.view(torch.int32), m_expected.view(torch.int32)) and all(
                torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(mine, expected))
    return ok


_kept_compress: list = []  # [whether the local momentum's pass forms m from kept rows as the update wrote it]


def kept_compress_agrees() -> bool:
    """Whether ``co_lerp_scale_clamp_compress_kept`` (the local momentum's pass with ``m`` formed
    from the last result's kept rows) gives, on this machine, the bits of the same pass reading the
    ``m`` that ``co_rows_divide_zero_descend`` wrote from those rows: checked once per process at
    first use (:func:`kept_pass_agrees`)."""
    if not _kept_compress:
        lib = cpu.library()
        _kept_compress.append(lib is not None and divide_descend_agrees() and kept_pass_agrees(lib, _write_m, True))
    return _kept_compress[0]


def _write_m(lib, prev, chunk, block, r, segments, divisors, m) -> None:
    """``m`` <- ``(y / r) / divisors`` from the rows ``prev``, as the update writes it."""
    nseg = len(segments)
    ones, v = _c_doubles([1.0] * nseg, nseg), None if divisors is None else _c_doubles(divisors, nseg)
    params = [torch.zeros(k) for k in segments.sizes]
    dests = destination_addresses(params, segments.sizes)  # (alive through the call)
    lib.co_rows_divide_zero_descend(prev.data_ptr(), prev.stride(0), chunk, block, r.data_ptr(), 1e-3, ones[1],
                                    ones[1], segments.offsets.data_ptr(), nseg, dests.data_ptr(), 1.0, 0, -1e-3,
                                    m.data_ptr(), None if v is None else v[1])


def kept_pass_agrees(lib, write_m, divided: bool) -> bool:
    """Whether the local momentum's pass gives the same bits with ``m`` formed from a result's rows
    (``co_lerp_scale_clamp_compress_kept``) as reading the ``m`` that ``write_m(lib, rows, chunk,
    block, r, segments, divisors, m)`` wrote from those rows: segments with and without vector
    tails, an empty one, ``r == 0``, both of ``torch.lerp``'s formulas, with divisors (``divided``)
    and without, the gradients gathered and where they lie."""
    g, segs, chunk, block, prev, _ = check_case(43)
    sizes, n, nseg, world, ok = segs.sizes, segs.numel, len(segs), prev.shape[0], True
    r = torch.rand(n, generator=g) * 3
    r[::9] = 0.0
    bounds = _c_doubles([0.5 + 0.25 * i for i in range(nseg)], nseg)
    scales = _c_doubles([1.0 + 0.1 * i for i in range(nseg)], nseg)
    x = torch.randn(n, generator=g)
    grads = [t.clone() for t in segs.split(x)]
    sources = source_addresses(grads, sizes)
    for weight, divisors in ((0.1, None), (0.9, [1.0 + 0.05 * i for i in range(nseg)] if divided else None)):
        v = None if divisors is None else _c_doubles(divisors, nseg)
        m = torch.full((n,), 7.0)
        write_m(lib, prev, chunk, block, r, segs, divisors, m)
        start = torch.randn(n, generator=g)
        for srcs in (None, sources):
            outs = []
            for kept in (False, True):
                error, rows = start.clone(), torch.zeros_like(prev)
                tail = (bounds[1], scales[1], segs.offsets.data_ptr(), nseg, error.data_ptr(), rows.data_ptr(),
                        rows.stride(0), world, chunk, block, n)
                if kept:
                    lib.co_lerp_scale_clamp_compress_kept(prev.data_ptr(), prev.stride(0), None if v is None else v[1],
                                                          None if srcs is None else srcs.data_ptr(), x.data_ptr(),
                                                          weight, r.data_ptr(), *tail)
                elif srcs is None:
                    lib.co_lerp_scale_clamp_compress_rows(x.data_ptr(), m.data_ptr(), weight, r.data_ptr(), *tail)
                else:
                    lib.co_lerp_scale_clamp_compress_sources(srcs.data_ptr(), x.data_ptr(), m.data_ptr(), weight,
                                                             r.data_ptr(), *tail)
                outs.append((error.view(torch.int32), rows))
            ok = ok and all(torch.equal(a, b) for a, b in zip(*outs))
    return ok


def rows_keep_descend_(result: CompressedResult, den: torch.Tensor, m: torch.Tensor | None, factors, dests: list,
                       segments: Segments, decay: float, alpha: float) -> bool:
    """The momentum exchange's update from the result's rows in one native pass (the module doc;
    ``m`` ``None``: not kept, ZeRO's momentum is the rows); ``False``, with nothing done, where it
    cannot run here."""
    n = segments.numel
    if not result.rows.is_cpu or result.rows.shape[0] * result.chunk < n or len(dests) != len(segments):
        return False
    flats = (den,) if m is None else (den, m)
    lib = _native(*flats) if all(t.numel() >= n and t.dim() == 1 for t in flats) else None
    addresses = destination_addresses(dests, segments.sizes) if lib is not None else None
    if addresses is None or not keep_descend_agrees():
        return False
    f = _c_doubles([1.0] * len(segments) if factors is None else factors, len(segments))  # (alive through the call)
    lib.co_rows_keep_descend(result.rows.data_ptr(), result.rows.stride(0), result.chunk, result.block,
                             den.data_ptr(), None if m is None else m.data_ptr(), f[1], segments.offsets.data_ptr(),
                             len(segments),
                             addresses.data_ptr(), float(decay), decay != 1.0, float(alpha))
    return True


def compose_keep_descend_(y: torch.Tensor, den: torch.Tensor, m: torch.Tensor, factors, dests: list,
                          segments: Segments, decay: float, alpha: float) -> None:
    """:func:`rows_keep_descend_` composed in PyTorch from the decompressed ``y`` (overwritten: the
    direction), as the momentum exchange's update composes it: the oracle of the check."""
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


_keep_descend: list = []  # [whether co_rows_keep_descend gave the composition's bits here]


def keep_descend_agrees() -> bool:
    """Whether the C pass of :func:`rows_keep_descend_` gives :func:`compose_keep_descend_`'s bits
    on this machine (checked once per process, at first use: segments with and without vector
    tails, an empty one, ``den == inf`` where ``v_f == 0``, with and without decay and factors)."""
    if not _keep_descend:
        lib = cpu.library()
        _keep_descend.append(lib is not None and _keep_descend_check(lib))
    return _keep_descend[0]


def check_case(seed: int) -> tuple:
    """The case the checks at first use run the passes from a result's rows on: ``(generator,
    segments, chunk, block, rows, y)``, segments of sizes with and without vector tails and an empty
    one, the rows of 2 chunks (blocks of 256) compressed from random values, ``y`` their values."""
    g = torch.Generator().manual_seed(seed)
    segments = Segments([7, 1411, 0, 33, 4099, 16, 1])
    n, world, block = segments.numel, 2, 256
    chunk = -(-n // (32 * world)) * 32
    rows = torch.zeros(world, reference.rows_layout(chunk, block)[1], dtype=torch.uint8)
    reference.compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    y = torch.empty(n)
    reference.decompress_rows_(rows, y, chunk, block)
    return g, segments, chunk, block, rows, y


def _keep_descend_check(lib) -> bool:
    g, segments, chunk, block, rows, t = check_case(37)
    sizes, n = segments.sizes, segments.numel
    den = torch.rand(n, generator=g) * 1e-2 + 1e-8
    den[::11] = float("inf")
    ok = True
    for decay, factors, kept in ((1.0, None, True), (0.999, [1.0 - 0.03 * i for i in range(len(sizes))], True),
                                 (0.999, None, False)):
        params = [torch.randn(k, generator=g) for k in sizes]
        expected = [p.clone() for p in params]
        m, m_expected, y = torch.zeros(n), torch.zeros(n), t.clone()
        compose_keep_descend_(y, den, m_expected if kept else None, factors, expected, segments, decay, -1e-3)
        f = _c_doubles([1.0] * len(sizes) if factors is None else factors, len(sizes))  # (alive through the call)
        dests = destination_addresses(params, sizes)
        lib.co_rows_keep_descend(rows.data_ptr(), rows.stride(0), chunk, block, den.data_ptr(),
                                 m.data_ptr() if kept else None, f[1],
                                 segments.offsets.data_ptr(), len(sizes), dests.data_ptr(), decay, decay != 1.0, -1e-3)
        ok = ok and torch.equal(m.view(torch.int32), m_expected.view(torch.int32)) and all(
            torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(params, expected))
    return ok
