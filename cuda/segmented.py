"""Segmented element-wise passes: one pass over a flat fp32 buffer made of segments, each with
scalars of its own (docs/design.md 2.3.1, 2.3.2).

A :class:`Segments` is the partition of a flat buffer into consecutive segments (for the
optimizers: a bucket's parameters). The passes fuse what would otherwise be one PyTorch call per
operation and per segment:

``gather_(sources, out, segments, scale=None, sumsq_out=None)``
    segment ``s`` of ``out`` <- ``sources[s] * scale`` (zeros where ``None``); with ``sumsq_out``,
    the segments' sums of squares of what was written, in the same pass.
``segment_sumsq(x, segments, out)``
    ``out[s] = sum_{k in s} x_k^2``, accumulated in float64 (squares of gradients below ~1e-19
    underflow in fp32).
``lerp_scale_clamp_(x, m, weight, r, bounds, segments, scales=None)``
    ``x <- clamp(c_s * r * lerp(m, x, weight), -b_s, b_s)`` element-wise, ``b_s = bounds[s]``,
    ``c_s = scales[s]`` (1 without ``scales``).
``LerpScaleClamp(x, m, weight, r, bounds, segments, scales=None, sources=None)``
    the same pass on ``x``, not run yet: its ``compress_rows_(x, error, rows, chunk, block)`` runs
    it fused with the compression of ``x`` (the kernels' worker side) where it can, one pass over
    memory that never writes ``x``, bit for bit as the two in turn; ``apply_()`` runs it alone.
    With ``sources`` (one tensor per segment: the gradients), ``x`` is ``gather_(sources, x,
    segments)`` not run yet either: the fused pass reads each source where it lies.
    ``ScaleClamp(x, r, bounds, segments)``: the same for ``scale_clamp_``; ``Lerp(x, m, weight)``
    for ``torch.lerp(m, x, weight, out=x)`` (where the C pass is checked to round as it does).
``scale_clamp_(x, r, bounds, segments)``
    ``x <- clamp(r * x, -b_s, b_s)``.
``divide_where_nonzero_(y, r, out, zero_index=None, segments=None, divisors=None)``
    ``out <- y / r``, 0 where ``r == 0`` (``out`` may be ``y``); with ``segments`` and
    ``divisors``, then divided by ``divisors[s]`` on segment ``s``.

CPU tensors run ``segmented_cpu.c`` (one pass, no per-segment call); other devices, and CPUs where
no C compiler exists (or ``COMPRESSED_OPT_KERNELS=reference``), compose the same math from
PyTorch's fused multi-tensor ops (``torch._foreach_*``), which on CUDA launch a few kernels per
pass whatever the number of segments. Both compute in fp32 like PyTorch (the sums in float64); they
may differ in the last bit where the C pass contracts ``a + w * b`` into one FMA. (The updates of
:mod:`compressed_opt.cuda.update` are bit for bit their compositions, checked at first use.)
:class:`LerpScaleClamp`'s compression runs ``onebit_cpu.c`` on CPU tensors and ``onebit.cu`` (CuPy)
on CUDA tensors, each bit for bit its device's pass then the compression.
"""
from __future__ import annotations

import array
import warnings

import torch

from . import cpu, reference
from .addresses import addressable
from .addresses import library_allowed as _library_allowed
from .addresses import plain_cpu_float, plain_cpu_floats, source_addresses


class Segments:
    """Consecutive segments of ``sizes[s]`` elements, starting at element 0 of a flat buffer."""

    def __init__(self, sizes: list[int]):
        self.sizes = [int(n) for n in sizes]
        if any(n < 0 for n in self.sizes):
            raise ValueError("segment sizes must be non-negative")
        offsets = [0]
        for n in self.sizes:
            offsets.append(offsets[-1] + n)
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        self.numel = offsets[-1]
        self._on_device: dict = {}  # device -> a copy of offsets there (made once)

    def offsets_on(self, device: torch.device) -> torch.Tensor:
        """``offsets`` on ``device`` (copied there once)."""
        device = torch.device(device)
        if device.type == "cpu":
            return self.offsets
        if device not in self._on_device:
            self._on_device[device] = self.offsets.to(device)
        return self._on_device[device]

    def __len__(self) -> int:
        return len(self.sizes)

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat[: self.numel].split(self.sizes))


