"""Element-wise kernels of error-feedback 1-bit compression, dispatched by tensor device.

Three kernels carry all element-wise work of the compressed allreduce (docs/design.md 2.1, 2.2); each
works in place on flat, contiguous buffers that the caller owns and reuses:

``compress_(x, error, packed, scale_out, finish=True)``
    ``u = x + error`` (``x=None`` means ``x = 0``); ``s = ||u|| / sqrt(n)``; ``packed`` gets the
    bits ``[u >= 0]``; ``error <- u - s (2b - 1)``; ``scale_out`` (one fp32 element) gets ``s``.
    With ``finish=False`` only the first pass runs: ``packed`` and ``scale_out`` are final and
    ``error`` holds ``u``; :func:`finish_` (the second pass) completes it later, e.g. while the
    bits are on the wire.
``average_compress_(chunks, scales, error, packed, scale_out, finish=True)``
    the server side: ``z = error + (1/N) sum_i scales[i] (2 chunks[i] - 1)``, then compress ``z``
    with ``error`` as above. ``chunks`` is ``uint8 [N, row_bytes]``; ``error`` holds the chunk's
    valid elements (at most ``8 * row_bytes``).
``decompress_(packed, scales, out)``
    ``out[k] = scales[k // c] * (2 b_k - 1)`` with ``c = 8 * row_bytes``: the concatenation of
    every server's decompressed chunk. ``packed`` is ``uint8 [N, row_bytes]``; its rows may be
    strided (``packed.stride(0) >= row_bytes``), e.g. a view that skips a header in each row.

:mod:`~compressed_opt.cuda.segmented` holds the segmented element-wise passes around them (the
gather of the gradients with their per-segment sums of squares, the update's preconditioning
and its inverse).

Bits: bit ``k`` is bit ``k % 8`` of byte ``k // 8``; bits past the valid elements are 1.
Float buffers are fp32. CUDA tensors run the CuPy kernels of ``onebit.cu`` on the current stream
(no synchronisation); CPU tensors run ``onebit_cpu.c`` (compiled at first use), or the PyTorch
reference where no C compiler exists. ``COMPRESSED_OPT_KERNELS=reference`` forces the reference.
"""
from __future__ import annotations

if __name__ != "compressed_opt.cuda":  # pragma: no cover - only when the repo root is on sys.path
    # This folder installs as compressed_opt.cuda. Imported as a top-level ``cuda`` (a script run
    # from the repository root puts it on sys.path) it would shadow NVIDIA's ``cuda`` package,
    # which torch and CuPy import; an ImportError lets them fall back cleanly.
    raise ImportError(
        f"{__file__} is compressed_opt.cuda, not NVIDIA's 'cuda' package: do not put the "
        "compressed-opt source root on sys.path (run Python with -P, or from another folder)"
    )

import os
import warnings

import torch

from . import reference
from .segmented import Segments, divide_where_nonzero_, gather_, lerp_scale_clamp_, scale_clamp_, segment_sumsq

__all__ = [
    "compress_",
    "finish_",
    "average_compress_",
    "decompress_",
    "packed_numel",
    "kernel_path",
    "reference",
    "Segments",
    "segment_sumsq",
    "gather_",
    "lerp_scale_clamp_",
    "scale_clamp_",
    "divide_where_nonzero_",
]


def packed_numel(numel: int) -> int:
    """Bytes needed for the sign bits of ``numel`` elements."""
    return (numel + 7) // 8


_warned_fallback = False
_warned_cuda_fallback = False


def kernel_path(device: torch.device) -> str:
    """Which implementation serves tensors on ``device``: ``"cuda"``, ``"cpu"`` or ``"reference"``."""
    if os.environ.get("COMPRESSED_OPT_KERNELS") == "reference":
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
    from . import cpu

    if cpu.library() is None:
        global _warned_fallback
        if not _warned_fallback:
            _warned_fallback = True
            warnings.warn(
                "compressed_opt: no C compiler could build the CPU compression kernels "
                "(set CC to one); using the slower PyTorch reference implementation.",
                RuntimeWarning,
                stacklevel=3,
            )
        return "reference"
    return "cpu"


def _impl(device: torch.device):
    path = kernel_path(device)
    if path == "cuda":
        from . import gpu

        return gpu
    if path == "cpu":
        from . import cpu

        return cpu
    return reference


def _check_flat(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other buffers")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def compress_(x, error, packed, scale_out, finish: bool = True) -> None:
    device = error.device
    _check_flat("error", error, torch.float32, device)
    if x is not None:
        _check_flat("x", x, torch.float32, device)
        if x.numel() != error.numel():
            raise ValueError(f"x has {x.numel()} elements but error has {error.numel()}")
    _check_flat("packed", packed, torch.uint8, device)
    _check_flat("scale_out", scale_out, torch.float32, device)
    if packed.numel() < packed_numel(error.numel()):
        raise ValueError(f"packed needs {packed_numel(error.numel())} bytes, has {packed.numel()}")
    if scale_out.numel() != 1:
        raise ValueError("scale_out must have exactly one element")
    _impl(device).compress_(x, error, packed, scale_out, finish)


def average_compress_(chunks, scales, error, packed, scale_out, finish: bool = True) -> None:
    device = error.device
    for name, t, dtype in (
        ("chunks", chunks, torch.uint8),
        ("scales", scales, torch.float32),
        ("error", error, torch.float32),
        ("packed", packed, torch.uint8),
        ("scale_out", scale_out, torch.float32),
    ):
        _check_flat(name, t, dtype, device)
    if chunks.dim() != 2 or scales.numel() != chunks.shape[0]:
        raise ValueError("chunks must be [world, row_bytes] with one scale per row")
    if chunks.shape[0] > 1024:
        raise ValueError("at most 1024 ranks are supported by the compression kernels")
    row_bytes = chunks.shape[1]
    if error.numel() > 8 * row_bytes or packed.numel() != row_bytes:
        raise ValueError("error must fit in one row of chunks and packed must be one row long")
    if scale_out.numel() != 1:
        raise ValueError("scale_out must have exactly one element")
    _impl(device).average_compress_(chunks, scales, error, packed, scale_out, finish)


def finish_(error, scale_out) -> None:
    """The second pass of a compression started with ``finish=False``: ``error`` holds ``u``;
    ``error <- u - s (2 [u >= 0] - 1)`` with ``s = scale_out``."""
    device = error.device
    _check_flat("error", error, torch.float32, device)
    _check_flat("scale_out", scale_out, torch.float32, device)
    _impl(device).finish_(error, scale_out)


def decompress_(packed, scales, out) -> None:
    device = out.device
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.device != device:
        raise TypeError(f"packed must be a uint8 tensor on {device}")
    if packed.dim() != 2 or packed.stride(1) != 1 or packed.stride(0) < packed.shape[1]:
        raise ValueError("packed must be [world, row_bytes] with contiguous, non-overlapping rows")
    _check_flat("scales", scales, torch.float32, device)
    _check_flat("out", out, torch.float32, device)
    if packed.dim() != 2 or scales.numel() != packed.shape[0]:
        raise ValueError("packed must be [world, row_bytes] with one scale per row")
    if out.numel() > packed.numel() * 8:  # numel() of the view: rows * row_bytes
        raise ValueError(f"out has {out.numel()} elements but packed holds {packed.numel() * 8} bits")
    _impl(device).decompress_(packed, scales, out)
