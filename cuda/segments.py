"""A flat buffer's segments: the partition the segmented passes work on (for the optimizers: a
bucket's parameters, each a segment with scalars of its own)."""
from __future__ import annotations

import torch


class Segments:
    """Consecutive segments of ``sizes[s]`` elements, starting at element 0 of a flat buffer:
    ``offsets`` (int64, ``len(sizes) + 1`` entries, on the CPU), ``numel`` (their total) and
    ``count`` (their number; ``len(segments)`` too)."""

    def __init__(self, sizes: list[int]):
        self.sizes = [int(n) for n in sizes]
        if any(n < 0 for n in self.sizes):
            raise ValueError("segment sizes must be non-negative")
        offsets = [0]
        for n in self.sizes:
            offsets.append(offsets[-1] + n)
        self.offsets = torch.tensor(offsets, dtype=torch.int64)
        self.numel = offsets[-1]
        self.count = len(self.sizes)
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
        return self.count

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The segments of ``flat`` (at least :attr:`numel` elements) as views."""
        return list(flat[: self.numel].split(self.sizes))


def check(segments: Segments, *tensors: torch.Tensor) -> None:
    """Raise unless every tensor is a flat buffer of at least ``segments.numel`` elements."""
    for t in tensors:
        if t.dim() != 1 or t.numel() < segments.numel:
            raise ValueError(f"a flat buffer of at least {segments.numel} elements is needed, got shape "
                             f"{tuple(t.shape)}")


def doubles(values, n: int) -> torch.Tensor:
    """``values`` (one per segment: a tensor or a sequence of ``n`` numbers) as a contiguous
    float64 tensor; ``ValueError`` for another number of them."""
    out = torch.as_tensor(values, dtype=torch.float64)
    if out.shape != (n,):
        raise ValueError(f"one value per segment is needed ({n}), got shape {tuple(out.shape)}")
    return out.contiguous()