def _native(*tensors: torch.Tensor):
    """The C library when every tensor is a contiguous fp32 CPU tensor and it is allowed, else None."""
    if not _library_allowed():
        return None
    if not all(plain_cpu_float(t) for t in tensors):
        return None
    return cpu.library()


def _check(segments: Segments, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dim() != 1 or t.numel() < segments.numel:
            raise ValueError(f"a flat buffer of at least {segments.numel} elements is needed, got shape "
                             f"{tuple(t.shape)}")


def _doubles(values, n: int) -> torch.Tensor:
    out = torch.as_tensor(values, dtype=torch.float64)
    if out.shape != (n,):
        raise ValueError(f"one value per segment is needed ({n}), got shape {tuple(out.shape)}")
    return out.contiguous()


def _c_doubles(values, n: int) -> tuple[object, int]:
    """``values`` (a tensor or a sequence of ``n`` numbers) as ``n`` C doubles for the C library:
    ``(what keeps them alive, their address)`` (a list in an ``array.array``: a sixth of a ctypes
    array's cost, a thirtieth of a tensor's)."""
    if isinstance(values, torch.Tensor):
        t = _doubles(values, n)
        return t, t.data_ptr()
    if len(values) != n:
        raise ValueError(f"one value per segment is needed ({n}), got shape ({len(values)},)")
    doubles = array.array("d", values)
    return doubles, doubles.buffer_info()[0]


def gather_(sources: list, out: torch.Tensor, segments: Segments, scale: float | None = None,
            sumsq_out: torch.Tensor | None = None) -> None:
    """Segment ``s`` of ``out`` <- ``sources[s]`` (times ``scale``; zeros where ``None``), and with
    ``sumsq_out`` (float64) the per-segment sums of squares of what was written, in one pass."""
    if len(sources) != len(segments):
        raise ValueError(f"one source per segment is needed ({len(segments)}), got {len(sources)}")
    _check(segments, out)
    if sumsq_out is not None and (sumsq_out.shape != (len(segments),) or sumsq_out.dtype != torch.float64):
        raise ValueError(f"sumsq_out must be float64 of shape ({len(segments)},)")
    lib = _native(out) if sumsq_out is None or (sumsq_out.is_cpu and sumsq_out.is_contiguous()) else None
    if lib is not None and plain_cpu_floats(sources):
        addresses = source_addresses(sources, segments.sizes)
        lib.co_gather(addresses.data_ptr(), out.data_ptr(), segments.offsets.data_ptr(), len(segments),
                      1.0 if scale is None else float(scale), scale is not None,
                      None if sumsq_out is None else sumsq_out.data_ptr())
        return
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


def segment_sumsq(x: torch.Tensor, segments: Segments, out: torch.Tensor) -> torch.Tensor:
    """``out[s]`` <- the sum of squares of segment ``s`` of ``x`` (``out``: float64, on ``x``'s device)."""
    _check(segments, x)
    if out.shape != (len(segments),) or out.dtype != torch.float64:
        raise ValueError(f"out must be float64 of shape ({len(segments)},)")
    lib = _native(x) if out.device.type == "cpu" and out.is_contiguous() else None
    if lib is not None:
        lib.co_segment_sumsq(x.data_ptr(), segments.offsets.data_ptr(), len(segments), out.data_ptr())
        return out
    out.zero_()
    views = segments.split(x)
    nonempty = [i for i, n in enumerate(segments.sizes) if n]
    if nonempty:
        norms = torch._foreach_norm([views[i] for i in nonempty], 2, dtype=torch.float64)
        out[nonempty] = torch.stack(norms).to(out).square_()
    return out


def lerp_scale_clamp_(x: torch.Tensor, m: torch.Tensor, weight: float, r: torch.Tensor, bounds,
                      segments: Segments, scales=None) -> None:
    """``x`` <- ``clamp(c_s * (r * lerp(m, x, weight)), -bounds[s], bounds[s])`` on each segment
    ``s`` (``c_s = scales[s]``; 1, exactly the unscaled result, without ``scales``)."""
    _check(segments, x, m, r)
    lib = _native(x, m, r)
    if lib is not None:
        b, bp = _c_doubles(bounds, len(segments))
        c, cp = (None, None) if scales is None else _c_doubles(scales, len(segments))
        lib.co_lerp_scale_clamp(x.data_ptr(), m.data_ptr(), float(weight), r.data_ptr(), bp, cp,
                                segments.offsets.data_ptr(), len(segments))
        return
    b = _doubles(bounds, len(segments))
    c = None if scales is None else _doubles(scales, len(segments))
    n = segments.numel
    torch.lerp(m[:n], x[:n], weight, out=x[:n])
    x[:n].mul_(r[:n])
    if c is not None:
        views = segments.split(x)
        if views:
            torch._foreach_mul_(views, [float(v) for v in c.to(torch.float32).tolist()])
    _clamp_segments_(x, b.tolist(), segments)


class LerpScaleClamp:
    """``lerp_scale_clamp_(x, m, weight, r, bounds, segments, scales)``, not run yet: a pass whose
    result only a compression reads (the local momentum of the preconditioned exchange) runs inside
    that compression (:meth:`compress_rows_`) and never travels to memory; anywhere else, the caller
    runs it alone first (:meth:`apply_`). The arguments are kept, not copied: they must not change
    before the pass runs. ``sources`` (one tensor per segment): ``x``'s segments, not gathered yet
    (:meth:`apply_` gathers them first). ``kept`` (a :class:`~compressed_opt.cuda.update.KeptMomentum`
    of ``m``): the fused C pass forms ``m`` from the last result's kept rows instead of reading it,
    where that object says it still may (the same bits; the rows are 1/32 of ``m``'s bytes)."""

    sources = None
    kept = None

    def __init__(self, x: torch.Tensor, m: torch.Tensor, weight: float, r: torch.Tensor, bounds,
                 segments: Segments, scales=None, sources: list | None = None, kept=None):
        _check(segments, x, m, r)
        if sources is not None and (len(sources) != len(segments) or any(s is None for s in sources)):
            raise ValueError(f"one source tensor per segment is needed ({len(segments)})")
        self.x, self.m, self.weight, self.r = x, m, float(weight), r
        self.bounds, self.segments, self.scales, self.sources, self.kept = bounds, segments, scales, sources, kept

    def apply_(self) -> None:
        """Run the pass on its ``x``, alone (its sources gathered into ``x`` first)."""
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        lerp_scale_clamp_(self.x, self.m, self.weight, self.r, self.bounds, self.segments, self.scales)

    def compress_rows_(self, x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, chunk: int,
                       block: int) -> bool:
        """The pass, then the worker side of the compression, ``compress_rows_(x, error, rows, chunk,
        block)`` (:mod:`compressed_opt.cuda`), in one native pass over memory, bit for bit as
        :meth:`apply_` then the compression: ``x`` (this pass's buffer, as a flat view) is read, not
        written (its values afterwards: unspecified; the compressed allreduce writes its result
        there). ``False``, with nothing done, where no fused pass runs here (not contiguous fp32 CPU
        tensors, no C library or CUDA kernels, another buffer): then :meth:`apply_` and compress. The
        caller has checked the compression's arguments (as for the kernels' unchecked implementations)."""
        n = error.numel()
        if (x.dim() != 1 or x.data_ptr() != self.x.data_ptr() or x.numel() != self.x.numel() or n > x.numel()
                or rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or rows.device != x.device):
            return False
        if x.device.type == "cuda":
            return self.sources is None and self._compress_rows_cuda(x, error, rows, chunk, block)
        lib = _native(*(t for t in (x, self.m, self.r, error) if t is not None))
        if lib is None or (self.sources is not None and not plain_cpu_floats(self.sources)):
            return False
        if self.r is None:  # torch.lerp alone: only where the C pass rounds as it does here
            if not _native_lerp_agrees(lib):
                return False
            tail = (error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, n)
            if self.sources is None:
                lib.co_lerp_compress_rows(x.data_ptr(), self.m.data_ptr(), self.weight, self.m.numel(), *tail)
            else:
                addresses = source_addresses(self.sources, self.segments.sizes)
                lib.co_lerp_compress_sources(addresses.data_ptr(), x.data_ptr(), self.m.data_ptr(), self.weight,
                                             self.segments.offsets.data_ptr(), len(self.segments), *tail)
            return True
        nseg = len(self.segments)
        b, bp = _c_doubles(self.bounds, nseg)
        if self.m is None and self.sources is None:
            lib.co_scale_clamp_compress_rows(x.data_ptr(), self.r.data_ptr(), bp, self.segments.offsets.data_ptr(),
                                             nseg, error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0],
                                             chunk, block, n)
            return True
        c, cp = (None, None) if self.scales is None else _c_doubles(self.scales, nseg)
        addresses = None if self.sources is None else source_addresses(self.sources, self.segments.sizes)
        kept = self.kept
        if (kept is not None and self.m is not None
                and kept.usable(self.m, self.r, self.segments, rows.shape[0], chunk, block)):
            lib.co_lerp_scale_clamp_compress_kept(
                kept.rows.data_ptr(), kept.rows.stride(0), kept.divisors_address,
                None if addresses is None else addresses.data_ptr(), x.data_ptr(), self.weight, self.r.data_ptr(), bp,
                cp, self.segments.offsets.data_ptr(), nseg, error.data_ptr(), rows.data_ptr(), rows.stride(0),
                rows.shape[0], chunk, block, n)
            return True
        args = (x.data_ptr(), None if self.m is None else self.m.data_ptr(), self.weight, self.r.data_ptr(), bp, cp,
                self.segments.offsets.data_ptr(), nseg, error.data_ptr(), rows.data_ptr(), rows.stride(0),
                rows.shape[0], chunk, block, n)
        if self.sources is None:
            lib.co_lerp_scale_clamp_compress_rows(*args)
        else:
            lib.co_lerp_scale_clamp_compress_sources(addresses.data_ptr(), *args)
        return True

    def _compress_rows_cuda(self, x, error, rows, chunk, block) -> bool:
        from . import gpu

        tensors = [t for t in (x, self.m, self.r, error) if t is not None]
        if (not _library_allowed()
                or not all(addressable(t) and t.device == x.device and t.dtype == torch.float32 and t.is_contiguous()
                           for t in tensors)
                or not gpu.is_available(x.device) or not _cuda_fusion_agrees(x.device)):
            return False
        self._launch_cuda(x, error, rows, chunk, block)
        return True

    def _launch_cuda(self, x, error, rows, chunk, block) -> None:
        from . import gpu

        nseg, scalars = len(self.segments), None
        if self.bounds is not None:
            # the bounds and the scales as fp32, as PyTorch's ops on CUDA round their scalars (scale 1: exact)
            scales = torch.ones(nseg, dtype=torch.float64) if self.scales is None else _doubles(self.scales, nseg)
            scalars = torch.cat([_doubles(self.bounds, nseg), scales]).to(torch.float32)
            if x.device.type == "cuda":  # (pinned: the copy waits for nothing, the host goes on)
                scalars = scalars.pin_memory()
            scalars = scalars.to(x.device, non_blocking=True)
        gpu.lerp_scale_clamp_compress_rows_(x, self.m, self.weight, self.r, scalars, self.segments.offsets_on(x.device),
                                            error, rows, chunk, block)


