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
after a synchronising step (``optimizer.schedule.last_step_kind == "sync"``), or on one rank.

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
``optimizer.var_freeze_step`` and goes into checkpoints, with every counter of both schedules
(:class:`ZeroOneSchedule`, ``optimizer.schedule``).

The pieces: the exchanges (:class:`PreconditionedExchange01`, :class:`MomentumExchange01`, chosen by
``exchange=``), the variance tracking of phase B (:mod:`compressed_opt.variance_tracking`), and
phase B's local steps and synchronisations (:mod:`compressed_opt.zero_one_local`), composed by
:class:`ZeroOneAlgorithm`, the engine's client; :class:`ZeroOneAdam` is the optimizer.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import DEFAULT_BLOCK

from . import scaling, zero_one_local
from . import variance_tracking as tracking
from .exchange import Request
from .freeze import VarianceStabilityRule, resolve_rule, restore_rule
from .adam import (COMPRESSED_STEP_BOUND, PRECONDITIONED_GRADIENT_BOUND, choose_exchange, denominator_, momentum_,
                   variance_)
from .optimizer import Algorithm, CompressedOptimizer, common_args
from .state import DERIVED, LAYER, SCRATCH, STATE, STEP, buffer, names
from .validation import check_adam_group, check_step_count
from .zero_one_local import no_variance_no_move_

logger = logging.getLogger("compressed_opt")

#: what the last ``step()`` did: full-precision variance refresh, 1-bit gradient average (phase
#: A), local step without communication, or local step + synchronisation (phase B)
STEP_KINDS = ("refresh", "compressed", "local", "sync")


@dataclass(eq=False)
class ZeroOneBuffers:
    """A bucket's 0/1 Adam state (every rank holds it whole: it is not sharded)."""

    exp_avg: torch.Tensor | None = buffer(STATE)  # m
    exp_avg_sq: torch.Tensor | None = buffer(STATE)  # v
    momentum_accumulator: torch.Tensor | None = buffer(STATE)  # acc
    sync_params: torch.Tensor | None = buffer(STATE)  # p_sync
    #: phase B's sqrt(v_hat) + eps (signed: negative where v == 0, as the C passes take it), and the
    #: (v's address and version, eps, signed) it was made from
    frozen_denominator: torch.Tensor | None = buffer(DERIVED)
    denominator_of: tuple | None = buffer(DERIVED)
    #: phase A's sqrt(v) / sqrt(bc2) + eps, signed, fixed between refreshes: ((v, its version, eps, bc2), it)
    phase_a_denominator: tuple | None = buffer(DERIVED)
    preconditioner: torch.Tensor | None = buffer(DERIVED)  # the preconditioned exchange's R
    no_variance: torch.Tensor | None = buffer(SCRATCH, (torch.int64, torch.bool))  # where v == 0: indices, or a mask


@dataclass(eq=False)
class ZeroOneBucket:
    """A bucket's 0/1 Adam state: its buffers, its tracking, the tracking's factor of the current
    synchronisation interval, and per layer the dicts of ``optimizer.state[p]`` (``scaling_coeff``)."""

    buffers: ZeroOneBuffers
    tracked: tracking.TrackedLayers | None
    #: per layer, the tracking's factor of the current synchronisation interval (with tracking)
    interval_factor: torch.Tensor | None = buffer(LAYER, torch.float64)
    states: list = field(default_factory=list, repr=False)
    #: phase B: this step's gradients where they lie (not gathered; the passes read them there)
    sources: list | None = buffer(STEP)


@dataclass
class ZeroOneSchedule:
    """0/1 Adam's progress (checkpointed): its two phases' schedules and where they are."""

    var_update_scaler: int
    local_step_scaler: int
    local_step_clipper: int
    #: the last step of phase A: as given, or (``"auto"``) ``None`` until the rule decides
    var_freeze_step: int | None
    rule: VarianceStabilityRule | None
    configured_freeze: object
    frozen: bool = False  # phase B
    var_interval: int = 1
    var_counter: int = 0  # refreshes since var_interval last doubled
    var_refreshes: int = 0  # refreshes in all: the variance's bias correction
    local_step_interval: int = 1
    local_step_counter: int = 0  # phase-B steps since local_step_interval last doubled
    steps_since_sync: int = 0
    lr_sums: list = field(default_factory=list)  # per param group, over the current interval
    decays: list = field(default_factory=list)  # per param group: prod (1 - lr wd) over the interval
    last_step_kind: str | None = None

    COUNTERS = ("var_interval", "var_counter", "var_refreshes", "local_step_interval", "local_step_counter",
                "steps_since_sync")

    @property
    def phase(self) -> str:
        return "B" if self.frozen else "A"

    def group_lists(self, groups: int) -> tuple[list[float], list[float]]:
        missing = groups - len(self.lr_sums)
        if missing > 0:
            self.lr_sums.extend([0.0] * missing)
            self.decays.extend([1.0] * missing)
        return self.lr_sums, self.decays

    def syncs_now(self) -> bool:
        return self.steps_since_sync + 1 >= self.local_step_interval


