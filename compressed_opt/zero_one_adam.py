"""0/1 Adam (Lu et al., "Maximizing Communication Efficiency for Large-scale Training via 0/1
Adam", ICLR 2023).

1-bit Adam (:mod:`compressed_opt.onebit_adam`) still sends 1 bit per element every step and
needs a full-precision warmup to freeze the variance. 0/1 Adam removes both costs:

**Phase A** (steps ``1..var_freeze_step``): the variance ``v`` is refreshed only on steps with
``t % var_interval == 0``, from the full-precision average gradient ``g``; every other step the
gradient goes through the 1-bit compressed allreduce (error feedback, docs/design.md 2.2) and only ``m``
is updated::

    refresh step:     m = b1 m + (1 - b1) g;    v = b2 v + (1 - b2) g^2     (g: fp32 average)
    compressed step:  m = b1 m + (1 - b1) C(g)                               (C: 1-bit average)
    every step:       p <- p (1 - lr wd) - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^r)) + eps)

``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` refreshes, so the
full-precision steps thin out geometrically (1, 2, ..., then every 2nd, every 4th step, ...).

*Bias correction with sparse refreshes.* ``m`` is updated every step, so its correction is the
usual ``1 - b1^t``. ``v`` is an EMA of only the ``r`` refreshes made so far (``r`` counts this
step's refresh), ``v = (1 - b2) sum_k b2^(r-k) g_k^2``, so its unbiased correction is
``1 - b2^r``, not ``1 - b2^t`` (which would treat the skipped steps as zero gradients and
overshoot ``v_hat`` by up to a factor ``(1 - b2^t) / (1 - b2^r)``). ``bias_correction=False``
uses neither (DeepSpeed's update: plain Adam without correction).

**Phase B** (after ``var_freeze_step``): ``v`` is frozen. At the switch, ``m`` and ``v`` become
their bias-corrected values (``m / (1 - b1^T)``, ``v / (1 - b2^r)``; unchanged without bias
correction): an EMA of unbiased inputs started from an unbiased value stays unbiased, so phase
B runs the paper's uncorrected rules. Ranks take *local* steps without any communication::

    m = b1 m + (1 - b1) g_local;    u = m / (sqrt(v) + eps)
    p <- p (1 - lr wd) - lr u;      acc += lr u;    lr_sum += lr

and every ``local_step_interval`` steps synchronise: undo the local steps, average
``acc * (sqrt(v) + eps)`` (= ``sum lr m``) with the 1-bit compressed allreduce into ``y``, then
``m = y / lr_sum`` and ``p <- p_sync D - y / (sqrt(v) + eps)``, where ``p_sync`` is the
parameters at the previous synchronisation and ``D = prod (1 - lr wd)`` over the interval's
steps (decoupled weight decay of the synchronised parameters); ``acc``, ``lr_sum`` and ``D``
restart. ``local_step_interval`` starts at 1 and doubles every ``local_step_scaler`` phase-B steps,
up to ``local_step_clipper``. The error buffers are reset when phase B begins (they then carry
the error of ``acc``, not of gradients).

"Undo the local steps" restores ``p_sync`` from a copy (the per-bucket fp32 buffer
``sync_params``) instead of computing ``p + acc``: float addition does not undo exactly, and the
ranks' local steps differ, so ``p + acc`` would leave each rank's parameters a few ulps apart,
drifting further with every interval. From the copy, every rank computes the same update from
the same numbers: right after each synchronisation the parameters are bitwise identical on all
ranks. Between synchronisations they differ (by design): evaluate or save the model right
after a synchronising step (``optimizer.last_step_kind == "sync"``), or on one rank.

*One scale per bucket.* The 1-bit exchange gives a whole bucket one scale, while its layers'
gradients differ in size by orders of magnitude. Before each exchange every layer is multiplied
by ``c_l = mean_k s_k / s_l`` with ``s_l = sqrt(mean v_l)`` (the typical size of the layer's
gradient, and of its momentum), and divided by it after (:mod:`compressed_opt.scaling`). ``v``
is the same on every rank, so are the coefficients; they are set again after every refresh
(the error buffers carried over to them) and at the freeze.

A param group whose ``lr`` summed to 0 over an interval moved nothing and has no momentum to
recover (``y / 0``): its buckets skip that synchronisation's communication.

``var_freeze_step="auto"`` (or a :class:`~compressed_opt.freeze.VarianceStabilityRule`) ends phase
A once the variance has stabilised: the rule observes the mean of ``v_hat`` after each refresh
(so its window counts refreshes), rank 0 decides and broadcasts; the step chosen is logged, is
``optimizer.var_freeze_step`` and goes into checkpoints, with every counter of both schedules.
"""
from __future__ import annotations

