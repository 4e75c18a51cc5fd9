"""CuPy path of the compression kernels: ``onebit.cu``, compiled with NVRTC at first use.

Same three functions as :mod:`compressed_opt.cuda.cpu`, on CUDA tensors (validated by the
checked forms in :mod:`compressed_opt.cuda.rows`), with the contract of its module docstring: a buffer of
``world`` chunks travels as ``world`` rows ``[nb fp32 scales | chunk / 8 bytes of bits]``, one
scale per block of ``block`` elements (docs/design.md 2.1, 2.2):

* ``compress_rows_``: ``u = x + e``; per block ``s = sqrt(sum u^2 / count)``; bits ``[u >= 0]``;
  ``e <- u - s (2b - 1)``.
* ``average_compress_rows_``: ``z = e + sum_i (s_ib / N) (2 b_i - 1)`` in rank order, then
  compress ``z`` with ``e`` into one row.
* ``decompress_rows_``: ``out_k = s (2 b_k - 1)`` from row ``k // chunk``, block
  ``(k % chunk) // block``.

Each is one kernel launch (none for no work). A compression gives each (row, block) unit to one
warp, which reduces the block's sum of squares with shuffles and writes its scale itself: no
workspace, no grid-wide reduction. The launches run on torch's current stream of the tensors'
device and never synchronise with the host. The launch plans (``*_plan``) are pure functions of
sizes and pointers, so they can be checked without a GPU.

The local momentum's passes (:class:`LerpScaleClamp`, :class:`ScaleClamp`, :class:`Lerp`) run
inside the compression (``co_lerp_scale_clamp_compress_rows``) where the registry's harness found
that kernel giving PyTorch's bits on the device; the other segmented passes are the reference's,
PyTorch's multi-tensor ops on the device.

CuPy is imported lazily: importing this module works without it, using it raises ImportError.
:func:`is_available` says whether the kernels can actually run here.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import harness, reference
from .segments import Segments, doubles

SOURCE = Path(__file__).with_name("onebit.cu")
BLOCK = 256  # CO_BLOCK in onebit.cu: threads per block
WARPS = BLOCK // 32  # CO_WARPS: one (row, block) unit, or one tile, per warp at a time
TILE = 256  # CO_TILE: elements per warp tile (32 bytes of bits)
MAX_GRID_X = (1 << 31) - 1
MAX_GRID_Y = 65535

# Kernel signatures: p pointer, q int64, i int32, f float32 (see onebit.cu).
SIGNATURES = {
    "co_compress_rows": "pppqqqqq",
    "co_average_compress_rows": "pqiqqppq",
    "co_decompress_rows": "pqqqqpq",
    "co_lerp_scale_clamp_compress_rows": "ppfpppqippqqqqq",
}
_CTYPES = {"p": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32, "f": ctypes.c_float}


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise ImportError(
            "compressed_opt's CUDA kernels need CuPy: pip install 'compressed-opt[cuda12]' "
            "(or 'compressed-opt[cuda13]', matching your CUDA driver)"
        ) from exc
    return cupy


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _grid(work_blocks: int, resident: int, cap: int = MAX_GRID_X) -> int:
    """Enough blocks for the work, at most what fits on the device at once (grid-stride loops)."""
    return max(1, min(work_blocks, resident, cap))


def _blocks(chunk: int, block: int) -> int:
    return _cdiv(chunk, block)


# ---- launch plans: [(kernel, (grid_x, grid_y), args)], pure functions of sizes and pointers ----


def compress_plan(x, error, rows, row_stride, world, chunk, block, n, resident):
    """Launches of ``compress_rows_``: one warp per (row, block) unit, ``world * nb`` of them."""
    units = world * _blocks(chunk, block)
    if units == 0:
        return []
    name = "co_compress_rows"
    grid = _grid(_cdiv(units, WARPS), resident[name])
    return [(name, (grid, 1), (x, error, rows, row_stride, world, chunk, block, n))]


def lerp_scale_clamp_compress_plan(x, m, weight, r, scalars, offsets, nseg, mode, error, rows, row_stride, world,
                                   chunk, block, n, resident):
    """Launches of ``lerp_scale_clamp_compress_rows_``: as :func:`compress_plan`, one warp per
    (row, block) unit."""
    units = world * _blocks(chunk, block)
    if units == 0:
        return []
    name = "co_lerp_scale_clamp_compress_rows"
    grid = _grid(_cdiv(units, WARPS), resident[name])
    return [(name, (grid, 1), (x, m, float(weight), r, scalars, offsets, nseg, int(mode), error, rows, row_stride,
                               world, chunk, block, n))]


def average_compress_plan(rows, row_stride, world, chunk, block, error, out_row, m, resident):
    """Launches of ``average_compress_rows_``: one warp per block of the chunk, ``nb`` of them."""
    units = _blocks(chunk, block)
    if units == 0:
        return []
    name = "co_average_compress_rows"
    grid = _grid(_cdiv(units, WARPS), resident[name])
    return [(name, (grid, 1), (rows, row_stride, world, chunk, block, error, out_row, m))]


def decompress_plan(rows, row_stride, chunk, block, out, n, resident):
    """Launches of ``decompress_rows_``: blocks along y walk the ``ceil(n / chunk)`` rows, warps
    along x a row's tiles."""
    if n == 0:
        return []
    nrows = _cdiv(n, chunk)
    grid_y = min(nrows, MAX_GRID_Y)
    name = "co_decompress_rows"
    grid_x = _grid(_cdiv(_cdiv(min(n, chunk), TILE), WARPS), _cdiv(resident[name], grid_y))
    return [(name, (grid_x, grid_y), (rows, row_stride, nrows, chunk, block, out, n))]


