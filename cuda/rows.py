"""The 1-bit rows a buffer travels as, and the compression kernels on them, checked.

A buffer of ``world`` chunks of ``chunk`` elements travels as ``world`` *rows* of bytes, row ``j``
holding chunk ``j``: ``nb = ceil(chunk / block)`` fp32 scales, one per block of ``block`` elements
of the chunk, then the chunk's ``chunk / 8`` bytes of sign bits (:func:`rows_layout`). Each kernel
works in place on flat buffers that the caller owns and reuses; rows may lie ``rows.stride(0) >=
row_len`` bytes apart:

``compress_rows_(x, error, rows, chunk, block)``
    the worker side, over the ``n = error.numel()`` valid elements: ``u = x + error`` (``x=None``
    means ``x = 0``); per block ``s = sqrt(sum u^2 / count)`` over its valid elements (0 when none);
    bits ``[u >= 0]``; ``error <- u - s (2b - 1)``. ``rows`` is ``uint8 [world, row_len]`` with
    ``world * chunk >= n``.
``average_compress_rows_(rows, error, out_row, chunk, block)``
    the server side, over this rank's ``m = error.numel() <= chunk`` valid elements: ``z = error +
    sum_i (s_ib / world) (2 b_i - 1)`` (``s_ib`` the scale of row ``i``'s block ``b``, added in rank
    order), then compress ``z`` with ``error`` into ``out_row`` (``uint8 [row_len]``).
``decompress_rows_(rows, out, chunk, block)``
    ``out[k] = s (2 b_k - 1)`` from row ``k // chunk``, block ``(k % chunk) // block``: the
    concatenation of every row's decompressed chunk.

``chunk`` is a multiple of 32 and ``block`` a multiple of 256 (a CUDA warp tile); at most
:data:`MAX_SERVER_ROWS` rows for the server side. Bit ``k`` of a row's bits is bit ``k % 8`` of
byte ``k // 8``; bits of invalid elements are 1. The functions here check their arguments, then
run the implementation that serves the tensors' device (:func:`kernel_path`);
:func:`implementation` gives it unchecked, for a caller that checked a geometry once (the
compressed allreduce's plan).
"""
from __future__ import annotations

import warnings

import torch

from . import cpu, reference

#: the most rows the server side averages (``onebit_cpu.c`` keeps one weight per row on its stack)
MAX_SERVER_ROWS = 1024


_warned_cuda_fallback = False


def kernel_path(device: torch.device) -> str:
    """Which implementation serves tensors on ``device``: ``"cuda"``, ``"cpu"`` or ``"reference"``."""
    if not cpu.library_allowed():
        return "reference"
    if device.type == "cuda":
        from . import gpu

        if gpu.is_available(device):
            return "cuda"
        global _warned_cuda_fallback
        if not _warned_cuda_fallback:
            _warned_cuda_fallback = True
            warnings.warn(
                "compressed_opt: the CuPy compression kernels cannot run here (CuPy missing, or "
                "it cannot use this GPU); using the slower PyTorch reference implementation on "
                "CUDA tensors. Install CuPy with pip install 'compressed-opt[cuda12]' (or "
                "'compressed-opt[cuda13]', matching your CUDA driver).",
                RuntimeWarning,
                stacklevel=3,
            )
        return "reference"
    if device.type != "cpu":
        return "reference"
    # None: library() has said why, once per process (no compiler, no writable folder)
    return "cpu" if cpu.library() is not None else "reference"


def implementation(device: torch.device):
    """The module whose ``compress_rows_``, ``average_compress_rows_`` and ``decompress_rows_``
    serve ``device`` now (:func:`kernel_path`), called without this module's checks: for a caller
    that made its buffers for one geometry (``check_rows_geometry``, at most
    :data:`MAX_SERVER_ROWS` rows) and checked its arguments once, as the compressed allreduce's
    plan does. Anyone else: the checked functions of this module."""
    return _impl(device)


def _impl(device: torch.device):
    path = kernel_path(device)
    if path == "cuda":
        from . import gpu

        return gpu
    if path == "cpu":
        return cpu
    return reference


