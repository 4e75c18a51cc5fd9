"""1-bit Adam (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", ICML 2021).

Warmup, steps ``1..freeze_step``: gradients averaged at full precision; the step is exactly AdamW::

    m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
    p <- p (1 - lr wd) - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

At the end of step ``freeze_step`` the variance is frozen: ``v_f = v / (1 - b2^freeze_step)``.
Compression stage: no gradient allreduce. Each rank forms its local momentum
``m_i = b1 m + (1 - b1) g_i`` and ``m = compressed_allreduce(m_i)`` (error feedback, identical on
every rank); ``p <- p (1 - lr wd) - lr * (m / (1 - b1^t)) / (sqrt(v_f) + eps)``.

*The preconditioned exchange* (``exchange="preconditioned"``, the default; docs/design.md 2.3.1).
The paper exchanges ``m_i`` itself. One 1-bit scale then serves a whole bucket, so a coordinate
whose frozen variance is tiny (GPT-2's attention key bias: gradients ~1e-11, ``v_f`` ~1e-24)
receives ``+-scale`` of the bucket's typical momentum, and ``scale / (sqrt(v_f) + eps)``
moves it by up to ``lr * scale / eps`` per step: a key bias of 5e-6 jumped to 145 at the first
compressed step. Since ``v_f`` is the same on every rank, the average commutes with any fixed
per-coordinate factor, so we exchange the *preconditioned* momentum instead::

    R = c_l / (sqrt(v_f) + eps)          per coordinate, fixed from the freeze on (0 where v_f == 0)
    y = compressed_allreduce(clip(s_l R m_i, +-K c_l))    (error feedback in this space)
    m = y / (s_l R);   p <- p (1 - lr wd) - lr (f_l / s_l) (y / c_l) / (1 - b1^t)

``R m`` is Adam's own update direction, times a per-layer coefficient ``c_l = mean_k s_k / s_l``
(``s_l``: the RMS of layer ``l``'s ``m / (sqrt(v_f) + eps)`` at the first compressed step, the same
on every rank, kept in ``state[p]["scaling_coeff"]``; :mod:`compressed_opt.scaling`). ``f_l`` is
the layer's variance-tracking factor (:mod:`compressed_opt.variance_tracking`), and ``s_l`` its
value of the last update, applied before the exchange (docs/design.md 2.3.3; 1 without
tracking): every layer reaches the compressor at the size of its step, and what 1-bit noise a
coordinate gets is at most the size of its own layer's steps, never ``scale / eps``. The clip
``K`` (:data:`~compressed_opt.moments.COMPRESSED_STEP_BOUND`, 1.25) keeps any coordinate from
stepping further than ``K lr``. ``exchange="momentum"`` is the paper's exchange.

Beyond the paper: a coordinate whose frozen variance is exactly 0 (it never received a gradient
in warmup, e.g. the weight of an input that is always 0) is not moved by the momentum in the
compression stage. 1-bit compression sends it ``+-scale`` like every other coordinate, and
``scale / eps`` would blow it up (to inf, then NaN as ``inf * 0``); its denominator is ``inf``.

``bias_correction=False`` reproduces DeepSpeed's update (no bias correction).
"""
from __future__ import annotations

import logging

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import DEFAULT_BLOCK

from . import exchange_variant, scaling, zero
from . import variance_tracking as tracking
from .buckets import param_states
from .buffers import DERIVED, STATE, Buffer
from .freeze import VarianceStabilityRule, resolve_rule, restore_rule
from .moments import (COMPRESSED_STEP_BOUND, bias_corrections, denominator_, frozen_denominator_of,
                      momentum_, preconditioned_denominator, variance_)
from .optimizer import CompressedOptimizer, common_args
from .validation import check_adam_group, check_step_count

logger = logging.getLogger("compressed_opt")

#: ``freeze_step``'s default: long enough to be safe for a long run, so a shorter run never
#: compresses (rank 0 says so at the first step; docs/guarantees: "Visible")
DEFAULT_FREEZE_STEP = 100_000