# ---- execution with CuPy ----


class _Kernels:
    """The compiled kernels of one device and how many of their blocks fit on it at once."""

    def __init__(self, index: int):
        cp = _cupy()
        self.index = index
        module = cp.RawModule(code=SOURCE.read_text(encoding="utf-8"), options=("-std=c++14",))
        sms = torch.cuda.get_device_properties(index).multi_processor_count
        occupancy = cp.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor
        with cp.cuda.Device(index):  # compiles (or loads from CuPy's cache) for this device
            # keep the Function objects alive: they hold the loaded module
            self._loaded = [module.get_function(name).kernel for name in SIGNATURES]
            self.functions = {name: f.ptr for name, f in zip(SIGNATURES, self._loaded)}
            self.resident = {
                name: sms * max(1, occupancy(f, BLOCK, 0)) for name, f in self.functions.items()
            }

    def run(self, plan, stream: int) -> None:
        """Launch the plan on ``stream`` (asynchronous: nothing waits for the device)."""
        cp = _cupy()
        runtime, launch = cp.cuda.runtime, cp.cuda.driver.launchKernel
        previous = runtime.getDevice()
        runtime.setDevice(self.index)  # also makes its primary context current on this thread
        try:
            for name, (grid_x, grid_y), args in plan:
                values = [_CTYPES[kind](value) for kind, value in zip(SIGNATURES[name], args)]
                params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
                launch(self.functions[name], grid_x, grid_y, 1, BLOCK, 1, 1, 0, stream,
                       ctypes.addressof(params), 0)
        finally:
            if previous != self.index:
                runtime.setDevice(previous)


@functools.cache
def _kernels(index: int) -> _Kernels:
    return _Kernels(index)