# --- the exchanges -------------------------------------------------------------------------------------------
class PreconditionedExchange01:
    """0/1 Adam's default exchange: ``R x_i`` bounded (:meth:`ZeroOneAlgorithm.preconditioner`): phase
    A's gradients times ``R = 1 / sqrt(v_hat)``, phase B's accumulated update times ``R = c_l / sqrt(v_f)``."""

    name = "preconditioned"
    #: phase A's compressed steps run one native pass from the exchange's rows (:meth:`phase_a_update_`)
    phase_a_pass = True

    def request(self, alg, bucket, x, lr_sum, factors, sources=None, keep_rows=False) -> Request:
        """``x`` times ``R``, clipped to the bounds, in one pass (the producer the compression runs,
        fused where it can); ``keep_rows``: phase A's, whose update reads the result's rows."""
        r = alg.preconditioner(bucket)
        bounds = alg.bounds(bucket, lr_sum, factors)
        producer = bucket.kernels.ScaleClamp(x, r, bounds, bucket.segments, sources)
        return Request(x, bucket.feedback, producer, keep_rows, expand=not keep_rows)

    def after(self, alg, bucket, x) -> None:
        """What the result ``x`` is divided by after it: ``R`` (0 / 0 where ``v == 0``: the callers
        zero those coordinates)."""
        x.div_(alg.preconditioner(bucket))

    def sync_plan(self, alg, bucket, lr_sum, factors):
        """Phase B's synchronisation in the C passes: ``(per-layer scales before the exchange, R and
        the per-layer bounds of its clamp(R x), per-layer divisors after it)``."""
        return None, alg.preconditioner(bucket), alg.bounds(bucket, lr_sum, factors), None

    def phase_a_update_(self, alg, bucket, group, grad, step) -> bool:
        """Phase A, a compressed step: the update from the result's 1-bit rows in one native pass
        (``True``: done, ``grad`` untouched), or the averaged gradient ``y / R`` into ``grad``, 0 where
        ``v == 0`` (``y / R`` is 0 / 0 there), and ``False``: the caller composes the update."""
        result, r = bucket.sync.result, alg.preconditioner(bucket)
        if result is not None:
            if alg.phase_a_pass(bucket, group, result, r, step):
                return True
            result.expand_()
        grad.div_(r)
        no_variance_no_move_(grad, bucket.state.buffers, False)
        return False

    def refresh_variance_(self, alg, bucket, v, grad, beta2: float) -> None:
        """A refresh: ``v <- b2 v + (1 - b2) g^2``, a new ``R`` from it, and the error buffers carried
        to the new ``R``."""
        old = alg.preconditioner(bucket)  # (after a load: made from v)
        variance_(v, grad, beta2)
        alg.refresh_preconditioner(bucket, old)

    def after_refresh(self, alg, bucket) -> None:
        """Nothing more: the new ``R`` was made in :meth:`refresh_variance_`."""

    def at_freeze(self, alg, bucket) -> None:
        """Phase B's coefficients from the RMS of ``m / sqrt(v_f)``, and its ``R``."""
        alg.set_freeze_coeffs(bucket)


