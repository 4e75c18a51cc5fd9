"""ZeRO-style sharding of the frozen-variance optimizers' state (:class:`OnebitAdam`,
:class:`OnebitLamb`) by the compressed allreduce's server chunks: the sharded layouts
(:class:`Sharded`, ``zero_stage=1``; :class:`ShardedGradients`, ``zero_stage=2``) of the
interface in :mod:`compressed_opt.layout`, whose :class:`~compressed_opt.layout.Replicated` is
``zero_stage=0``; :func:`for_stage` picks one.

Rank ``j`` owns chunk ``j`` of every bucket (elements ``[j c, (j+1) c)``, ``c`` the server chunk
of :func:`compressed_opt.comm.chunk_numel`), the same elements whose server error it holds.

Warmup (full precision):

* stage 1: the gradient bucket is all-reduced; stage 2: reduce-scattered, so each rank receives
  only the average of its own chunk;
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
scale_block`` bytes.
Each rank keeps those rows instead of an fp32 momentum (32x less) and expands them when it forms
its next local momentum; every rank applies the same update to its replica of the parameters, so
the parameters stay identical without any full-precision traffic. (1-bit LAMB's fresh variance is
sharded too: rank ``j`` updates chunk ``j`` from the reconstructed gradient, and the per-layer
maximum its factor needs is one all-gather of a float per layer.)

Parameters in bf16/fp16 get an fp32 master chunk on their owner (``master_shard``): warmup
updates it and gathers it into the parameters; in the compression stage every rank updates its
low-precision parameters as without ZeRO, the owner also its exact fp32 chunk, and every
``master_resync_interval`` steps one all-gather of the master chunks replaces the parameters,
bounding the drift of their rounding (an fp32 all-gather: ``4n (N-1)/N`` bytes per rank then).

Per-rank state of 1-bit Adam, fp32 parameters, ``n`` elements, ``N`` ranks (bytes): stage 0
warmup ``8n`` (``m``, ``v``); ZeRO warmup ``8n/N``; stage 0 compression ``16n + 4n/N`` (``m``,
``v``, the frozen denominator, the worker error, the server error); ZeRO compression
``8n + 4n/N + n/8 + 4n/scale_block`` (denominator, worker error, server error, the momentum rows). 1-bit LAMB adds
its fresh variance: ``4n`` more in stage 0, ``4n/N`` with ZeRO.

0/1 Adam is not sharded: its phase-B state is per rank by the algorithm (each rank's local
momentum and accumulated update, over every element it steps locally) or needed whole on every
rank (the frozen denominator, the parameters at the last synchronisation), so sharding it would
cost a full-precision parameter all-gather at every synchronisation.
"""
from __future__ import annotations

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel, expand_result_rows

from . import scaling
from .averaging import FlatAveraging
from .buckets import Bucket
from .buffers import SAVED, SCRATCH, Buffer
from .layout import Layout, Replicated
from .moments import frozen_denominator_of
from .zero_reductions import ChunkReductions, shard

#: the sharded layout's bucket buffers (over the optimizer's own: compressed_opt.buffers.overlay)
BUFFERS = {
    # saved: this rank's shards, and what the freeze gathered whole
    "exp_avg_shard": Buffer(SAVED),  # m_j (warmup)
    "exp_avg_sq_shard": Buffer(SAVED),  # v_j (warmup)
    "exp_avg": Buffer(SAVED),  # the momentum gathered at the freeze (until the first exchange keeps rows)
    "frozen_denominator": Buffer(SAVED),  # sqrt(v_f) + eps, gathered at the freeze
    "preconditioner": Buffer(SAVED),  # R = c_l / sqrt(v_f)
    "momentum_rows": Buffer(SAVED, torch.uint8),  # the last exchange's [scales | bits] rows: the momentum
    "master_shard": Buffer(SAVED),  # fp32 masters of this rank's chunk (bf16/fp16 parameters)
    # workspace
    "grad_padded": Buffer(SCRATCH),
    "grad_shard": Buffer(SCRATCH),
    "update_shard": Buffer(SCRATCH),
    "momentum_prev_shard": Buffer(SCRATCH),
    "layer_ids": Buffer(SCRATCH, torch.int64),
    "coeff_shard": Buffer(SCRATCH),
}


