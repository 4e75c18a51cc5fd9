"""The one harness that checks a native pass against its reference, once per process and device.

A native pass whose rounding depends on PyTorch's own kernels (``torch.lerp``'s contraction into an
FMA, the add-with-alpha of its CPU kernels, the sums' order) is used only where :func:`agrees` found
it giving its reference's outputs on this machine. Each such pass registers a :class:`Check` where it
is defined: cases with and without a vector loop's tail, an empty segment, zeros where the passes
divide, run once at first use; where the native pass disagrees, its reference runs, and a warning
says so once.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import torch

from . import reference
from .segments import Segments


@dataclasses.dataclass(frozen=True)
class Check:
    """How the harness runs one native pass against its reference: ``run(*case, native=...)`` runs
    the native pass (``True``) or the reference (``False``) on ``case`` (the arguments; a seed and
    parameters, from which ``run`` makes the same tensors each time) and returns the outputs, or
    ``None`` where the native pass cannot run here. Tensors must agree bit for bit; numbers within
    ``close`` (relative; 0: equal). ``device``: the check takes the device to run on as its first
    argument (a CUDA pass)."""

    cases: tuple
    run: Callable
    close: float = 0.0
    device: bool = False


CHECKS: dict[str, Check] = {}
_agreed: dict = {}  # (name, device) -> bool


def register(name: str, check: Check) -> None:
    """Register the harness's ``check`` of the native pass ``name`` (once, when its module is imported)."""
    CHECKS[name] = check


def agrees(name: str, device="cpu") -> bool:
    """Whether the native pass ``name`` gives its reference's outputs on ``device`` here, on every
    case of its :class:`Check` (run once per process and device, at first use; a warning where it
    runs but disagrees)."""
    device = torch.device(device)
    key = (name, device)
    if key not in _agreed:
        _agreed[key] = False  # (while checking: a check may call the passes, which ask)
        _agreed[key] = _run_check(name, CHECKS[name], device)
    return _agreed[key]


def _run_check(name: str, check: Check, device: torch.device) -> bool:
    for case in check.cases:
        args = (device, *case) if check.device else case
        got = check.run(*args, native=True)
        if got is None:
            return False  # (it cannot run here: nothing to warn about)
        want = check.run(*args, native=False)
        if not _same(got, want, check.close):
            warnings.warn(f"compressed_opt: the native pass {name!r} does not give its PyTorch reference's bits on "
                          f"{device}; running the reference instead", RuntimeWarning, stacklevel=4)
            return False
    return True


def _same(got, want, close: float) -> bool:
    if isinstance(got, (list, tuple)):
        return (isinstance(want, (list, tuple)) and len(got) == len(want)
                and all(_same(a, b, close) for a, b in zip(got, want)))
    if isinstance(got, torch.Tensor):
        return (isinstance(want, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
                and torch.equal(_bits(got), _bits(want)))
    if isinstance(got, float) and close:
        return abs(got - want) <= close * abs(want)
    return got == want


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64) if t.dtype == torch.float64 else t


def rows_case(seed: int) -> tuple:
    """The case the checks of passes that read an exchange's result run on: ``(generator, segments,
    chunk, block, rows, y)``, segments of sizes with and without vector tails and an empty one, the
    rows of 2 chunks (blocks of 256) compressed from random values, ``y`` their values."""
    g = torch.Generator().manual_seed(seed)
    segments = Segments([7, 1411, 0, 33, 4099, 16, 1])
    n, world, block = segments.numel, 2, 256
    chunk = -(-n // (32 * world)) * 32
    rows = torch.zeros(world, reference.rows_layout(chunk, block)[1], dtype=torch.uint8)
    reference.compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    y = torch.empty(n)
    reference.decompress_rows_(rows, y, chunk, block)
    return g, segments, chunk, block, rows, y