class MomentumExchange01:
    """The paper's exchanges: each layer scaled by its coefficient ``c_l`` from ``v``."""

    name = "momentum"
    phase_a_pass = False

    def request(self, alg, bucket, x, lr_sum, factors, sources=None, keep_rows=False) -> Request:
        """``x`` times ``c_l`` per layer, then its exchange (the result always into ``x``)."""
        scaling.scale_(bucket.views(x), alg.layer_coeffs(bucket))
        return Request(x, bucket.feedback)

    def after(self, alg, bucket, x) -> None:
        """The result ``x`` divided by ``c_l`` per layer."""
        scaling.unscale_(bucket.views(x), alg.layer_coeffs(bucket))

    def sync_plan(self, alg, bucket, lr_sum, factors):
        """Each layer times ``c_l`` before, divided by it after (``None``, nothing, where every ``c_l`` is 1)."""
        coeffs = alg.layer_coeffs(bucket)
        scaled = coeffs if any(c != 1.0 for c in coeffs) else None
        return scaled, None, None, scaled

    def phase_a_update_(self, alg, bucket, group, grad, step) -> bool:
        """``False``: ``grad`` holds the averaged gradient, its layers' coefficients divided out."""
        self.after(alg, bucket, grad)
        return False

    def refresh_variance_(self, alg, bucket, v, grad, beta2: float) -> None:
        """A refresh: ``v <- b2 v + (1 - b2) g^2``."""
        variance_(v, grad, beta2)

    def after_refresh(self, alg, bucket) -> None:
        """``v`` changed, so do the layers' coefficients (the error buffers move with them)."""
        alg.set_layer_coeffs(bucket)

    def at_freeze(self, alg, bucket) -> None:
        """The layers' coefficients from the frozen ``v``."""
        alg.set_layer_coeffs(bucket)


