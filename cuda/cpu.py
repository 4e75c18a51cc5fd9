"""The C implementation of the passes (the library :mod:`~compressed_opt.cuda.build` compiles from
``onebit_cpu.c``, ``segmented_cpu.c``, ``lamb_cpu.c``, ``zero_one_cpu.c`` and ``zero_cpu.c``), for
contiguous fp32 CPU tensors: the compression kernels, and the segmented passes of the 1-bit
exchange around them, each the pass of that name in :mod:`~compressed_opt.cuda.reference` bit for
bit (the registry's harness checks those whose rounding depends on PyTorch's own CPU kernels).

The passes take tensors by pointer: a bucket's parameters are written through their own memory and
its gradients read where they lie, each checked as its address is taken (:class:`Sources`,
:class:`Destinations`; a tensor a C pass cannot address sends that call to the reference). A pass
here takes arguments :mod:`compressed_opt.cuda.registry` bound it to after checking them once (the
buffers of one bucket geometry); :mod:`compressed_opt.cuda.segmented` holds the checked forms.
"""
from __future__ import annotations

import array
import ctypes
import functools
import os

import torch

from . import build, harness, reference
from .segments import Segments

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The C library with its functions declared, or ``None`` where none can be loaded or built here
    (:func:`compressed_opt.cuda.build.load`, once per process: it warns once on a fallback)."""
    return build.load(_declare)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.co_compress_rows.argtypes = [p, p, p, i64, i64, i64, i64, i64]
    lib.co_compress_rows.restype = None
    lib.co_average_compress_rows.argtypes = [p, i64, i64, i64, i64, p, p, i64]
    lib.co_average_compress_rows.restype = ctypes.c_int
    lib.co_decompress_rows.argtypes = [p, i64, i64, i64, i64, p, i64]
    lib.co_decompress_rows.restype = None
    lib.co_has_avx2.restype = ctypes.c_int
    lib.co_segment_sumsq.argtypes = [p, p, i64, p]
    lib.co_segment_sumsq.restype = None
    lib.co_sumsq_each.argtypes = [p, p, i64, p]
    lib.co_direction_sumsq.argtypes = [p, p, p, p, f32, p, i64, p]
    lib.co_sumsq_each.restype = None
    lib.co_direction_sumsq.restype = None
    lib.co_lerp_scale_clamp.argtypes = [p, p, f32, p, p, p, p, i64]
    lib.co_lerp_scale_clamp.restype = None
    lib.co_lerp_scale_clamp_compress_rows.argtypes = [p, p, f32, p, p, p, p, i64, p, p, i64, i64, i64, i64, i64]
    lib.co_lerp_scale_clamp_compress_rows.restype = None
    lib.co_lerp_scale_clamp_compress_sources.argtypes = [p, p, p, f32, p, p, p, p, i64, p, p, i64, i64, i64, i64,
                                                         i64]
    lib.co_lerp_scale_clamp_compress_sources.restype = None
    lib.co_zero_momentum_compress_rows.argtypes = [p, p, p, p, p, p, p, i64, p, p, i64, i64, i64, i64]
    lib.co_zero_local_momentum.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, i64, p]
    lib.co_zero_momentum_compress_rows.restype = None
    lib.co_zero_local_momentum.restype = None
    lib.co_zero_rows_descend.argtypes = [p, i64, i64, i64, p, f32, p, p, p, i64, p, f32, ctypes.c_int, f32]
    lib.co_zero_rows_descend.restype = None
    lib.co_rows_divide_zero_descend.argtypes = [p, i64, i64, i64, p, f32, p, p, p, i64, p, f32, ctypes.c_int, f32, p, p]
    lib.co_rows_divide_zero_descend.restype = None
    lib.co_divide_zero_descend.argtypes = [p, p, f32, p, p, p, i64, p, f32, ctypes.c_int, f32, p, p]
    lib.co_divide_zero_descend.restype = None
    lib.co_rows_quotient_finite.argtypes = [p, i64, i64, i64, p, i64, i64, p]
    lib.co_rows_quotient_finite.restype = None
    lib.co_zero_lamb_rows_descend.argtypes = [p, i64, i64, i64, p, f32, p, p, i64, p, p, p]
    lib.co_zero_lamb_rows_descend.restype = None
    lib.co_scale_clamp_compress_rows.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, i64, i64]
    lib.co_scale_clamp_compress_rows.restype = None
    lib.co_lerp_compress_rows.argtypes = [p, p, f32, i64, p, p, i64, i64, i64, i64, i64]
    lib.co_lerp_compress_rows.restype = None
    lib.co_lerp_compress_sources.argtypes = [p, p, p, f32, p, i64, p, p, i64, i64, i64, i64, i64]
    lib.co_lerp_compress_sources.restype = None
    lib.co_scale_clamp.argtypes = [p, p, p, p, i64]
    lib.co_scale_clamp.restype = None
    lib.co_gather.argtypes = [p, p, p, i64, f32, ctypes.c_int, p]
    lib.co_gather.restype = None
    lib.co_divide_where_nonzero.argtypes = [p, p, p, i64]
    lib.co_divide_where_nonzero.restype = None
    lib.co_divide_where_nonzero_segments.argtypes = [p, p, p, p, p, i64]
    lib.co_divide_where_nonzero_segments.restype = None
    lib.co_rows_keep_descend.argtypes = [p, i64, i64, i64, p, p, p, p, i64, p, f32, ctypes.c_int, f32]
    lib.co_rows_keep_descend.restype = None
    lib.co_lamb_variance_maxima.argtypes = [p, p, p, p, p, p, p, i64, f32, f32, f32, f32, f32, p]
    lib.co_lamb_variance_maxima.restype = None
    lib.co_lamb_rows_variance_maxima.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, i64, f32, f32, f32, f32, f32, p]
    lib.co_lamb_rows_variance_maxima.restype = None
    lib.co_lamb_descend.argtypes = [p, p, p, p, i64, p, p]
    lib.co_lamb_descend.restype = None
    lib.co_zo_local_step.argtypes = [p, p, p, p, p, p, p, i64, i64, f32, f32, f32, ctypes.c_int, p]
    lib.co_zo_local_step.restype = None
    lib.co_zo_sync_before.argtypes = [p, p, p, p, p, p, i64, i64, f32, f32, p]
    lib.co_zo_sync_before.restype = None
    lib.co_zo_sync_after.argtypes = [p, p, p, p, p, p, p, i64, i64, f32, f32, ctypes.c_int, p, p]
    lib.co_zo_sync_after.restype = None
    lib.co_zo_sync_after_rows.argtypes = [p, p, i64, i64, i64, p, p, p, p, p, p, i64, i64, f32, f32, ctypes.c_int, p,
                                          p]
    lib.co_zo_sync_after_rows.restype = None
    lib.co_zo_sync_before_compress_rows.argtypes = [p, p, p, p, p, f32, f32, p, p, p, p, i64, p, p, i64, i64, i64,
                                                    i64, i64]
    lib.co_zo_sync_before_compress_rows.restype = None
    lib.co_zo_phase_a_rows.argtypes = [p, p, i64, i64, i64, p, p, p, p, i64, f32, f32, ctypes.c_int, f32]
    lib.co_zo_phase_a_rows.restype = None
    lib.co_lamb_warmup_moments.argtypes = [p, p, p, i64, f32, f32, f32]
    lib.co_lamb_warmup_moments.restype = None
    lib.co_lamb_warmup_direction.argtypes = [p, p, p, p, p, i64, f32, ctypes.c_int, f32, f32, f32, ctypes.c_int]
    lib.co_lamb_warmup_direction.restype = None
    lib.co_lamb_step_layers.argtypes = [p, p, p, i64, p]
    lib.co_lamb_step_layers.restype = None
    return lib


# --- where the C passes may read and write ------------------------------------------------------------
def library_allowed() -> bool:
    """Whether the C passes may be used (``COMPRESSED_OPT_KERNELS=reference``: never)."""
    return os.environ.get("COMPRESSED_OPT_KERNELS") != "reference"


def addressable(t: torch.Tensor) -> bool:
    """Whether a kernel may address ``t``'s elements at ``data_ptr()``: a ``torch.Tensor`` or
    ``nn.Parameter`` itself (not a subclass such as DTensor, whose ``data_ptr()`` is not its
    elements': 0, its elements are its local shard's), with storage (or no elements). Exported as
    ``compressed_opt.cuda.plain_memory``."""
    return type(t) in _PLAIN_TYPES and (t.numel() == 0 or t.data_ptr() != 0)


def plain_cpu_float(t: torch.Tensor) -> bool:
    """Whether the C passes may take ``t`` by pointer: contiguous fp32 CPU memory they can address."""
    return addressable(t) and t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()


def plain_cpu_floats(sources: list) -> bool:
    """Whether the C passes may read every source (``None``: none): :func:`plain_cpu_float`."""
    if isinstance(sources, Sources):
        return True
    return all(s is None or plain_cpu_float(s) for s in sources)


def native(*tensors: torch.Tensor):
    """The C library where every tensor is contiguous fp32 CPU memory and it is allowed, else ``None``."""
    if not library_allowed() or not all(plain_cpu_float(t) for t in tensors):
        return None
    return library()


def readable_in_place(sources: list) -> bool:
    """Whether the C passes read every one of ``sources`` where it lies (none ``None``): plain
    contiguous fp32 CPU memory, and the C library here and allowed."""
    if isinstance(sources, Sources):
        return True
    return (all(s is not None for s in sources) and plain_cpu_floats(sources) and library_allowed()
            and library() is not None)


def source_addresses(sources: list, sizes: list[int]) -> torch.Tensor:
    """Each source's address (0 for ``None`` or an empty one), checked against its segment's size."""
    if isinstance(sources, Sources):
        return sources.addresses
    for src, n in zip(sources, sizes):
        if src is not None and src.numel() != n:
            raise ValueError(f"a source of {src.numel()} elements for a segment of {n}")
    return torch.tensor([0 if src is None or not src.numel() else src.data_ptr() for src in sources],
                        dtype=torch.int64)


def _plain_addresses(tensors: list, sizes: list[int], what: str) -> list[int] | None:
    """Each tensor's address (0 for an empty one), in one walk that checks each as it goes (five
    attribute reads a tensor, the least a step pays per tensor), or ``None`` where one is not a
    plain contiguous fp32 CPU tensor with storage (``None`` included). Raises ``ValueError`` where
    their number or a size is not the segments' (``what``: the tensors, for the message)."""
    if len(tensors) != len(sizes):
        raise ValueError(f"one {what} per segment is needed ({len(sizes)}), got {len(tensors)}")
    f32, plain, out = torch.float32, _PLAIN_TYPES, []
    append = out.append
    for t, n in zip(tensors, sizes):
        if type(t) not in plain:
            return None
        if t.numel() != n:
            raise ValueError(f"a {what} of {t.numel()} elements for a segment of {n}")
        if t.dtype is not f32 or not t.is_cpu or not t.is_contiguous():
            return None
        ptr = t.data_ptr() if n else 0
        if n and not ptr:
            return None
        append(ptr)
    return out


