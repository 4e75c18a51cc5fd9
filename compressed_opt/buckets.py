"""Flat gradient buckets: parameters grouped into contiguous fp32 buffers, one collective each.

A bucket holds parameters of one param group on one device, in reverse registration order (the
order backward produces gradients), up to ``cap_bytes`` of fp32 each (a parameter larger than the
cap gets a bucket of its own). Every rank builds the same buckets from the same parameters, so
bucket ``i`` means the same elements everywhere. The optimizer state that takes part in
collectives (momentum, variance, error buffers) lives in per-bucket flat buffers; the per-parameter
tensors users see in ``optimizer.state`` are views into them.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch

from compressed_opt.comm import chunk_numel
from compressed_opt.cuda import Destinations, Segments, gather_

from .buffers import BucketBuffers


@dataclass
class Bucket:
    index: int
    group_index: int
    params: list[torch.Tensor]
    offsets: list[int]
    numel: int
    device: torch.device
    #: the bucket's buffers by name (declared by the optimizer: compressed_opt.buffers)
    flats: BucketBuffers = field(default_factory=BucketBuffers)
    #: views of the bucket's own buffers, by (address, dtype, device): made once (a model with
    #: thousands of parameters would otherwise spend most of a step slicing)
    _views: dict = field(default_factory=dict, repr=False, compare=False)
    _own: tuple | None = field(default=None, repr=False, compare=False)  # ((flats, version), their keys)
    #: values an optimizer derives from the bucket's buffers and keeps while they last (keyed by
    #: what they were made from; runtime only, never saved); keys that start with "step." hold one
    #: step's values (its gradients left in place, a pass not run yet) and go at its end
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    def step_destinations(self) -> list[torch.Tensor]:
        """The parameters for this step's C passes: checked and addressed once per step
        (:class:`~compressed_opt.cuda.Destinations`, kept in :attr:`derived` until the step ends), or
        the plain list where a C pass cannot write them (the passes then decline, and the caller
        composes). Only within ``step()``: no loop code runs between its passes."""
        dests = self.derived.get("step.destinations")
        if dests is None:
            dests = self.derived["step.destinations"] = Destinations.of(self.params, self.segments.sizes) or self.params
        return dests

    def forget_step(self) -> None:
        """Drop this step's values from :attr:`derived` (no reference to its gradients stays)."""
        for key in [k for k in self.derived if k.startswith("step.")]:
            del self.derived[key]

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
    def segments(self) -> Segments:
        """The parameters as consecutive segments of the bucket's flat buffers, for the segmented
        passes of :mod:`compressed_opt.cuda.segmented`."""
        return Segments([p.numel() for p in self.params])

    def flat(self, name: str) -> torch.Tensor:
        """The fp32 buffer ``name`` of this bucket (zeros on first use)."""
        buf = self.flats.get(name)
        if buf is None:
            buf = self.flats[name] = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        return buf

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat buffer, shaped like the parameters (do not modify the
        list). Views of one of the bucket's ``flats`` (or of a slice starting where it starts)
        are kept until that buffer leaves ``flats``; views of other tensors are made each call."""
        own, stamp = self._own, (id(self.flats), self.flats.version)
        if own is None or own[0] != stamp:  # which tensors the names hold changed
            own = self._own = (stamp, {(t.data_ptr(), t.dtype, t.device) for t in self.flats.values()})
            for stale in [k for k in self._views if k not in own[1]]:
                del self._views[stale]  # the buffer was dropped: let it go
        own = own[1]
        key = (flat.data_ptr(), flat.dtype, flat.device)
        views = self._views.get(key)
        if views is None:
            views = [flat[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]
            if key in own and flat.is_contiguous():
                self._views[key] = views
        return views

    def gather_grads(self, out: torch.Tensor, inv_scale: float | None = None,
                     square_sums: torch.Tensor | None = None) -> None:
        """``out`` <- this bucket's gradients (zeros where a parameter has none), times ``inv_scale``;
        with ``square_sums`` (float64, one per parameter), their sums of squares, in the same pass."""
        if square_sums is not None:
            gather_([p.grad for p in self.params], out, self.segments, inv_scale, square_sums)
            return
        have, views = [], []
        for p, view in zip(self.params, self.views(out)):
            if p.grad is None:
                view.zero_()
            else:
                have.append(p.grad)
                views.append(view)
        if views:
            torch._foreach_copy_(views, have)
        if inv_scale is not None:
            out.mul_(inv_scale)


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


def param_states(state, bucket: Bucket) -> list[dict]:
    """``[state[p] for p in bucket.params]`` (``state``: an optimizer's), made once per state
    mapping and kept in ``bucket.derived``: a step's per-layer scalars are read and written through
    it without hashing a tensor per layer (``load_state_dict`` makes a new mapping, and a new list)."""
    cached = bucket.derived.get("param_states")
    if cached is None or cached[0] is not state:
        cached = bucket.derived["param_states"] = (state, [state[p] for p in bucket.params])
    return cached[1]
