"""ZeRO-style sharding of the frozen-variance optimizers' state (:class:`OnebitAdam`,
:class:`OnebitLamb`, ``zero_stage`` 1 or 2) by the compressed allreduce's server chunks.

Rank ``j`` owns chunk ``j`` of every bucket (elements ``[j c, (j+1) c)``, ``c`` the server chunk
of :func:`compressed_opt.comm.chunk_numel`), the same elements whose server error it holds. Its
buffers are a bucket's :class:`Shards`; :class:`Sharding` is what the algorithms call where the
state's place changes what a step does.

Warmup (full precision):

* stage 1: the gradient bucket is all-reduced; stage 2: reduce-scattered (the engine's
  ``shard_gradients``), so each rank receives only the average of its own chunk;
* rank ``j`` keeps only ``m_j`` and ``v_j`` (chunk ``j`` of the momentum and the variance),
  computes the new parameter values of its chunk, and one all-gather of the chunks gives every
  rank the new parameters (in place of the fp32 gradient all-reduce's second half). Per-layer
  quantities over a chunk (LAMB's norms) are reduced across the ranks from one all-gather of a
  few floats per layer, summed in rank order, so every rank gets the same bits. The
  ``freeze_step="auto"`` rule watches the mean variance of the whole model as without ZeRO: each
  rank sums its chunks, and one all-gather of two floats adds the sums up.

At the freeze the chunks of ``m`` and ``v`` are all-gathered once: every rank then holds the frozen
denominator ``sqrt(v_f) + eps`` of the whole bucket (the compression-stage update needs it for
every element, on every rank, so that no full-precision parameter all-gather is needed).

Compression stage: the averaged momentum is identical on every rank and is exactly what the last
exchange's second all-gather carried: ``N`` rows of ``[block scales | sign bits]``, ``n/8 + 4n /
scale_block`` bytes. Each rank keeps those rows instead of an fp32 momentum (32x less) and expands
them when it forms its next local momentum; every rank applies the same update to its replica of
the parameters, so the parameters stay identical without any full-precision traffic. (1-bit LAMB's
fresh variance is sharded too: rank ``j`` updates chunk ``j`` from the reconstructed gradient, and
the per-layer maximum its factor needs is one all-gather of a float per layer.)

Parameters in bf16/fp16 get an fp32 master chunk on their owner (``master_shard``): warmup updates
it and gathers it into the parameters; in the compression stage every rank updates its
low-precision parameters as without ZeRO, the owner also its exact fp32 chunk, and every
``master_resync_interval`` steps one all-gather of the master chunks replaces the parameters,
bounding the drift of their rounding (an fp32 all-gather: ``4n (N-1)/N`` bytes per rank then).

Per-rank state of 1-bit Adam, fp32 parameters, ``n`` elements, ``N`` ranks (bytes): stage 0
warmup ``8n`` (``m``, ``v``); ZeRO warmup ``8n/N``; stage 0 compression ``16n + 4n/N`` (``m``,
``v``, the frozen denominator, the worker error, the server error); ZeRO compression
``8n + 4n/N + n/8 + 4n/scale_block`` (``R``, worker error, server error, the momentum rows). 1-bit
LAMB adds its fresh variance: ``4n`` more in stage 0, ``4n/N`` with ZeRO.

0/1 Adam is not sharded: its phase-B state is per rank by the algorithm or needed whole on every
rank, so sharding it would cost a full-precision parameter all-gather at every synchronisation.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel, expand_result_rows

from . import scaling
from .adam import denominator_, frozen_denominator_of, momentum_, preconditioned_denominator, variance_
from .reductions import maxima
from .state import DERIVED, SAVED, SCRATCH, buffer
from .validation import check_step_count


@dataclass(eq=False)
class Shards:
    """A bucket's state under ZeRO (:mod:`compressed_opt.state`): this rank's chunks, what the
    freeze gathered whole, and the last exchange's rows (the momentum)."""

    exp_avg_shard: torch.Tensor | None = buffer(SAVED)  # m_j (warmup)
    exp_avg_sq_shard: torch.Tensor | None = buffer(SAVED)  # v_j (warmup)
    exp_avg_sq_fresh_shard: torch.Tensor | None = buffer(SAVED)  # 1-bit LAMB's v_fresh, chunk j
    exp_avg: torch.Tensor | None = buffer(SAVED)  # the momentum gathered at the freeze, until the first exchange
    frozen_denominator: torch.Tensor | None = buffer(SAVED)  # sqrt(v_f) + eps, gathered at the freeze, until R
    preconditioner: torch.Tensor | None = buffer(SAVED)  # R = c_l / sqrt(v_f)
    momentum_rows: torch.Tensor | None = buffer(SAVED, torch.uint8)  # the last exchange's [scales | bits] rows
    master_shard: torch.Tensor | None = buffer(SAVED)  # fp32 masters of chunk j (bf16/fp16 parameters)
    no_variance: torch.Tensor | None = buffer(DERIVED, torch.int64)  # where v_f == 0
    #: this rank's chunk cut at the layers' ends: ``(Segments of the pieces, their layers, as an int64 tensor)``
    pieces: tuple | None = buffer(DERIVED)
    layer_ids: torch.Tensor | None = buffer(DERIVED, torch.int64)  # per element of the chunk, its layer
    update_shard: torch.Tensor | None = buffer(SCRATCH)  # chunk j's update, or its values copied out
    momentum_prev_shard: torch.Tensor | None = buffer(SCRATCH)  # 1-bit LAMB's m_{t-1}, chunk j
    coeff_shard: torch.Tensor | None = buffer(SCRATCH)  # a per-layer value spread over chunk j
    step_count: torch.Tensor | None = buffer(SCRATCH)  # fused AdamW's step count (a 0-dim tensor)
    lamb_denominator: tuple | None = buffer(DERIVED)  # 1-bit LAMB: (its key, chunk j's sqrt(v_f) + eps)
    lamb_segments: tuple | None = buffer(DERIVED)  # 1-bit LAMB: ((lo, hi), the layers' pieces of chunk j)