def _context(device: torch.device) -> tuple[_Kernels, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _kernels(index), torch.cuda.current_stream(index).cuda_stream


def _ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


def compress_rows_(x, error, rows, chunk, block):
    kernels, stream = _context(error.device)
    plan = compress_plan(_ptr(x), error.data_ptr(), rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block,
                         error.numel(), kernels.resident)
    kernels.run(plan, stream)


def lerp_scale_clamp_compress_rows_(x, m, weight, r, scalars, offsets, error, rows, chunk, block):
    """``compress_rows_`` of the segmented pass ``lerp_scale_clamp_`` over ``x`` (``m is None``:
    ``scale_clamp_``; ``r is None``: ``torch.lerp`` alone), ``x`` not written: ``offsets`` the
    segments' ``nseg + 1`` int64 offsets and ``scalars`` their ``nseg`` fp32 bounds then ``nseg``
    fp32 scales, on the device (:class:`compressed_opt.cuda.segmented.LerpScaleClamp`)."""
    kernels, stream = _context(error.device)
    mode = 0 if m is None else (2 if r is None else 1)
    plan = lerp_scale_clamp_compress_plan(x.data_ptr(), _ptr(m), weight, _ptr(r), _ptr(scalars),
                                          offsets.data_ptr(), offsets.numel() - 1, mode, error.data_ptr(),
                                          rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, error.numel(),
                                          kernels.resident)
    kernels.run(plan, stream)


def average_compress_rows_(rows, error, out_row, chunk, block):
    kernels, stream = _context(error.device)
    plan = average_compress_plan(rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, error.data_ptr(),
                                 out_row.data_ptr(), error.numel(), kernels.resident)
    kernels.run(plan, stream)


def decompress_rows_(rows, out, chunk, block):
    kernels, stream = _context(out.device)
    plan = decompress_plan(rows.data_ptr(), rows.stride(0), chunk, block, out.data_ptr(), out.numel(),
                           kernels.resident)
    kernels.run(plan, stream)


# The self-check: two rows of chunk 32 (one block each), scales 2 and 0.5, read 40 elements.
_CHECK_ROWS = [
    [0x00, 0x00, 0x00, 0x40, 0b10110101, 0b00000010, 0xFF, 0x00],
    [0x00, 0x00, 0x00, 0x3F, 0b01100001, 0x00, 0x00, 0x00],
]
_CHECK_OUT = ([2.0, -2.0, 2.0, -2.0, 2.0, 2.0, -2.0, 2.0, -2.0, 2.0] + [-2.0] * 6 + [2.0] * 8 + [-2.0] * 8
              + [0.5, -0.5, -0.5, -0.5, -0.5, 0.5, 0.5, -0.5])


@functools.cache
def _works_on(index: int) -> bool:
    try:
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return False
        cp = _cupy()
        if cp.cuda.runtime.getDeviceCount() <= index:
            return False
        device = torch.device("cuda", index)
        rows = torch.tensor(_CHECK_ROWS, dtype=torch.uint8, device=device)
        out = torch.empty(len(_CHECK_OUT), dtype=torch.float32, device=device)
        decompress_rows_(rows, out, 32, 256)
        return out.tolist() == _CHECK_OUT
    except Exception:  # no CuPy, no driver, NVRTC missing or failing, launch error, ...
        return False


def is_available(device=None) -> bool:
    """Whether the CuPy kernels run on ``device`` (default: the current CUDA device).

    A real check, cached per device: torch and CuPy both see the device, and a tiny
    decompression compiles, runs and gives the right answer. ``import cupy`` alone can succeed
    where no GPU is usable.
    """
    if isinstance(device, int):
        return _works_on(device)
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return False
        if device.index is not None:
            return _works_on(device.index)
    try:
        if not torch.cuda.is_available():
            return False
        return _works_on(torch.cuda.current_device())
    except Exception:  # e.g. a broken driver
        return False


# --- the local momentum's passes inside the compression ----------------------------------------------
def _fusable(pass_, x, error, rows, *tensors) -> bool:
    """Whether the fused kernel may compress ``x`` (the pass's own gathered buffer) into ``rows``."""
    return (pass_.sources is None and x.dim() == 1 and x.data_ptr() == pass_.x.data_ptr()
            and x.numel() == pass_.x.numel() and error.numel() <= x.numel() and rows.dtype == torch.uint8
            and rows.dim() == 2 and rows.stride(1) == 1 and rows.device == x.device
            and all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device == x.device
                    and t.dtype == torch.float32 and t.is_contiguous() for t in (x, error, *tensors)))