# --- the algorithm --------------------------------------------------------------------------------------------
class ZeroOneAlgorithm(Algorithm):
    """0/1 Adam's steps (see the module doc): phase A here, phase B's local steps and
    synchronisations in :mod:`compressed_opt.zero_one_local`."""

    #: phase B: each rank's local momentum and accumulated update (between synchronisations)
    rank_state_names = ("exp_avg", "momentum_accumulator")

    def __init__(self, name: str, var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper,
                 exchange: str, variance_tracking: bool):
        super().__init__(name)
        self.exchange = choose_exchange(exchange, {"preconditioned": PreconditionedExchange01,
                                                   "momentum": MomentumExchange01})
        if not isinstance(variance_tracking, bool):
            raise TypeError(f"variance_tracking must be True or False, got {variance_tracking!r}")
        if not isinstance(var_freeze_step, VarianceStabilityRule):
            var_freeze_step = check_step_count("var_freeze_step", var_freeze_step, allow_auto=True, minimum=1)
        rule = resolve_rule(var_freeze_step)
        self.schedule_ = ZeroOneSchedule(
            check_step_count("var_update_scaler", var_update_scaler, minimum=1),
            check_step_count("local_step_scaler", local_step_scaler, minimum=1),
            check_step_count("local_step_clipper", local_step_clipper, minimum=1),
            None if rule is not None else var_freeze_step, rule, "auto" if rule is not None else var_freeze_step)
        self.tracking = tracking.VarianceTracking(self._clock) if variance_tracking else None

    def validate_group(self, group):
        check_adam_group(group)
        if not isinstance(group["bias_correction"], bool):
            raise TypeError(f"bias_correction must be a bool, got {group['bias_correction']!r}")

    @property
    def observes_square_sums(self) -> bool:
        return self.tracking is not None

    # --- progress -------------------------------------------------------------------------------------------
    def _restage(self) -> None:
        """``compressing`` (phase B, or phase A past its first doubling: 1-bit steps) and ``stage``."""
        s = self.schedule_
        self.compressing = s.frozen or s.var_interval > 1
        self.stage = 2 if s.frozen else int(s.var_interval > 1)

    def full_precision(self, step: int) -> bool:
        s = self.schedule_
        return not s.frozen and step % s.var_interval == 0

    @property
    def last_warmup_step(self):
        return self.schedule_.var_freeze_step

    def schedule(self) -> str:
        step = self.schedule_.var_freeze_step
        end = ("until the variance settles (var_freeze_step='auto')" if step is None else f"through step {step}")
        return (f"variance refreshes at full precision at doubling intervals with 1-bit steps between them {end}, "
                "then local steps with 1-bit synchronisations")

    def _clock(self, step: int) -> tuple[int, int, int]:
        # v had var_refreshes updates at the freeze; Adam's would have one more each step since
        s = self.schedule_
        since = step - s.var_freeze_step
        return since, s.var_refreshes + since, s.var_refreshes

    def signature(self):
        s = self.schedule_
        rule = None if s.rule is None else s.rule.state_dict()
        return (s.configured_freeze, rule and (rule["window"], rule["rtol"], rule["min_step"], rule["max_step"]),
                s.var_update_scaler, s.local_step_scaler, s.local_step_clipper, self.exchange.name,
                self.tracking is not None)

    # --- buckets ---------------------------------------------------------------------------------------------
    def new_bucket_state(self, bucket) -> ZeroOneBucket:
        tracked = self.tracking.layers(bucket) if self.tracking is not None else None
        factor = torch.ones(len(bucket.params), 1, dtype=torch.float64, device=bucket.device) if tracked else None
        return ZeroOneBucket(ZeroOneBuffers(), tracked, factor, [self.state[p] for p in bucket.params])

    def tensor_names(self) -> tuple[str, ...]:
        return names(ZeroOneBuffers, STATE)

    def layer_state(self) -> dict[str, int]:
        if self.tracking is None:
            return {}
        return {"layer_variance": len(tracking.COLUMNS), "interval_factor": 1}

    def new_state(self, param, name, view):
        if name == "sync_params" and self.schedule_.frozen:  # a parameter added in phase B starts from itself
            view.copy_(param)

    def rank_parameters(self) -> bool:
        """Between synchronisations each rank's parameters are its own (its local steps)."""
        return self.schedule_.frozen and self.schedule_.steps_since_sync > 0

    def interval_factors(self, bucket) -> list[float] | None:
        """Phase B: the per-layer factors of this synchronisation interval (set at its first step: a
        sync undoes the interval's local steps and redoes them with one factor)."""
        st = bucket.state
        if self.tracking is None:
            return None
        rows = st.interval_factor
        if self.schedule_.steps_since_sync == 0:
            rows[:, 0] = torch.tensor(st.tracked.factors, dtype=rows.dtype)
        return rows[:, 0].tolist()

    # --- the tracking's sums ---------------------------------------------------------------------------------------
    def statistics(self, step: int, buckets: list) -> torch.Tensor:
        if self.tracking is None:
            return torch.zeros(0, dtype=torch.float64)
        return self.tracking.statistics(buckets, step, self.schedule_.frozen, self.full_precision(step),
                                        self.engine.param_index)

    # --- the exchanges' factors --------------------------------------------------------------------------------------
    def layer_coeffs(self, bucket) -> list[float]:
        """The bucket's per-layer coefficients (:mod:`compressed_opt.scaling`), from ``v``."""
        states = bucket.state.states
        if any("scaling_coeff" not in st for st in states):
            self.set_layer_coeffs(bucket)
        return [st["scaling_coeff"] for st in states]

    def set_layer_coeffs(self, bucket) -> None:
        """``c_l = mean_k s_k / s_l`` with ``s_l = sqrt(mean v_l)``: a layer's typical gradient (phase
        A), and of its momentum (phase B). ``v`` is the same on every rank, so are the coefficients.
        Called after every refresh and at the freeze; the error buffers are moved to the new
        coefficients."""
        rms = scaling.rms_from_variance(bucket.views(bucket.state.buffers.exp_avg_sq))
        new = scaling.coefficients(rms, [p.numel() for p in bucket.params])
        states = bucket.state.states
        if all("scaling_coeff" in st for st in states):
            scaling.rescale_errors(bucket, self.engine.exchange.error_ranges(bucket),
                                   [st["scaling_coeff"] for st in states], new)
        for st, c in zip(states, new):
            st["scaling_coeff"] = c

    def preconditioner(self, bucket) -> torch.Tensor:
        """``R`` per element, 0 where ``v == 0``. Phase A: ``1 / sqrt(v_hat)`` (the exchanged gradient
        ``R g_i`` has RMS ~1 in every layer: no coefficients needed), fixed between refreshes. Phase B:
        ``c_l / sqrt(v_f)`` with ``c_l = mean_k s_k / s_l``, ``s_l`` the RMS of ``m / sqrt(v_f)`` over
        layer ``l`` at the freeze (as OnebitAdam's exchange). Made again from ``v`` and the
        coefficients after a load."""
        buffers = bucket.state.buffers
        if buffers.preconditioner is None:
            buffers.preconditioner = self._make_preconditioner(bucket, self.schedule_.var_refreshes)
        return buffers.preconditioner

    def _make_preconditioner(self, bucket, refreshes: int) -> torch.Tensor:
        """``R`` from ``v`` after ``refreshes`` refreshes: ``v`` bias-corrected whatever
        ``bias_correction`` says (an EMA of few refreshes is ``1 - b2^r`` of the mean square it
        estimates, and the bound is relative to the mean square)."""
        v = bucket.state.buffers.exp_avg_sq
        group = self.param_groups[bucket.group_index]
        frozen = self.schedule_.frozen
        corrected = frozen and group["bias_correction"]  # the freeze bias-corrected v
        correction = 1.0 if corrected else 1.0 - group["betas"][1] ** max(refreshes, 1)
        r = torch.sqrt(v).reciprocal_().mul_(math.sqrt(correction)).masked_fill_(v == 0, 0.0)
        if frozen:
            states = bucket.state.states
            if any("scaling_coeff" not in st for st in states):  # parameters added in phase B
                self.set_freeze_coeffs(bucket)
            scaling.scale_(bucket.views(r), [st["scaling_coeff"] for st in states])
        return r

    def bounds(self, bucket, lr_sum: float, factors: list[float] | None) -> list[float]:
        """Per layer, the bound on ``|R x_i|``. Phase A (gradients): :data:`~compressed_opt.onebit_adam.
        PRECONDITIONED_GRADIENT_BOUND` (3; what ``|g_i| / sqrt(v)`` may be, in units of its RMS). Phase B
        (``sum lr m``): ``c_l lr_sum K / f_l``, ``K`` the compression stage's bound on ``|m / sqrt(v_f)|``,
        ``f_l`` the interval's tracking factor (``factors``; ``None``: 1), which multiplies the step."""
        if not self.schedule_.frozen:
            return [PRECONDITIONED_GRADIENT_BOUND] * len(bucket.params)
        k = COMPRESSED_STEP_BOUND * lr_sum
        states = bucket.state.states
        if factors is None:
            return [k * st["scaling_coeff"] for st in states]
        return [k * st["scaling_coeff"] / f for st, f in zip(states, factors)]

    def refresh_preconditioner(self, bucket, old: torch.Tensor) -> None:
        """After a refresh (``v`` changed; ``old``: the ``R`` before it): the new ``R``, and the error
        buffers carried over to it (they hold errors of ``R_old x``: each element times ``R_new / R_old``)."""
        new = bucket.state.buffers.preconditioner = self._make_preconditioner(bucket, self.schedule_.var_refreshes + 1)
        feedback = bucket.feedback
        if feedback.worker_error is None:
            return
        ratio = torch.div(new, old).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        (wlo, whi), (slo, shi) = self.engine.exchange.error_ranges(bucket)
        feedback.worker_error[: whi - wlo].mul_(ratio[wlo:whi])
        feedback.server_error[: shi - slo].mul_(ratio[slo:shi])

    def set_freeze_coeffs(self, bucket) -> None:
        """At the freeze (``m``, ``v`` bias-corrected): phase B's per-layer coefficients from the RMS of
        ``m / sqrt(v_f)``, and its ``R``."""
        buffers = bucket.state.buffers
        # (a per-layer RMS ratio: v's correction cancels)
        preconditioned = torch.sqrt(buffers.exp_avg_sq).reciprocal_().mul_(buffers.exp_avg)
        preconditioned.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        for st, c in zip(bucket.state.states, scaling.coefficients_of(bucket.views(preconditioned))):
            st["scaling_coeff"] = c
        buffers.preconditioner = None

    # --- phase A ------------------------------------------------------------------------------------------------
    def phase_a_corrections(self, group, step: int, refresh: bool) -> tuple[float, float]:
        """Phase A's bias corrections of ``m`` and ``v`` at ``step``, ``(1 - b1^t, 1 - b2^r)``, ``r`` the
        refreshes counting this step's (``(1, 1)`` without bias correction; the module doc)."""
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        return 1.0 - beta1**step, 1.0 - beta2 ** (self.schedule_.var_refreshes + (1 if refresh else 0))

    def phase_a_denominator(self, bucket, group, bc2_sqrt: float, direction: torch.Tensor | None = None):
        """Phase A's denominator ``sqrt(v) / bc2_sqrt + eps`` (PyTorch's), its sign bit set where ``v ==
        0`` (:func:`~compressed_opt.cuda.signed_denominator`): fixed between refreshes, so kept and made
        again where ``v`` or ``eps`` changed. A refresh step makes it (``direction``: its own ``m / den``
        is divided into it first) for the compressed steps after it: the passes it takes anyway, and a
        fill of the few coordinates without variance (``den`` is ``eps`` there) in place of a pass over ``v``."""
        buffers = bucket.state.buffers
        v = buffers.exp_avg_sq
        kept = buffers.phase_a_denominator
        key = (v.data_ptr(), v._version, group["eps"], bc2_sqrt)
        if kept is not None and kept[0] == key and direction is None:
            return kept[1]
        den = kept[1] if kept is not None and kept[1].shape == v.shape else torch.empty_like(v)
        denominator_(v, den, group["eps"], bc2_sqrt)
        zeros = buffers.no_variance  # (a refresh's: v == 0 after it, no_variance_no_move_)
        if direction is None or zeros is None:
            kernels.signed_denominator(v, den)
        else:
            torch.div(buffers.exp_avg, den, out=direction)
            eps = -torch.tensor(group["eps"], dtype=den.dtype)  # (-0.0 where eps is 0: the sign bit)
            if zeros.dtype == torch.bool:
                den.masked_fill_(zeros, eps)
            else:
                den.index_fill_(0, zeros, eps)
        buffers.phase_a_denominator = (key, den)
        return den

    def phase_a_pass(self, bucket, group, result, r, step) -> bool:
        """A compressed step's update in one native pass from the exchange's ``result`` (its 1-bit
        rows; ``r``: the preconditioner it divides by), bit for bit the composition
        (:func:`~compressed_opt.cuda.zero_one_phase_a_update_`); ``False``, nothing done, where it
        cannot run."""
        lr, wd = float(group["lr"]), group["weight_decay"]
        bc1, bc2 = self.phase_a_corrections(group, step, refresh=False)
        sden = self.phase_a_denominator(bucket, group, math.sqrt(bc2))
        dests = kernels.Destinations.of(bucket.params, bucket.segments.sizes) or bucket.params
        return kernels.zero_one_phase_a_update_(dests, result, r, sden, bucket.state.buffers.exp_avg,
                                                bucket.segments, 1 - group["betas"][0], 1 - lr * wd, -lr / bc1)

    def reads_in_place(self, bucket, step: int, inline: bool, native: bool) -> bool:
        # phase B: its local step's or its synchronisation's passes; phase A: its exchange's clamp(R g_i)
        return inline and native and (self.schedule_.frozen or self.exchange.phase_a_pass)

    def outgoing(self, bucket, gradients, step: int) -> Request | None:
        """Phase A, a step without variance refresh: the 1-bit compressed average of the ranks'
        gradients, as the exchange carries it (the update takes the result). Phase B communicates
        only in its update, which needs the learning rate: the gradients where they lie are kept for it."""
        sources = None if gradients.gathered else gradients.sources
        if self.schedule_.frozen:
            bucket.state.sources = sources
            return None
        return self.exchange.request(self, bucket, gradients.buffer, 1.0, None, sources, keep_rows=True)

    def update(self, step: int, buckets: list) -> None:
        engine = self.engine
        s = self.schedule_
        full = self.full_precision(step)
        if self.tracking is not None:
            self.tracking.before_update(buckets, step, full, s.frozen, engine.statistics, self.param_groups)
        for b in buckets:
            group = self.param_groups[b.group_index]
            if s.frozen:
                zero_one_local.local_step(self, b, group)
            else:
                self._phase_a_step(b, group, step, full)

    def _phase_a_step(self, bucket, group, step, refresh):
        grad = bucket.sync.padded[: bucket.numel]
        if not refresh and self.exchange.phase_a_update_(self, bucket, group, grad, step):
            return
        buffers = bucket.state.buffers
        m, v = buffers.exp_avg, buffers.exp_avg_sq
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        # grad is the full-precision average (refresh) or the 1-bit average (outgoing)
        momentum_(m, grad, beta1)
        if refresh:
            if self.tracking is not None:
                self.tracking.observe_update(bucket, bucket.state.tracked, grad, step)
            self.exchange.refresh_variance_(self, bucket, v, grad, beta2)
        no_variance_no_move_(m, buffers, refresh)
        bc1, bc2 = self.phase_a_corrections(group, step, refresh)
        if refresh and self.exchange.phase_a_pass:  # (m / den into grad: free now) kept for the next steps
            direction = grad
            self.phase_a_denominator(bucket, group, math.sqrt(bc2), direction=direction)
        else:
            direction = denominator_(v, grad, eps, math.sqrt(bc2))  # the gradient buffer is free: reuse it
            torch.div(m, direction, out=direction)
        if wd != 0:
            torch._foreach_mul_(bucket.params, 1 - lr * wd)
        torch._foreach_add_(bucket.params, bucket.sync.views, alpha=-lr / bc1)

    def end_step(self, step: int, took: bool) -> None:
        for b in self.engine._buckets or ():
            b.state.sources = None  # (STEP)
            if b.state.tracked is not None:
                b.state.tracked.mean = b.state.tracked.warmup_local = None
        if not took:
            return
        s = self.schedule_
        if s.frozen:
            self._end_local_step()
            return
        self._end_phase_a_step(step)
        self._restage()

    def _end_phase_a_step(self, step: int) -> None:
        s = self.schedule_
        refreshed = step % s.var_interval == 0
        s.last_step_kind = "refresh" if refreshed else "compressed"
        if refreshed:
            for b in self.engine.buckets:  # v changed: so may the exchange's factors
                self.exchange.after_refresh(self, b)
            s.var_refreshes += 1
            s.var_counter += 1
            if s.var_counter >= s.var_update_scaler:
                s.var_counter = 0
                s.var_interval *= 2
        if s.rule is None:
            freeze = step >= s.var_freeze_step
        elif step >= s.rule.max_step:
            freeze = True
        elif refreshed:
            freeze = self._auto_decision(step)
        else:
            freeze = False
        if freeze:
            self._freeze(step)

    def _end_local_step(self):
        s = self.schedule_
        lr_sums, decays = s.group_lists(len(self.param_groups))
        if s.syncs_now():
            s.last_step_kind = "sync"
            s.steps_since_sync = 0
            lr_sums[:] = [0.0] * len(lr_sums)
            decays[:] = [1.0] * len(decays)
        else:
            s.last_step_kind = "local"
            s.steps_since_sync += 1
            for i, group in enumerate(self.param_groups):
                lr = float(group["lr"])
                lr_sums[i] += lr
                decays[i] *= 1 - lr * group["weight_decay"]
        s.local_step_counter += 1
        if s.local_step_counter >= s.local_step_scaler:
            s.local_step_counter = 0
            s.local_step_interval = min(2 * s.local_step_interval, s.local_step_clipper)

    # --- phase A -> phase B -------------------------------------------------------------------------------------
    def _auto_decision(self, step) -> bool:
        """Rank 0's decision, on every rank, from the mean over all elements of the bias-corrected
        variance (what the auto rule watches; a layer split over a mesh summed over its ranks, so
        every shard of the model decides alike)."""
        total = numel = 0.0
        shards = self.engine.local_shards
        for b in self.engine.buckets:
            beta2 = self.param_groups[b.group_index]["betas"][1]
            v = b.state.buffers.exp_avg_sq
            part, count = shards.whole_sums(
                b.params, [float(v.sum()) / (1.0 - beta2**self.schedule_.var_refreshes), float(b.numel)], v.device)
            total, numel = total + part, numel + count
        wants = self.schedule_.rule.observe(step, total / max(numel, 1.0))
        return self.engine.agreement.rank0_decides(wants, self.engine.device)

    def _freeze(self, step):
        s = self.schedule_
        for b in self.engine.buckets:
            buffers = b.state.buffers
            if self.tracking is not None:
                self.tracking.start(b, b.state.tracked, buffers.exp_avg_sq)  # (raw v)
            group = self.param_groups[b.group_index]
            if group["bias_correction"]:
                beta1, beta2 = group["betas"]
                buffers.exp_avg.div_(1.0 - beta1**step)
                buffers.exp_avg_sq.div_(1.0 - beta2**s.var_refreshes)
            buffers.momentum_accumulator.zero_()
            torch._foreach_copy_(b.views(buffers.sync_params), b.params)
            buffers.phase_a_denominator = None
        for b in self.engine.buckets:
            b.feedback.reset()
        for b in self.engine.buckets:  # from the frozen v: the typical size of each layer's momentum
            self.exchange.at_freeze(self, b)
        s.frozen = True
        s.var_freeze_step = step
        s.steps_since_sync = 0
        s.local_step_interval = 1
        s.local_step_counter = 0
        s.lr_sums = [0.0] * len(self.param_groups)
        s.decays = [1.0] * len(self.param_groups)
        logger.info(
            "%s: variance frozen at the end of step %d (%d refreshes, var_interval %d); local steps start",
            self.name, step, s.var_refreshes, s.var_interval,
        )

    # --- checkpoints ----------------------------------------------------------------------------------------------
    def stage_fields(self) -> dict:
        s = self.schedule_
        lr_sums, decays = s.group_lists(len(self.param_groups))
        return {
            "frozen": s.frozen,
            "var_freeze_step": s.var_freeze_step,
            "freeze_rule": None if s.rule is None else s.rule.state_dict(),
            **{name: getattr(s, name) for name in ZeroOneSchedule.COUNTERS},
            "lr_sums": list(lr_sums),
            "decays": list(decays),
            "last_step_kind": s.last_step_kind,
            "exchange": self.exchange.name,
            "variance_tracking": self.tracking is not None,
        }

    def load_stage(self, extra: dict) -> None:
        tracking.check_checkpoint(self.name, self.tracking is not None, extra)
        # checkpoints from before the preconditioned exchange carry no "exchange": the paper's
        saved = extra.get("exchange", "momentum")
        if saved != self.exchange.name and int(extra.get("global_step", 0)) > 0:
            raise ValueError(
                f"this checkpoint was saved by ZeroOneAdam(exchange={saved!r}); its error-feedback buffers hold "
                f"errors of that exchange, not of exchange={self.exchange.name!r}. Resume it with "
                f"ZeroOneAdam(..., exchange={saved!r})"
            )
        s = self.schedule_
        s.frozen = bool(extra["frozen"])
        s.var_freeze_step = extra["var_freeze_step"]
        s.rule = restore_rule(s.rule, extra.get("freeze_rule"))
        for name in ZeroOneSchedule.COUNTERS:
            setattr(s, name, int(extra[name]))
        s.lr_sums = [float(x) for x in extra["lr_sums"]]
        s.decays = [float(x) for x in extra["decays"]]
        s.last_step_kind = extra.get("last_step_kind")
        self._restage()


