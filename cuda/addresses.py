"""Where the C passes may read and write: the checks and the address arrays of tensors they take
by pointer (a bucket's parameters, written through their own memory; the gradients, read where
they are), made once per call for thousands of tensors (a microsecond or less each).
"""
from __future__ import annotations

import os

import torch

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def library_allowed() -> bool:
    """Whether the C passes may be used (``COMPRESSED_OPT_KERNELS=reference``: never)."""
    return os.environ.get("COMPRESSED_OPT_KERNELS") != "reference"


def addressable(t: torch.Tensor) -> bool:
    """Whether a kernel may address ``t``'s elements at ``data_ptr()``: a ``torch.Tensor`` or
    ``nn.Parameter`` itself (not a subclass such as DTensor, whose ``data_ptr()`` is not its
    elements': 0, its elements are its local shard's), with storage (or no elements). Exported as
    ``compressed_opt.cuda.plain_memory``."""
    return type(t) in _PLAIN_TYPES and (t.numel() == 0 or t.data_ptr() != 0)


def plain_cpu_float(t: torch.Tensor) -> bool:
    """Whether the C passes may take ``t`` by pointer: contiguous fp32 CPU memory they can address
    (:func:`addressable`). The one form of the check but :func:`_plain_addresses`, which inlines it
    for thousands of tensors a step."""
    return addressable(t) and t.is_cpu and t.dtype is torch.float32 and t.is_contiguous()


def plain_cpu_floats(sources: list) -> bool:
    """Whether the C passes may read every source (``None``: none): :func:`plain_cpu_float`."""
    if isinstance(sources, Sources):
        return True
    return all(s is None or plain_cpu_float(s) for s in sources)


def readable_in_place(sources: list) -> bool:
    """Whether the C passes read every one of ``sources`` where it lies (none ``None``; the fused
    pass of :class:`~compressed_opt.cuda.LerpScaleClamp` with ``sources``): plain contiguous fp32 CPU
    memory, and the C library here and allowed (not ``COMPRESSED_OPT_KERNELS=reference``)."""
    from . import cpu

    if isinstance(sources, Sources):
        return True
    return (all(s is not None for s in sources) and plain_cpu_floats(sources) and library_allowed()
            and cpu.library() is not None)


def source_addresses(sources: list, sizes: list[int]) -> torch.Tensor:
    """Each source's address (0 for ``None`` or an empty one), checked against its segment's size."""
    if isinstance(sources, Sources):
        return sources.addresses
    for src, n in zip(sources, sizes):
        if src is not None and src.numel() != n:
            raise ValueError(f"a source of {src.numel()} elements for a segment of {n}")
    return torch.tensor([0 if src is None or not src.numel() else src.data_ptr() for src in sources],
                        dtype=torch.int64)


def _plain_addresses(tensors: list, sizes: list[int], what: str) -> list[int] | None:
    """Each tensor's address (0 for an empty one), in one walk that checks each as it goes (five
    attribute reads a tensor, the least a step pays per tensor), or ``None`` where one is not a
    plain contiguous fp32 CPU tensor with storage (``None`` included). Raises ``ValueError`` where
    their number or a size is not the segments' (``what``: the tensors, for the message)."""
    if len(tensors) != len(sizes):
        raise ValueError(f"one {what} per segment is needed ({len(sizes)}), got {len(tensors)}")
    f32, plain, out = torch.float32, _PLAIN_TYPES, []
    append = out.append
    for t, n in zip(tensors, sizes):
        if type(t) not in plain:
            return None
        if t.numel() != n:
            raise ValueError(f"a {what} of {t.numel()} elements for a segment of {n}")
        if t.dtype is not f32 or not t.is_cpu or not t.is_contiguous():
            return None
        ptr = t.data_ptr() if n else 0
        if n and not ptr:
            return None
        append(ptr)
    return out


def destination_addresses(dests: list, sizes: list[int]) -> torch.Tensor | None:
    """Each destination's address (0 for an empty one; int64), or ``None`` where one is not a plain
    contiguous fp32 CPU tensor with storage (a C pass cannot write it). Raises ``ValueError`` where
    their number or a size is not the segments'. :class:`Destinations` give the addresses they hold."""
    if isinstance(dests, Destinations):
        if len(dests) != len(sizes):
            raise ValueError(f"one destination per segment is needed ({len(sizes)}), got {len(dests)}")
        return dests.addresses
    out = _plain_addresses(dests, sizes, "destination")
    return None if out is None else torch.tensor(out, dtype=torch.int64)


class Sources(list):
    """Tensors the C passes read where they lie, one per segment (a bucket's gradients), checked
    once (:func:`readable_in_place`) with their addresses made once (:attr:`addresses`), for the
    passes of one step: :func:`plain_cpu_floats`, :func:`readable_in_place` and
    :func:`source_addresses` take them as they are. They must not change before those passes ran."""

    @classmethod
    def of(cls, tensors: list, sizes: list[int]) -> Sources | None:
        """``tensors`` as :class:`Sources`, or ``None`` where a C pass cannot read them all (as
        :func:`readable_in_place`; checked and addressed in one walk)."""
        from . import cpu

        if not library_allowed() or cpu.library() is None:
            return None
        addresses = _plain_addresses(tensors, sizes, "source")
        if addresses is None:
            return None
        out = cls(tensors)
        out.addresses = torch.tensor(addresses, dtype=torch.int64)
        return out


class Destinations(list):
    """Tensors the C passes write through their own memory, one per segment (a bucket's
    parameters), checked once with their addresses made once (:attr:`addresses`), for the passes of
    one step (a step that asks whether its passes can run, then runs them, walks its parameters
    once): :func:`destination_addresses` takes them as they are. They must not change before those
    passes ran."""

    @classmethod
    def of(cls, tensors: list, sizes: list[int]) -> Destinations | None:
        """``tensors`` as :class:`Destinations`, or ``None`` where a C pass cannot write them all."""
        addresses = destination_addresses(tensors, sizes)
        if addresses is None:
            return None
        out = cls(tensors)
        out.addresses = addresses
        return out