class Sharded(ChunkReductions, Layout):
    """ZeRO stage 1: rank ``j`` holds chunk ``j`` of every bucket's state (see the module doc);
    the warmup gradients are all-reduced whole."""

    stage = 1
    sharded = True

    # --- checks, once ---------------------------------------------------------------------------
    def declare_buffers(self, opt):
        # no per-parameter views of whole buffers; the shards are saved
        opt.overlay_buffers({**BUFFERS, **opt.sharded_buffers})

    def check_options(self, opt, path, hierarchy):
        # (path: averaging.resolve_path refuses all but "1bit" for a sharded layout)
        if hierarchy == "node":
            raise ValueError("hierarchy='node' with zero_stage > 0: ZeRO's shards are the flat exchange's server "
                             "chunks; use hierarchy='auto' or 'flat' (flat) or zero_stage=0")

    def check_rebuild(self, opt):
        if opt.global_step > 0:
            raise RuntimeError(
                f"{type(opt).__name__} with zero_stage={self.stage}: the trainable parameters changed "
                "after the first step (add_param_group or requires_grad changed); the sharded state is laid "
                "out by the buckets and cannot follow. Set up every parameter before the first step, or "
                "use zero_stage=0"
            )

    def checkpoint_problem(self, opt, rank, world, consolidated):
        backend = opt.backend
        if world != backend.world_size or (rank != backend.rank and not consolidated):
            return (f"this ZeRO checkpoint holds the shards of rank {rank} of {world}; it cannot be loaded on rank "
                    f"{backend.rank} of {backend.world_size}. Resume with the same world size, each rank loading "
                    "its own file (or train with zero_stage=0 to move between world sizes)")
        return None

    def check_ddp(self, opt):
        raise ValueError(
            f"{type(opt).__name__}(zero_stage={self.stage}) found its parameters inside a "
            "DistributedDataParallel model: DDP keeps whole gradients and parameters on every "
            "rank, so ZeRO sharding cannot work under it. Use zero_stage=0 with a DDP-wrapped "
            "model, or give the optimizer the unwrapped model without DDP"
        )

    # --- the gradients -------------------------------------------------------------------------
    def grad_buffer(self, opt, bucket):
        """The gradient workspace, padded to ``N c`` elements so it splits into equal chunks."""
        world = opt.backend.world_size
        return shard(bucket, "grad_padded", world * chunk_numel(bucket.numel, world))[: bucket.numel]

    def average(self, opt, bucket, grad):
        opt.backend.all_reduce(grad, op="avg")

    # --- warmup: rank j updates chunk j ------------------------------------------------------------
    def own(self, opt, bucket, whole):
        lo, hi, _ = self.own_range(opt, bucket)
        return whole[lo:hi]

    def state(self, opt, bucket, name):
        """Chunk ``j`` of the state ``name``: the buffer ``name + "_shard"`` (``m_j``, ``v_j``, ...)."""
        lo, hi, c = self.own_range(opt, bucket)
        return shard(bucket, name + "_shard", c)[: hi - lo]

    def direction_buffer(self, opt, bucket, grad):
        lo, hi, c = self.own_range(opt, bucket)
        return shard(bucket, "update_shard", c)[: hi - lo]

    def own_values(self, opt, bucket: Bucket) -> torch.Tensor:
        """This rank's chunk of the parameters in fp32, to update in place and then
        :meth:`publish`: the master chunk of a bf16/fp16 bucket (the truth), else the current
        values copied out of the parameters (this overwrites the padded gradient workspace)."""
        return self._values_in(opt, bucket, bucket.flats["grad_padded"][self.own_range(opt, bucket)[0] :])

    def _values_in(self, opt, bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
        """:meth:`own_values`, copied into ``out`` where they are copied (not a master chunk)."""
        master = self.master_shard(opt, bucket)
        if master is not None:
            lo, hi, _ = self.own_range(opt, bucket)
            return master[: hi - lo]
        return self.copy_own_params_(opt, bucket, out)

    def step_(self, opt, bucket, values, direction, decay, alpha):
        values.mul_(decay).add_(direction, alpha=alpha)
        self.publish(opt, bucket, values)

    def add_values_(self, opt, bucket, out, values, alpha):
        out.add_(values, alpha=alpha)

    def adamw_(self, opt, bucket, grad, kernel):
        """On this rank's chunk: its fp32 master, or its parameters' values copied out of them (into
        the direction buffer: ``grad`` is read by the kernel); then :meth:`publish`."""
        lo, hi, c = self.own_range(opt, bucket)
        values = self._values_in(opt, bucket, shard(bucket, "update_shard", c))
        if hi > lo:
            m, v = self.state(opt, bucket, "exp_avg"), self.state(opt, bucket, "exp_avg_sq")
            kernel([values], [grad[lo:hi]], [m], [v])
        self.publish(opt, bucket, values)
        return True

    def step_layers_(self, opt, bucket, values, update, coeffs, scale):
        """Per piece of a layer in the chunk, as the replicated layout steps a whole layer."""
        pieces, index, _ = self.chunk_pieces(opt, bucket)
        if index:
            steps = pieces.split(update)
            torch._foreach_mul_(steps, [scale * coeffs[i] for i in index])
            torch._foreach_add_(pieces.split(values), steps)
        self.publish(opt, bucket, values)

    def publish(self, opt, bucket: Bucket, values: torch.Tensor) -> None:
        """One all-gather of every rank's :meth:`own_values` into the parameters."""
        padded = bucket.flats["grad_padded"]
        master = bucket.flats.get("master_shard")
        if master is None:
            lo, hi, c = self.own_range(opt, bucket)
            out = shard(bucket, "update_shard", c)
            out[: hi - lo].copy_(values)
            out[hi - lo :].zero_()
        else:
            out = master  # zero beyond the chunk's end
        opt.backend.all_gather(padded, out)
        torch._foreach_copy_(bucket.params, bucket.views(padded[: bucket.numel]))

    def master_shard(self, opt, bucket: Bucket) -> torch.Tensor | None:
        """This rank's fp32 master copy of its chunk of a bucket that holds bf16/fp16 parameters
        (made from the parameters on first use); ``None`` for fp32 buckets."""
        if not bucket.low_precision:
            return None
        master = bucket.flats.get("master_shard")
        if master is None:
            world = opt.backend.world_size
            lo, hi, c = self.own_range(opt, bucket)
            padded = shard(bucket, "grad_padded", world * c)
            torch._foreach_copy_(bucket.views(padded[: bucket.numel]), bucket.params)
            master = bucket.flats["master_shard"] = torch.zeros(c, device=bucket.device)
            master[: hi - lo].copy_(padded[lo:hi])
        return master

    def freeze(self, opt, bucket):
        """Gather the chunks of ``m`` and ``v`` once: the full momentum (until the first compressed
        exchange replaces it by its 1-bit rows) and the frozen denominator of every element. Returns
        the whole raw ``v`` (a scratch buffer: valid until the bucket's next collective)."""
        world = opt.backend.world_size
        c = chunk_numel(bucket.numel, world)
        padded = shard(bucket, "grad_padded", world * c)
        n = bucket.numel
        opt.backend.all_gather(padded, shard(bucket, "exp_avg_shard", c))
        bucket.flats["exp_avg"] = padded[:n].clone()
        opt.backend.all_gather(padded, shard(bucket, "exp_avg_sq_shard", c))
        group = opt.param_groups[bucket.group_index]
        bucket.flats["frozen_denominator"] = frozen_denominator_of(padded[:n], group, opt.freeze_step)
        # the momentum lives on whole, then as 1-bit rows; the variance only as the denominator
        del bucket.flats["exp_avg_shard"], bucket.flats["exp_avg_sq_shard"]
        return padded[:n]

    # --- compression stage: every rank updates its whole replica ----------------------------------
    def gather_local(self, opt, bucket, grad):
        """The local momentum, formed from ``p.grad`` directly (:meth:`form_local_momentum`), or (from
        the kept rows, unscaled, ``opt.leave_gradients_in_place``) kept for the exchange's compression
        to run (:class:`~compressed_opt.cuda.zero_passes.ZeroLocalMomentum`)."""
        beta1 = opt.param_groups[bucket.group_index]["betas"][0]
        preconditioner = opt.exchange_preconditioner(bucket)
        factors = opt.exchange_factors(bucket) if preconditioner is not None else None
        args = dict(keep_previous=opt.keeps_previous_momentum, row_scales=opt.exchange_scales(bucket),
                    preconditioner=preconditioner,
                    factors=None if factors is None else (opt.kept_exchange_factors(bucket), factors))
        bucket.derived.pop("step.local_momentum_pass", None)
        bucket.derived.pop("step.local_momentum_formed", None)
        from_rows = (args["row_scales"] is None and "exp_avg" not in bucket.flats
                     and (not args["keep_previous"] or self._previous_from_rows(opt, bucket, preconditioner)))
        if from_rows and opt.leave_gradients_in_place(bucket, grad):
            bucket.derived["step.local_momentum_pass"] = self._momentum_pass(opt, bucket, grad, beta1, args)
            return
        opt.observe_local_gradient(bucket)
        if from_rows:  # (x read whole before the exchange: formed natively, either exchange)
            sources = kernels.Sources.of([p.grad for p in bucket.params], bucket.segments.sizes)
            if sources is not None and self._momentum_pass(opt, bucket, grad, beta1, args, sources).form_():
                bucket.derived["step.local_momentum_formed"] = True  # (zeroed and bounded: local_momentum_'s)
                return
        self.form_local_momentum(opt, bucket, grad, beta1, **args)

    def _momentum_pass(self, opt, bucket, x, beta1, args, sources=None) -> kernels.zero_passes.ZeroLocalMomentum:
        """:meth:`form_local_momentum` (from the kept rows) and :meth:`local_momentum_`, not run yet
        (``sources``: the gradients; default: those :meth:`gather_local` left in place)."""
        kept, new = args["factors"] or (None, None)
        n_layers, alpha = len(bucket.params), 1 - beta1
        keep = [beta1] * n_layers if new is None else [beta1 * n / k for n, k in zip(new, kept or [1.0] * n_layers)]
        gain = [alpha] * n_layers if new is None else [alpha * n for n in new]

        def compose():
            self.form_local_momentum(opt, bucket, x, beta1, **args)
            self.local_momentum_(opt, bucket, x, beta1)

        r = args["preconditioner"]  # (None: the momentum exchange, neither zeroed nor bounded)
        return kernels.zero_passes.ZeroLocalMomentum(
            x, self._kept_rows(opt, bucket, x), r, keep, gain, None if r is None else opt.exchange_bounds(bucket),
            bucket.segments, bucket.derived.pop("step.gradients_in_place") if sources is None else sources, compose)

    def _previous_from_rows(self, opt, bucket, r) -> bool:
        """This rank's chunk of ``m_{t-1} = (R m) / R`` from the kept rows (``momentum_prev_shard``,
        as :meth:`form_local_momentum` keeps it), natively; ``False`` where that cannot run (no ``R``)."""
        lo, hi, c = self.own_range(opt, bucket)
        out, passes = shard(bucket, "momentum_prev_shard", c), kernels.zero_passes
        return r is not None and passes.previous_momentum_(self._kept_rows(opt, bucket, out), r, lo, hi, out)

    def _kept_rows(self, opt, bucket, buffer) -> kernels.CompressedResult:
        """The kept rows (the last exchange's result), as a compressed result of the bucket."""
        world = opt.backend.world_size
        return kernels.CompressedResult(bucket.flats["momentum_rows"].view(world, -1),
                                        chunk_numel(bucket.numel, world), opt.scale_block, buffer)

    def local_momentum_pass(self, opt, bucket, x, beta1):
        """The pass :meth:`gather_local` kept, else :meth:`local_momentum_` now (``None``)."""
        pending = bucket.derived.pop("step.local_momentum_pass", None)
        if pending is None:
            self.local_momentum_(opt, bucket, x, beta1)
        return pending

    def form_local_momentum(self, opt, bucket: Bucket, x: torch.Tensor, beta1: float, keep_previous: bool = False,
                            row_scales: list[float] | None = None, preconditioner: torch.Tensor | None = None,
                            factors: tuple[list[float], list[float]] | None = None) -> None:
        """``x`` <- ``b1 m + (1 - b1) g_i`` with ``m`` expanded from the kept rows (or the momentum
        gathered at the freeze) and ``g_i`` read straight from ``p.grad``. ``row_scales``: per layer,
        what the exchanged momentum was multiplied by (1-bit LAMB's scaling coefficients), divided
        out after expanding. ``preconditioner``: per element, the fixed factor ``R`` of an exchange of
        ``R m`` (OnebitAdam's preconditioned exchange): ``x`` <- ``b1 R m + (1 - b1) R g_i``, with
        ``R m`` the kept rows themselves. ``factors``: ``(kept, new)`` per layer, the exchange
        factors the kept rows were made with and this exchange's (the tracked exchange,
        :meth:`~compressed_opt.onebit_adam._FreezingAdam.exchange_factors`): ``x`` <- ``new (b1 R m +
        (1 - b1) R g_i)``, the rows divided by ``kept``. ``keep_previous``: also keep this rank's
        chunk of ``m`` (``momentum_prev_shard``, for 1-bit LAMB's fresh variance)."""
        kept, new = factors if factors is not None else (None, None)
        if "exp_avg" in bucket.flats:
            x.copy_(bucket.flats["exp_avg"])
            kept = None  # the momentum gathered at the freeze: not scaled
            if preconditioner is not None:
                x.mul_(preconditioner)
        else:
            expand_result_rows(bucket.flats["momentum_rows"], bucket.numel, opt.backend.world_size, x, opt.scale_block)
            if row_scales is not None:
                scaling.unscale_(bucket.views(x), row_scales)
        if keep_previous:
            lo, hi, c = self.own_range(opt, bucket)
            previous = shard(bucket, "momentum_prev_shard", c)[: hi - lo]
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
        present = [i for i, p in enumerate(bucket.params) if p.grad is not None]
        if not present:
            return
        x_views = bucket.views(x)
        views = [x_views[i] for i in present]
        grads = [g if g.dtype == torch.float32 else g.float() for g in (bucket.params[i].grad for i in present)]
        if preconditioner is None:
            torch._foreach_add_(views, grads, alpha=alpha)
            return
        r_views = bucket.views(preconditioner)
        scales = [r_views[i] for i in present]
        if new is None:
            torch._foreach_addcmul_(views, scales, grads, value=alpha)
        else:
            torch._foreach_addcmul_(views, scales, grads, [alpha * new[i] for i in present])

    def local_momentum_(self, opt, bucket, x, beta1):
        """``x`` holds ``m_i`` (``R m_i``) already (:meth:`gather_local`); preconditioned, it is
        bounded and zeroed where ``v_f == 0`` (the kept rows carry the exchange's ``+-t`` there)."""
        if bucket.derived.pop("step.local_momentum_formed", False):
            return  # (gather_local formed it natively, zeroed and bounded)
        if opt.exchange_preconditioner(bucket) is None:
            return
        idx = opt.no_variance_indices(bucket)
        if idx.numel():
            x.index_fill_(0, idx, 0.0)
        opt.bound_exchanged_(bucket, x)

    def exchange(self, opt, bucket, x, pending=None, keep_result=False):
        """The compressed allreduce of the local momentum (always flat: its server chunks are the
        shards); keep the result's 1-bit rows: they are the momentum from now on."""
        flat = getattr(self, "_flat", None)
        if flat is None or flat.backend is not opt.backend:  # (its plans: agreed once per size, as the optimizer's)
            flat = self._flat = FlatAveraging(opt.backend, opt.scale_block)
        # (this exchange's own rows: several may share one plan's buffers); keep_result: not
        # decompressed into x, the step reads the kept rows (step_preconditioned_)
        rows = yield bucket, x, flat, pending, not keep_result
        shard(bucket, "momentum_rows", rows.numel(), torch.uint8).copy_(rows.reshape(-1))
        bucket.flats.pop("exp_avg", None)
        bucket.derived["step.result_in_rows"] = keep_result

    def exchanged(self, opt, bucket, x):
        """The kept rows, where this step's exchange left its result in them (``keep_result``)."""
        return self._kept_rows(opt, bucket, x) if bucket.derived.pop("step.result_in_rows", False) else x

    def keep_momentum(self, opt, bucket, m):
        pass  # the exchange kept its 1-bit rows (32x smaller than m)

    def previous_momentum(self, opt, bucket):
        """Chunk ``j`` of ``m_{t-1}``, kept when the local momentum was formed."""
        lo, hi, _ = self.own_range(opt, bucket)
        return bucket.flats["momentum_prev_shard"][: hi - lo]

    def keep_exchange_factors(self, opt, bucket, root, denom, coeffs):
        """Only ``R`` is kept (saved): the denominator is made again from it for a step that
        divides by it, and ``A y`` is formed by a division (:meth:`step_preconditioned_`)."""
        bucket.flats.pop("frozen_denominator", None)

    def step_preconditioned_(self, opt, bucket, y, decay, alpha, step):
        """From the kept rows in one native pass (fp32 parameters: ``zero_passes.rows_descend_``), or composed."""
        # p <- p decay + alpha (m / (sqrt(v_f) + eps)) f_l / s_l, where m / (sqrt(v_f) + eps) = y / (c_l + eps R)
        # (0 where v_f == 0), made for this step from R = c_l / sqrt(v_f), as the replicated layout makes it
        d = opt.preconditioned_descend(bucket, decay, alpha)
        result, in_rows = self._kept_rows(opt, bucket, y), bucket.derived.pop("step.result_in_rows", False)
        args = (opt.exchange_preconditioner(bucket), d.eps, d.coeffs, d.factors, d.dests, bucket.segments, d.decay,
                d.alpha)
        if bucket.low_precision or not kernels.zero_passes.rows_descend_(result, *args):
            if in_rows:
                result.expand_()
            kernels.zero_passes.compose_descend_(y, *args, zero_index=opt.no_variance_indices(bucket))
            self.update_masters(opt, bucket, step, decay, y, alpha)

    def update_masters(self, opt, bucket, step, decay, delta, alpha=1.0):
        """Low-precision parameters: every rank applied the update to its parameters (as
        replicated); the owner applies it exactly to its fp32 master chunk, ``master <- master *
        decay + alpha * delta`` (``delta`` the whole bucket's update), and every
        ``master_resync_interval`` steps one all-gather of the master chunks replaces the
        parameters, bounding what their rounding drifted."""
        master = self.master_shard(opt, bucket)
        if master is None:
            return
        if isinstance(decay, list):  # one per layer
            decay = self.per_element(opt, bucket, decay, "coeff_shard")
        lo, hi, _ = self.own_range(opt, bucket)
        master[: hi - lo].mul_(decay).add_(delta[lo:hi], alpha=alpha)
        if step % opt.master_resync_interval == 0:
            padded = bucket.flats["grad_padded"]
            opt.backend.all_gather(padded, master)
            torch._foreach_copy_(bucket.params, bucket.views(padded[: bucket.numel]))


class ShardedGradients(Sharded):
    """ZeRO stage 2: as :class:`Sharded`, and the warmup gradients are reduce-scattered."""

    stage = 2

    def average(self, opt, bucket, grad):
        """A reduce-scatter, then an all-gather of the averaged chunks, so that ``p.grad`` can
        hold the whole average after backward (as DDP leaves it, for the loop's clipping) without
        one rank's chunk being summed differently on another."""
        world = opt.backend.world_size
        c = chunk_numel(bucket.numel, world)
        padded = bucket.flats["grad_padded"]
        mine = shard(bucket, "grad_shard", c)
        opt.backend.reduce_scatter(mine, padded, op="avg")
        opt.backend.all_gather(padded, mine)


#: the layout of each ``zero_stage``
LAYOUTS: dict[int, type[Layout]] = {0: Replicated, 1: Sharded, 2: ShardedGradients}


def for_stage(stage: int) -> Layout:
    """The layout of ``zero_stage=stage`` (0, 1 or 2)."""
    return LAYOUTS[stage]()