_fusion_checked: dict = {}  # device -> whether the fused kernel gave the two passes' bits there


class ScaleClamp(LerpScaleClamp):
    """``scale_clamp_(x, r, bounds, segments)``, not run yet (0/1 Adam's exchanged ``R x``, bounded),
    for a compression to run (:meth:`compress_rows_`), or the caller first (:meth:`apply_`), as
    :class:`LerpScaleClamp`, ``sources`` included (phase A's gradients, read where they lie)."""

    def __init__(self, x: torch.Tensor, r: torch.Tensor, bounds, segments: Segments, sources: list | None = None):
        _check(segments, x, r)
        if sources is not None and (len(sources) != len(segments) or any(s is None for s in sources)):
            raise ValueError(f"one source tensor per segment is needed ({len(segments)})")
        self.x, self.m, self.weight, self.r = x, None, 0.0, r
        self.bounds, self.segments, self.scales, self.sources = bounds, segments, None, sources

    def apply_(self) -> None:
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        scale_clamp_(self.x, self.r, self.bounds, self.segments)


class Lerp(LerpScaleClamp):
    """``torch.lerp(m, x, weight, out=x)`` not run yet (the momentum exchange's local momentum), for
    a compression to run (:meth:`compress_rows_`), or the caller first (:meth:`apply_`), as
    :class:`LerpScaleClamp`; ``x`` and ``m`` flat, of one size. torch.lerp's rounding is
    PyTorch's (its vector kernels contract each formula into one FMA on CPUs that have it): the
    fused pass runs only where a check at first use found it the same bit for bit. ``sources``
    (one tensor per segment of ``segments``, which cover ``x``): ``x``'s segments, not gathered yet
    (the fused pass reads them where they lie; :meth:`apply_` gathers them first)."""

    def __init__(self, x: torch.Tensor, m: torch.Tensor, weight: float, sources: list | None = None,
                 segments: Segments | None = None):
        if x.dim() != 1 or x.shape != m.shape:
            raise ValueError(f"x and m must be flat buffers of one size, got {tuple(x.shape)} and {tuple(m.shape)}")
        if sources is not None and (segments is None or segments.numel != x.numel() or len(sources) != len(segments)
                                    or any(s is None for s in sources)):
            raise ValueError(f"sources need segments that cover x ({x.numel()} elements) and one tensor per segment")
        self.x, self.m, self.weight, self.r = x, m, float(weight), None
        self.bounds, self.scales, self.sources = None, None, sources
        self.segments = segments if sources is not None else Segments([x.numel()])

    def apply_(self) -> None:
        if self.sources is not None:
            gather_(self.sources, self.x, self.segments)
        torch.lerp(self.m, self.x, self.weight, out=self.x)


