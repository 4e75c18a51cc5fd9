"""Per-layer reductions over ZeRO's chunks (the part of :class:`compressed_opt.zero.Sharded` that
reduces): rank ``j`` holds chunk ``j`` of every bucket's per-element state, so a per-layer sum,
norm or maximum is this rank's partial over its chunk, then one all-gather of every rank's
partials, combined in rank order: every rank gets the same value. And :func:`shard`, the bucket
buffers of a chunk's size the sharded layout keeps.
"""
from __future__ import annotations

import torch

from .buckets import Bucket
from .reductions import maxima


def shard(bucket: Bucket, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    """The bucket's buffer ``name`` of ``numel`` elements (zeros when new or resized)."""
    buf = bucket.flats.get(name)
    if buf is None or buf.numel() != numel:
        buf = bucket.flats[name] = torch.zeros(numel, dtype=dtype, device=bucket.device)
    return buf


class ChunkReductions:
    """The per-layer reductions of a sharded layout (a mixin of :class:`compressed_opt.zero.Sharded`)."""

    def own_range(self, opt, bucket: Bucket) -> tuple[int, int, int]:
        """``(lo, hi, chunk)``: this rank's elements ``[lo, hi)`` of the bucket, and the chunk size."""
        return bucket.chunk_range(opt.backend.world_size, opt.backend.rank)

    def layer_ids(self, opt, bucket: Bucket) -> torch.Tensor:
        """For each element of this rank's chunk, the index of its parameter (layer) in the bucket."""
        ids = bucket.flats.get("layer_ids")
        if ids is None:
            lo, hi, _ = self.own_range(opt, bucket)
            starts = torch.tensor(bucket.offsets, dtype=torch.int64, device=bucket.device)
            positions = torch.arange(lo, hi, dtype=torch.int64, device=bucket.device)
            # an empty parameter shares its offset with the next one: right=True skips it
            ids = bucket.flats["layer_ids"] = torch.searchsorted(starts, positions, right=True) - 1
        return ids

    def layer_norms(self, opt, bucket, parts):
        """Sums of squares over this rank's chunk of each of ``parts``, one all-gather of them,
        added in rank order."""
        ids, n_layers = self.layer_ids(opt, bucket), len(bucket.params)
        partial = torch.zeros(len(parts), n_layers, dtype=torch.float32, device=bucket.device)
        square = shard(bucket, "square_shard", self.own_range(opt, bucket)[2])[: ids.numel()]
        for row, v in zip(partial, parts):
            row.index_add_(0, ids, torch.mul(v, v, out=square))
        return list(self._gather(opt, partial.view(-1)).sum(dim=0).view(len(parts), n_layers).sqrt_())

    def per_element(self, opt, bucket: Bucket, per_layer: list[float], name: str) -> torch.Tensor:
        """A per-layer value spread over this rank's chunk (into the scratch buffer ``name``)."""
        ids = self.layer_ids(opt, bucket)
        values = torch.tensor(per_layer, dtype=torch.float32, device=bucket.device)
        out = shard(bucket, name, self.own_range(opt, bucket)[2])[: ids.numel()]
        return torch.index_select(values, 0, ids, out=out)

    def layer_maxima(self, opt, bucket, values):
        """Per layer, the maximum over every rank's chunk (``values`` >= 0; one all-gather of them)."""
        lo, hi, _ = self.own_range(opt, bucket)
        index, views = [], []
        for i, (start, p) in enumerate(zip(bucket.offsets, bucket.params)):
            a, b = max(start, lo), min(start + p.numel(), hi)
            if a < b:
                index.append(i)
                views.append(values[a - lo : b - lo])
        partial = torch.zeros(len(bucket.params), dtype=torch.float32, device=bucket.device)
        if views:
            partial[index] = torch.stack(maxima(views)).clamp_(min=0.0)
        return self.maxima_over_ranks(opt, bucket, partial)

    def maxima_over_ranks(self, opt, bucket, partial) -> list[float]:
        """Per layer, the maximum of every rank's ``partial`` (fp32, >= 0; 0 for a layer outside
        the rank's chunk): one all-gather; 1.0 for an empty layer."""
        found = self._gather(opt, torch.as_tensor(partial, dtype=torch.float32, device=bucket.device)).amax(dim=0)
        return [f if p.numel() else 1.0 for p, f in zip(bucket.params, found.tolist())]

    def sum_over_ranks(self, opt, values: list[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (fp64, in rank order: the same on every rank)."""
        mine = torch.tensor(values, dtype=torch.float64, device=opt.comm_device)
        return self._gather(opt, mine).sum(dim=0).tolist()

    def _gather(self, opt, partial: torch.Tensor) -> torch.Tensor:
        world = opt.backend.world_size
        everyone = torch.empty(world * partial.numel(), dtype=partial.dtype, device=partial.device)
        opt.backend.all_gather(everyone, partial)
        return everyone.view(world, partial.numel())
