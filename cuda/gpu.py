"""CuPy path of the compression kernels: ``onebit.cu``, compiled with NVRTC at first use.

Same three functions as :mod:`compressed_opt.cuda.cpu`, on CUDA tensors (validated by the
dispatcher in ``compressed_opt.cuda``), with the math of docs/design.md 2.1 and 2.2:

* ``compress_``: ``u = x + e``; ``b = [u >= 0]``; ``s = ||u|| / sqrt(n)``; ``e <- u - s (2b - 1)``.
* ``average_compress_``: ``z = e + sum_i (s_i / N) (2 b_i - 1)``, then compress ``z`` with ``e``.
* ``decompress_``: ``out_k = s_r (2 b_k - 1)`` with ``r = k // (8 * row_bytes)``.

Each compression is two kernel launches (pass 1: form u, pack, reduce the scale on the device;
pass 2: subtract the decompressed value), a decompression one. They run on torch's current
stream of the tensors' device and never synchronise with the host: the scale stays on the device.
Pass 1 reduces the sum of squares through a small workspace (fp64 partial sums and a ticket
counter that the kernel resets itself), one per (device, stream) so that streams never share it.

CuPy is imported lazily: importing this module works without it, using it raises ImportError.
:func:`is_available` says whether the kernels can actually run here.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("onebit.cu")
BLOCK = 256  # CO_BLOCK in onebit.cu: threads per block
WARPS = BLOCK // 32
TILE = 256  # CO_TILE: elements per warp tile (32 bytes of bits)
MAX_PARTIALS = 4096  # most blocks of a pass-1 launch: fp64 partial sums in the workspace
MAX_GRID_Y = 65535

# Kernel signatures: p pointer, q int64, i int32 (see onebit.cu).
SIGNATURES = {
    "co_compress_pack": "pppqqppp",
    "co_average_compress_pack": "ppiqppqppp",
    "co_subtract_decompressed": "ppq",
    "co_decompress": "ppqqqpq",
}
_CTYPES = {"p": ctypes.c_uint64, "q": ctypes.c_int64, "i": ctypes.c_int32}


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


def _grid(work_blocks: int, resident: int, cap: int = 1 << 31) -> int:
    """Enough blocks for the work, at most what fits on the device at once (grid-stride loops)."""
    return max(1, min(work_blocks, resident, cap))


# ---- launch plans: (kernel, (grid_x, grid_y), args), pure functions of sizes and pointers ----


def compress_plan(x, error, packed, scale_out, n, nbytes, partials, ticket, resident):
    """Launches of ``compress_``: pass 1 over ``ceil(nbytes / 32)`` warp tiles, then pass 2."""
    grid = _grid(_cdiv(_cdiv(nbytes, TILE // 8), WARPS), resident["co_compress_pack"], MAX_PARTIALS)
    plan = [("co_compress_pack", (grid, 1), (x, error, packed, n, nbytes, scale_out, partials, ticket))]
    return plan + subtract_plan(error, scale_out, n, resident)


def average_compress_plan(chunks, scales, world, row_bytes, error, packed, n, scale_out, partials,
                          ticket, resident):
    """Launches of ``average_compress_``: server pass 1 over the row's tiles, then pass 2."""
    name = "co_average_compress_pack"
    grid = _grid(_cdiv(_cdiv(row_bytes, TILE // 8), WARPS), resident[name], MAX_PARTIALS)
    args = (chunks, scales, world, row_bytes, error, packed, n, scale_out, partials, ticket)
    return [(name, (grid, 1), args)] + subtract_plan(error, scale_out, n, resident)


def subtract_plan(error, scale_out, n, resident):
    """Pass 2 (none for an empty buffer): each thread handles 4 elements per step."""
    if n == 0:
        return []
    grid = _grid(_cdiv(n, 4 * BLOCK), resident["co_subtract_decompressed"])
    return [("co_subtract_decompressed", (grid, 1), (error, scale_out, n))]


def decompress_plan(packed, scales, row_bytes, row_stride, out, n, resident):
    """Launches of ``decompress_``: blocks along y walk the rows, along x a row's tiles."""
    if n == 0:
        return []
    chunk = 8 * row_bytes
    rows = _cdiv(n, chunk)
    grid_y = min(rows, MAX_GRID_Y)
    grid_x = _grid(_cdiv(_cdiv(min(n, chunk), TILE), WARPS), _cdiv(resident["co_decompress"], grid_y))
    return [("co_decompress", (grid_x, grid_y), (packed, scales, rows, row_bytes, row_stride, out, n))]


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
        self._workspaces: dict[int, torch.Tensor] = {}

    def workspace(self, stream: int) -> tuple[int, int]:
        """(partials, ticket) pointers of this stream's pass-1 workspace, zeroed on first use."""
        ws = self._workspaces.get(stream)
        if ws is None:
            ws = torch.zeros(MAX_PARTIALS * 8 + 8, dtype=torch.uint8, device=f"cuda:{self.index}")
            self._workspaces[stream] = ws
        return ws.data_ptr(), ws.data_ptr() + MAX_PARTIALS * 8

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


def compress_(x, error, packed, scale_out, finish=True):
    kernels, stream = _context(error.device)
    partials, ticket = kernels.workspace(stream)
    plan = compress_plan(
        _ptr(x), error.data_ptr(), packed.data_ptr(), scale_out.data_ptr(), error.numel(),
        packed.numel(), partials, ticket, kernels.resident,
    )
    kernels.run(plan if finish else plan[:1], stream)


def average_compress_(chunks, scales, error, packed, scale_out, finish=True):
    kernels, stream = _context(error.device)
    partials, ticket = kernels.workspace(stream)
    world, row_bytes = chunks.shape
    plan = average_compress_plan(
        chunks.data_ptr(), scales.data_ptr(), world, row_bytes, error.data_ptr(), packed.data_ptr(),
        error.numel(), scale_out.data_ptr(), partials, ticket, kernels.resident,
    )
    kernels.run(plan if finish else plan[:1], stream)


def finish_(error, scale_out):
    """Pass 2 alone (after a ``finish=False`` compression)."""
    kernels, stream = _context(error.device)
    kernels.run(subtract_plan(error.data_ptr(), scale_out.data_ptr(), error.numel(), kernels.resident), stream)


def decompress_(packed, scales, out):
    kernels, stream = _context(out.device)
    plan = decompress_plan(
        packed.data_ptr(), scales.data_ptr(), packed.shape[1], packed.stride(0), out.data_ptr(),
        out.numel(), kernels.resident,
    )
    kernels.run(plan, stream)


@functools.cache
def _works_on(index: int) -> bool:
    try:
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            return False
        cp = _cupy()
        if cp.cuda.runtime.getDeviceCount() <= index:
            return False
        device = torch.device("cuda", index)
        packed = torch.tensor([[0b10110101, 0b00000010]], dtype=torch.uint8, device=device)
        out = torch.empty(10, dtype=torch.float32, device=device)
        decompress_(packed, torch.tensor([2.0], device=device), out)
        expected = [2.0, -2.0, 2.0, -2.0, 2.0, 2.0, -2.0, 2.0, -2.0, 2.0]
        return out.tolist() == expected
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
