"""1-bit LAMB (Li et al., "1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
with LAMB's Convergence Speed", 2021).

Warmup, steps ``1..freeze_step``: LAMB on the gradient averaged at full precision. Per layer
(parameter tensor) ``l``::

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    u = m_hat / (sqrt(v_hat) + eps) + wd p            (m_hat = m / (1 - b1^t), v_hat likewise)
    r = clip(||p|| / ||u||, min_coeff, max_coeff)      (1 when either norm is 0)
    p <- p - lr r u

and an exponential moving average of ``r`` with ``coeff_beta`` (from 0, bias-corrected like
Adam's moments: ``r_ema / (1 - coeff_beta^n)`` after ``n`` updates).

At the end of step ``freeze_step``: ``v`` is frozen (``v_f = v / (1 - b2^freeze_step)``), each
layer's trust ratio is frozen (``r_f``: its bias-corrected EMA), and a fresh variance starts from
``v_fresh = v``.

Compression stage: no gradient allreduce. Each rank forms its local momentum
``m_i = b1 m + (1 - b1) g_i`` and all the momenta of a bucket go through ONE compressed
allreduce. By default (``exchange="preconditioned"``) what goes through it is OnebitAdam's
preconditioned momentum ``R m_i``, ``R = c_l / sqrt(v_f)``, bounded, and ``m_t = y / R``
(:mod:`compressed_opt.onebit_adam`): every coordinate reaches the compressor normalised by its own
gradient scale, so a coordinate of tiny variance gets 1-bit noise of its own size. With
``exchange="momentum"`` (the paper's) one scale serves the whole buffer, so each layer's momentum
is multiplied by a fixed coefficient ``c_l = mean_k RMS(m_k) / RMS(m_l)`` (``k`` over the layers
of the bucket, set from the momentum at the first compression step, identical on every rank)
before the exchange and divided by it after. From the averaged momentum ``m_t`` the averaged gradient is reconstructed,
``g~ = (m_t - b1 m_{t-1}) / (1 - b1)``, and ``v_fresh = b2 v_fresh + (1 - b2) g~^2``. Per layer::

    factor = max_k (sqrt(v_f) + eps) / (sqrt(v_fresh_hat) + eps)
    factor = clip(factor, factor_min, factor_max), then clip to
             [(1 - factor_threshold) f_prev, (1 + factor_threshold) f_prev]   (f_prev starts at 1)
    p <- p - lr r_f factor (m_hat / (sqrt(v_f) + eps) + wd p)

That is the paper's algorithm, ``trust_ratio="frozen"``. By default (``trust_ratio="live"``) the
coefficient follows LAMB's own trust ratio instead, which keeps changing after the freeze (on
digits it grows from 0.15 to 4.3 while ``r_f`` stays 0.15: docs/design.md 2.4). Each rank takes the
norm of its *local* LAMB direction, ``u_i = m_i_hat / sqrt(v_f) + wd p`` (``m_i`` its local
momentum, read off the vector it hands to the exchange: ``R m_i / c_l``), and one all-gather of a
float per layer averages the squares in rank order, so every rank gets the same::

    ||u|| = sqrt(mean_i ||u_i||^2)
    d     = m_hat / (sqrt(v_f) + eps) + wd p                     (the direction the step applies)
    coeff = min(max(clip(||p|| / ||u||, min_coeff, max_coeff), r_f, r_f factor),
                K clip(||p|| / ||d||, min_coeff, max_coeff))
    p <- p - lr coeff d

Each of the three estimates LAMB's ratio from below: a local momentum carries the 1-bit noise of
``m_{t-1}`` and its rank's gradient noise, so ``||u||`` overstates the averaged direction's norm;
``v_fresh``, rebuilt from the 1-bit momentum (its noise amplified ``1 / (1 - b1)`` times in
``g~``), overstates the variance, so the factor understates the step (on GPT-2 it sinks to
``factor_min`` in every layer); ``r_f`` is LAMB's ratio where it was last measured, which LAMB's
own ratio can fall below after the freeze. The largest of them is used, capped at ``K`` (1.25,
:data:`~compressed_opt.adam.COMPRESSED_STEP_BOUND`) times LAMB's ratio of the direction ``d`` the
step applies: no layer moves further than ``K`` times LAMB's step from where it is
(docs/design.md 2.4.1). ``||p|| / ||u||`` and the cap are measured at the first compression step
and every ``trust_ratio_interval`` (10) steps after, and kept in between
(``state[p]["trust_ratio_live"]``, ``state[p]["trust_ratio_cap"]``): a measuring step costs a norm
pass over the exchanged vector and one over ``d`` (each with a copy when ``wd != 0``), ``||p||``,
and one all-gather of a float per layer and rank (before the update); the others nothing.

With ``bias_correction=True`` (the default) ``m_hat = m / (1 - b1^t)`` and
``v_fresh_hat = v_fresh / (1 - b2^t)``; ``False`` uses the raw moments everywhere (the paper's
code). Unlike the paper's code, the factor is not blended towards 1 by the weight-decay share of
the update.

As in :class:`OnebitAdam`, coordinates whose frozen variance is exactly 0 (weights fed by an
always-zero input, unused embedding rows) get no momentum step in the compression stage (their
``sqrt(v_f) + eps`` counts as infinite) and take no part in the factor's maximum: 1-bit
compression cannot send a 0, and ``scale / eps`` would throw them far away.

The algorithm (:class:`LambAlgorithm`) is 1-bit Adam's frozen-variance algorithm
(:class:`compressed_opt.adam.AdamAlgorithm`: the freeze, the exchange, ZeRO's shards) with
LAMB's warmup and compression-stage update and no variance tracking. Its exchange (the local
momentum, as the exchange carries it) goes out from backward with ``overlap=True``; ``step()`` does
the rest: on CPU with the whole state on the rank, in two native passes
(:mod:`compressed_opt.cuda.lamb_passes`, docs/design.md 2.4.2; so does the warmup,
:mod:`compressed_opt.cuda.lamb_warmup`); under ZeRO, :mod:`compressed_opt.zero_lamb`'s.

With ``zero_stage=1 | 2`` the state is sharded as for :class:`OnebitAdam`
(:mod:`compressed_opt.zero`): in warmup rank ``j`` keeps chunk ``j`` of ``m`` and ``v`` and
computes chunk ``j`` of the update; the per-layer norms ``||p||`` and ``||u||`` are sums of
squares over the chunks, reduced across the ranks by one all-gather of two floats per layer (added
in rank order: every rank gets the same trust ratios). In the compression stage every rank holds
the frozen denominator and the 1-bit rows of the momentum and updates its whole replica; rank
``j`` keeps chunk ``j`` of the fresh variance, and the factor's per-layer maximum is one
all-gather of a float per layer.

Per-layer scalars live in ``optimizer.state[p]`` as Python floats (so checkpoints keep them exactly):
``trust_ratio_ema``, ``trust_ratio_updates``, ``trust_ratio_frozen``, ``scaling_coeff``, ``last_factor`` and
``lamb_coeff`` (the coefficient the last step applied: ``r`` in warmup, then the live one or ``r_f factor``).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import DEFAULT_BLOCK

from . import scaling, zero_lamb
from .adam import (COMPRESSED_STEP_BOUND, DEFAULT_FREEZE_STEP, AdamAlgorithm, AdamBucket, AdamBuffers, Momentum,
                   Preconditioned, bias_corrections, choose_exchange, denominator_, momentum_, spike_bound, variance_)
from .exchange import Request
from .optimizer import CompressedOptimizer, common_args
from .reductions import norms
from .state import STATE, STEP, buffer, names
from .validation import check_choice, check_nonneg_float, check_step_count
from .zero import sharding

__all__ = ["OnebitLamb"]


def _check_positive(name: str, value) -> float:
    value = check_nonneg_float(name, value)
    if value <= 0.0:
        raise ValueError(f"Invalid {name}: {value} (must be > 0)")
    return value


def lamb_bound(betas) -> float:
    """1-bit LAMB's ``K`` for the exchanged ``|m_i / sqrt(v_f)|``: Adam's bound for one gradient spike.
    The trust ratio sets each layer's step from its direction's norm, and a tighter clip flattens that
    direction (GPT-2 at a clip of 1: 1.30x LAMB's final loss; docs/benchmarks.md, "The step bound")."""
    return spike_bound(*betas)


@dataclass(eq=False)
class LambBuffers(AdamBuffers):
    """A bucket's 1-bit LAMB state where every rank holds it whole: Adam's and the fresh variance."""

    exp_avg_sq_fresh: torch.Tensor | None = buffer(STATE)  # v_fresh


@dataclass(eq=False)
class LambBucket(AdamBucket):
    """A bucket's 1-bit LAMB state: 1-bit Adam's, and what a step that measures the live trust
    ratio carries from its exchange to its update."""

    #: this rank's per-layer ``||u_i||^2`` (float64)
    local_direction_sq: torch.Tensor | None = buffer(STEP)
    #: per layer, the RMS over the ranks of ``||u_i||``
    direction_norms: list | None = buffer(STEP)
    #: ZeRO: the step's update runs as :mod:`compressed_opt.zero_lamb`'s passes (decided before its exchange)
    fused: bool | None = buffer(STEP)


class LambAlgorithm(AdamAlgorithm):
    """1-bit LAMB's steps (see the module doc): 1-bit Adam's freeze, exchange and shards, LAMB's
    warmup and update, the trust ratio live (``"live"``) or the paper's (``"frozen"``)."""

    #: the factor and the update divide by sqrt(v_f) + eps (ZeRO makes it again from R for each step)
    keeps_denominator = True
    TRUST_RATIOS = ("live", "frozen")

    def __init__(self, name: str, freeze_step, exchange: str, zero, trust_ratio: str, trust_ratio_interval: int):
        super().__init__(name, freeze_step, "preconditioned", False, zero)
        self.exchange = choose_exchange(exchange, {"preconditioned": lambda: Preconditioned(lamb_bound),
                                                   "momentum": lambda: Momentum(layer_coefficients=True)})
        check_choice("trust_ratio", trust_ratio, self.TRUST_RATIOS)
        self.trust_ratio = trust_ratio
        self.trust_ratio_interval = check_step_count("trust_ratio_interval", trust_ratio_interval, minimum=1)

    def validate_group(self, group):
        super().validate_group(group)
        for name in ("max_coeff", "min_coeff", "factor_max", "factor_min"):
            group[name] = _check_positive(name, group[name])
        if group["min_coeff"] > group["max_coeff"]:
            raise ValueError(f"Invalid min_coeff: {group['min_coeff']} (must be <= max_coeff, {group['max_coeff']})")
        if group["factor_min"] > group["factor_max"]:
            raise ValueError(f"Invalid factor_min: {group['factor_min']} (must be <= factor_max={group['factor_max']})")
        beta = check_nonneg_float("coeff_beta", group["coeff_beta"])
        if beta >= 1.0:
            raise ValueError(f"Invalid coeff_beta: {beta} (must be in [0, 1))")
        group["coeff_beta"] = beta
        group["factor_threshold"] = check_nonneg_float("factor_threshold", group["factor_threshold"])
        if not isinstance(group["bias_correction"], (bool, numbers.Integral)):
            raise TypeError(f"bias_correction must be a bool, got {type(group['bias_correction']).__name__}")

    def new_bucket_state(self, bucket) -> LambBucket:
        buffers = self.zero.shards(bucket) if self.zero is not None else LambBuffers()
        return LambBucket(buffers, None, [self.state[p] for p in bucket.params])

    def tensor_names(self) -> tuple[str, ...]:
        return () if self.zero is not None else names(LambBuffers, STATE)

    # --- what differs between the state on every rank and ZeRO's shards -------------------------------
    def _moment(self, bucket, name: str) -> torch.Tensor:
        """The part this rank holds of the moment ``name`` (``exp_avg``, ``exp_avg_sq``, ``exp_avg_sq_fresh``)."""
        return self.zero.moment(bucket, name) if self.zero is not None else getattr(bucket.state.buffers, name)

    def _own(self, bucket, whole: torch.Tensor) -> torch.Tensor:
        return self.zero.own(bucket, whole) if self.zero is not None else whole

    def _previous_momentum(self, bucket) -> torch.Tensor:
        """The part this rank holds of the momentum of the step before (consumed in place)."""
        return self.zero.previous_momentum(bucket) if self.zero is not None else bucket.state.buffers.exp_avg

    def _layer_maxima(self, bucket, values: torch.Tensor) -> list[float]:
        """Per layer, the maximum of ``values`` (this rank's part, >= 0) over every rank's part; 1.0
        for an empty layer."""
        if self.zero is not None:
            return self.zero.layer_maxima(bucket, values)
        raw = [1.0] * len(bucket.params)
        nonempty = [i for i, p in enumerate(bucket.params) if p.numel()]
        if nonempty:
            views = bucket.views(values)
            from .reductions import maxima

            for i, f in zip(nonempty, torch.stack(maxima([views[i] for i in nonempty])).tolist()):
                raw[i] = f
        return raw

    # --- the freeze --------------------------------------------------------------------------------------
    def _freeze(self, step):
        for b in self.engine.buckets:
            # v_fresh starts from v (the part this rank holds; ZeRO's freeze then drops v)
            self._moment(b, "exp_avg_sq_fresh").copy_(self._moment(b, "exp_avg_sq"))
            beta = self.param_groups[b.group_index]["coeff_beta"]
            for st in b.state.states:
                st["trust_ratio_frozen"] = _debiased_ema(st, beta)
                st["last_factor"] = 1.0
                st.pop("scaling_coeff", None)  # set again from the momentum at the first compression step
        super()._freeze(step)

    # --- warmup: LAMB on the averaged gradient ---------------------------------------------------------------
    def _warmup(self, bucket, group, step):
        """LAMB over the part of the bucket this rank holds; the per-layer norms are over every
        rank's part. On contiguous fp32 CPU buffers in two native passes around PyTorch's square root
        (:mod:`compressed_opt.cuda.lamb_warmup`), else composed: the same bits."""
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        bc1, bc2_sqrt = bias_corrections(beta1, beta2, step, group["bias_correction"])
        grad, passes, zero = bucket.sync.padded[: bucket.numel], kernels.lamb_warmup, self.zero
        g = self._own(bucket, grad)
        m, v = self._moment(bucket, "exp_avg"), self._moment(bucket, "exp_avg_sq")
        native = passes.warmup_moments_(g, m, v, beta1, beta2)  # (else composed, the same bits)
        if not native:
            momentum_(m, g, beta1)
            variance_(v, g, beta2)
        # u = m_hat / (sqrt(v_hat) + eps) + wd p, into the gradient's place (ZeRO: its chunk's scratch),
        # the values after the moments (ZeRO may copy them into the gradient's memory)
        if zero is None:
            update = grad
            values = kernels.Destinations.of(bucket.params, bucket.segments.sizes) or bucket.params
        else:
            update, values = zero.direction_buffer(bucket), zero.own_values(bucket)
        if not (native and passes.warmup_direction_(torch.sqrt(v, out=update), m, values, bucket.segments, bc2_sqrt,
                                                    eps, bc1, wd)):
            denominator_(v, update, eps, bc2_sqrt).mul_(bc1)
            torch.div(m, update, out=update)
            if wd != 0:
                if zero is None:
                    torch._foreach_add_(bucket.views(update), values, alpha=wd)
                else:
                    update.add_(values, alpha=wd)
        # (a layer split over a shard or tensor-parallel mesh: its whole norm, compressed_opt.local_shards)
        shards = self.engine.local_shards
        if zero is None:
            parts = [norms(values, segments=bucket.segments), norms(bucket.views(update), segments=bucket.segments)]
        else:
            parts = zero.layer_norms(bucket, [values, update])
        p_norm, u_norm = shards.whole_layer_norms(bucket.params, parts)
        ratios = _trust_ratios(p_norm, u_norm, group)
        beta = group["coeff_beta"]
        for st, r in zip(bucket.state.states, ratios):
            st["trust_ratio_ema"] = beta * st.get("trust_ratio_ema", 0.0) + (1 - beta) * r
            st["trust_ratio_updates"] = st.get("trust_ratio_updates", 0) + 1
            st["lamb_coeff"] = r
        if zero is not None:
            zero.step_layers_(bucket, values, update, ratios, -lr)
            return
        scales = [-lr * c for c in ratios]  # (one native pass where it runs: the same bits)
        if not passes.step_layers_(values, update, bucket.segments, scales):
            views = bucket.views(update)
            torch._foreach_mul_(views, scales)
            torch._foreach_add_(values, views)

    # --- the compression stage --------------------------------------------------------------------------------
    def measures_live_ratio(self, step: int) -> bool:
        """Whether compression step ``step`` measures ``||p|| / ||u||`` (the first compression step,
        then every ``trust_ratio_interval``; the same on every rank)."""
        return self.trust_ratio == "live" and (step - self.schedule_.freeze_step - 1) % self.trust_ratio_interval == 0

    def coefficients(self, bucket) -> list[float] | None:
        """The paper's exchange's per-layer ``c_l = mean_k RMS(m_k) / RMS(m_l)`` (1 for an all-zero or
        empty layer), set once from the momentum (the averaged one, the same on every rank; ZeRO: at
        the first exchange, while the momentum gathered at the freeze is whole) and kept in state;
        ``None`` for the preconditioned exchange (``c_l`` is inside ``R``)."""
        if self.exchange.preconditioned:
            return None
        st = bucket.state
        if any("scaling_coeff" not in s for s in st.states):
            m = st.buffers.exp_avg
            if m is None:  # cannot happen: the coefficients are set when the momentum is whole
                raise RuntimeError("1-bit LAMB: scaling coefficients missing after the first exchange")
            for s, c in zip(st.states, scaling.coefficients_of(bucket.views(m))):
                s["scaling_coeff"] = c
        return [s["scaling_coeff"] for s in st.states]

    def reads_in_place(self, bucket, step: int, inline: bool, native: bool) -> bool:
        if self.zero is not None:
            return True  # (it reads them at once where it must)
        return inline and native and self.exchange.preconditioned and not self.measures_live_ratio(step)

    def outgoing(self, bucket, gradients, step: int) -> Request:
        """Compression stage: the local momentum ``b1 m + (1 - b1) g_i`` as the exchange carries it
        (``R m_i``, bounded, or ``c_l m_i``), its 1-bit average into the gradient buffer, or left in its
        rows where the native passes read them; the update takes ``m_t`` back. Where nothing reads the
        local momentum first (preconditioned, not measuring the live ratio), its pass runs inside the
        compression where it can."""
        st, group = bucket.state, self.param_groups[bucket.group_index]
        beta1, measuring = group["betas"][0], self.measures_live_ratio(step)
        coeffs = self.coefficients(bucket)
        r = self.preconditioner(bucket)
        x, producer = gradients.buffer, None
        if self.zero is not None:
            producer = self.zero.local_momentum(self, bucket, gradients, beta1, r, keep_previous=True,
                                                row_scales=coeffs, formed=measuring)
        elif coeffs is None and not measuring:
            producer = bucket.kernels.LerpScaleClamp(x, st.buffers.exp_avg, 1 - beta1, r,
                                                     self.exchange.bounds(st, group["betas"]), bucket.segments, None,
                                                     None if gradients.gathered else gradients.sources)
        elif r is None:
            torch.lerp(st.buffers.exp_avg, x, 1 - beta1, out=x)
        else:
            kernels.lerp_scale_clamp_(x, st.buffers.exp_avg, 1 - beta1, r, self.exchange.bounds(st, group["betas"]),
                                      bucket.segments, None)
        if coeffs is not None:
            scaling.scale_(bucket.views(x), coeffs)
        if measuring:
            self._observe_local_direction(bucket, group, x, step)
        if self.zero is not None:  # (the rows are the momentum: kept; left in them where ZeRO's passes run)
            st.fused = zero_lamb.ready(self, bucket)
            return Request(x, bucket.feedback, producer, True, self.engine.exchange.flat, not st.fused)
        keep = self._passes_ready(bucket, x)
        return Request(x, bucket.feedback, producer, keep, expand=not keep)

    def exchange_factors(self, bucket) -> None:
        """1-bit LAMB's exchange is not tracked (its trust ratio takes a layer's variance change)."""
        return None

    def _passes_ready(self, bucket, y, params=None) -> bool:
        """Whether this compression step runs as the two native passes of
        :mod:`compressed_opt.cuda.lamb_passes` (the whole state on this rank): the exchanged ``y``
        (the bucket's buffer, or the result's CPU rows and that buffer), the buffers and the
        parameters contiguous fp32 CPU tensors (``lamb_passes.ready``)."""
        st = bucket.state
        r, _ = self._divisors(bucket)
        tensors = [y, r, st.buffers.exp_avg, st.buffers.exp_avg_sq_fresh, self.frozen_denominator(bucket)]
        return kernels.lamb_passes.ready(tensors, bucket.params if params is None else params, bucket.segments)

    def _divisors(self, bucket) -> tuple:
        """What ``y`` is divided by to form ``m``: ``(R, None)`` (preconditioned: ``m = y / R``, 0 where
        ``R == 0``) or ``(None, c_l)`` (the paper's: ``m = y / c_l``; ``(None, None)`` when every ``c_l``
        is 1)."""
        if self.exchange.preconditioned:
            return bucket.state.buffers.preconditioner, None
        coeffs = self.coefficients(bucket)
        return None, (coeffs if any(c != 1.0 for c in coeffs) else None)

    def _observe_local_direction(self, bucket, group, x, step):
        """This rank's per-layer ``||u_i||^2``, ``u_i = m_i_hat / sqrt(v_f) + wd p`` its LAMB direction
        from its local momentum, from the exchanged vector ``x`` (``R m_i`` or ``c_l m_i``)."""
        st = bucket.state
        beta1, beta2 = group["betas"]
        bc1, _ = bias_corrections(beta1, beta2, step, group["bias_correction"])
        scales = [1.0 / (s["scaling_coeff"] * bc1) for s in st.states]
        wd = group["weight_decay"]
        if self.exchange.preconditioned:
            # m_i_hat / sqrt(v_f) = x scales, scales = 1 / (c_l bc1) (the bound aside, and eps: where
            # sqrt(v_f) < eps it overstates the step's m_i / (sqrt(v_f) + eps), which only lowers the ratio)
            if wd == 0:  # the norms of x, scaled
                sq = norms(bucket.views(x[: bucket.numel]), segments=bucket.segments).square_()
                sq = sq.mul_(torch.tensor(scales, dtype=sq.dtype, device=sq.device).square_())
            else:
                sq = kernels.direction_sumsq(x, None, scales, bucket.params, wd, bucket.segments).sqrt_().square_()
        else:  # m_i_hat / (sqrt(v_f) + eps) = x / (sqrt(v_f) + eps) scales
            sq = kernels.direction_sumsq(x, self.frozen_denominator(bucket), scales, bucket.params if wd else None, wd,
                                         bucket.segments).sqrt_().square_()
        st.local_direction_sq = sq

    def update(self, step: int, buckets: list) -> None:
        engine = self.engine
        if not self.compressing:
            for b in buckets:
                self._warmup(b, self.param_groups[b.group_index], step)
            return
        if self.measures_live_ratio(step) and buckets:
            # every rank's per-layer ||u_i||^2 (one all-gather of a float per layer), averaged in rank
            # order so that every rank gets the same norms
            whole = engine.local_shards.whole_layer_sums  # (layers split over a mesh: their whole norms)
            mine = torch.cat([whole(b.params, b.state.local_direction_sq.double()).cpu() for b in buckets])
            world = engine.backend.world_size
            if world > 1:
                device = buckets[0].device
                everyone = torch.empty(world * mine.numel(), dtype=torch.float64, device=device)
                engine.backend.all_gather(everyone, mine.to(device))
                mine = everyone.view(world, -1).cpu().mean(dim=0)
            rms = mine.sqrt_().tolist()
            offset = 0
            for b in buckets:
                b.state.direction_norms = rms[offset: offset + len(b.params)]
                offset += len(b.params)
        for b in buckets:
            self._compressed_step(b, self.param_groups[b.group_index], step)

    def end_step(self, step: int, took: bool) -> None:
        for b in self.engine._buckets or ():
            b.state.local_direction_sq = b.state.direction_norms = b.state.fused = None  # (STEP)
        super().end_step(step, took)

    def _compressed_step(self, bucket, group, step):
        """The compression stage's update from the exchange's average ``y`` (the gradient buffer, or
        its rows): ``m_t`` formed from it, the fresh variance and its factor, the trust ratio, the
        step; in the two native passes where they run (:meth:`_fused_step`), else composed in
        PyTorch (other devices, ``COMPRESSED_OPT_KERNELS=reference``: the passes' oracle). The state
        still holds ``m_{t-1}`` (ZeRO: chunk ``j``, kept when the local momentum was formed)."""
        st, sync, zero = bucket.state, bucket.sync, self.zero
        momentum = sync.padded[: bucket.numel]
        if zero is not None:
            zero.keep_rows(bucket)  # (the exchange's rows: the momentum from now on)
        y = sync.result if sync.result is not None else momentum
        dests = kernels.Destinations.of(bucket.params, bucket.segments.sizes) or bucket.params
        if st.fused if zero is not None else self._passes_ready(bucket, y, dests):
            return self._fused_step(bucket, group, y, step, dests)
        if isinstance(y, kernels.CompressedResult):
            y.expand_()  # into momentum
        self.exchange.momentum_from_exchange(st, bucket, momentum, momentum)
        denom = self.frozen_denominator(bucket)  # sqrt(v_f) + eps, inf where v_f == 0
        params = bucket.params
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        bc1, bc2_sqrt = bias_corrections(beta1, beta2, step, group["bias_correction"])

        # over the part this rank holds: v_fresh <- b2 v_fresh + (1 - b2) g~^2,
        # g~ = (m_t - b1 m_{t-1}) / (1 - b1)
        previous = self._previous_momentum(bucket)
        v_fresh = self._moment(bucket, "exp_avg_sq_fresh")
        g = previous  # m_{t-1} is consumed here
        torch.add(self._own(bucket, momentum), previous, alpha=-beta1, out=g)
        v_fresh.mul_(beta2).addcmul_(g, g, value=(1 - beta2) / (1 - beta1) ** 2)

        # per layer: max (sqrt(v_f) + eps) / (sqrt(v_fresh_hat) + eps), over the coordinates that
        # move (v_f > 0: the others have an infinite frozen denominator and stay where they are)
        ratio = g  # free now
        torch.sqrt(v_fresh, out=ratio).div_(bc2_sqrt).add_(eps)
        torch.div(self._own(bucket, denom), ratio, out=ratio).nan_to_num_(nan=0.0, posinf=0.0)
        shards = self.engine.local_shards
        maxima = shards.whole_layer_maxima(params, self._layer_maxima(bucket, ratio))
        coeffs = self._compression_coeffs(bucket, group, maxima)

        # p <- p - lr coeff (m_hat / (sqrt(v_f) + eps) + wd p)
        if zero is None:
            st.buffers.exp_avg.copy_(momentum)  # m <- m_t (ZeRO: the rows are the momentum)
        update = momentum  # free now
        torch.div(momentum, denom, out=update)
        if self.trust_ratio == "live":
            coeffs = self._live_coeffs(bucket, group, coeffs, self.measures_live_ratio(step), (update, None), bc1,
                                       dests)
        decays = [1.0 - lr * c * wd for c in coeffs]
        if wd != 0:
            torch._foreach_mul_(params, decays)
        views = bucket.views(update)
        torch._foreach_mul_(views, [-lr * c / bc1 for c in coeffs])
        torch._foreach_add_(params, views)
        if zero is not None:
            zero.update_masters(bucket, step, decays, update)

    def _fused_step(self, bucket, group, y, step, dests):
        """:meth:`_compressed_step`'s math in two native passes over the bucket, from the exchange's
        average ``y`` (the bucket's buffer, or a :class:`~compressed_opt.cuda.CompressedResult`: its
        rows, decompressed tile by tile in the first pass): the first forms ``m_t`` (``y / R`` or ``y /
        c_l``), the fresh variance and the factor's per-layer maxima, and keeps ``m <- m_t``; the second
        is the update ``p <- p decay_l - (lr coeff_l / bc1) m_t / (sqrt(v_f) + eps)`` through each
        parameter's memory. A step that measures the live ratio takes the norms of its direction
        ``m_t / (sqrt(v_f) + eps)`` from ``m_t`` and the denominator (``direction_sumsq``). ``m``,
        ``v_fresh`` and the parameters are the composition's bit for bit given the same coefficients;
        the maxima are within ``2^-20`` of its (docs/design.md 2.4.2). ZeRO: the passes of
        :mod:`compressed_opt.zero_lamb`."""
        params, passes, zero = bucket.params, kernels.lamb_passes, self.zero
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        bc1, bc2_sqrt = bias_corrections(beta1, beta2, step, group["bias_correction"])
        measuring = self.measures_live_ratio(step)
        if zero is not None:  # (m_t and the denominator whole: only for a measuring step's direction norms)
            maxima = zero_lamb.variance_maxima_(self, bucket, beta1, beta2, bc2_sqrt, eps)
            m, denom = zero_lamb.whole_direction(self, bucket, y) if measuring else (None, None)
        else:
            denom = self.frozen_denominator(bucket)  # sqrt(v_f) + eps, inf where v_f == 0
            m = bucket.state.buffers.exp_avg  # m_{t-1}; m_t after the first pass
            r, divisors = self._divisors(bucket)
            maxima = passes.variance_maxima_(y, r, divisors, m, bucket.state.buffers.exp_avg_sq_fresh, denom,
                                             bucket.segments, beta1, beta2, bc2_sqrt, eps)
        coeffs = self._compression_coeffs(bucket, group, self.engine.local_shards.whole_layer_maxima(params, maxima))
        buffer = y.buffer if isinstance(y, kernels.CompressedResult) else y  # (free after the first pass)
        if self.trust_ratio == "live":
            coeffs = self._live_coeffs(bucket, group, coeffs, measuring, (m, denom), bc1, dests)
        decays = [1.0 - lr * c * wd for c in coeffs] if wd != 0 else None
        alphas = [-lr * c / bc1 for c in coeffs]
        if zero is not None:  # (fp32 parameters: no masters to update)
            zero_lamb.descend_(self, bucket, buffer, decays, alphas, dests)
        else:
            passes.descend_(dests, m, denom, bucket.segments, decays, alphas)

    # --- the live trust ratio (trust_ratio="live") --------------------------------------------------------
    def _live_coeffs(self, bucket, group, frozen, measure, direction, bc1, dests) -> list[float]:
        """Each layer's ``min(max(clip(||p|| / ||u||, min_coeff, max_coeff), r_f, r_f factor), cap)``
        (``frozen``: the layers' ``r_f factor``; the live term is 0 where either norm is 0), ``||u||``
        the RMS over the ranks of their local ``||u_i||``; ``cap`` ``K`` times LAMB's own trust ratio
        of the direction this step applies, ``K clip(||p|| / ||d||, min_coeff, max_coeff)`` with ``d =
        x / (den bc1) + wd p`` (``direction``: ``(x, den)``, ``x / den = m_t / (sqrt(v_f) + eps)``
        whole, ``den`` ``None``: ``x`` is it; ``K``: :data:`~compressed_opt.adam.COMPRESSED_STEP_BOUND`),
        so no layer steps further than ``K`` times LAMB's step from where it is. Both are measured when
        ``measure`` and kept in ``state[p]`` (``trust_ratio_live``, ``trust_ratio_cap``: checkpointed)
        in between."""
        params, states = bucket.params, bucket.state.states
        if measure:
            (x, den), wd, layers = direction, group["weight_decay"], len(params)
            if wd == 0:
                d_norm = kernels.direction_sumsq(x, den, [1.0] * layers, None, 0.0, bucket.segments).sqrt_().div_(bc1)
            else:  # (the parameters, addressed once a step)
                d_norm = kernels.direction_sumsq(x, den, [1.0 / bc1] * layers, dests, wd, bucket.segments).sqrt_()
            p_norm, d_norm = self.engine.local_shards.whole_layer_norms(params, [
                norms(params, segments=bucket.segments), d_norm])
            u_norm = p_norm.new_tensor(bucket.state.direction_norms)
            caps = [COMPRESSED_STEP_BOUND * r for r in _trust_ratios(p_norm, d_norm, group)]
            for st, live, cap in zip(states, _trust_ratios(p_norm, u_norm, group, where_zero=0.0), caps):
                st["trust_ratio_live"], st["trust_ratio_cap"] = live, cap
        coeffs = []
        for st, r_factor in zip(states, frozen):
            coeff = max(st.get("trust_ratio_live", 0.0), st["trust_ratio_frozen"], r_factor)
            st["lamb_coeff"] = coeff = min(coeff, st.get("trust_ratio_cap", math.inf))
            coeffs.append(coeff)
        return coeffs

    def _compression_coeffs(self, bucket, group, raw) -> list[float]:
        """Each layer's ``r_f * factor`` from the raw factors (clipped, and by the threshold)."""
        fmin, fmax, threshold = group["factor_min"], group["factor_max"], group["factor_threshold"]
        coeffs = []
        for st, f in zip(bucket.state.states, raw):
            last = st.get("last_factor", 1.0)
            f = min(max(f, fmin), fmax)
            f = min(max(f, last * (1.0 - threshold)), last * (1.0 + threshold))
            st["last_factor"] = f
            if "trust_ratio_frozen" not in st:  # a parameter added after the freeze
                st["trust_ratio_frozen"] = _debiased_ema(st, group["coeff_beta"])
            st["lamb_coeff"] = coeff = st["trust_ratio_frozen"] * f
            coeffs.append(coeff)
        return coeffs


def _trust_ratios(p_norm: torch.Tensor, u_norm: torch.Tensor, group: dict, where_zero: float = 1.0) -> list[float]:
    """LAMB's trust ratio ``clip(||p|| / ||u||, min_coeff, max_coeff)`` per layer (the warmup's,
    and the live term of the compression stage), ``where_zero`` where a norm is 0."""
    ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, torch.full_like(p_norm, -1.0))
    lo, hi = group["min_coeff"], group["max_coeff"]
    return [where_zero if r < 0 else min(max(r, lo), hi) for r in ratio.tolist()]