@common_args
class ZeroOneAdam(CompressedOptimizer):
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
    synchronisation). Progress: ``var_freeze_step``, and in ``schedule`` (:class:`ZeroOneSchedule`)
    the phase (``schedule.phase``: "A"/"B"), what the last step did (``schedule.last_step_kind``:
    "refresh", "compressed", "local" or "sync") and the counters (``var_interval``,
    ``local_step_interval``, ...).

    A bucket is compressed with one scale (its RMS, docs/design.md 2.1); each layer is multiplied by its
    coefficient ``c_l = mean_k s_k / s_l``, ``s_l = sqrt(mean v_l)``, before every 1-bit exchange
    and divided after (:mod:`compressed_opt.scaling`; ``optimizer.state[p]["scaling_coeff"]``),
    so that a layer with small gradients is not drowned in the 1-bit noise of the large ones.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 var_freeze_step=100000, var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16,
                 bias_correction=True, backend=None, bucket_cap_mb=25.0, overlap=True, accumulation_steps=1,
                 zero_stage=0, exchange="preconditioned", variance_tracking=True, hierarchy="auto", path=None,
                 scale_block=DEFAULT_BLOCK):
        if zero_stage != 0 or isinstance(zero_stage, bool):
            raise ValueError(
                f"Invalid zero_stage: {zero_stage!r}. ZeroOneAdam's state is not sharded (only 0 is accepted): "
                "in phase B every rank steps all of its parameters locally, so its momentum, accumulated "
                "update and error buffer are its own, and the frozen denominator and the parameters at the "
                "last synchronisation are needed whole on every rank; sharding them would cost a "
                "full-precision parameter all-gather at every synchronisation. OnebitAdam and OnebitLamb "
                "take zero_stage=1 or 2"
            )
        algorithm = ZeroOneAlgorithm(type(self).__name__, var_freeze_step, var_update_scaler, local_step_scaler,
                                     local_step_clipper, exchange, variance_tracking)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction)
        super().__init__(params, defaults, algorithm, backend=backend, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
                         accumulation_steps=accumulation_steps, hierarchy=hierarchy, path=path,
                         scale_block=scale_block)

    @property
    def schedule(self) -> ZeroOneSchedule:
        """Where 0/1 Adam is: its phase, intervals and counters (checkpointed)."""
        return self._algorithm.schedule_

    @property
    def var_freeze_step(self) -> int | None:
        """The last step of phase A (``None`` with ``var_freeze_step="auto"`` until the rule decides)."""
        return self._algorithm.schedule_.var_freeze_step