def _launch(pass_, x, m, weight, r, bounds, scales, error, rows, chunk, block) -> None:
    """The fused kernel: ``bounds`` and ``scales`` as fp32 on the device (as PyTorch's ops on CUDA
    round their scalars; scale 1 exact), copied from pinned memory (the host goes on)."""
    segments, scalars = pass_.segments, None
    if bounds is not None:
        count = segments.count
        ones = torch.ones(count, dtype=torch.float64) if scales is None else doubles(scales, count)
        scalars = torch.cat([doubles(bounds, count), ones]).to(torch.float32)
        scalars = scalars.pin_memory().to(x.device, non_blocking=True)
    lerp_scale_clamp_compress_rows_(x, m, weight, r, scalars, segments.offsets_on(x.device), error, rows, chunk,
                                    block)


class LerpScaleClamp(reference.LerpScaleClamp):
    """The pass inside the compression in one CUDA kernel (``x`` gathered; read, not written)."""

    __slots__ = ()

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        if not _fusable(self, x, error, rows, self.m, self.r):
            return False
        _launch(self, x, self.m, self.weight, self.r, self.bounds, self.scales, error, rows, chunk, block)
        return True


class ScaleClamp(reference.ScaleClamp):
    """The pass inside the compression in one CUDA kernel (``x`` gathered)."""

    __slots__ = ()

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        if not _fusable(self, x, error, rows, self.r):
            return False
        _launch(self, x, None, 0.0, self.r, self.bounds, None, error, rows, chunk, block)
        return True


class Lerp(reference.Lerp):
    """``torch.lerp`` inside the compression in one CUDA kernel (``x`` gathered)."""

    __slots__ = ()

    def compress_rows_(self, x, error, rows, chunk: int, block: int) -> bool:
        if not _fusable(self, x, error, rows, self.m):
            return False
        _launch(self, x, self.m, self.weight, None, None, None, error, rows, chunk, block)
        return True


# --- the harness's check of the fused kernel ------------------------------------------------------------
def _fusion_check(device: torch.device, kind: str, weight, native: bool):
    """The local momentum's pass then the compression, on ``device``: fused in one kernel
    (``native``) or as PyTorch's ops there then :func:`compress_rows_`; the error and the rows.
    Segments across blocks and chunks and an empty one; zeros in ``x`` and ``r``; both of
    ``torch.lerp``'s formulas (weights below and above 0.5); scales."""
    if not is_available(device):
        return None
    g = torch.Generator().manual_seed(29)
    segments = Segments([300, 0, 1100, 5])
    n, chunk, block = segments.numel + 7, 736, 256
    x, m, e = (torch.randn(n, generator=g).to(device) for _ in range(3))
    r = (torch.rand(n, generator=g) * 3).to(device)
    x[::9], r[::7] = 0.0, 0.0
    bounds, scales = [0.5, 1.0, 2.0, 0.25], [1.5, 0.5, 0.75, 1.25]
    rows = torch.zeros(2, reference.rows_layout(chunk, block)[1], dtype=torch.uint8, device=device)
    made = (ScaleClamp(x, r, bounds, segments) if kind == "scale_clamp"
            else Lerp(x, m, weight, Segments([n])) if kind == "lerp"
            else LerpScaleClamp(x, m, weight, r, bounds, segments, scales))
    if native:
        if not made.compress_rows_(x, e, rows, chunk, block):
            return None  # (the fused kernel declined: nothing to bind)
    else:
        made.apply_()
        compress_rows_(x, e, rows, chunk, block)
    return e, rows


harness.register("lerp_scale_clamp_compress", harness.Check(
    (("lerp_scale_clamp", 0.1), ("lerp_scale_clamp", 0.9), ("scale_clamp", None), ("lerp", 0.1), ("lerp", 0.9)),
    _fusion_check, device=True))