def _debiased_ema(st: dict, beta: float) -> float:
    """The layer's trust-ratio EMA divided by ``1 - beta^n`` (1.0 before any update)."""
    n = st.get("trust_ratio_updates", 0)
    if n == 0:
        return 1.0
    return st.get("trust_ratio_ema", 0.0) / (1.0 - beta**n)


@common_args
class OnebitLamb(CompressedOptimizer):
    """1-bit LAMB: LAMB during warmup, then 1-bit compressed momentum with frozen variance; the
    per-layer trust ratio follows LAMB's from the ranks' local momenta (``trust_ratio="live"``) or
    is frozen and rescaled by the drift of a fresh variance estimate (the paper's, ``"frozen"``).

    Warmup: LAMB, ``u = m_hat / (sqrt(v_hat) + eps) + wd p``, ``r = clip(||p|| / ||u||,
    min_coeff, max_coeff)`` per layer, ``p = p - lr r u``. Compression stage: the momenta of all
    layers through one 1-bit exchange with error feedback; ``u = m / (sqrt(v_f) + eps) + wd p``
    with ``v_f`` frozen at ``freeze_step``, and each layer's step ``lr r u`` with ``r`` LAMB's
    ratio (docs/design.md 2.4).

    Example::

        opt = compressed_opt.OnebitLamb(model.parameters(), lr=1e-2, freeze_step=2000)
        loss_fn(model(x), y).backward()
        opt.step()

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as LAMB (weight decay added to the update before the
            trust ratio).
        freeze_step: warmup length in steps (>= 1), or ``"auto"`` / a
            :class:`compressed_opt.freeze.VarianceStabilityRule` (as :class:`OnebitAdam`).
        max_coeff, min_coeff: the range of the warmup trust ratio (> 0, ``min <= max``).
        coeff_beta: decay of the trust ratios' moving average, in ``[0, 1)``.
        factor_max, factor_min: the range of the compression-stage variance factor
            (> 0, ``min <= max``).
        factor_threshold: the most the factor may change from one step to the next (relative, >= 0).
        bias_correction: Adam's bias correction of the moments (``False``: the paper's code).
        {common_args}
        zero_stage: 0, or 1 / 2 to shard the optimizer state ZeRO-style (as :class:`OnebitAdam`;
            see the module doc). Checkpoints then hold this rank's shards.
        master_resync_interval: with ZeRO and bf16/fp16 parameters, every this many
            compression-stage steps the parameters are replaced by the gathered fp32 master chunks.
        exchange: ``"preconditioned"`` (default): exchange ``c_l m / sqrt(v_f)``, as
            :class:`OnebitAdam`; ``"momentum"``: the paper's exchange of ``c_l m`` with ``c_l``
            from the momentum's RMS (see the module doc).
        trust_ratio: ``"live"`` (default): in the compression stage each layer's coefficient is
            ``max(clip(||p|| / ||u||), r_f, r_f * factor)`` with ``||u||`` from the ranks' local
            momenta, capped at ``K`` times LAMB's ratio of the applied direction (see the module
            doc); ``"frozen"``: the paper's ``r_f * factor``.
        trust_ratio_interval: the live ratio's ``||p|| / ||u||`` and its cap are measured at the
            first compression step and every this many steps after, and kept in between (>= 1).
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 freeze_step=DEFAULT_FREEZE_STEP, *,
                 max_coeff=10.0, min_coeff=0.01, coeff_beta=0.9, factor_max=4.0, factor_min=0.5,
                 factor_threshold=0.1, bias_correction=True, backend=None, bucket_cap_mb=25.0, overlap=True,
                 accumulation_steps=1, zero_stage=0, master_resync_interval=100, exchange="preconditioned",
                 hierarchy="auto", path=None, trust_ratio="live", trust_ratio_interval=10, scale_block=DEFAULT_BLOCK):
        name = type(self).__name__
        algorithm = LambAlgorithm(name, freeze_step, exchange, sharding(name, zero_stage, master_resync_interval),
                                  trust_ratio, trust_ratio_interval)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff, coeff_beta=coeff_beta, factor_max=factor_max, factor_min=factor_min,
                        factor_threshold=factor_threshold, bias_correction=bool(bias_correction))
        super().__init__(params, defaults, algorithm, backend=backend, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
                         accumulation_steps=accumulation_steps, hierarchy=hierarchy, path=path,
                         scale_block=scale_block)

    @property
    def freeze_step(self) -> int | None:
        """The last full-precision step (``None`` with ``freeze_step="auto"`` until the rule decides)."""
        return self._algorithm.schedule_.freeze_step
