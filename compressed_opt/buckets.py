"""Flat buckets: parameters grouped into contiguous fp32 buffers, one exchange each.

A bucket holds parameters of one param group on one device, in reverse registration order (the
order backward produces gradients), up to ``cap_bytes`` of fp32 each (a parameter larger than the
cap gets a bucket of its own). Every rank builds the same buckets from the same parameters, so
bucket ``i`` means the same elements everywhere.

A :class:`Bucket` is the geometry (its parameters, their offsets in the flat buffers, the
segments the kernels walk) and the typed state of the parts that keep per-bucket buffers, each a
dataclass declared where it is made (:mod:`compressed_opt.state`): ``sync``, the engine's
workspace; ``feedback``, the exchange's error feedback; ``state``, the algorithm's buffers. The
per-parameter tensors users see in ``optimizer.state`` are views into the algorithm's buffers.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from compressed_opt.comm import chunk_numel
from compressed_opt.cuda import Kernels, Segments, kernels_for


@dataclass(eq=False)
class Bucket:
    index: int
    group_index: int
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    device: torch.device
    #: the engine's workspace (:class:`compressed_opt.engine.BucketSync`)
    sync: Any = field(default=None, repr=False)
    #: the exchange's error feedback (:class:`compressed_opt.exchange.ErrorFeedback`)
    feedback: Any = field(default=None, repr=False)
    #: the algorithm's buffers (its own dataclass, e.g. :class:`compressed_opt.adam.AdamBuffers`)
    state: Any = field(default=None, repr=False)

    @functools.cached_property
    def low_precision(self) -> bool:
        """Whether some parameter is not fp32 (bf16/fp16): ZeRO keeps fp32 masters then."""
        return any(p.dtype != torch.float32 for p in self.params)

    def chunk_range(self, world: int, rank: int) -> tuple[int, int, int]:
        """``(lo, hi, chunk)``: the elements ``[lo, hi)`` of the bucket in rank ``rank``'s chunk of
        the compressed allreduce (its server part, and its ZeRO shard), and the chunk size."""
        c = chunk_numel(self.numel, world)
        lo = min(rank * c, self.numel)
        return lo, min(lo + c, self.numel), c

    @functools.cached_property
    def layer_numels(self) -> torch.Tensor:
        """Per parameter, its number of elements (at least 1), as float64 on the bucket's device."""
        return torch.tensor([max(p.numel(), 1) for p in self.params], dtype=torch.float64, device=self.device)

    @functools.cached_property
    def kernels(self) -> Kernels:
        """The passes that serve the bucket's device, bound once (:func:`compressed_opt.cuda.kernels_for`)."""
        return kernels_for(self.device)

    @functools.cached_property
    def segments(self) -> Segments:
        """The parameters as consecutive segments of the bucket's flat buffers, for the segmented
        passes of :mod:`compressed_opt.cuda`."""
        return Segments([p.numel() for p in self.params])

    def zeros(self, numel: int | None = None, dtype=torch.float32) -> torch.Tensor:
        """A new buffer of ``numel`` (default: the bucket's) zeros on the bucket's device."""
        return torch.zeros(self.numel if numel is None else numel, dtype=dtype, device=self.device)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat buffer, shaped like the parameters (made on each call: a
        part keeps those of its own buffers where it reads them every step)."""
        return [flat[o: o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def scatter_grads(self, flat: torch.Tensor) -> None:
        """Each parameter's ``p.grad`` <- its slice of ``flat`` (a parameter without one gets a
        new gradient, as DDP gives a locally unused parameter the average)."""
        have, views = [], []
        for p, view in zip(self.params, self.views(flat)):
            if p.grad is None:
                p.grad = view.to(p.dtype, copy=True)
            else:
                have.append(p.grad)
                views.append(view)
        if views:
            torch._foreach_copy_(have, views)


def build_buckets(param_groups: list[dict], cap_bytes: int, numel=torch.Tensor.numel, kind=None) -> list[Bucket]:
    """Each param group's trainable parameters in buckets of at most ``cap_bytes`` (fp32; a
    parameter over the cap is a bucket alone), in reverse order (backward's), per device and
    per ``kind(p)`` (parameters of different kinds never share a bucket: a layer split over a
    mesh and one every rank of that mesh holds whole). ``numel(p)``: the size a parameter counts
    for (a split layer's nominal share)."""
    buckets: list[Bucket] = []
    for gi, group in enumerate(param_groups):
        current: dict[tuple, list[torch.Tensor]] = {}
        sizes: dict[tuple, int] = {}

        def close(key):
            params = current.pop(key, [])
            sizes.pop(key, None)
            if params:
                offsets, total = [], 0
                for p in params:
                    offsets.append(total)
                    total += p.numel()
                buckets.append(Bucket(len(buckets), gi, params, offsets, total, key[0]))

        for p in reversed([p for p in group["params"] if p.requires_grad]):
            key = (p.device, None if kind is None else kind(p))
            size = 4 * numel(p)
            if current.get(key) and sizes[key] + size > cap_bytes:
                close(key)
            current.setdefault(key, []).append(p)
            sizes[key] = sizes.get(key, 0) + size
        for key in list(current):
            close(key)
    return buckets


_requires_grad = operator.attrgetter("requires_grad")


def trained_ids(params: list) -> tuple[int, ...]:
    """The ids of the parameters that require a gradient, in order: what the buckets are built
    from, checked every step (walked in C where all do: a tenth of a generator's cost)."""
    if all(map(_requires_grad, params)):
        return tuple(map(id, params))
    return tuple(id(p) for p in params if p.requires_grad)


def exchange_groups(buckets: list[Bucket], cap_bytes: int) -> list[list[int]]:
    """Consecutive buckets whose fp32 bytes together stay within ``cap_bytes``, as runs of their
    indices: their 1-bit exchanges share collectives. Buckets are cut at the cap, so only buckets
    a param group's end cut short merge (a per-layer group's, a no-decay group's): each small
    exchange's time on a link is its collectives' latency. The same on every rank (the layout is)."""
    groups: list[list[int]] = []
    size = 0
    for b in buckets:
        nbytes = 4 * b.numel
        if groups and size + nbytes <= cap_bytes:
            groups[-1].append(b.index)
            size += nbytes
        else:
            groups.append([b.index])
            size = nbytes
    return groups