import logging
import math

import torch

from compressed_opt.comm import DEFAULT_BLOCK

from . import exchange_variant
from . import variance_tracking as tracking
from .buffers import DERIVED, LAYER, SCRATCH, STATE, Buffer
from .freeze import VarianceStabilityRule, resolve_rule, restore_rule
from .moments import denominator_, momentum_
from .optimizer import CompressedOptimizer, common_args
from .validation import check_adam_group, check_step_count
from .zero_one_exchange import VARIANTS, ZeroOneExchange, _no_variance_no_move_
from .zero_one_local import ZeroOneLocalSteps

logger = logging.getLogger("compressed_opt")

#: what the last ``step()`` did: full-precision variance refresh, 1-bit gradient average (phase
#: A), local step without communication, or local step + synchronisation (phase B)
STEP_KINDS = ("refresh", "compressed", "local", "sync")


@common_args
class ZeroOneAdam(ZeroOneExchange, ZeroOneLocalSteps, tracking.LayerVarianceTracking, CompressedOptimizer):
    """0/1 Adam: sparse variance refreshes with 1-bit gradients, then a frozen variance with
    local steps and 1-bit synchronisations at growing intervals.

    Phase A (to ``var_freeze_step``): ``v`` refreshed from a full-precision gradient average at
    doubling intervals, the 1-bit average of the gradients between, ``m = b1 m + (1 - b1) g``.
    Phase B: ``v`` frozen; local steps ``p = p - lr m / (sqrt(v) + eps)``, synchronised through
    the 1-bit exchange at doubling intervals (docs/design.md 2.5).

    Example::

        opt = compressed_opt.ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=2000)
        loss_fn(model(x), y).backward()
        opt.step()

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        var_freeze_step: the last step of phase A (an int >= 1), or ``"auto"`` to end it when the
            variance has stabilised (pass a :class:`~compressed_opt.freeze.VarianceStabilityRule`
            to tune the rule). The step chosen is ``optimizer.var_freeze_step``.
        var_update_scaler: refreshes between doublings of ``var_interval`` (>= 1).
        local_step_scaler: phase-B steps between doublings of ``local_step_interval`` (>= 1).
        local_step_clipper: the largest ``local_step_interval`` (>= 1).
        bias_correction: Adam's bias correction, adapted to sparse refreshes (see the module
            doc); ``False``: DeepSpeed's update, without correction.
        {common_args}
        zero_stage: only 0: 0/1 Adam's state is not sharded (the error for 1 or 2 says why; see
            :mod:`compressed_opt.zero`).
        exchange: ``"preconditioned"`` (default): every 1-bit exchange sends its values divided
            by ``sqrt(v)`` (preconditioned, bounded), so a coordinate of tiny variance gets 1-bit noise
            of its own size (see the module doc); ``"momentum"``: the paper's exchanges, with
            per-layer coefficients.
        variance_tracking: ``True`` (default): in phase B each layer's steps follow the change of
            its gradients' second moment since the freeze, measured on the ranks' local gradients
            (:mod:`compressed_opt.variance_tracking`; the factor is set at the first step of each
            synchronisation interval and kept through it); ``False``: the paper's frozen variance.

    With ``overlap``, phase A's communication (full-precision or 1-bit gradient average) goes out
    from backward; phase-B synchronisations run in ``step()`` (they need the step's lr).

    Per-parameter state (views of per-bucket fp32 buffers): ``exp_avg``, ``exp_avg_sq``,
    ``momentum_accumulator`` (``acc``) and ``sync_params`` (the parameters at the last
    synchronisation). Progress: ``phase`` ("A"/"B"), ``var_interval``, ``local_step_interval``,
    ``last_step_kind``.

    A bucket is compressed with one scale (its RMS, docs/design.md 2.1); each layer is multiplied by its
    coefficient ``c_l = mean_k s_k / s_l``, ``s_l = sqrt(mean v_l)``, before every 1-bit exchange
    and divided after (:mod:`compressed_opt.scaling`; ``optimizer.state[p]["scaling_coeff"]``),
    so that a layer with small gradients is not drowned in the 1-bit noise of the large ones.
    """

    buffers = {
        "exp_avg": Buffer(STATE),  # m
        "exp_avg_sq": Buffer(STATE),  # v
        "momentum_accumulator": Buffer(STATE),  # acc
        "sync_params": Buffer(STATE),  # p_sync
        "frozen_denominator": Buffer(DERIVED),  # phase B's sqrt(v_hat) + eps
        "preconditioner": Buffer(DERIVED),  # phase A's preconditioning factors
        "no_variance": Buffer(SCRATCH, (torch.int64, torch.bool)),  # where v == 0: indices, or a mask if many
        "interval_factor": Buffer(LAYER, torch.float64),  # the tracking's factor of the interval
    }
    #: phase B: each rank's local momentum and accumulated update (between synchronisations)
    rank_state_names = ("exp_avg", "momentum_accumulator")
    #: the exchange variants it takes (``exchange=``), :mod:`compressed_opt.zero_one_exchange`
    EXCHANGES = VARIANTS

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16,
                 bias_correction=True, backend=None, bucket_cap_mb=25.0, overlap=True, accumulation_steps=1,
                 zero_stage=0, exchange="preconditioned", variance_tracking=True, hierarchy="auto", path=None,
                 scale_block=DEFAULT_BLOCK):
        self.exchange_variant = exchange_variant.choose(exchange, self.EXCHANGES)
        self._init_variance_tracking(variance_tracking)
        if variance_tracking:  # the factor of the current synchronisation interval, per layer
            self.layer_state = {**self.layer_state, "interval_factor": 1}
        if zero_stage != 0 or isinstance(zero_stage, bool):
            raise ValueError(
                f"Invalid zero_stage: {zero_stage!r}. ZeroOneAdam's state is not sharded (only 0 is accepted): "
                "in phase B every rank steps all of its parameters locally, so its momentum, accumulated "
                "update and error buffer are its own, and the frozen denominator and the parameters at the "
                "last synchronisation are needed whole on every rank; sharding them would cost a "
                "full-precision parameter all-gather at every synchronisation. OnebitAdam and OnebitLamb "
                "take zero_stage=1 or 2"
            )
        if not isinstance(var_freeze_step, VarianceStabilityRule):
            var_freeze_step = check_step_count("var_freeze_step", var_freeze_step, allow_auto=True, minimum=1)
        self.var_update_scaler = check_step_count("var_update_scaler", var_update_scaler, minimum=1)
        self.local_step_scaler = check_step_count("local_step_scaler", local_step_scaler, minimum=1)
        self.local_step_clipper = check_step_count("local_step_clipper", local_step_clipper, minimum=1)
        self.freeze_rule = resolve_rule(var_freeze_step)
        #: the last step of phase A: as given, or (``"auto"``) ``None`` until the rule decides
        self.var_freeze_step = None if self.freeze_rule is not None else var_freeze_step
        self._configured_freeze = "auto" if self.freeze_rule is not None else var_freeze_step
        self.frozen = False  # phase B
        self.var_interval = 1
        self.var_counter = 0  # refreshes since var_interval last doubled
        self.var_refreshes = 0  # refreshes in all: the variance's bias correction
        self.local_step_interval = 1
        self.local_step_counter = 0  # phase-B steps since local_step_interval last doubled
        self.steps_since_sync = 0
        self._lr_sums: list[float] = []  # per param group, over the current interval
        self._decays: list[float] = []  # per param group: prod (1 - lr wd) over the interval
        self.last_step_kind: str | None = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, backend=backend, bucket_cap_mb=bucket_cap_mb,
                         overlap=overlap, accumulation_steps=accumulation_steps, hierarchy=hierarchy, path=path,
                         scale_block=scale_block)

    def _validate_group(self, group):
        check_adam_group(group)
        if not isinstance(group["bias_correction"], bool):
            raise TypeError(f"bias_correction must be a bool, got {group['bias_correction']!r}")

    # --- progress ------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return "B" if self.frozen else "A"

    @property
    def compressing(self) -> bool:
        return self.frozen or self.var_interval > 1

    def _stage_code(self):
        return 2 if self.frozen else int(self.var_interval > 1)

    def _needs_average(self, step):
        return not self.frozen and step % self.var_interval == 0

    def _group_lists(self) -> tuple[list[float], list[float]]:
        missing = len(self.param_groups) - len(self._lr_sums)
        if missing > 0:
            self._lr_sums.extend([0.0] * missing)
            self._decays.extend([1.0] * missing)
        return self._lr_sums, self._decays

    def _syncs_now(self) -> bool:
        return self.steps_since_sync + 1 >= self.local_step_interval

    # --- per-layer variance tracking (compressed_opt.variance_tracking) ------------------------
    def _tracking_clock(self, step):
        # v had var_refreshes updates at the freeze; Adam's would have one more each step since
        since = step - self.var_freeze_step
        return since, self.var_refreshes + since, self.var_refreshes

    def _new_layer_rows(self, name, bucket):
        if name == "interval_factor":
            return torch.ones(len(bucket.params), 1, dtype=torch.float64, device=bucket.device)
        return super()._new_layer_rows(name, bucket)

    def _gather(self, bucket, grad, step):
        if not self.leave_gradients_in_place(bucket, grad):  # (phase B's passes read them where they lie)
            self.gather_observed(bucket, grad)

    def _reads_gradients_in_place(self, step) -> bool:
        # phase B: its local step or its synchronisation's passes; phase A: its exchange's clamp(R g_i)
        return self.frozen or self.exchange_variant.phase_a_pass

    def _interval_factors(self, bucket) -> list[float] | None:
        """Phase B: the per-layer factors of this synchronisation interval (set at its first
        step: a sync undoes the interval's local steps and redoes them with one factor)."""
        if not self.variance_tracking:
            return None
        rows = bucket.flats["interval_factor"]
        if self.steps_since_sync == 0:
            rows[:, 0] = torch.tensor(self._layer_factors[bucket.index], dtype=rows.dtype)
        return rows[:, 0].tolist()

    # --- the step ------------------------------------------------------------------------------
    def _bucket_communicate(self, bucket, group, grad, step):
        """Phase A, a step without variance refresh: ``grad`` becomes the 1-bit compressed average
        of the ranks' gradients (phase B communicates only in ``_local_step``, which needs lr)."""
        if not self.frozen:  # (the update takes the result: exchange_variant.phase_a_update_)
            yield from self._exchange_steps(bucket, grad, keep_result=True)

    def _bucket_step(self, bucket, group, grad, step, averaged):
        if self.frozen:
            self._local_step(bucket, group, grad)
        else:
            self._phase_a_step(bucket, group, grad, step, averaged)

    def _phase_a_step(self, bucket, group, grad, step, refresh):
        if not refresh and self.exchange_variant.phase_a_update_(self, bucket, group, grad, step):
            return
        m, v = bucket.flat("exp_avg"), bucket.flat("exp_avg_sq")
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        # grad is the full-precision average (refresh) or the 1-bit average (_bucket_communicate)
        momentum_(m, grad, beta1)
        if refresh:
            self._observe_averaged_gradient(bucket, grad)
            self.exchange_variant.refresh_variance_(self, bucket, v, grad, beta2)
        _no_variance_no_move_(m, bucket, v, refresh)
        bc1, bc2 = self._phase_a_corrections(group, step, refresh)
        if refresh and self.exchange_variant.phase_a_pass:  # (m / den into grad: free now) kept for the next steps
            direction = grad
            self._phase_a_denominator(bucket, group, math.sqrt(bc2), direction=direction)
        else:
            direction = denominator_(v, grad, eps, math.sqrt(bc2))  # the gradient buffer is free: reuse it
            torch.div(m, direction, out=direction)
        if wd != 0:
            torch._foreach_mul_(bucket.params, 1 - lr * wd)
        torch._foreach_add_(bucket.params, bucket.views(direction), alpha=-lr / bc1)

    def _end_step(self, step):
        if self.frozen:
            self._end_local_step()
            return
        refreshed = step % self.var_interval == 0
        self.last_step_kind = "refresh" if refreshed else "compressed"
        if refreshed:
            for b in self._buckets:  # v changed: so may the exchange's factors
                self.exchange_variant.after_refresh(self, b)
            self.var_refreshes += 1
            self.var_counter += 1
            if self.var_counter >= self.var_update_scaler:
                self.var_counter = 0
                self.var_interval *= 2
        if self.freeze_rule is None:
            freeze = step >= self.var_freeze_step
        elif step >= self.freeze_rule.max_step:
            freeze = True
        elif refreshed:
            freeze = self._auto_decision(step)
        else:
            freeze = False
        if freeze:
            self._freeze(step)

    def rank_parameters(self):
        """Between synchronisations each rank's parameters are its own (its local steps)."""
        return self.frozen and self.steps_since_sync > 0

    def _end_local_step(self):
        lr_sums, decays = self._group_lists()
        if self._syncs_now():
            self.last_step_kind = "sync"
            self.steps_since_sync = 0
            lr_sums[:] = [0.0] * len(lr_sums)
            decays[:] = [1.0] * len(decays)
        else:
            self.last_step_kind = "local"
            self.steps_since_sync += 1
            for i, group in enumerate(self.param_groups):
                lr = float(group["lr"])
                lr_sums[i] += lr
                decays[i] *= 1 - lr * group["weight_decay"]
        self.local_step_counter += 1
        if self.local_step_counter >= self.local_step_scaler:
            self.local_step_counter = 0
            self.local_step_interval = min(2 * self.local_step_interval, self.local_step_clipper)

    # --- phase A -> phase B --------------------------------------------------------------------
    def _mean_variance(self) -> float:
        """Mean over all elements of the bias-corrected variance (what the auto rule watches)."""
        total = numel = 0.0
        for b in self._buckets:
            beta2 = self.param_groups[b.group_index]["betas"][1]
            total += float(b.flat("exp_avg_sq").sum()) / (1.0 - beta2**self.var_refreshes)
            numel += b.numel
        return total / max(numel, 1.0)

    def _auto_decision(self, step) -> bool:
        return self.rank0_decides(self.freeze_rule.observe(step, self._mean_variance()))

    def _freeze(self, step):
        for b in self._buckets:
            self._start_variance_tracking(b, b.flat("exp_avg_sq"))  # (raw v)
            group = self.param_groups[b.group_index]
            if group["bias_correction"]:
                beta1, beta2 = group["betas"]
                b.flat("exp_avg").div_(1.0 - beta1**step)
                b.flat("exp_avg_sq").div_(1.0 - beta2**self.var_refreshes)
            b.flat("momentum_accumulator").zero_()
            torch._foreach_copy_(b.views(b.flat("sync_params")), b.params)
            b.derived.pop("phase_a_denominator", None)
        self.reset_error_buffers()
        for b in self._buckets:  # from the frozen v: the typical size of each layer's momentum
            self.exchange_variant.at_freeze(self, b)
        self.frozen = True
        self.var_freeze_step = step
        self.steps_since_sync = 0
        self.local_step_interval = 1
        self.local_step_counter = 0
        self._lr_sums = [0.0] * len(self.param_groups)
        self._decays = [1.0] * len(self.param_groups)
        logger.info(
            "%s: variance frozen at the end of step %d (%d refreshes, var_interval %d); local steps start",
            type(self).__name__, step, self.var_refreshes, self.var_interval,
        )

    def _new_state(self, param, name, view):
        if name == "sync_params" and self.frozen:  # a parameter added in phase B starts from itself
            view.copy_(param)

    # --- checkpoints and rank agreement --------------------------------------------------------
    def _extra_state(self):
        lr_sums, decays = self._group_lists()
        return {
            "frozen": self.frozen,
            "var_freeze_step": self.var_freeze_step,
            "freeze_rule": None if self.freeze_rule is None else self.freeze_rule.state_dict(),
            "var_interval": self.var_interval,
            "var_counter": self.var_counter,
            "var_refreshes": self.var_refreshes,
            "local_step_interval": self.local_step_interval,
            "local_step_counter": self.local_step_counter,
            "steps_since_sync": self.steps_since_sync,
            "lr_sums": list(lr_sums),
            "decays": list(decays),
            "last_step_kind": self.last_step_kind,
            "exchange": self.exchange_variant.name,
            "variance_tracking": self.variance_tracking,
        }

    def _load_extra_state(self, extra):
        self._load_tracking_of(extra)
        # checkpoints from before the preconditioned exchange carry no "exchange": the paper's
        saved = extra.get("exchange", "momentum")
        if saved != self.exchange_variant.name and int(extra.get("global_step", 0)) > 0:
            raise ValueError(
                f"this checkpoint was saved by ZeroOneAdam(exchange={saved!r}); its error-feedback buffers hold "
                f"errors of that exchange, not of exchange={self.exchange_variant.name!r}. Resume it with "
                f"ZeroOneAdam(..., exchange={saved!r})"
            )
        self.frozen = bool(extra["frozen"])
        self.var_freeze_step = extra["var_freeze_step"]
        self.freeze_rule = restore_rule(self.freeze_rule, extra.get("freeze_rule"))
        for name in ("var_interval", "var_counter", "var_refreshes", "local_step_interval",
                     "local_step_counter", "steps_since_sync"):
            setattr(self, name, int(extra[name]))
        self._lr_sums = [float(x) for x in extra["lr_sums"]]
        self._decays = [float(x) for x in extra["decays"]]
        self.last_step_kind = extra.get("last_step_kind")

    def _last_warmup_step(self):
        return self.var_freeze_step

    def _schedule(self):
        end = ("until the variance settles (var_freeze_step='auto')" if self.var_freeze_step is None
               else f"through step {self.var_freeze_step}")
        return (f"variance refreshes at full precision at doubling intervals with 1-bit steps between them {end}, "
                "then local steps with 1-bit synchronisations")

    def _extra_signature(self):
        rule = None if self.freeze_rule is None else self.freeze_rule.state_dict()
        return (
            self._configured_freeze,
            rule and (rule["window"], rule["rtol"], rule["min_step"], rule["max_step"]),
            self.var_update_scaler,
            self.local_step_scaler,
            self.local_step_clipper,
            self.exchange_variant.name,
            self.variance_tracking,
        )
