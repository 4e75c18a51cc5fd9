"""The declared state of an optimizer: each part's per-bucket buffers are the fields of one
dataclass, declared where the part makes them, each with its role.

A compressed optimizer keeps its per-bucket buffers in a few parts, each a dataclass the module
that owns it defines: the engine's workspace (:class:`compressed_opt.engine.BucketSync`), the
exchange's error feedback (:class:`compressed_opt.exchange.ErrorFeedback`), the algorithm's moments
and what it derives from them (:class:`compressed_opt.adam.AdamBuffers`, ...), ZeRO's shards
(:class:`compressed_opt.zero.Shards`). A bucket holds one of each
(:class:`compressed_opt.buckets.Bucket`). Every field is declared with :func:`buffer`, whose role
says what it is to the rest of the library:

``STATE``
    the algorithm's state, a whole-bucket fp32 buffer whose per-parameter views are
    ``optimizer.state[p][name]``: saved by torch's part of the state dict;
``SAVED``
    kept per bucket only, saved in ``state_dict()["compressed_opt"]["buckets"]`` under its field's
    name (error feedback, ZeRO's shards and what the freeze gathered);
``LAYER``
    per-layer numbers, a float64 ``(layers, width)`` tensor whose rows are
    ``optimizer.state[p][name]`` (saved by torch's part, as ``STATE``);
``DERIVED``
    made from the state when first needed (the frozen denominator, the exchange's factors) and
    made again after a load: never saved;
``SCRATCH``
    workspace: never saved, not counted as state (``state_bytes()``);
``STEP``
    what one step keeps (its gradients left in place, its exchange's result rows): dropped when the
    step ends, taken or skipped, so that no gradient stays referenced.

The functions below read the declarations, so the checkpoint, ``state_bytes()`` and consolidation
never list names of their own.
"""
from __future__ import annotations

import dataclasses

import torch

STATE, SAVED, LAYER, DERIVED, SCRATCH, STEP = "state", "saved", "layer", "derived", "scratch", "step"
ROLES = (STATE, SAVED, LAYER, DERIVED, SCRATCH, STEP)


def buffer(role: str, dtype: torch.dtype = torch.float32):
    """A dataclass field holding a per-bucket buffer of ``role`` (``None`` until made)."""
    if role not in ROLES:
        raise ValueError(f"unknown buffer role {role!r} (one of {ROLES})")
    return dataclasses.field(default=None, metadata={"role": role, "dtype": dtype})


def parts(obj) -> list:
    """``obj`` (a dataclass instance, or ``None``) and the dataclass instances its fields hold, and
    theirs: an algorithm's bucket state made of parts (its moments, its tracking, ...)."""
    if obj is None or not dataclasses.is_dataclass(obj):
        return []
    out = [obj]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out += parts(value)
    return out


def names(part, *roles: str) -> tuple[str, ...]:
    """The names of ``part``'s (a dataclass or an instance) fields of any of ``roles``, in order."""
    return tuple(f.name for f in dataclasses.fields(part) if f.metadata.get("role") in roles)


def saved(obj) -> dict[str, torch.Tensor]:
    """The ``SAVED`` fields of ``obj`` and its parts that hold a tensor, by name."""
    return {n: getattr(p, n) for p in parts(obj) for n in names(p, SAVED) if getattr(p, n) is not None}


def restore(obj, entry: dict, device) -> None:
    """The ``SAVED`` fields of ``obj`` and its parts from a checkpoint's bucket entry (copies on ``device``)."""
    for p in parts(obj):
        for n in names(p, SAVED):
            if n in entry:
                setattr(p, n, entry[n].to(device).clone())


def held_bytes(obj) -> int:
    """Bytes of the buffers of ``obj`` and its parts that are state (not ``SCRATCH`` or ``STEP``)."""
    total = 0
    for p in parts(obj):
        for n in names(p, STATE, SAVED, LAYER, DERIVED):
            t = getattr(p, n)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def clear(obj, *roles: str) -> None:
    """Drop the fields of ``roles`` of ``obj`` and its parts (``STEP`` at a step's end)."""
    for p in parts(obj):
        for n in names(p, *roles):
            setattr(p, n, None)