def destination_addresses(dests: list, sizes: list[int]) -> torch.Tensor | None:
    """Each destination's address (0 for an empty one; int64), or ``None`` where one is not a plain
    contiguous fp32 CPU tensor with storage (a C pass cannot write it). Raises ``ValueError`` where
    their number or a size is not the segments'. :class:`Destinations` give the addresses they hold."""
    if isinstance(dests, Destinations):
        if len(dests) != len(sizes):
            raise ValueError(f"one destination per segment is needed ({len(sizes)}), got {len(dests)}")
        return dests.addresses
    out = _plain_addresses(dests, sizes, "destination")
    return None if out is None else torch.tensor(out, dtype=torch.int64)


class Sources(list):
    """Tensors the C passes read where they lie, one per segment (a bucket's gradients), checked
    once with their addresses made once (:attr:`addresses`), for the passes of one step. They must
    not change before those passes ran."""

    @classmethod
    def of(cls, tensors: list, sizes: list[int]) -> Sources | None:
        """``tensors`` as :class:`Sources`, or ``None`` where a C pass cannot read them all
        (checked and addressed in one walk; the library loaded and allowed)."""
        if not library_allowed() or library() is None:
            return None
        return sources(tensors, sizes)


class Destinations(list):
    """Tensors the C passes write through their own memory, one per segment (a bucket's
    parameters), checked once with their addresses made once (:attr:`addresses`)."""

    @classmethod
    def of(cls, tensors: list, sizes: list[int]) -> Destinations | None:
        """``tensors`` as :class:`Destinations`, or ``None`` where a C pass cannot write them all."""
        addresses = destination_addresses(tensors, sizes)
        if addresses is None:
            return None
        out = cls(tensors)
        out.addresses = addresses
        return out


