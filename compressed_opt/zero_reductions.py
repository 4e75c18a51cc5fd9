"""The part of :class:`compressed_opt.zero.Sharded` that knows its chunk's geometry: rank ``j``'s
elements ``[lo, hi)`` of each bucket, cut at the layers' ends into pieces (:meth:`ChunkReductions.
chunk_pieces`), the parameters' values of those pieces, and the per-layer reductions over the
chunks: this rank's partial over its pieces (a sum, a norm, a maximum), then one all-gather of
every rank's partials, combined in rank order, so that every rank gets the same value. And
:func:`shard`, the bucket buffers of a chunk's size the sharded layout keeps.
"""
from __future__ import annotations

import torch

from compressed_opt.cuda import Segments, segment_sumsq

from .buckets import Bucket
from .reductions import maxima


def shard(bucket: Bucket, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    """The bucket's buffer ``name`` of ``numel`` elements (zeros when new or resized)."""
    buf = bucket.flats.get(name)
    if buf is None or buf.numel() != numel:
        buf = bucket.flats[name] = torch.zeros(numel, dtype=dtype, device=bucket.device)
    return buf


class ChunkReductions:
    """A sharded layout's chunk geometry and per-layer reductions (a mixin of :class:`compressed_opt.zero.Sharded`)."""

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

    def chunk_pieces(self, opt, bucket: Bucket) -> tuple[Segments, list[int], torch.Tensor]:
        """This rank's chunk as consecutive pieces of the bucket's layers: the pieces (segments of the
        chunk), each one's layer (its index in the bucket; layers without an element in the chunk
        left out) as a list and as an int64 tensor, made once per bucket."""
        lo, hi, _ = self.own_range(opt, bucket)
        kept = bucket.derived.get("chunk_pieces")
        if kept is None or kept[0] != (lo, hi):
            index, sizes = [], []
            for i, (start, p) in enumerate(zip(bucket.offsets, bucket.params)):
                a, b = max(start, lo), min(start + p.numel(), hi)
                if a < b:
                    index.append(i)
                    sizes.append(b - a)
            at = torch.tensor(index, dtype=torch.int64, device=bucket.device)
            kept = bucket.derived["chunk_pieces"] = ((lo, hi), Segments(sizes), index, at)
        return kept[1:]

    def copy_own_params_(self, opt, bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
        """``out[: hi - lo]`` <- this rank's chunk of the parameters (only its pieces read); returns that view."""
        lo, hi, _ = self.own_range(opt, bucket)
        pieces, index, _ = self.chunk_pieces(opt, bucket)
        if index:
            params, offsets = bucket.params, bucket.offsets
            src = [params[i].reshape(-1)[max(offsets[i], lo) - offsets[i] :][:n] for i, n in zip(index, pieces.sizes)]
            torch._foreach_copy_(pieces.split(out), src)
        return out[: hi - lo]

    def layer_norms(self, opt, bucket, parts):
        """Sums of squares over this rank's pieces of each of ``parts`` (float64, the C pass where it
        runs: ``segment_sumsq``, as stage 0's norms sum a whole layer), one all-gather of them,
        added in rank order."""
        pieces, index, at = self.chunk_pieces(opt, bucket)
        partial = torch.zeros(len(parts), len(bucket.params), dtype=torch.float64, device=bucket.device)
        if index:
            sums = torch.empty(len(index), dtype=torch.float64, device=bucket.device)
            for row, v in zip(partial, parts):
                row[at] = segment_sumsq(v, pieces, sums)
        return list(self._gather(opt, partial.view(-1)).sum(dim=0).view(len(parts), -1).sqrt_())

    def per_element(self, opt, bucket: Bucket, per_layer: list[float], name: str) -> torch.Tensor:
        """A per-layer value spread over this rank's chunk (into the scratch buffer ``name``)."""
        ids = self.layer_ids(opt, bucket)
        values = torch.tensor(per_layer, dtype=torch.float32, device=bucket.device)
        out = shard(bucket, name, self.own_range(opt, bucket)[2])[: ids.numel()]
        return torch.index_select(values, 0, ids, out=out)

    def layer_maxima(self, opt, bucket, values):
        """Per layer, the maximum over every rank's chunk (``values`` >= 0; one all-gather of them)."""
        pieces, index, at = self.chunk_pieces(opt, bucket)
        partial = torch.zeros(len(bucket.params), dtype=torch.float32, device=bucket.device)
        if index:
            partial[at] = torch.stack(maxima(pieces.split(values))).clamp_(min=0.0)
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