class _FreezingAdam(tracking.LayerVarianceTracking, CompressedOptimizer):
    """Adam-family optimizers with one variance freeze: warmup, then compression."""

    buffers = {
        "exp_avg": Buffer(STATE),  # m
        "exp_avg_sq": Buffer(STATE),  # v (frozen: v_f)
        "frozen_denominator": Buffer(DERIVED),  # sqrt(v_f) + eps
        "preconditioner": Buffer(DERIVED),  # R = c_l / sqrt(v_f), the preconditioned exchange's factor
        "no_variance": Buffer(DERIVED, torch.int64),  # the indices where v_f == 0
    }
    #: whether the compression stage needs this rank's chunk of the previous momentum (a sharded
    #: layout keeps it when it forms the local momentum)
    keeps_previous_momentum = False

    #: the exchange variants it takes (``exchange=``), :mod:`compressed_opt.exchange_variant`
    EXCHANGES = exchange_variant.ADAM
    #: whether the compression stage still divides by ``sqrt(v_f) + eps`` itself (1-bit LAMB's
    #: factor does), or needs only the exchange's factor ``R``
    keeps_denominator = False

    def __init__(self, params, defaults, freeze_step, backend, bucket_cap_mb, overlap=True, accumulation_steps=1,
                 zero_stage=0, master_resync_interval=100, exchange="preconditioned", variance_tracking=False,
                 hierarchy="auto", path=None, scale_block=DEFAULT_BLOCK):
        self.exchange_variant = exchange_variant.choose(exchange, self.EXCHANGES)
        self._init_variance_tracking(variance_tracking)
        freeze_step = check_step_count("freeze_step", freeze_step, allow_auto=True, minimum=1) \
            if not isinstance(freeze_step, VarianceStabilityRule) else freeze_step
        if zero_stage not in (0, 1, 2) or isinstance(zero_stage, bool):
            raise ValueError(f"Invalid zero_stage: {zero_stage!r} (must be 0, 1 or 2)")
        self.zero_stage = zero_stage
        self.master_resync_interval = check_step_count("master_resync_interval", master_resync_interval, minimum=1)
        self.freeze_rule = resolve_rule(freeze_step)
        self.freeze_step = None if self.freeze_rule is not None else freeze_step
        self.frozen = False
        self._unit_factor_errors: set[int] = set()  # buckets whose loaded errors are of s = 1
        super().__init__(params, defaults, backend=backend, bucket_cap_mb=bucket_cap_mb,
                         overlap=overlap, accumulation_steps=accumulation_steps, hierarchy=hierarchy, path=path,
                         layout=zero.for_stage(zero_stage), scale_block=scale_block)

    def _validate_group(self, group):
        check_adam_group(group)

    @property
    def compressing(self) -> bool:
        return self.frozen

    def _needs_average(self, step):
        return not self.frozen

    def _end_step(self, step):
        if self.frozen:
            return
        if self.freeze_rule is None:
            freeze = step >= self.freeze_step
        else:
            freeze = self._auto_decision(step)
        if freeze:
            self._freeze(step)

    def _mean_bias_corrected_variance(self, step) -> float:
        """The auto rule's statistic: the mean of ``v_hat`` over every element. Each rank sums
        the variance it holds (sharded: its chunks; one all-gather of two floats adds them up in
        rank order)."""
        total = numel = 0.0
        for b in self._buckets:
            group = self.param_groups[b.group_index]
            _, bc2 = bias_corrections(*group["betas"], step, group["bias_correction"])
            v = self.layout.state(self, b, "exp_avg_sq")
            total += float(v.sum()) / (bc2 * bc2)
            numel += v.numel()
        total, numel = self.layout.sum_over_ranks(self, [total, numel])
        return total / max(numel, 1.0)

    def _auto_decision(self, step) -> bool:
        return self.rank0_decides(self.freeze_rule.observe(step, self._mean_bias_corrected_variance(step)))

    def _freeze(self, step):
        self.frozen = True
        self.freeze_step = step
        self.reset_error_buffers()
        for b in self._buckets:
            b.derived.pop("exchange_factors", None)
            for p in b.params:
                self.state[p].pop("exchange_factor", None)
        for b in self._buckets:
            self._start_variance_tracking(b, self.layout.freeze(self, b))
        logger.info("%s: variance frozen at the end of step %d; compression starts", type(self).__name__, step)

    def frozen_denominator(self, bucket) -> torch.Tensor:
        """``sqrt(v_f) + eps`` of the bucket (``inf`` where ``v_f == 0``), made once at the freeze
        (or after a checkpoint load) from ``exp_avg_sq`` and the freeze step."""
        denom = bucket.flats.get("frozen_denominator")
        r = bucket.flats.get("preconditioner")
        if denom is None and r is not None:  # (sharded: only R = c_l / sqrt(v_f) is kept) made for one step
            return preconditioned_denominator(r, bucket.views, self.exchange_coefficients(bucket),
                                              self.param_groups[bucket.group_index]["eps"])
        if denom is None:
            group = self.param_groups[bucket.group_index]
            denom = frozen_denominator_of(bucket.flat("exp_avg_sq"), group, self.freeze_step)
            bucket.flats["frozen_denominator"] = denom
        return denom

    # --- per-layer variance tracking (compressed_opt.variance_tracking) ------------------------
    def _tracking_clock(self, step):
        return step - self.freeze_step, step, self.freeze_step

    def _gather(self, bucket, grad, step):
        if self.frozen:  # g_i, or (sharded) the local momentum formed from p.grad directly
            self.layout.gather_local(self, bucket, grad)
        else:
            self.gather_observed(bucket, grad)

    def _reads_gradients_in_place(self, step) -> bool:
        return self.exchange_variant.preconditioned  # (its local momentum: a pass inside the compression)

    def exchange_scales(self, bucket) -> list[float] | None:
        """Per parameter of the bucket, the factor its momentum is multiplied by for the 1-bit
        exchange (``None``: not scaled; the exchange variant's)."""
        return self.exchange_variant.exchange_scales(self, bucket)

    # --- the preconditioned exchange ----------------------------------------------------------
    def exchange_preconditioner(self, bucket) -> torch.Tensor | None:
        """Per element of the bucket, the fixed factor its momentum is multiplied by for the 1-bit
        exchange, ``R = c_l / sqrt(v_f)`` (``None``: the momentum itself is exchanged; the exchange
        variant's, :mod:`compressed_opt.exchange_variant`)."""
        return self.exchange_variant.preconditioner(self, bucket)

    def _bound_constant(self, betas) -> float:
        """``K``, the bound on a coordinate's exchanged ``|m_i / sqrt(v_f)|`` in units of its step
        (:data:`~compressed_opt.moments.COMPRESSED_STEP_BOUND`)."""
        return COMPRESSED_STEP_BOUND

    def exchange_bounds(self, bucket) -> list[float]:
        """Per layer, the bound ``c_l K`` on the exchanged ``|s_l R m_i|`` (:meth:`_bound_constant`;
        ``s_l`` the layer's exchange factor, :meth:`exchange_factors`): no coordinate steps further
        than ``lr K``. Made once per preconditioner (``c_l`` is set with it) and betas."""
        betas = tuple(self.param_groups[bucket.group_index]["betas"])
        key = (self.exchange_preconditioner(bucket), betas)
        cached = bucket.derived.get("exchange_bounds")
        if cached is None or cached[0][0] is not key[0] or cached[0][1] != betas:
            k = self._bound_constant(betas)
            cached = (key, [k * c for c in self.exchange_coefficients(bucket)])
            bucket.derived["exchange_bounds"] = cached
        return cached[1]

    def exchange_coefficients(self, bucket) -> list[float]:
        """Per layer, the preconditioned exchange's ``c_l`` (``state[p]["scaling_coeff"]``, set with
        ``R``): read from the state once per preconditioner, not every step."""
        r = self.exchange_preconditioner(bucket)
        cached = bucket.derived.get("exchange_coefficients")
        if cached is None or cached[0] is not r:
            cached = bucket.derived["exchange_coefficients"] = (r, [st["scaling_coeff"] for st in
                                                                    param_states(self.state, bucket)])
        return cached[1]

    def preconditioned_descend(self, bucket, decay: float, alpha: float):
        """The preconditioned exchange's update, ``p <- p decay + alpha (f_l / s_l) y / (c_l + eps R)``
        (0 where ``v_f == 0``), as its arguments but ``y``, ``R`` and the segments
        (:class:`compressed_opt.cuda.Descend`): what both layouts' ``step_preconditioned_`` take."""
        factors = self.update_factors(bucket) or [1.0] * len(bucket.params)  # f_l / s_l
        return kernels.Descend(bucket.params, self.param_groups[bucket.group_index]["eps"],
                               self.exchange_coefficients(bucket), factors, decay, alpha)

    def bound_exchanged_(self, bucket, x: torch.Tensor) -> None:
        """Clip the exchanged ``s_l R m_i`` to ``+-c_l K`` (:meth:`exchange_bounds`)."""
        views, bounds = bucket.views(x), self.exchange_bounds(bucket)
        if views:
            torch._foreach_clamp_max_(views, bounds)
            torch._foreach_clamp_min_(views, [-b for b in bounds])

    # --- the tracked exchange: each layer reaches the compressor at the size of its step ----------
    def exchange_factors(self, bucket) -> list[float] | None:
        """Per layer, ``s_l``, what the preconditioned exchange multiplies ``R m_i`` by before the
        1-bit exchange: the layer's variance-tracking factor of the last update (the latest there
        is before this step's all-gather), so that every layer reaches the compressor at the size
        of its step and the scales of the blocks it shares with other layers fit it
        (docs/design.md 2.3.3). ``None`` (1) with the paper's exchange or without tracking.
        Called once per exchange: the factors are kept with the bucket for the rest of the step
        (:meth:`_applied_exchange_factors`), and after it in ``state[p]["exchange_factor"]``."""
        s = self.exchange_variant.exchange_factors(lambda: self._last_variance_factors(bucket))
        if s is None:
            return None
        bucket.derived["exchange_factors"] = s
        if bucket.index in self._unit_factor_errors:  # a checkpoint of format 2: errors made with s = 1
            scaling.rescale_errors(self, bucket, [1.0] * len(s), s)
            self._unit_factor_errors.discard(bucket.index)
        return s

    def _applied_exchange_factors(self, bucket) -> list[float] | None:
        """The ``s_l`` of this step's exchange (``None``: not tracked, or the exchange variant does
        not scale by them: :meth:`exchange_factors` then keeps none)."""
        if not (self.variance_tracking and self.frozen):
            return None
        return bucket.derived.get("exchange_factors")

    def kept_exchange_factors(self, bucket) -> list[float]:
        """The ``s_l`` of the last exchange, whose result a sharded layout keeps as 1-bit rows (1
        for a checkpoint of format 2, or before any tracked exchange)."""
        return [st.get("exchange_factor", 1.0) for st in param_states(self.state, bucket)]

    def update_factors(self, bucket) -> list[float] | None:
        """Per layer, what the exchanged ``y`` is multiplied by in the update on top of ``A``:
        ``f_l / s_l`` (this step's tracking factor over the exchange's), ``f_l`` when the exchange
        was not tracked, ``None`` without tracking."""
        f = self._variance_factors_of(bucket)
        s = self._applied_exchange_factors(bucket)
        if f is None or s is None:
            return f
        return [a / b for a, b in zip(f, s)]

    def _record_exchange_factors(self, bucket) -> None:
        """After the update: the exchange's ``s_l`` into ``state[p]["exchange_factor"]`` (the
        sharded layout's rows are in its units; checkpoints carry it)."""
        s = self._applied_exchange_factors(bucket)
        if s is not None:
            for st, v in zip(param_states(self.state, bucket), s):
                st["exchange_factor"] = v

    def no_variance_indices(self, bucket) -> torch.Tensor:
        """Indices of the bucket's elements with ``v_f == 0`` (usually none): ``m = y / R`` is
        0 / 0 there, and is set to 0."""
        idx = bucket.flats.get("no_variance")
        if idx is None:
            idx = bucket.flats["no_variance"] = torch.nonzero(self.exchange_preconditioner(bucket) == 0).view(-1)
        return idx

    def momentum_from_exchange(self, bucket, y: torch.Tensor, out: torch.Tensor, descend=None) -> None:
        """The momentum ``m`` from the exchanged average ``y`` into ``out``: ``y / (s_l R)`` (0 where
        ``v_f == 0``), or ``y / c_l`` with the paper's exchange (the exchange variant's).
        ``descend`` (the preconditioned exchange): the update of ``y``, a
        :class:`compressed_opt.cuda.Descend`, run in the same pass; then the
        :class:`compressed_opt.cuda.KeptMomentum` of ``out`` where the pass formed it from the
        result's rows (else ``None``)."""
        factors = self._applied_exchange_factors(bucket)
        if descend is None:
            self.exchange_variant.momentum_from_exchange(self, bucket, y, out, factors)
            return None
        return self.exchange_variant.momentum_and_update_(self, bucket, y, out, factors, descend)

    def _load_extra_state(self, extra):
        self._load_tracking_of(extra)
        # a compression-stage checkpoint of format 2: its error buffers hold errors of s = 1
        unit = extra["frozen"] and extra.get("unit_exchange_factors", False) and self.variance_tracking
        self._unit_factor_errors = set(range(len(extra["buckets"]))) if unit else set()
        # checkpoints from before the preconditioned exchange carry no "exchange": the paper's
        saved = extra.get("exchange", "momentum")
        if extra["frozen"] and saved != self.exchange_variant.name:
            name = self.exchange_variant.name
            raise ValueError(
                f"this checkpoint was saved in the compression stage of {type(self).__name__}(exchange={saved!r}); "
                f"its error-feedback buffers hold errors of that exchange, not of exchange={name!r}. "
                f"Resume it with {type(self).__name__}(..., exchange={saved!r})"
            )
        self.frozen = bool(extra["frozen"])
        self.freeze_step = extra["freeze_step"]
        self.freeze_rule = restore_rule(self.freeze_rule, extra.get("freeze_rule"))

    def _extra_state(self):
        return {
            "frozen": self.frozen,
            "freeze_step": self.freeze_step,
            "freeze_rule": None if self.freeze_rule is None else self.freeze_rule.state_dict(),
            "exchange": self.exchange_variant.name,
            "variance_tracking": self.variance_tracking,
        }

    def _warmup_left_at_default(self):
        return self.freeze_rule is None and self.freeze_step == DEFAULT_FREEZE_STEP

    def _extra_signature(self):
        rule = None if self.freeze_rule is None else self.freeze_rule.state_dict()
        return (self.freeze_step, rule and (rule["window"], rule["rtol"], rule["min_step"], rule["max_step"]),
                self.exchange_variant.name, self.variance_tracking)