def _check_flat(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not cpu.addressable(t):
        raise TypeError(f"{name} must be a plain torch.Tensor with its own memory, got a {type(t).__name__} "
                        "(a tensor subclass such as DTensor: the kernels address elements directly)")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other buffers")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def rows_layout(chunk: int, block: int) -> tuple[int, int]:
    """``(blocks per chunk, bytes per row)`` of chunks of ``chunk`` elements with one scale per
    ``block``: ``ceil(chunk / block)`` fp32 scales, then ``chunk / 8`` bytes of bits."""
    return reference.rows_layout(chunk, block)


def check_block(block, name: str = "block") -> int:
    """``block`` if it is a positive multiple of 256 elements (a CUDA warp tile), else raise."""
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0 or block % 256:
        raise ValueError(f"{name} must be a positive multiple of 256 elements, got {block!r}")
    return block


def check_rows_geometry(chunk: int, block: int) -> None:
    """Raise unless ``chunk`` is a multiple of 32 and ``block`` a positive multiple of 256."""
    check_block(block)
    if chunk < 0 or chunk % 32:
        raise ValueError(f"chunk must be a multiple of 32 elements, got {chunk}")


def _check_rows(name: str, rows: torch.Tensor, row_len: int, device: torch.device, count: int | None = None) -> None:
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.device != device:
        raise TypeError(f"{name} must be a uint8 tensor on {device}")
    if rows.dim() != 2 or rows.shape[1] != row_len or rows.stride(1) != 1 or rows.stride(0) < row_len:
        raise ValueError(f"{name} must be [rows, {row_len}] bytes with contiguous, non-overlapping rows, "
                         f"got shape {tuple(rows.shape)} strides {rows.stride()}")
    if count is not None and rows.shape[0] != count:
        raise ValueError(f"{name} must have {count} rows, got {rows.shape[0]}")


def compress_rows_(x, error, rows, chunk: int, block: int) -> None:
    check_rows_geometry(chunk, block)
    device = error.device
    _check_flat("error", error, torch.float32, device)
    if x is not None:
        _check_flat("x", x, torch.float32, device)
        if x.numel() != error.numel():
            raise ValueError(f"x has {x.numel()} elements but error has {error.numel()}")
    _check_rows("rows", rows, rows_layout(chunk, block)[1], device)
    if error.numel() > rows.shape[0] * chunk:
        raise ValueError(f"{rows.shape[0]} rows of {chunk} elements cannot hold {error.numel()}")
    _impl(device).compress_rows_(x, error, rows, chunk, block)


def average_compress_rows_(rows, error, out_row, chunk: int, block: int) -> None:
    check_rows_geometry(chunk, block)
    device = error.device
    _check_flat("error", error, torch.float32, device)
    _check_flat("out_row", out_row, torch.uint8, device)
    _, row_len = rows_layout(chunk, block)
    _check_rows("rows", rows, row_len, device)
    if rows.shape[0] > MAX_SERVER_ROWS:
        raise ValueError(f"at most {MAX_SERVER_ROWS} ranks are supported by the compression kernels")
    if error.numel() > chunk or out_row.numel() != row_len:
        raise ValueError(f"error must hold at most {chunk} elements and out_row {row_len} bytes, got "
                         f"{error.numel()} and {out_row.numel()}")
    _impl(device).average_compress_rows_(rows, error, out_row, chunk, block)


def decompress_rows_(rows, out, chunk: int, block: int) -> None:
    check_rows_geometry(chunk, block)
    device = out.device
    _check_flat("out", out, torch.float32, device)
    _check_rows("rows", rows, rows_layout(chunk, block)[1], device)
    if out.numel() > rows.shape[0] * chunk:
        raise ValueError(f"out has {out.numel()} elements but {rows.shape[0]} rows hold {rows.shape[0] * chunk}")
    _impl(device).decompress_rows_(rows, out, chunk, block)


class CompressedResult:
    """A compressed allreduce's result as its 1-bit rows: ``rows`` (uint8 ``[world, row_len]``, each
    row contiguous, the layout of :func:`rows_layout`) of ``chunk`` elements each, one scale per
    ``block``; :meth:`expand_` decompresses them into ``buffer`` (a flat fp32 tensor of the
    result's size, where a pass that cannot read the rows takes it)."""

    def __init__(self, rows: torch.Tensor, chunk: int, block: int, buffer: torch.Tensor):
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.stride(1) != 1 or rows.stride(0) < rows.shape[1]:
            raise ValueError(f"rows must be uint8 [world, row_len] with contiguous, non-overlapping rows, got "
                             f"{rows.dtype} {tuple(rows.shape)} strides {rows.stride()}")
        check_rows_geometry(chunk, block)
        if rows.shape[1] < rows_layout(chunk, block)[1]:
            raise ValueError(f"rows of {rows.shape[1]} bytes for chunks of {chunk} elements in blocks of {block}")
        self.rows, self.chunk, self.block, self.buffer = rows, int(chunk), int(block), buffer

    def expand_(self) -> torch.Tensor:
        """The result, decompressed into :attr:`buffer` (returned)."""
        decompress_rows_(self.rows, self.buffer, self.chunk, self.block)
        return self.buffer
