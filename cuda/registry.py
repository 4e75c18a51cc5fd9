"""Which implementation serves each pass, chosen once per device, and the one harness that checks a
native pass against its reference.

Every pass of the 1-bit exchange has a PyTorch reference (:mod:`~compressed_opt.cuda.reference`)
that defines its bits, a C implementation (:mod:`~compressed_opt.cuda.cpu`) for contiguous fp32 CPU
tensors and, for the compression and the local momentum fused into it, a CUDA one
(:mod:`~compressed_opt.cuda.gpu`). :func:`kernels_for` binds each pass of the interface
:class:`Kernels` to the implementation that serves a device; a bucket takes it once, when it is
built, so that a step runs its passes with no dispatch of its own.

A native pass whose rounding depends on PyTorch's own kernels is bound only where
:func:`compressed_opt.cuda.harness.agrees` found it giving its reference's bits on this machine.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from . import cpu, reference
from .harness import agrees
from .rows import kernel_path

_INTERFACE = ("compress_rows_", "average_compress_rows_", "decompress_rows_", "sources", "sumsq_each", "gather_",
              "Lerp", "LerpScaleClamp", "ScaleClamp", "divide_descend_", "keep_descend_")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The passes that serve one device, each bound to its implementation (the reference's
    signatures and contracts, ``compressed_opt.cuda.reference``): the compression kernels
    (``compress_rows_``, ``average_compress_rows_``, ``decompress_rows_``); the gradients as a native
    pass reads them where they lie (``sources(grads, sizes)``: ``None`` where none does), their sums
    of squares (``sumsq_each``) and their gather (``gather_``); the local momentum's passes not run
    yet, for the compression to run (``Lerp``, ``LerpScaleClamp``, ``ScaleClamp``: the
    ``compressed_opt.comm.Producer`` interface); and the updates from an exchange's result
    (``divide_descend_``, ``keep_descend_``). ``path``: ``"cpu"``, ``"cuda"`` or ``"reference"``."""

    path: str
    compress_rows_: Callable
    average_compress_rows_: Callable
    decompress_rows_: Callable
    sources: Callable
    sumsq_each: Callable
    gather_: Callable
    Lerp: type
    LerpScaleClamp: type
    ScaleClamp: type
    divide_descend_: Callable
    keep_descend_: Callable


_bound: dict = {}  # (device, path) -> Kernels


def kernels_for(device) -> Kernels:
    """The :class:`Kernels` that serve ``device`` now (``kernel_path``: the C library loaded and
    allowed, the CUDA kernels working there), each native pass the harness found disagreeing with
    its reference replaced by the reference (made once per device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    path = kernel_path(device)
    key = (device, path)
    found = _bound.get(key)
    if found is None:
        found = _bound[key] = _bind(device, path)
    return found


def _bind(device: torch.device, path: str) -> Kernels:
    ours = {name: getattr(reference, name) for name in _INTERFACE}
    if path == "cpu":
        ours.update({name: getattr(cpu, name) for name in _INTERFACE})
        for name, check in (("Lerp", "lerp_compress"), ("divide_descend_", "divide_descend"),
                            ("keep_descend_", "keep_descend")):
            if not agrees(check):
                ours[name] = getattr(reference, name)
    elif path == "cuda":
        from . import gpu

        for name in ("compress_rows_", "average_compress_rows_", "decompress_rows_"):
            ours[name] = getattr(gpu, name)
        if agrees("lerp_scale_clamp_compress", device):
            ours.update(Lerp=gpu.Lerp, LerpScaleClamp=gpu.LerpScaleClamp, ScaleClamp=gpu.ScaleClamp)
    return Kernels(path, **ours)
