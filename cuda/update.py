"""The preconditioned exchange's last pass: the momentum taken back from the exchanged average and
the update it makes, in one pass over memory (docs/design.md 2.3.1).

``divide_descend_(y, r, out, segments, divisors, descend, zero_index=None)``
    ``out <- y / r`` (0 where ``r == 0``), divided by ``divisors[s]`` on segment ``s`` (none:
    ``None``), then ``descend`` (a :class:`Descend`, ``dests[s] <- dests[s] * decay +
    (scales[s] * y) * a``) with the same ``y``.

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
memory), where the other passes decompress them into the result's buffer first.

It is :func:`~compressed_opt.cuda.segmented.divide_where_nonzero_` then :func:`descend_scaled_`,
bit for bit: on contiguous fp32 CPU tensors ``segmented_cpu.c`` runs both in one loop (``y``, ``r``,
``a`` and each destination read once; the C library forms each element with the same inline
functions as the two passes), elsewhere the two passes run in turn. ``descend_scaled_``'s native
element is ``fma(c y, a, p d)``, PyTorch's ``mul_`` then ``addcmul_`` as they round on CPUs with FMA;
:func:`descend_agrees` checks it at first use, and where it differs both update passes compose, so a
rank whose parameters the C pass cannot write (or that has no compiler) keeps the others' bits.
"""
from __future__ import annotations

import torch

from . import cpu, reference
from .addresses import destination_addresses
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


def descend_scaled_(dests: list, y: torch.Tensor, a: torch.Tensor, segments: Segments, decay: float,
                    scales) -> None:
    """``dests[s] <- dests[s] * decay + (scales[s] * y) * a`` over segment ``s`` of the flat ``y``
    and ``a`` (``dests``: one tensor per segment, of its size, e.g. a bucket's parameters; no
    multiplication where ``decay`` is 1): ``torch._foreach_mul_`` then ``torch._foreach_addcmul_``,
    or the native pass that reads and writes each destination once, where it gives their bits here
    (:func:`descend_agrees`)."""
    if len(dests) != len(segments):
        raise ValueError(f"one destination per segment is needed ({len(segments)}), got {len(dests)}")
    _check(segments, y, a)
    c, cp = _c_doubles(scales, len(segments))  # (checks their number on either path)
    lib = _native(y, a)
    addresses = destination_addresses(dests, segments.sizes) if lib is not None and descend_agrees() else None
    if addresses is None:
        _compose_descend_scaled(dests, y, a, segments, decay, scales)
        return
    lib.co_descend_scaled(addresses.data_ptr(), y.data_ptr(), a.data_ptr(), segments.offsets.data_ptr(),
                          len(segments), float(decay), decay != 1.0, cp)


def _compose_descend_scaled(dests: list, y: torch.Tensor, a: torch.Tensor, segments: Segments, decay: float,
                            scales) -> None:
    if not dests:
        return
    if decay != 1.0:
        torch._foreach_mul_(dests, decay)
    shapes = [p.shape for p in dests]
    torch._foreach_addcmul_(dests, [v.view(s) for v, s in zip(segments.split(y), shapes)],
                            [v.view(s) for v, s in zip(segments.split(a), shapes)], list(scales))


_descend: list = []  # [whether co_descend_scaled gave the composition's bits here]