_native_lerp: list = []  # [whether co_lerp_compress_rows gave torch.lerp then the compression, bit for bit]


def _native_lerp_agrees(lib) -> bool:
    """Whether the C library's lerp pass fused into the compression gives what ``torch.lerp`` then
    the compression give here, bit for bit (sizes with and without a vector loop's tail, both of
    lerp's formulas): checked once per process, at first use."""
    if not _native_lerp:
        g = torch.Generator().manual_seed(29)
        agree = True
        for n, weight in ((7, 0.1), (1411, 0.1), (1411, 0.9), (4099, 0.75), (4099, 0.25)):
            x, m, e = (torch.randn(n, generator=g) for _ in range(3))
            x[::9] = 0.0
            chunk, block = -(-n // 32) * 32, 256
            rows = [torch.zeros(1, reference.rows_layout(chunk, block)[1], dtype=torch.uint8) for _ in range(2)]
            e1, e2, x1 = e.clone(), e.clone(), x.clone()
            torch.lerp(m, x1, weight, out=x1)
            cpu.compress_rows_(x1, e1, rows[0], chunk, block)
            lib.co_lerp_compress_rows(x.data_ptr(), m.data_ptr(), weight, n, e2.data_ptr(), rows[1].data_ptr(),
                                      rows[1].stride(0), 1, chunk, block, n)
            agree = agree and torch.equal(e1.view(torch.int32), e2.view(torch.int32)) and torch.equal(*rows)
        _native_lerp.append(agree)
    return _native_lerp[0]


def _cuda_fusion_agrees(device: torch.device) -> bool:
    """Whether, on ``device``, the CUDA kernel of :class:`LerpScaleClamp`'s compression gives bit
    for bit what the pass (PyTorch's ops there) then the CUDA compression give, on a small case
    (segments across blocks and chunks, an empty one, both of torch.lerp's formulas, scales):
    checked once per device, at first use (one synchronisation). Where it does not (a PyTorch
    whose lerp rounds otherwise), the two passes run, and a warning says so, once."""
    from . import gpu

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device in _fusion_checked:
        return _fusion_checked[device]
    g = torch.Generator().manual_seed(29)
    segments = Segments([300, 0, 1100, 5])
    n, chunk, block = segments.numel + 7, 736, 256
    x, m, e = (torch.randn(n, generator=g) for _ in range(3))
    r = torch.rand(n, generator=g) * 3
    x[::9], r[::7] = 0.0, 0.0
    bounds, scales = [0.5, 1.0, 2.0, 0.25], [1.5, 0.5, 0.75, 1.25]
    agree = True
    for kind, weight in (("lsc", 0.1), ("lsc", 0.9), ("sc", None), ("lerp", 0.1), ("lerp", 0.9)):
        got = []
        for fused in (True, False):
            x_, m_, r_, e_ = (t.to(device, copy=True) for t in (x, m, r, e))
            rows = torch.zeros(2, reference.rows_layout(chunk, block)[1], dtype=torch.uint8, device=device)
            pending = (ScaleClamp(x_, r_, bounds, segments) if kind == "sc" else Lerp(x_, m_, weight) if kind == "lerp"
                       else LerpScaleClamp(x_, m_, weight, r_, bounds, segments, scales))
            if fused:
                pending._launch_cuda(x_, e_, rows, chunk, block)
            else:
                pending.apply_()
                gpu.compress_rows_(x_, e_, rows, chunk, block)
            got.append((e_.cpu().view(torch.int32), rows.cpu()))
        agree = agree and all(torch.equal(a, b) for a, b in zip(*got))
    if not agree:
        warnings.warn("compressed_opt: the fused CUDA kernel of the local momentum's compression does not give "
                      "PyTorch's rounding on this device; running the two passes instead", RuntimeWarning,
                      stacklevel=4)
    _fusion_checked[device] = agree
    return agree


def scale_clamp_(x: torch.Tensor, r: torch.Tensor, bounds, segments: Segments) -> None:
    """``x`` <- ``clamp(r * x, -bounds[s], bounds[s])`` on each segment ``s``."""
    _check(segments, x, r)
    lib = _native(x, r)
    if lib is not None:
        b, bp = _c_doubles(bounds, len(segments))
        lib.co_scale_clamp(x.data_ptr(), r.data_ptr(), bp, segments.offsets.data_ptr(), len(segments))
        return
    b = _doubles(bounds, len(segments))
    x[: segments.numel].mul_(r[: segments.numel])
    _clamp_segments_(x, b.tolist(), segments)


def _clamp_segments_(x: torch.Tensor, bounds: list[float], segments: Segments) -> None:
    views = segments.split(x)
    if views:
        torch._foreach_clamp_max_(views, bounds)
        torch._foreach_clamp_min_(views, [-v for v in bounds])


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
        _check(segments, y)
    lib = _native(y, r, out)
    if lib is not None:
        if segments is None:
            lib.co_divide_where_nonzero(y.data_ptr(), r.data_ptr(), out.data_ptr(), y.numel())
        else:
            d, dp = _c_doubles(divisors, len(segments))
            lib.co_divide_where_nonzero_segments(y.data_ptr(), r.data_ptr(), out.data_ptr(), dp,
                                                 segments.offsets.data_ptr(), len(segments))
        return
    d = None if segments is None else _doubles(divisors, len(segments))
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