def c_doubles(values, n: int) -> tuple[object, int]:
    """``values`` (a tensor or a sequence of ``n`` numbers) as ``n`` C doubles: ``(what keeps them
    alive, their address)`` (a list in an ``array.array``: a sixth of a ctypes array's cost, a
    thirtieth of a tensor's)."""
    if isinstance(values, torch.Tensor):
        t = torch.as_tensor(values, dtype=torch.float64).contiguous()
        if t.shape != (n,):
            raise ValueError(f"one value per segment is needed ({n}), got shape {tuple(t.shape)}")
        return t, t.data_ptr()
    if len(values) != n:
        raise ValueError(f"one value per segment is needed ({n}), got shape ({len(values)},)")
    doubles = array.array("d", values)
    return doubles, doubles.buffer_info()[0]


# --- the compression kernels ------------------------------------------------------------------------
def compress_rows_(x, error, rows, chunk, block):
    library().co_compress_rows(None if x is None else x.data_ptr(), error.data_ptr(), rows.data_ptr(), rows.stride(0),
                               rows.shape[0], chunk, block, error.numel())


def average_compress_rows_(rows, error, out_row, chunk, block):
    if library().co_average_compress_rows(rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block,
                                          error.data_ptr(), out_row.data_ptr(), error.numel()):
        raise ValueError(f"{rows.shape[0]} rows: more than the kernel's weights")  # (checked before the call)