def chunk(shards: Shards, name: str, numel: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """``shards``'s buffer ``name`` of ``numel`` elements (zeros when new or resized)."""
    buf = getattr(shards, name)
    if buf is None or buf.numel() != numel:
        buf = torch.zeros(numel, dtype=dtype, device=device)
        setattr(shards, name, buf)
    return buf


def sharding(name: str, zero_stage, master_resync_interval) -> Sharding | None:
    """The optimizer's ``zero_stage`` and ``master_resync_interval`` arguments, checked: ZeRO's
    shards for stage 1 or 2, ``None`` for 0 (every rank holds whole buckets)."""
    if zero_stage not in (0, 1, 2) or isinstance(zero_stage, bool):
        raise ValueError(f"Invalid zero_stage: {zero_stage!r} (must be 0, 1 or 2)")
    interval = check_step_count("master_resync_interval", master_resync_interval, minimum=1)
    return Sharding(name, zero_stage, interval) if zero_stage else None


class Sharding:
    """ZeRO stage 1 or 2 of one optimizer (see the module doc): what changes where the state is
    sharded, over the engine's backend (:meth:`bind`)."""

    def __init__(self, name: str, stage: int, master_resync_interval: int):
        self.name, self.stage, self.master_resync_interval = name, stage, master_resync_interval
        self.engine = None

    def bind(self, engine) -> None:
        self.engine = engine

    def __getstate__(self) -> dict:
        return {**self.__dict__, "engine": None}

    @staticmethod
    def shards(bucket) -> Shards:
        return Shards()

    # --- checks, once -----------------------------------------------------------------------------
    def check_rebuild(self, global_step: int) -> None:
        if global_step > 0:
            raise RuntimeError(
                f"{self.name} with zero_stage={self.stage}: the trainable parameters changed "
                "after the first step (add_param_group or requires_grad changed); the sharded state is laid "
                "out by the buckets and cannot follow. Set up every parameter before the first step, or "
                "use zero_stage=0"
            )

    def checkpoint_problem(self, backend, rank: int, world: int, consolidated: bool) -> str | None:
        if world != backend.world_size or (rank != backend.rank and not consolidated):
            return (f"this ZeRO checkpoint holds the shards of rank {rank} of {world}; it cannot be loaded on rank "
                    f"{backend.rank} of {backend.world_size}. Resume with the same world size, each rank loading "
                    "its own file (or train with zero_stage=0 to move between world sizes)")
        return None

    def check_ddp(self) -> None:
        raise ValueError(
            f"{self.name}(zero_stage={self.stage}) found its parameters inside a "
            "DistributedDataParallel model: DDP keeps whole gradients and parameters on every "
            "rank, so ZeRO sharding cannot work under it. Use zero_stage=0 with a DDP-wrapped "
            "model, or give the optimizer the unwrapped model without DDP"
        )

    # --- the chunk's geometry ----------------------------------------------------------------------
    def own_range(self, bucket) -> tuple[int, int, int]:
        """``(lo, hi, chunk)``: this rank's elements ``[lo, hi)`` of the bucket, and the chunk size."""
        backend = self.engine.backend
        return bucket.chunk_range(backend.world_size, backend.rank)

    def _chunk(self, bucket, name: str) -> torch.Tensor:
        """This rank's part of the chunk-sized buffer ``name``."""
        lo, hi, c = self.own_range(bucket)
        return chunk(bucket.state.buffers, name, c, device=bucket.device)[: hi - lo]

    def pieces(self, bucket) -> tuple:
        """This rank's chunk as consecutive pieces of the bucket's layers: the pieces (segments of the
        chunk), each one's layer (its index in the bucket; layers without an element in the chunk left
        out) as a list and as an int64 tensor, made once per bucket."""
        shards = bucket.state.buffers
        lo, hi, _ = self.own_range(bucket)
        if shards.pieces is None or shards.pieces[0] != (lo, hi):
            index, sizes = [], []
            for i, (start, p) in enumerate(zip(bucket.offsets, bucket.params)):
                a, b = max(start, lo), min(start + p.numel(), hi)
                if a < b:
                    index.append(i)
                    sizes.append(b - a)
            at = torch.tensor(index, dtype=torch.int64, device=bucket.device)
            shards.pieces = ((lo, hi), kernels.Segments(sizes), index, at)
        return shards.pieces[1:]

    def layer_ids(self, bucket) -> torch.Tensor:
        """For each element of this rank's chunk, the index of its parameter (layer) in the bucket."""
        shards = bucket.state.buffers
        if shards.layer_ids is None:
            lo, hi, _ = self.own_range(bucket)
            starts = torch.tensor(bucket.offsets, dtype=torch.int64, device=bucket.device)
            positions = torch.arange(lo, hi, dtype=torch.int64, device=bucket.device)
            # an empty parameter shares its offset with the next one: right=True skips it
            shards.layer_ids = torch.searchsorted(starts, positions, right=True) - 1
        return shards.layer_ids

    def per_element(self, bucket, per_layer: list[float]) -> torch.Tensor:
        """A per-layer value spread over this rank's chunk (into its scratch buffer)."""
        ids = self.layer_ids(bucket)
        values = torch.tensor(per_layer, dtype=torch.float32, device=bucket.device)
        out = chunk(bucket.state.buffers, "coeff_shard", self.own_range(bucket)[2], device=bucket.device)
        return torch.index_select(values, 0, ids, out=out[: ids.numel()])

    def copy_own_params_(self, bucket, out: torch.Tensor) -> torch.Tensor:
        """``out[: hi - lo]`` <- this rank's chunk of the parameters (only its pieces read); returns that view."""
        lo, hi, _ = self.own_range(bucket)
        pieces, index, _ = self.pieces(bucket)
        if index:
            params, offsets = bucket.params, bucket.offsets
            src = [params[i].reshape(-1)[max(offsets[i], lo) - offsets[i]:][:n] for i, n in zip(index, pieces.sizes)]
            torch._foreach_copy_(pieces.split(out), src)
        return out[: hi - lo]

    # --- reductions over every rank's chunk (the same on every rank: added in rank order) -------------
    def _gather(self, partial: torch.Tensor) -> torch.Tensor:
        backend = self.engine.backend
        world = backend.world_size
        everyone = torch.empty(world * partial.numel(), dtype=partial.dtype, device=partial.device)
        backend.all_gather(everyone, partial)
        return everyone.view(world, partial.numel())

    def sum_over_ranks(self, engine, values: list[float]) -> list[float]:
        """Each of ``values`` summed over the ranks (fp64, in rank order: the same on every rank)."""
        return self._gather(torch.tensor(values, dtype=torch.float64, device=engine.device)).sum(dim=0).tolist()

    def layer_norms(self, bucket, parts: list) -> list[torch.Tensor]:
        """Per layer, each of ``parts``' (this rank's chunk of a quantity) L2 norm over every rank's
        chunk: float64 sums of squares of its pieces (``segment_sumsq``, as stage 0's norms sum a
        whole layer), one all-gather of them, added in rank order."""
        pieces, index, at = self.pieces(bucket)
        partial = torch.zeros(len(parts), len(bucket.params), dtype=torch.float64, device=bucket.device)
        if index:
            sums = torch.empty(len(index), dtype=torch.float64, device=bucket.device)
            for row, v in zip(partial, parts):
                row[at] = kernels.segment_sumsq(v, pieces, sums)
        return list(self._gather(partial.view(-1)).sum(dim=0).view(len(parts), -1).sqrt_())

    def layer_maxima(self, bucket, values: torch.Tensor) -> list[float]:
        """Per layer, the maximum of ``values`` (chunk ``j``, >= 0) over every rank's chunk."""
        pieces, index, at = self.pieces(bucket)
        partial = torch.zeros(len(bucket.params), dtype=torch.float32, device=bucket.device)
        if index:
            partial[at] = torch.stack(maxima(pieces.split(values))).clamp_(min=0.0)
        return self.maxima_over_ranks(bucket, partial)

    def maxima_over_ranks(self, bucket, partial) -> list[float]:
        """Per layer, the maximum of every rank's ``partial`` (fp32, >= 0; 0 for a layer outside the
        rank's chunk): one all-gather; 1.0 for an empty layer."""
        found = self._gather(torch.as_tensor(partial, dtype=torch.float32, device=bucket.device)).amax(dim=0)
        return [f if p.numel() else 1.0 for p, f in zip(bucket.params, found.tolist())]

    # --- warmup: rank j updates chunk j, then every rank gathers the parameters ---------------------------
    def own(self, bucket, whole: torch.Tensor) -> torch.Tensor:
        lo, hi, _ = self.own_range(bucket)
        return whole[lo:hi]

    def moment(self, bucket, name: str) -> torch.Tensor:
        """Chunk ``j`` of the moment ``name`` (``"exp_avg"``, ``"exp_avg_sq"``, ``"exp_avg_sq_fresh"``)."""
        return self._chunk(bucket, name + "_shard")

    def variance(self, bucket) -> torch.Tensor:
        """This rank's chunk of ``v`` (what the auto freeze sums)."""
        return self.moment(bucket, "exp_avg_sq")

    def direction_buffer(self, bucket) -> torch.Tensor:
        return self._chunk(bucket, "update_shard")

    def master(self, bucket) -> torch.Tensor | None:
        """This rank's fp32 master copy of its chunk of a bucket that holds bf16/fp16 parameters
        (made from the parameters on first use); ``None`` for fp32 buckets."""
        if not bucket.low_precision:
            return None
        shards = bucket.state.buffers
        if shards.master_shard is None:  # (copied from the parameters' pieces alone: the gradient stays)
            shards.master_shard = torch.zeros(self.own_range(bucket)[2], device=bucket.device)
            self.copy_own_params_(bucket, shards.master_shard)
        return shards.master_shard

    def own_values(self, bucket, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's chunk of the parameters in fp32, to update in place and then :meth:`publish`:
        the master chunk of a bf16/fp16 bucket (the truth), else the current values copied out of
        the parameters into ``out`` (default: the gradient workspace, after the moments read it)."""
        master = self.master(bucket)
        if master is not None:
            lo, hi, _ = self.own_range(bucket)
            return master[: hi - lo]
        if out is None:
            out = bucket.sync.padded[self.own_range(bucket)[0]:]
        return self.copy_own_params_(bucket, out)

    def publish(self, bucket, values: torch.Tensor) -> None:
        """One all-gather of every rank's :meth:`own_values` into the parameters."""
        shards, padded = bucket.state.buffers, bucket.sync.padded
        master = shards.master_shard
        if master is None:
            lo, hi, c = self.own_range(bucket)
            out = chunk(shards, "update_shard", c, device=bucket.device)
            out[: hi - lo].copy_(values)
            out[hi - lo:].zero_()
        else:
            out = master  # zero beyond the chunk's end
        self.engine.backend.all_gather(padded, out)
        torch._foreach_copy_(bucket.params, bucket.views(padded[: bucket.numel]))

    def adamw_(self, bucket, shards: Shards, kernel) -> None:
        """A warmup step by a multi-tensor AdamW kernel (torch's fused one) on this rank's chunk: its
        fp32 master, or its parameters' values copied out of them (into the direction buffer: the
        gradient is read by the kernel); then :meth:`publish`."""
        lo, hi, c = self.own_range(bucket)
        values = self.own_values(bucket, chunk(shards, "update_shard", c, device=bucket.device))
        if hi > lo:
            grad = bucket.sync.padded
            kernel([values], [grad[lo:hi]], [self.moment(bucket, "exp_avg")], [self.moment(bucket, "exp_avg_sq")])
        self.publish(bucket, values)

    def adam_(self, bucket, shards: Shards, beta1: float, beta2: float, eps: float, bc2_sqrt: float, decay: float,
              alpha: float) -> None:
        """The warmup's AdamW composed on this rank's chunk (as the replicated state's, on the chunk)."""

        g = self.own(bucket, bucket.sync.padded)
        m, v = self.moment(bucket, "exp_avg"), self.moment(bucket, "exp_avg_sq")
        momentum_(m, g, beta1)
        variance_(v, g, beta2)
        direction = self.direction_buffer(bucket)
        torch.div(m, denominator_(v, direction, eps, bc2_sqrt), out=direction)
        values = self.own_values(bucket)
        values.mul_(decay).add_(direction, alpha=alpha)
        self.publish(bucket, values)

    def step_layers_(self, bucket, values: torch.Tensor, update: torch.Tensor, coeffs: list[float],
                     scale: float) -> None:
        """1-bit LAMB's warmup step: ``values <- values + scale coeff_l update`` per piece of a layer
        in the chunk, as the replicated state steps a whole layer; then :meth:`publish`."""
        pieces, index, _ = self.pieces(bucket)
        if index:
            steps = pieces.split(update)
            torch._foreach_mul_(steps, [scale * coeffs[i] for i in index])
            torch._foreach_add_(pieces.split(values), steps)
        self.publish(bucket, values)

    def freeze(self, engine, bucket, group: dict, freeze_step: int) -> torch.Tensor:
        """Gather the chunks of ``m`` and ``v`` once: the full momentum (until the first compressed
        exchange replaces it by its 1-bit rows) and the frozen denominator of every element. Returns
        the whole raw ``v`` (the gradient workspace: valid until the bucket's next collective)."""

        shards, padded, n = bucket.state.buffers, bucket.sync.padded, bucket.numel
        c = chunk_numel(n, engine.backend.world_size)
        engine.backend.all_gather(padded, chunk(shards, "exp_avg_shard", c, device=bucket.device))
        shards.exp_avg = padded[:n].clone()
        engine.backend.all_gather(padded, chunk(shards, "exp_avg_sq_shard", c, device=bucket.device))
        shards.frozen_denominator = frozen_denominator_of(padded[:n], group, freeze_step)
        # the momentum lives on whole, then as 1-bit rows; the variance only as the denominator
        shards.exp_avg_shard = shards.exp_avg_sq_shard = None
        return padded[:n]

    def frozen_denominator(self, bucket, st, group: dict) -> torch.Tensor:
        """``sqrt(v_f) + eps``: as gathered at the freeze, or (once ``R`` is made, which is all that is
        kept) made for one step from ``R``: ``(1 / R) c_l + eps``."""

        shards = st.buffers
        if shards.frozen_denominator is not None:
            return shards.frozen_denominator
        return preconditioned_denominator(shards.preconditioner, bucket.views,
                                          [s["scaling_coeff"] for s in st.states], group["eps"])

    # --- the compression stage: every rank updates its whole replica from the kept rows -------------------
    def kept_rows(self, bucket, buffer: torch.Tensor) -> kernels.CompressedResult:
        """The kept rows (the last exchange's result), as a compressed result of the bucket."""
        engine = self.engine
        world = engine.backend.world_size
        return kernels.CompressedResult(bucket.state.buffers.momentum_rows.view(world, -1),
                                        chunk_numel(bucket.numel, world), engine.scale_block, buffer)

    def previous_momentum(self, bucket) -> torch.Tensor:
        """1-bit LAMB: chunk ``j`` of ``m_{t-1}``, kept when the local momentum was formed."""
        return self._chunk(bucket, "momentum_prev_shard")

    def local_momentum(self, algorithm, bucket, gradients, beta1: float, r: torch.Tensor | None,
                       keep_previous: bool = False, row_scales: list[float] | None = None, formed: bool = False):
        """The local momentum ``b1 m + (1 - b1) g_i`` (``m`` the kept rows, or the momentum the freeze
        gathered; ``g_i`` read from ``p.grad`` where it lies, ``gradients.sources``), as the
        preconditioned exchange carries it (``clip(s_l R m_i, +-K c_l)``, 0 where ``v_f == 0``) or the
        momentum exchange (``row_scales``: 1-bit LAMB's ``c_l``, divided out of the rows): the pass
        that makes it inside the compression, where it runs from the kept rows and the exchange runs
        next on this thread (``gradients.inline``), else formed into the buffer now (``None``: the
        buffer holds it). ``formed``: the caller reads it whole before the exchange (1-bit LAMB's
        measuring steps). ``keep_previous``: also keep chunk ``j`` of ``m_{t-1}`` (1-bit LAMB's fresh
        variance)."""
        st, x = bucket.state, gradients.buffer
        shards = st.buffers
        factors = algorithm.exchange_factors(bucket) if r is not None else None
        kept = [s.get("exchange_factor", 1.0) for s in st.states] if factors is not None else None
        bounds = algorithm.exchange.bounds(st, algorithm.param_groups[bucket.group_index]["betas"]) if r is not None \
            else None

        def compose():
            self.form_local_momentum(bucket, x, beta1, gradients.sources, keep_previous, row_scales, r, kept,
                                     factors)
            if r is not None:
                idx = algorithm.exchange.no_variance(st)
                if idx.numel():
                    x.index_fill_(0, idx, 0.0)
                views = bucket.views(x)
                if views:
                    torch._foreach_clamp_max_(views, bounds)
                    torch._foreach_clamp_min_(views, [-b for b in bounds])

        from_rows = row_scales is None and shards.exp_avg is None
        if from_rows and keep_previous:  # m_{t-1} = (R m) / R of chunk j, natively (no R: composed)
            previous = self.previous_momentum(bucket)
            from_rows = r is not None and kernels.zero_passes.previous_momentum_(
                self.kept_rows(bucket, previous), r, *self.own_range(bucket)[:2], previous)
        if not from_rows or not isinstance(gradients.sources, kernels.Sources):  # (the C passes cannot read them)
            compose()
            return None
        formed = formed or not gradients.inline  # (p.grad may change before the exchange: read it now)
        n_layers, alpha = len(bucket.params), 1 - beta1
        keep = [beta1] * n_layers if factors is None else [beta1 * n / k for n, k in zip(factors, kept)]
        gain = [alpha] * n_layers if factors is None else [alpha * n for n in factors]
        producer = kernels.zero_passes.ZeroLocalMomentum(x, self.kept_rows(bucket, x), r, keep, gain, bounds,
                                                          bucket.segments, gradients.sources, compose)
        if not formed:
            return producer
        if not producer.form_():
            compose()
        return None

    def form_local_momentum(self, bucket, x: torch.Tensor, beta1: float, grads: list, keep_previous: bool,
                            row_scales: list[float] | None, preconditioner: torch.Tensor | None,
                            kept: list[float] | None, new: list[float] | None) -> None:
        """``x`` <- ``b1 m + (1 - b1) g_i`` composed, with ``m`` expanded from the kept rows (or the
        momentum gathered at the freeze) and ``g_i`` one tensor per layer (``grads``).
        ``row_scales``: per layer, what the exchanged momentum was multiplied by (1-bit LAMB's
        scaling coefficients), divided out after expanding. ``preconditioner``: per element, the
        fixed factor ``R`` of an exchange of ``R m``: ``x`` <- ``b1 R m + (1 - b1) R g_i``, with ``R m``
        the kept rows themselves. ``kept``, ``new``: per layer, the exchange factors the kept rows
        were made with and this exchange's (the tracked exchange): ``x`` <- ``new (b1 R m + (1 - b1) R
        g_i)``, the rows divided by ``kept``. ``keep_previous``: also keep this rank's chunk of ``m``."""
        shards = bucket.state.buffers
        if shards.exp_avg is not None:
            x.copy_(shards.exp_avg)
            kept = None  # the momentum gathered at the freeze: not scaled
            if preconditioner is not None:
                x.mul_(preconditioner)
        else:
            engine = self.engine
            expand_result_rows(shards.momentum_rows, bucket.numel, engine.backend.world_size, x, engine.scale_block)
            if row_scales is not None:
                scaling.unscale_(bucket.views(x), row_scales)
        if keep_previous:
            lo, hi, _ = self.own_range(bucket)
            previous = self.previous_momentum(bucket)
            if preconditioner is None:
                previous.copy_(x[lo:hi])
            else:  # m = (R m) / R; 0 where R == 0 (v_f == 0)
                torch.div(x[lo:hi], preconditioner[lo:hi], out=previous).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        alpha = 1 - beta1
        if new is None:
            x.mul_(beta1)
        else:  # per layer: b1 new / kept on the rows, (1 - b1) new on the gradient
            kept = kept if kept is not None else [1.0] * len(new)
            torch._foreach_mul_(bucket.views(x), [beta1 * n / k for n, k in zip(new, kept)])
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return
        x_views = bucket.views(x)
        views = [x_views[i] for i in present]
        grads = [g.reshape(x_views[i].shape) if g.dtype == torch.float32 else g.float().reshape(x_views[i].shape)
                 for i, g in ((i, grads[i]) for i in present)]
        if preconditioner is None:
            torch._foreach_add_(views, grads, alpha=alpha)
            return
        r_views = bucket.views(preconditioner)
        scales = [r_views[i] for i in present]
        if new is None:
            torch._foreach_addcmul_(views, scales, grads, value=alpha)
        else:
            torch._foreach_addcmul_(views, scales, grads, [alpha * new[i] for i in present])

    def keep_rows(self, bucket) -> None:
        """The exchange's result rows are the momentum from now on (the gathered one goes)."""
        shards, rows = bucket.state.buffers, bucket.sync.rows
        chunk(shards, "momentum_rows", rows.numel(), torch.uint8, bucket.device).copy_(rows.reshape(-1))
        shards.exp_avg = None

    def update_(self, algorithm, bucket, result, decay: float, alpha: float, factors, step: int) -> None:
        """1-bit Adam's compression-stage update of the whole replica, the result's rows kept as the
        momentum: the preconditioned exchange's ``p <- p decay + alpha (f_l / s_l) y / (c_l + eps R)``
        in one native pass from the rows (fp32 parameters: ``zero_passes.rows_descend_``), else
        composed; the momentum exchange's ``p <- p decay + alpha f_l y / (sqrt(v_f) + eps)``."""
        st = bucket.state
        self.keep_rows(bucket)
        group = algorithm.param_groups[bucket.group_index]
        y = bucket.sync.padded[: bucket.numel]
        if algorithm.exchange.preconditioned:
            r = st.buffers.preconditioner
            args = (r, group["eps"], algorithm.exchange.coefficients(st), factors or [1.0] * len(bucket.params),
                    bucket.params, bucket.segments, decay, alpha)
            if bucket.low_precision or not kernels.zero_passes.rows_descend_(result, *args):
                if isinstance(result, kernels.CompressedResult):
                    result.expand_()
                kernels.zero_passes.compose_descend_(y, *args, zero_index=algorithm.exchange.no_variance(st))
                self.update_masters(bucket, step, decay, y, alpha)
            return
        # p <- p decay + alpha f_l y / (sqrt(v_f) + eps), y the direction after it (read by the masters' update)
        bucket.kernels.keep_descend_(result, algorithm.frozen_denominator(bucket), None, factors, bucket.params,
                                     bucket.segments, decay, alpha)
        self.update_masters(bucket, step, decay, y, alpha)

    def update_masters(self, bucket, step: int, decay, delta: torch.Tensor, alpha: float = 1.0) -> None:
        """Low-precision parameters: every rank applied the update to its parameters (as
        replicated); the owner applies it exactly to its fp32 master chunk, ``master <- master *
        decay + alpha * delta`` (``delta`` the whole bucket's update; ``decay`` a float or one per
        layer), and every ``master_resync_interval`` steps one all-gather of the master chunks
        replaces the parameters, bounding what their rounding drifted."""
        master = self.master(bucket)
        if master is None:
            return
        if isinstance(decay, list):  # one per layer
            decay = self.per_element(bucket, decay)
        lo, hi, _ = self.own_range(bucket)
        master[: hi - lo].mul_(decay).add_(delta[lo:hi], alpha=alpha)
        if step % self.master_resync_interval == 0:
            padded = bucket.sync.padded
            self.engine.backend.all_gather(padded, master)
            torch._foreach_copy_(bucket.params, bucket.views(padded[: bucket.numel]))