def descend_agrees() -> bool:
    """Whether the C library's update element (``co_descend_scaled``'s; ``co_divide_descend`` and
    ``co_rows_divide_descend`` form it alike: ``fma(c y, a, p d)``) gives the composition's bits on
    this machine (torch's ``addcmul`` one FMA where the CPU has one), checked once per process at
    first use (with and without decay, segments with and without vector tails, an empty one). Where
    it does not, the update composes: every rank then computes the same bits, whichever path it takes."""
    if not _descend:
        lib, agree = cpu.library(), True
        g = torch.Generator().manual_seed(31)
        segments = Segments([7, 1411, 0, 4099, 16])
        y, a = torch.randn(segments.numel, generator=g), torch.rand(segments.numel, generator=g)
        scales = [0.5, -2.0, 1.0, 3e-3, 7.0]
        for decay in (1.0, 0.999):
            mine = [torch.randn(n, generator=g) for n in segments.sizes]
            theirs = [p.clone() for p in mine]
            _compose_descend_scaled(theirs, y, a, segments, decay, scales)
            if lib is not None:
                dests, c = destination_addresses(mine, segments.sizes), _c_doubles(scales, len(segments))  # (alive)
                lib.co_descend_scaled(dests.data_ptr(), y.data_ptr(), a.data_ptr(), segments.offsets.data_ptr(),
                                      len(segments), decay, decay != 1.0, c[1])
            agree = agree and lib is not None and all(
                torch.equal(p.view(torch.int32), q.view(torch.int32)) for p, q in zip(mine, theirs))
        _descend.append(agree)
    return _descend[0]


class Descend:
    """``descend_scaled_(dests, y, a, segments, decay, scales)``'s arguments but ``y`` and
    ``segments``: an update to run with the ``y`` of another pass (:func:`divide_descend_`)."""

    def __init__(self, dests: list, a: torch.Tensor, decay: float, scales):
        self.dests, self.a, self.decay, self.scales = dests, a, float(decay), scales

    def apply_(self, y: torch.Tensor, segments: Segments) -> None:
        descend_scaled_(self.dests, y, self.a, segments, self.decay, self.scales)


def divide_descend_(y, r: torch.Tensor, out: torch.Tensor, segments: Segments, divisors, descend: Descend,
                    zero_index: torch.Tensor | None = None) -> None:
    """``out <- y / r`` (0 where ``r == 0``; then ``/ divisors[s]`` on segment ``s`` unless
    ``divisors`` is ``None``) and ``descend.dests[s] <- dests[s] * decay + (scales[s] * y) * a``,
    over the segments' elements of the flat ``y``, ``r``, ``out`` and ``descend.a`` (``out`` not
    ``y``). ``y``: a flat tensor, or a :class:`CompressedResult` (decompressed into its buffer
    first where the C pass cannot run).
    ``zero_index``: as for :func:`divide_where_nonzero_` (the two passes' mask)."""
    if len(descend.dests) != len(segments):
        raise ValueError(f"one destination per segment is needed ({len(segments)}), got {len(descend.dests)}")
    compressed = isinstance(y, CompressedResult)
    _check(segments, r, out, descend.a, *(() if compressed else (y,)))
    if compressed and y.rows.shape[0] * y.chunk < segments.numel:
        raise ValueError(f"{y.rows.shape[0]} rows of {y.chunk} elements for {segments.numel} elements")
    n = segments.numel
    if compressed:
        lib = _native(r, out, descend.a) if y.rows.is_cpu else None
    else:
        lib = _native(y, r, out, descend.a) if out.data_ptr() != y.data_ptr() else None
    addresses = (destination_addresses(descend.dests, segments.sizes) if lib is not None and descend_agrees()
                 else None)
    if addresses is None:
        if compressed:
            y = y.expand_()
        with_divisors = () if divisors is None else (segments, divisors)
        divide_where_nonzero_(y[:n], r[:n], out[:n], zero_index, *with_divisors)
        descend.apply_(y, segments)
        return
    nseg = len(segments)
    v, vp = (None, None) if divisors is None else _c_doubles(divisors, nseg)
    c, cp = _c_doubles(descend.scales, nseg)
    tail = (segments.offsets.data_ptr(), nseg, addresses.data_ptr(), descend.a.data_ptr(), descend.decay,
            descend.decay != 1.0, cp)
    if compressed:
        lib.co_rows_divide_descend(y.rows.data_ptr(), y.rows.stride(0), y.chunk, y.block, r.data_ptr(), out.data_ptr(),
                                   vp, *tail)
    else:
        lib.co_divide_descend(y.data_ptr(), r.data_ptr(), out.data_ptr(), vp, *tail)


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