def decompress_rows_(rows, out, chunk, block):
    library().co_decompress_rows(rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, out.data_ptr(),
                                 out.numel())


# --- the segmented passes of the 1-bit exchange (reference.py's, bit for bit) ---------------------------
def sources(grads: list, sizes: list[int]) -> Sources | None:
    """The gradients as the C passes read them where they lie (:class:`Sources`), or ``None``
    (:meth:`Sources.of` without its look at the library: bound only where it is loaded)."""
    addresses = _plain_addresses(grads, sizes, "source")
    if addresses is None:
        return None
    out = Sources(grads)
    out.addresses = torch.tensor(addresses, dtype=torch.int64)
    return out


def sumsq_each(sources: list, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """:func:`compressed_opt.cuda.reference.sumsq_each` in one C pass where the sources are plain
    (accumulated as the gather's sums: PyTorch's norm may differ in the last bit)."""
    if isinstance(sources, Sources):
        addresses = sources.addresses
    elif plain_cpu_floats(sources):
        addresses = source_addresses(sources, segments.sizes)  # (alive through the call)
    else:
        return reference.sumsq_each(sources, segments, out)
    library().co_sumsq_each(addresses.data_ptr(), segments.offsets.data_ptr(), segments.count, out.data_ptr())
    return out


def gather_(sources: list, out: torch.Tensor, segments: Segments, scale: float | None = None,
            sumsq_out: torch.Tensor | None = None) -> None:
    """:func:`compressed_opt.cuda.reference.gather_` in one C pass where the sources are plain; else
    PyTorch's copies, then the C sums of what they wrote (the same sums as the one pass's)."""
    if not isinstance(sources, Sources) and not plain_cpu_floats(sources):
        reference.gather_(sources, out, segments, scale)
        if sumsq_out is not None:
            segment_sumsq(out, segments, sumsq_out)
        return
    addresses = source_addresses(sources, segments.sizes)  # (alive through the call)
    library().co_gather(addresses.data_ptr(), out.data_ptr(),
                        segments.offsets.data_ptr(), segments.count, 1.0 if scale is None else float(scale),
                        scale is not None, None if sumsq_out is None else sumsq_out.data_ptr())


def segment_sumsq(x: torch.Tensor, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    library().co_segment_sumsq(x.data_ptr(), segments.offsets.data_ptr(), segments.count, out.data_ptr())
    return out


def lerp_scale_clamp_(x: torch.Tensor, m: torch.Tensor, weight: float, r: torch.Tensor, bounds,
                      segments: Segments, scales=None) -> None:
    b, bp = c_doubles(bounds, segments.count)
    c, cp = (None, None) if scales is None else c_doubles(scales, segments.count)
    library().co_lerp_scale_clamp(x.data_ptr(), m.data_ptr(), float(weight), r.data_ptr(), bp, cp,
                                  segments.offsets.data_ptr(), segments.count)


def scale_clamp_(x: torch.Tensor, r: torch.Tensor, bounds, segments: Segments) -> None:
    b, bp = c_doubles(bounds, segments.count)
    library().co_scale_clamp(x.data_ptr(), r.data_ptr(), bp, segments.offsets.data_ptr(), segments.count)


def divide_where_nonzero_(y: torch.Tensor, r: torch.Tensor, out: torch.Tensor, zero_index=None,
                          segments: Segments | None = None, divisors=None) -> None:
    """(``zero_index`` unused: the C pass tests ``r`` as it goes.)"""
    if segments is None:
        library().co_divide_where_nonzero(y.data_ptr(), r.data_ptr(), out.data_ptr(), y.numel())
        return
    d, dp = c_doubles(divisors, segments.count)
    library().co_divide_where_nonzero_segments(y.data_ptr(), r.data_ptr(), out.data_ptr(), dp,
                                               segments.offsets.data_ptr(), segments.count)


def _rows_plain(x, error, rows, target) -> bool:
    """Whether a fused pass may compress ``x`` (its own buffer ``target``, flat) into C rows."""
    return (x.dim() == 1 and x.data_ptr() == target.data_ptr() and x.numel() == target.numel()
            and error.numel() <= x.numel() and rows.dtype == torch.uint8 and rows.dim() == 2 and rows.stride(1) == 1
            and rows.is_cpu and error.is_cpu)


class LerpScaleClamp(reference.LerpScaleClamp):
    """The pass, run inside the compression in one C pass over memory (``x`` read, not written;
    the sources read where they lie), bit for bit the pass then the compression; alone, in C."""

    __slots__ = ()

    def apply_(self) -> None:
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        lerp_scale_clamp_(self.x, self.m, self.weight, self.r, self.bounds, self.segments, self.scales)

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        sources, segments = self.sources, self.segments
        if (x.data_ptr() != self.x.data_ptr() or x.numel() != self.x.numel() or x.dim() != 1
                or error.numel() > x.numel() or rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1
                or not rows.is_cpu or not error.is_cpu):
            return False  # (not this pass's buffer, or not C rows)
        if isinstance(sources, Sources):
            addresses = sources.addresses
        elif sources is None or not plain_cpu_floats(sources):
            addresses = None
        else:
            addresses = source_addresses(sources, segments.sizes)  # (alive through the call)
        if sources is not None and addresses is None:
            return False
        b, bp = c_doubles(self.bounds, segments.count)
        c, cp = (None, None) if self.scales is None else c_doubles(self.scales, segments.count)
        args = (x.data_ptr(), self.m.data_ptr(), self.weight, self.r.data_ptr(), bp, cp, segments.offsets.data_ptr(),
                segments.count, error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block,
                error.numel())
        if addresses is None:
            library().co_lerp_scale_clamp_compress_rows(*args)
        else:
            library().co_lerp_scale_clamp_compress_sources(addresses.data_ptr(), *args)
        return True


class ScaleClamp(reference.ScaleClamp):
    """The pass inside the compression in one C pass (the sources read where they lie); alone, in C."""

    __slots__ = ()

    def apply_(self) -> None:
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        scale_clamp_(self.x, self.r, self.bounds, self.segments)

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        sources, segments = self.sources, self.segments
        if not _rows_plain(x, error, rows, self.x) or (sources is not None and not plain_cpu_floats(sources)):
            return False
        b, bp = c_doubles(self.bounds, segments.count)
        tail = (error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, error.numel())
        if sources is None:
            library().co_scale_clamp_compress_rows(x.data_ptr(), self.r.data_ptr(), bp, segments.offsets.data_ptr(),
                                                   segments.count, *tail)
        else:  # (the lerp's pass without m: the scale and clamp alone)
            addresses = source_addresses(sources, segments.sizes)  # (alive through the call)
            library().co_lerp_scale_clamp_compress_sources(addresses.data_ptr(),
                                                           x.data_ptr(), None, 0.0, self.r.data_ptr(), bp, None,
                                                           segments.offsets.data_ptr(), segments.count, *tail)
        return True


class Lerp(reference.Lerp):
    """The momentum exchange's local momentum inside the compression in one C pass, where the
    registry's harness found the C lerp rounding as ``torch.lerp`` does here."""

    __slots__ = ()

    def apply_(self) -> None:
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        torch.lerp(self.m, self.x, self.weight, out=self.x)

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        sources, segments = self.sources, self.segments
        if not _rows_plain(x, error, rows, self.x) or (sources is not None and not plain_cpu_floats(sources)):
            return False
        tail = (error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, error.numel())
        if sources is None:
            library().co_lerp_compress_rows(x.data_ptr(), self.m.data_ptr(), self.weight, self.m.numel(), *tail)
        else:
            addresses = source_addresses(sources, segments.sizes)  # (alive through the call)
            library().co_lerp_compress_sources(addresses.data_ptr(), x.data_ptr(),
                                               self.m.data_ptr(), self.weight, segments.offsets.data_ptr(),
                                               segments.count, *tail)
        return True


def divide_descend_(y, r: torch.Tensor, out: torch.Tensor, segments: Segments, divisors,
                    descend: reference.Descend, zero_index: torch.Tensor | None = None) -> None:
    """:func:`compressed_opt.cuda.reference.divide_descend_` in one C pass (``y``, ``r`` and each
    parameter read once; ``y`` from the result's rows, decompressed tile by tile in cache, where it
    travelled as them), where the parameters are plain fp32 CPU memory and ``y`` is not ``out``."""
    count = segments.count
    flat = isinstance(y, torch.Tensor)
    dests = destination_addresses(descend.dests, segments.sizes)
    if dests is None or (flat and y.data_ptr() == out.data_ptr()) or (not flat and not y.rows.is_cpu):
        return reference.divide_descend_(y, r, out, segments, divisors, descend, zero_index)
    c, f = c_doubles(descend.coeffs, count), c_doubles(descend.factors, count)  # (alive through the call)
    v = None if divisors is None else c_doubles(divisors, count)
    tail = (descend.eps, c[1], f[1], segments.offsets.data_ptr(), count, dests.data_ptr(), descend.decay,
            descend.decay != 1.0, descend.alpha, out.data_ptr(), None if v is None else v[1])
    if flat:
        library().co_divide_zero_descend(y.data_ptr(), r.data_ptr(), *tail)
    else:
        library().co_rows_divide_zero_descend(y.rows.data_ptr(), y.rows.stride(0), y.chunk, y.block, r.data_ptr(),
                                              *tail)


def keep_descend_(y, den: torch.Tensor, m: torch.Tensor | None, factors, dests: list, segments: Segments,
                  decay: float, alpha: float) -> None:
    """:func:`compressed_opt.cuda.reference.keep_descend_` in one C pass from the result's 1-bit rows
    (decompressed tile by tile in cache), where ``y`` travelled as them and the parameters are plain
    fp32 CPU memory."""
    addresses = None if isinstance(y, torch.Tensor) or not y.rows.is_cpu else destination_addresses(dests,
                                                                                                     segments.sizes)
    if addresses is None:
        return reference.keep_descend_(y, den, m, factors, dests, segments, decay, alpha)
    f = c_doubles([1.0] * segments.count if factors is None else factors, segments.count)  # (alive through the call)
    library().co_rows_keep_descend(y.rows.data_ptr(), y.rows.stride(0), y.chunk, y.block, den.data_ptr(),
                                   None if m is None else m.data_ptr(), f[1], segments.offsets.data_ptr(),
                                   segments.count, addresses.data_ptr(), float(decay), decay != 1.0, float(alpha))


# --- the harness's checks of the passes whose rounding is PyTorch's (compressed_opt.cuda.harness) ------
def _lerp_compress_check(n: int, weight: float, native: bool):
    """``co_lerp_compress_rows`` against ``torch.lerp`` then the compression."""
    if library() is None:
        return None
    g = torch.Generator().manual_seed(n)
    x, m, e = (torch.randn(n, generator=g) for _ in range(3))
    x[::9] = 0.0
    chunk, block = -(-n // 32) * 32, 256
    rows = torch.zeros(1, reference.rows_layout(chunk, block)[1], dtype=torch.uint8)
    if native:
        library().co_lerp_compress_rows(x.data_ptr(), m.data_ptr(), weight, n, e.data_ptr(), rows.data_ptr(),
                                        rows.stride(0), 1, chunk, block, n)
    else:
        torch.lerp(m, x, weight, out=x)
        compress_rows_(x, e, rows, chunk, block)
    return e, rows


def _divide_descend_check(decay: float, divided: bool, flat: bool, native: bool):
    """:func:`divide_descend_`'s C passes (from a flat ``y``; from the rows, ``co_rows_divide_zero_descend``)
    against the reference's from the rows' values."""
    if library() is None:
        return None
    g, segs, chunk, block, rows, y = harness.rows_case(41)
    count, n = segs.count, segs.numel
    r = torch.rand(n, generator=g) * 3
    r[::9] = 0.0
    coeffs, factors = [1.0 + 0.3 * i for i in range(count)], [1.0 - 0.01 * i for i in range(count)]
    divisors = [1.0 + 0.05 * i for i in range(count)] if divided else None
    params, m = [torch.randn(k, generator=g) for k in segs.sizes], torch.full((n + 3,), 7.0)
    descend = reference.Descend(params, 1e-3, coeffs, factors, decay, -1e-3)
    if not native:
        reference.divide_descend_(y, r, m, segs, divisors, descend)
    elif flat:
        divide_descend_(y, r, m, segs, divisors, descend)
    else:
        held = [c_doubles(v, count) for v in (coeffs, factors, divisors or [1.0] * count)]  # (alive through the call)
        dests = destination_addresses(params, segs.sizes)
        library().co_rows_divide_zero_descend(
            rows.data_ptr(), rows.stride(0), chunk, block, r.data_ptr(), 1e-3, held[0][1], held[1][1],
            segs.offsets.data_ptr(), count, dests.data_ptr(), decay, decay != 1.0, -1e-3, m.data_ptr(),
            held[2][1] if divided else None)
    return m, params


def _keep_descend_check(decay: float, scaled: bool, kept: bool, native: bool):
    """``co_rows_keep_descend`` (:func:`keep_descend_`) against the reference's from the rows' values."""
    if library() is None:
        return None
    g, segs, chunk, block, rows, y = harness.rows_case(37)
    n = segs.numel
    den = torch.rand(n, generator=g) * 1e-2 + 1e-8
    den[::11] = float("inf")
    factors = [1.0 - 0.03 * i for i in range(segs.count)] if scaled else None
    params, m = [torch.randn(k, generator=g) for k in segs.sizes], torch.zeros(n)
    if not native:
        reference.keep_descend_(y, den, m if kept else None, factors, params, segs, decay, -1e-3)
        return m, params
    f = c_doubles([1.0] * segs.count if factors is None else factors, segs.count)  # (alive through the call)
    dests = destination_addresses(params, segs.sizes)
    library().co_rows_keep_descend(rows.data_ptr(), rows.stride(0), chunk, block, den.data_ptr(),
                                   m.data_ptr() if kept else None, f[1], segs.offsets.data_ptr(), segs.count,
                                   dests.data_ptr(), decay, decay != 1.0, -1e-3)
    return m, params


harness.register("lerp_compress", harness.Check(
    ((7, 0.1), (1411, 0.1), (1411, 0.9), (4099, 0.75), (4099, 0.25)), _lerp_compress_check))
harness.register("divide_descend", harness.Check(
    tuple((decay, divided, flat) for decay, divided in ((1.0, False), (0.999, True)) for flat in (False, True)),
    _divide_descend_check))
harness.register("keep_descend", harness.Check(((1.0, False, True), (0.999, True, True), (0.999, False, False)),
                                               _keep_descend_check))
