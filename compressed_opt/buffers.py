"""The per-bucket buffers of the optimizers, each declared once: its name, role and dtype.

Every buffer a bucket holds (``bucket.flats[name]``) is declared in its optimizer's ``buffers``
table (merged along the class hierarchy; ZeRO's sharded layout overlays its own,
:data:`compressed_opt.zero.BUFFERS`). The role says what the buffer is to the rest of the library:

``STATE``
    the algorithm's state, a whole-bucket fp32 buffer whose per-parameter views are
    ``optimizer.state[p][name]``: saved by torch's part of the state dict;
``SAVED``
    state kept per bucket only, saved in ``state_dict()["compressed_opt"]["buckets"]`` (the
    error feedback, ZeRO's shards and what the freeze gathered);
``DERIVED``
    made from the state when first needed (the frozen denominator, the exchange's factors), not
    saved: a load makes it again;
``SCRATCH``
    workspace: not saved, not counted in ``state_bytes()``;
``LAYER``
    per-layer numbers, a float64 ``(layers, width)`` tensor whose rows are
    ``optimizer.state[p][name]`` (``layer_state`` gives the widths).

A bucket of an optimizer checks every access: a name the table does not declare raises
``KeyError``, a tensor of another dtype ``TypeError``. The lists the rest of the library reads
(``bucket_state_names``, ``saved_bucket_buffers``, ``scratch_names``) are made from the table.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping

import torch

STATE, SAVED, DERIVED, SCRATCH, LAYER = "state", "saved", "derived", "scratch", "layer"
ROLES = (STATE, SAVED, DERIVED, SCRATCH, LAYER)


@dataclass(frozen=True)
class Buffer:
    """One declared bucket buffer: its role (see the module doc) and dtype (or the dtypes of
    the forms it takes, e.g. indices or a mask)."""

    role: str
    dtype: torch.dtype | tuple[torch.dtype, ...] = torch.float32

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"unknown buffer role {self.role!r} (one of {ROLES})")

    def allows(self, dtype: torch.dtype) -> bool:
        return dtype in self.dtype if isinstance(self.dtype, tuple) else dtype == self.dtype


def names(table: Mapping[str, Buffer], role: str) -> tuple[str, ...]:
    """The names of ``table`` with ``role``, in declaration order."""
    return tuple(name for name, spec in table.items() if spec.role == role)


def overlay(table: Mapping[str, Buffer], layout: Mapping[str, Buffer]) -> dict[str, Buffer]:
    """``table`` under another layout: the layout's declarations replace or add to the table's,
    and the table's ``STATE`` buffers the layout does not declare are gone (a sharded layout
    keeps no whole-bucket per-parameter state)."""
    kept = {name: spec for name, spec in table.items() if spec.role != STATE or name in layout}
    return {**kept, **layout}


class BucketBuffers(dict):
    """A bucket's buffers by name. With a table (``declared``), only its names, of their dtype;
    without one (a bucket made outside an optimizer), any."""

    declared: Mapping[str, Buffer] | None = None
    #: bumped by every change of which tensor a name holds (not by writes into a tensor)
    version: int = 0

    def _spec(self, name: str) -> Buffer | None:
        if self.declared is None:
            return None
        spec = self.declared.get(name)
        if spec is None:
            raise KeyError(
                f"bucket buffer {name!r} is not declared (declared: {', '.join(self.declared)}); declare it with its "
                "role and dtype in the optimizer's `buffers` table (compressed_opt/buffers.py)"
            )
        return spec

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        spec = self._spec(name)
        if spec is not None and not spec.allows(tensor.dtype):
            raise TypeError(f"bucket buffer {name!r} is declared {spec.dtype}, got a {tensor.dtype} tensor")
        super().__setitem__(name, tensor)
        self.version += 1

    def __getitem__(self, name: str) -> torch.Tensor:
        self._spec(name)
        return super().__getitem__(name)

    def get(self, name: str, default=None):
        self._spec(name)
        return super().get(name, default)

    def pop(self, name: str, *default):
        self._spec(name)
        self.version += 1
        return super().pop(name, *default)

    def __contains__(self, name) -> bool:
        self._spec(name)
        return super().__contains__(name)

    def __delitem__(self, name: str) -> None:
        self._spec(name)
        super().__delitem__(name)
        self.version += 1

    def update(self, *args, **kwargs) -> None:  # (through __setitem__: checked and counted)
        for name, tensor in dict(*args, **kwargs).items():
            self[name] = tensor

    def setdefault(self, name: str, default=None):
        if name not in self:
            self[name] = default
        return self[name]

    def clear(self) -> None:
        super().clear()
        self.version += 1

    def popitem(self):
        self.version += 1
        return super().popitem()