@common_args
class OnebitAdam(_FreezingAdam):
    """1-bit Adam: AdamW during warmup, then 1-bit compressed momentum with a frozen variance.

    Warmup, steps ``1..freeze_step`` (gradients averaged at full precision): AdamW exactly::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    Compression stage (``v_f = v / (1 - b2^F)`` frozen at step ``F = freeze_step``): each rank's
    momentum ``m_i = b1 m + (1 - b1) g_i`` goes through the 1-bit exchange with error feedback,
    ``m = avg_1bit(m_i)``, and ``p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v_f) + eps)``
    (the exchange preconditioned and each layer's step tracked: the module docstring).

    Example::

        torch.distributed.init_process_group("nccl")      # under torchrun
        opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2000)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        print(opt.comm_stats())                            # bytes per step, warmup and compression

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        freeze_step: warmup length in steps (>= 1), or ``"auto"`` to freeze when the variance has
            stabilised (:class:`compressed_opt.freeze.VarianceStabilityRule`; pass an instance
            to tune it). The step chosen is in ``optimizer.freeze_step`` and in checkpoints.
        bias_correction: Adam's bias correction (``False``: DeepSpeed's update).
        {common_args}
        zero_stage: 0, or 1 / 2 to shard the optimizer state ZeRO-style by the compressed
            allreduce's server chunks (:mod:`compressed_opt.zero`; 2 also reduce-scatters the
            warmup gradients). Checkpoints then hold this rank's shards: save one per rank and
            resume on the same world size.
        master_resync_interval: with ZeRO and bf16/fp16 parameters, every this many
            compression-stage steps the parameters are replaced by the gathered fp32 master
            chunks (:mod:`compressed_opt.zero`).
        exchange: ``"preconditioned"`` (default): the compression stage exchanges
            ``c_l m / (sqrt(v_f) + eps)``, so no coordinate's 1-bit noise exceeds its layer's
            Adam step; ``"momentum"``: the paper's exchange of ``m`` (see the module doc).
        variance_tracking: ``True`` (default): in the compression stage each layer's step follows
            the change of its gradients' second moment since the freeze, measured on the ranks'
            local gradients (:mod:`compressed_opt.variance_tracking`; ``L`` floats per step in
            the step's existing all-gather); ``False``: the paper's frozen variance.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 freeze_step=DEFAULT_FREEZE_STEP, *,
                 bias_correction=True, backend=None, bucket_cap_mb=25.0, overlap=True, accumulation_steps=1,
                 zero_stage=0, master_resync_interval=100, exchange="preconditioned", variance_tracking=True,
                 hierarchy="auto", path=None, scale_block=DEFAULT_BLOCK):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bool(bias_correction))
        super().__init__(params, defaults, freeze_step, backend, bucket_cap_mb, overlap, accumulation_steps,
                         zero_stage, master_resync_interval, exchange, variance_tracking, hierarchy, path, scale_block)

    def _reads_gradients_in_place(self, step) -> bool:
        return True  # either exchange's local momentum is a pass inside the compression (LerpScaleClamp, Lerp)

    def _bucket_communicate(self, bucket, group, grad, step):
        """Compression stage: local momentum ``m_i = b1 m + (1 - b1) g_i`` into ``grad`` (as
        ``R m_i``, bounded, for the preconditioned exchange), then its compressed average over the
        ranks, in place (``m`` takes it in :meth:`_bucket_step`). Into the gradient buffer: ``m``
        changes only in :meth:`_bucket_step` (a skipped step leaves it alone). The pass that forms
        the local momentum runs inside the exchange's compression where the layout and the kernels
        can (:meth:`~compressed_opt.layout.Layout.local_momentum_pass`): nothing reads it before."""
        pending = self.layout.local_momentum_pass(self, bucket, grad, group["betas"][0])
        yield from self.layout.exchange(self, bucket, grad, pending,
                                        keep_result=self.exchange_variant.reads_compressed_result(self))

    def _fused_warmup_(self, bucket, group, grad, step) -> bool:
        """A warmup step as torch's fused AdamW kernel (``torch._fused_adamw_``, what
        ``torch.optim.AdamW(fused=True)`` runs: one pass where the composition below takes about
        eight) on what the layout hands it (:meth:`~compressed_opt.layout.Layout.adamw_`: the
        parameters and views of the bucket's flat ``m``, ``v`` and gradient; under ZeRO this rank's
        chunk of them, fp32), where it applies: an fp32 gradient on a device the kernel runs on,
        Adam's bias correction on (the kernel always corrects). The same AdamW, rounded as the
        kernel rounds it. ``False``, nothing done, elsewhere."""
        fused = getattr(torch, "_fused_adamw_", None)
        if (fused is None or not group["bias_correction"] or not bucket.params or grad.dtype != torch.float32
                or grad.device.type not in ("cpu", "cuda")):
            return False
        count = bucket.derived.get("warmup_step_count")
        if count is None or count.device != grad.device:
            count = bucket.derived["warmup_step_count"] = torch.zeros((), dtype=torch.float32, device=grad.device)
        count.fill_(float(step))
        beta1, beta2 = group["betas"]
        hp = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
                  eps=group["eps"], amsgrad=False, maximize=False, grad_scale=None, found_inf=None)
        return self.layout.adamw_(self, bucket, grad, lambda p, g, m, v: fused(p, g, m, v, [], [count] * len(p), **hp))

    def _bucket_step(self, bucket, group, grad, step, averaged):
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]  # lr: a float or a 1-element tensor
        bc1, bc2_sqrt = bias_corrections(beta1, beta2, step, group["bias_correction"])
        layout = self.layout
        if averaged:  # warmup: AdamW on the averaged gradient, over the part of the bucket this rank holds
            self._observe_averaged_gradient(bucket, grad)
            if self._fused_warmup_(bucket, group, grad, step):
                return
            g = layout.own(self, bucket, grad)
            m, v = layout.state(self, bucket, "exp_avg"), layout.state(self, bucket, "exp_avg_sq")
            momentum_(m, g, beta1)
            variance_(v, g, beta2)
            direction = layout.direction_buffer(self, bucket, grad)
            torch.div(m, denominator_(v, direction, eps, bc2_sqrt), out=direction)
            layout.step_(self, bucket, layout.own_values(self, bucket), direction, 1 - lr * wd, -lr / bc1)
            return
        # compression stage: grad holds the compressed average (_bucket_communicate)
        self.exchange_variant.update_(self, bucket, grad, 1 - lr * wd, -lr / bc1, step)
        self._record_exchange_factors(bucket)
