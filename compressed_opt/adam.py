"""1-bit Adam's algorithm (Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training
with Adam's Convergence Speed", ICML 2021): Adam's formulas, each written once, and 1-bit Adam as
per-bucket transforms of typed state, the client of the sync engine. The optimizer that composes
it with param groups and the engine is :class:`compressed_opt.onebit_adam.OnebitAdam`.

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
moves it by up to ``lr * scale / eps`` per step. Since ``v_f`` is the same on every rank, the
average commutes with any fixed per-coordinate factor, so we exchange the *preconditioned*
momentum instead::

    R = c_l / sqrt(v_f)                   per coordinate, fixed from the freeze on (0 where v_f == 0)
    y = compressed_allreduce(clip(s_l R m_i, +-K c_l))    (error feedback in this space)
    m = y / (s_l R);   p <- p (1 - lr wd) - lr (f_l / s_l) (y / (c_l + eps R)) / (1 - b1^t)

``c_l = mean_k s_k / s_l`` (``s_l``: the RMS of layer ``l``'s ``m / sqrt(v_f)`` at the first
compressed step, the same on every rank, kept in ``state[p]["scaling_coeff"]``;
:mod:`compressed_opt.scaling`). ``f_l`` is the layer's variance-tracking factor
(:mod:`compressed_opt.variance_tracking`), and ``s_l`` its value of the last update, applied before
the exchange (docs/design.md 2.3.3; 1 without tracking): every layer reaches the compressor at the
size of its step. The clip ``K`` (:data:`COMPRESSED_STEP_BOUND`, 1.25) keeps any coordinate from
stepping further than ``K lr``. ``exchange="momentum"`` is the paper's exchange.

Beyond the paper: a coordinate whose frozen variance is exactly 0 (it never received a gradient in
warmup) is not moved by the momentum in the compression stage: 1-bit compression sends it
``+-scale`` like every other coordinate, and ``scale / eps`` would blow it up; its denominator is
``inf``.

The pieces, each a transform of a bucket's typed state (:class:`AdamBuffers`), which 1-bit LAMB
composes too: Adam's formulas (written once, here), :class:`FreezeSchedule` (when the warmup ends),
:class:`Preconditioned` and :class:`Momentum` (what the exchange carries, chosen by ``exchange=``),
:class:`compressed_opt.variance_tracking.VarianceTracking` and, with ``zero_stage`` 1 or 2, ZeRO's
shards (:mod:`compressed_opt.zero`). :class:`AdamAlgorithm` is the engine's client that composes
them (ZeRO's shards handed to it by the optimizer). ``bias_correction=False`` reproduces DeepSpeed's update.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field

import torch

from compressed_opt import cuda as kernels

from . import scaling
from . import variance_tracking as tracking
from .exchange import Request
from .freeze import VarianceStabilityRule, resolve_rule, restore_rule
from .optimizer import Algorithm
from .state import DERIVED, SCRATCH, STATE, STEP, buffer, names
from .validation import check_adam_group, check_choice, check_step_count

logger = logging.getLogger("compressed_opt")

#: ``freeze_step``'s default: long enough to be safe for a long run, so a shorter run never
#: compresses (rank 0 says so at the first step; docs/guarantees.md: "Visible")
DEFAULT_FREEZE_STEP = 100_000

# --- Adam's formulas, each written once (1-bit LAMB, 0/1 Adam and ZeRO's shards take them from here) ---
#: The compression stage's bound on a coordinate's step ``|m / sqrt(v_f)|`` times its tracking
#: factor, in units of ``lr`` (OnebitAdam, 0/1 Adam; times ``c_l`` on the exchanged values). Adam's
#: step is 1 for a gradient that keeps its sign and size, and up to :func:`spike_bound` (3.16) for a
#: while after a rise, until ``v`` catches up, which a frozen ``v_f`` never does. 1.25 is measured
#: (docs/benchmarks.md, "The step bound").
COMPRESSED_STEP_BOUND = 1.25
#: 0/1 Adam's bound on a local gradient's ``|g_i / sqrt(v_hat)|`` in its phase-A 1-bit exchange:
#: one coordinate's outlier would set the scale of its whole block (docs/design.md 2.5).
PRECONDITIONED_GRADIENT_BOUND = 3.0


def spike_bound(beta1: float, beta2: float) -> float:
    """``max(1, (1 - b1) / sqrt(1 - b2))``: the largest ``|m / sqrt(v)|`` one gradient spike gives
    Adam (3.16 at the default betas)."""
    return max(1.0, (1 - beta1) / math.sqrt(1 - beta2))


def momentum_(m: torch.Tensor, g: torch.Tensor, beta1: float) -> None:
    """``m = b1 m + (1 - b1) g``."""
    m.lerp_(g, 1 - beta1)


def variance_(v: torch.Tensor, g: torch.Tensor, beta2: float) -> None:
    """``v = b2 v + (1 - b2) g^2``."""
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)


def bias_corrections(beta1: float, beta2: float, step: int, enabled: bool) -> tuple[float, float]:
    """``(1 - beta1^t, sqrt(1 - beta2^t))``, or ``(1, 1)`` without bias correction."""
    if not enabled:
        return 1.0, 1.0
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)


def denominator_(v: torch.Tensor, out: torch.Tensor, eps: float, bc2_sqrt: float = 1.0) -> torch.Tensor:
    """``sqrt(v) / bc2_sqrt + eps`` into ``out`` (``bc2_sqrt``: the square root of ``v``'s bias
    correction)."""
    torch.sqrt(v, out=out)
    if bc2_sqrt != 1.0:
        out.div_(bc2_sqrt)
    return out.add_(eps)


def frozen_denominator_of(v: torch.Tensor, group: dict, freeze_step: int) -> torch.Tensor:
    """``sqrt(v / (1 - b2^freeze_step)) + eps`` (a new tensor), ``inf`` where ``v == 0``: the
    compression stage's divisor; an infinite one keeps a coordinate without variance in place."""
    _, bc2_sqrt = bias_corrections(*group["betas"], freeze_step, group["bias_correction"])
    return torch.sqrt(v).div_(bc2_sqrt).add_(group["eps"]).masked_fill_(v == 0, float("inf"))


def preconditioned_denominator(r: torch.Tensor, split, coeffs: list[float], eps: float) -> torch.Tensor:
    """``sqrt(v_f) + eps`` made from ``R = c_l / sqrt(v_f)`` (ZeRO keeps only ``R``): ``(1 / R) c_l +
    eps``, ``inf`` where ``R == 0``; ``split`` gives a flat tensor's per-layer views."""
    denom = torch.reciprocal(r)
    if any(c != 1.0 for c in coeffs):
        torch._foreach_mul_(split(denom), list(coeffs))
    return denom.add_(eps)


def descend_(params: list[torch.Tensor], directions: list[torch.Tensor], decay: float, alpha: float) -> None:
    """``p = p decay + alpha d`` for each parameter and its direction (no multiplication where
    ``decay`` is 1: no weight decay)."""
    if decay != 1.0:
        torch._foreach_mul_(params, decay)
    torch._foreach_add_(params, directions, alpha=alpha)


def adam_bound(betas) -> float:
    """1-bit Adam's ``K``: :data:`COMPRESSED_STEP_BOUND`, whatever the betas."""
    return COMPRESSED_STEP_BOUND


# --- the state ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class AdamBuffers:
    """A bucket's Adam state where every rank holds it whole (``zero_stage=0``)."""

    exp_avg: torch.Tensor | None = buffer(STATE)  # m
    exp_avg_sq: torch.Tensor | None = buffer(STATE)  # v (frozen: v_f)
    #: sqrt(v_f) + eps (inf where v_f == 0): the momentum exchange's divisor, 1-bit LAMB's
    frozen_denominator: torch.Tensor | None = buffer(DERIVED)
    #: R = c_l / sqrt(v_f), the preconditioned exchange's factor (0 where v_f == 0)
    preconditioner: torch.Tensor | None = buffer(DERIVED)
    #: the indices where v_f == 0 (usually none)
    no_variance: torch.Tensor | None = buffer(DERIVED, torch.int64)
    #: fused AdamW's step count (a 0-dim tensor on the bucket's device)
    step_count: torch.Tensor | None = buffer(SCRATCH)


@dataclass(eq=False)
class AdamBucket:
    """A bucket's 1-bit Adam state: its moments (:class:`AdamBuffers`, or ZeRO's
    :class:`compressed_opt.zero.Shards`), its tracking (``None`` without), and per layer the dicts of
    ``optimizer.state[p]`` that hold its numbers (``scaling_coeff``, ``exchange_factor``)."""

    buffers: object
    tracked: tracking.TrackedLayers | None
    states: list = field(repr=False)
    #: per layer, the preconditioned exchange's ``c_l`` and bounds ``K c_l`` (made with ``R``), and
    #: the betas the bounds are of
    coefficients: list | None = buffer(DERIVED)
    bounds: list | None = buffer(DERIVED)
    bounds_of: tuple | None = buffer(DERIVED)
    #: ``s_l``, per layer, of this step's exchange (the tracked exchange; docs/design.md 2.3.3)
    exchange_factors: list | None = buffer(STEP)
    #: the error buffers hold errors of ``s_l = 1`` (a checkpoint of format 2): carried over at the next exchange
    unit_errors: bool = False


@dataclass
class FreezeSchedule:
    """When the warmup ends: at ``freeze_step``, or, with a ``rule`` (``freeze_step="auto"``), when
    the variance has stabilised (rank 0 decides, every rank follows)."""

    freeze_step: int | None
    rule: VarianceStabilityRule | None
    frozen: bool = False

    @classmethod
    def of(cls, freeze_step) -> FreezeSchedule:
        if not isinstance(freeze_step, VarianceStabilityRule):
            freeze_step = check_step_count("freeze_step", freeze_step, allow_auto=True, minimum=1)
        rule = resolve_rule(freeze_step)
        return cls(None if rule is not None else freeze_step, rule)

    def fields(self) -> dict:
        return {"frozen": self.frozen, "freeze_step": self.freeze_step,
                "freeze_rule": None if self.rule is None else self.rule.state_dict()}

    def load(self, extra: dict) -> None:
        self.frozen = bool(extra["frozen"])
        self.freeze_step = extra["freeze_step"]
        self.rule = restore_rule(self.rule, extra.get("freeze_rule"))

    def signature(self) -> tuple:
        rule = None if self.rule is None else self.rule.state_dict()
        return self.freeze_step, rule and (rule["window"], rule["rtol"], rule["min_step"], rule["max_step"])


# --- what the compression stage's 1-bit exchange carries --------------------------------------------------
class Preconditioned:
    """The preconditioned exchange (the default): ``clip(s_l R m_i, +-K c_l)`` goes out, ``m = y /
    (s_l R)`` comes back (see the module doc). ``bound(betas)`` is ``K``. Its state is the bucket's:
    ``R`` and the indices without variance in the buffers, ``c_l`` in ``state[p]["scaling_coeff"]``."""

    name = "preconditioned"
    preconditioned = True

    def __init__(self, bound):
        self.bound = bound  # (a module-level function: copies and pickles carry it)

    def preconditioner(self, st: AdamBucket, bucket, eps: float, denominator, momentum) -> torch.Tensor:
        """``R = c_l / sqrt(v_f)`` per element (0 where ``v_f == 0``), made at the first compressed
        exchange from ``v_f`` (``denominator()``: ``sqrt(v_f) + eps``, ``inf`` where ``v_f == 0``)
        and the momentum (``momentum()``, whole), both the same on every rank; after a load, from
        ``v_f`` and the saved ``c_l``."""
        buffers = st.buffers
        r = buffers.preconditioner
        if r is None:
            denom = denominator()
            # sqrt(v_f), from the denominator (inf where v_f == 0); floored where it sank below
            # eps's rounding (R and A only need to agree with each other)
            root = torch.sub(denom, eps).clamp_(min=eps * 2.0**-20)
            r = torch.reciprocal(root)  # 0 where v_f == 0
            if any("scaling_coeff" not in s for s in st.states):
                m = momentum()
                if m is None:
                    raise RuntimeError("the exchange's scaling coefficients are missing from the state of a "
                                       "checkpoint saved in the compression stage")
                for s, c in zip(st.states, scaling.coefficients_of(bucket.views(torch.mul(m, r)))):
                    s["scaling_coeff"] = c
            st.coefficients = st.bounds = None  # (made again from the state's c_l)
            scaling.scale_(bucket.views(r), self.coefficients(st))
            buffers.preconditioner = r
        return r

    @staticmethod
    def coefficients(st: AdamBucket) -> list[float]:
        """Per layer, ``c_l`` (kept in the bucket's state once ``R`` is made)."""
        if st.coefficients is None:
            st.coefficients = [s["scaling_coeff"] for s in st.states]
        return st.coefficients

    def bounds(self, st: AdamBucket, betas) -> list[float]:
        """Per layer, ``K c_l``: no coordinate steps further than ``K lr`` (kept in the bucket's state
        while the betas stay)."""
        if st.bounds is None or st.bounds_of != betas:
            k = self.bound(betas)
            st.bounds, st.bounds_of = [k * c for c in self.coefficients(st)], betas
        return st.bounds

    def no_variance(self, st: AdamBucket) -> torch.Tensor:
        """The indices where ``v_f == 0`` (``R == 0``): ``m = y / R`` is 0 / 0 there, set to 0."""
        buffers = st.buffers
        if buffers.no_variance is None:
            buffers.no_variance = torch.nonzero(buffers.preconditioner == 0).view(-1)
        return buffers.no_variance

    def momentum_from_exchange(self, st: AdamBucket, bucket, y: torch.Tensor, out: torch.Tensor) -> None:
        """``m = y / (s_l R)`` into ``out`` (0 where ``v_f == 0``)."""
        n, factors = bucket.numel, st.exchange_factors
        segments = (bucket.segments, factors) if factors is not None else ()
        kernels.divide_where_nonzero_(y[:n], st.buffers.preconditioner[:n], out[:n], self.no_variance(st), *segments)


class Momentum:
    """The paper's exchange: ``m_i`` itself (``coefficients``: 1-bit LAMB's per-layer ``c_l m_i``,
    ``c_l = mean_k RMS(m_k) / RMS(m_l)`` set from the momentum at the first compression step)."""

    name = "momentum"
    preconditioned = False

    def __init__(self, layer_coefficients: bool = False):
        self.layer_coefficients = layer_coefficients

    def preconditioner(self, st, bucket, eps, denominator, momentum) -> None:
        return None

    def coefficients(self, st: AdamBucket) -> list[float] | None:
        """The per-layer ``c_l`` (``None`` for 1-bit Adam's, which has none)."""
        if not self.layer_coefficients:
            return None
        return [s["scaling_coeff"] for s in st.states]

    def momentum_from_exchange(self, st: AdamBucket, bucket, y: torch.Tensor, out: torch.Tensor) -> None:
        """``m = y / c_l`` into ``out`` (no ``c_l``: ``m = y``)."""
        n = bucket.numel
        if out is not y:
            out[:n].copy_(y[:n])
        coeffs = self.coefficients(st)
        if coeffs is not None:
            scaling.unscale_(bucket.views(out), coeffs)


def choose_exchange(name, variants: dict):
    """The exchange called ``name`` (the ``exchange=`` argument) of ``variants`` (name -> maker)."""
    check_choice("exchange", name, tuple(variants))
    return variants[name]()


# --- the algorithm -----------------------------------------------------------------------------------------
class AdamAlgorithm(Algorithm):
    """1-bit Adam's steps (see the module doc): the engine's client and the update, composed of the
    freeze schedule, the exchange, the variance tracking and, under ZeRO, the shards (``zero``)."""

    def __init__(self, name: str, freeze_step, exchange: str, variance_tracking: bool, zero=None):
        super().__init__(name)
        self.exchange = choose_exchange(exchange, {"preconditioned": lambda: Preconditioned(adam_bound),
                                                   "momentum": Momentum})
        if not isinstance(variance_tracking, bool):
            raise TypeError(f"variance_tracking must be True or False, got {variance_tracking!r}")
        self.schedule_ = FreezeSchedule.of(freeze_step)
        self.tracking = tracking.VarianceTracking(self._clock) if variance_tracking else None
        #: ZeRO's shards (:class:`compressed_opt.zero.Sharding`, made by the optimizer), or ``None``
        self.zero = zero
        self.zero_stage = zero.stage if zero is not None else 0

    def validate_group(self, group):
        check_adam_group(group)

    @property
    def observes_square_sums(self) -> bool:
        return self.tracking is not None

    def bind(self, param_groups, state, engine) -> None:
        super().bind(param_groups, state, engine)
        if engine is not None and self.zero is not None:
            self.zero.bind(engine)

    def tensor_names(self) -> tuple[str, ...]:
        return () if self.zero is not None else names(AdamBuffers, STATE)

    # --- progress ---------------------------------------------------------------------------------
    def full_precision(self, step: int) -> bool:
        return not self.compressing

    @property
    def last_warmup_step(self):
        return self.schedule_.freeze_step

    def warmup_at_default(self) -> bool:
        return self.schedule_.rule is None and self.schedule_.freeze_step == DEFAULT_FREEZE_STEP

    def _clock(self, step: int) -> tuple[int, int, int]:
        freeze = self.schedule_.freeze_step
        return step - freeze, step, freeze

    def signature(self):
        return (*self.schedule_.signature(), self.exchange.name, self.tracking is not None)

    # --- buckets --------------------------------------------------------------------------------------
    def new_bucket_state(self, bucket) -> AdamBucket:
        buffers = self.zero.shards(bucket) if self.zero is not None else AdamBuffers()
        tracked = self.tracking.layers(bucket) if self.tracking is not None else None
        return AdamBucket(buffers, tracked, [self.state[p] for p in bucket.params])

    def layer_state(self) -> dict[str, int]:
        return {"layer_variance": len(tracking.COLUMNS)} if self.tracking is not None else {}

    def check_rebuild(self) -> None:
        if self.zero is not None:
            self.zero.check_rebuild(self.engine.global_step)

    def checkpoint_problem(self, rank, world, consolidated):
        return None if self.zero is None else self.zero.checkpoint_problem(self.engine.backend, rank, world,
                                                                          consolidated)

    def check_ddp(self) -> None:
        if self.zero is not None:
            self.zero.check_ddp()

    def frozen_denominator(self, bucket) -> torch.Tensor:
        """``sqrt(v_f) + eps`` of the bucket (``inf`` where ``v_f == 0``), made once at the freeze (or
        after a checkpoint load) from ``exp_avg_sq`` and the freeze step (ZeRO: gathered at the
        freeze, then made for one step at a time from ``R``)."""
        st, group = bucket.state, self.param_groups[bucket.group_index]
        if self.zero is not None:
            return self.zero.frozen_denominator(bucket, st, group)
        buffers = st.buffers
        if buffers.frozen_denominator is None:
            buffers.frozen_denominator = frozen_denominator_of(buffers.exp_avg_sq, group, self.schedule_.freeze_step)
        return buffers.frozen_denominator

    def preconditioner(self, bucket) -> torch.Tensor | None:
        """The exchange's ``R`` of the bucket (``None``: the momentum exchange), made at first use."""
        st = bucket.state
        r = st.buffers.preconditioner
        if r is not None or not self.exchange.preconditioned:
            return r
        r = self.exchange.preconditioner(st, bucket, self.param_groups[bucket.group_index]["eps"],
                                         lambda: self.frozen_denominator(bucket), lambda: st.buffers.exp_avg)
        if self.zero is not None or not self.keeps_denominator:  # (A y: a division in the update's pass;
            st.buffers.frozen_denominator = None  # ZeRO makes sqrt(v_f) + eps from R for a step that needs it)
        return r

    #: whether the compression stage still divides by ``sqrt(v_f) + eps`` itself (1-bit LAMB's factor does)
    keeps_denominator = False

    # --- warmup ------------------------------------------------------------------------------------------
    def _warmup(self, bucket, group, step: int) -> None:
        """AdamW on the averaged gradient, over the part of the bucket this rank holds: torch's fused
        AdamW kernel (``torch._fused_adamw_``, what ``torch.optim.AdamW(fused=True)`` runs) where it
        applies (fp32 gradients on a CPU or CUDA device, bias correction on: the kernel always
        corrects), else composed; the same AdamW, rounded as the kernel or the composition rounds it."""
        st, grad = bucket.state, bucket.sync.padded[: bucket.numel]
        if self.tracking is not None:
            self.tracking.observe_update(bucket, st.tracked, grad, step)
        beta1, beta2 = group["betas"]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]  # lr: a float or a 1-element tensor
        fused = getattr(torch, "_fused_adamw_", None)
        if (fused is not None and group["bias_correction"] and bucket.params and grad.device.type in ("cpu", "cuda")):
            count = st.buffers.step_count
            if count is None or count.device != grad.device:
                count = st.buffers.step_count = torch.zeros((), dtype=torch.float32, device=grad.device)
            count.fill_(float(step))
            hp = dict(lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False, maximize=False,
                      grad_scale=None, found_inf=None)

            def kernel(p, g, m, v):
                fused(p, g, m, v, [], [count] * len(p), **hp)

            if self.zero is not None:
                self.zero.adamw_(bucket, st.buffers, kernel)
                return
            if all(kernels.plain_memory(p) and p.dtype is torch.float32 and p.device == grad.device
                   for p in bucket.params):
                kernel(bucket.params, bucket.sync.views, [s["exp_avg"] for s in st.states],
                       [s["exp_avg_sq"] for s in st.states])
                return
        bc1, bc2_sqrt = bias_corrections(beta1, beta2, step, group["bias_correction"])
        if self.zero is not None:
            self.zero.adam_(bucket, st.buffers, beta1, beta2, eps, bc2_sqrt, 1 - lr * wd, -lr / bc1)
            return
        m, v = st.buffers.exp_avg, st.buffers.exp_avg_sq
        momentum_(m, grad, beta1)
        variance_(v, grad, beta2)
        torch.div(m, denominator_(v, grad, eps, bc2_sqrt), out=grad)  # (the direction, in the gradient's place)
        values = kernels.Destinations.of(bucket.params, bucket.segments.sizes) or bucket.params
        descend_(values, bucket.sync.views, 1 - lr * wd, -lr / bc1)

    def statistics(self, step: int, buckets: list) -> torch.Tensor:
        if self.tracking is None:
            return torch.zeros(0, dtype=torch.float64)
        return self.tracking.statistics(buckets, step, self.compressing, not self.compressing, self.engine.param_index)

    # --- the freeze -----------------------------------------------------------------------------------
    def end_step(self, step: int, took: bool) -> None:
        for b in self.engine._buckets or ():
            st = b.state
            st.exchange_factors = None  # (STEP)
            if st.tracked is not None:
                st.tracked.mean = st.tracked.warmup_local = None
        if took and not self.compressing:
            rule = self.schedule_.rule
            if step >= self.schedule_.freeze_step if rule is None else self._auto_decision(step):
                self._freeze(step)

    def _auto_decision(self, step: int) -> bool:
        """The auto rule's decision at ``step``, rank 0's on every rank: it watches the mean of
        ``v_hat`` over every element (each rank sums the variance it holds, ZeRO: its chunks; one
        all-gather of two floats adds them up in rank order; a layer split over a mesh, FSDP's or
        tensor parallelism's: summed over its ranks, so every shard of the model decides alike)."""
        total = numel = 0.0
        shards = self.engine.local_shards
        for b in self.engine.buckets:
            group = self.param_groups[b.group_index]
            _, bc2 = bias_corrections(*group["betas"], step, group["bias_correction"])
            v = b.state.buffers.exp_avg_sq if self.zero is None else self.zero.variance(b)
            part, count = shards.whole_sums(b.params, [float(v.sum()) / (bc2 * bc2), float(v.numel())], v.device)
            total, numel = total + part, numel + count
        if self.zero is not None:
            total, numel = self.zero.sum_over_ranks(self.engine, [total, numel])
        wants = self.schedule_.rule.observe(step, total / max(numel, 1.0))
        return self.engine.agreement.rank0_decides(wants, self.engine.device)

    def _freeze(self, step: int) -> None:
        self.schedule_.frozen = self.compressing = True
        self.stage = 1
        self.schedule_.freeze_step = step
        for b in self.engine.buckets:
            b.feedback.reset()
            b.state.exchange_factors = None
            for s in b.state.states:
                s.pop("exchange_factor", None)
        for b in self.engine.buckets:
            group = self.param_groups[b.group_index]
            v = self.zero.freeze(self.engine, b, group, step) if self.zero is not None else b.state.buffers.exp_avg_sq
            if self.tracking is not None:
                self.tracking.start(b, b.state.tracked, v)
        logger.info("%s: variance frozen at the end of step %d; compression starts", self.name, step)

    # --- the compression stage ---------------------------------------------------------------------------
    def exchange_factors(self, bucket) -> list[float] | None:
        """``s_l``, per layer, what the preconditioned exchange multiplies ``R m_i`` by: the layer's
        variance-tracking factor of the last update (docs/design.md 2.3.3), kept for this step's update
        (``None``: not tracked, or the momentum exchange). Called once per exchange."""
        st = bucket.state
        if self.tracking is None or not self.exchange.preconditioned:
            return None
        s = self.tracking.last_factors(bucket, st.tracked, self.param_groups[bucket.group_index],
                                       self.engine.global_step)
        st.exchange_factors = s
        if st.unit_errors:  # a checkpoint of format 2: errors made with s = 1
            scaling.rescale_errors(bucket, self.engine.exchange.error_ranges(bucket), [1.0] * len(s), s)
            st.unit_errors = False
        return s

    def reads_in_place(self, bucket, step: int, inline: bool, native: bool) -> bool:
        # either exchange's local momentum is a pass inside the compression (LerpScaleClamp, Lerp),
        # which reads p.grad where the exchange runs next (inline); ZeRO's reads them at once else
        return (inline and native) or self.zero is not None

    def outgoing(self, bucket, gradients, step: int) -> Request:
        """Compression stage: the local momentum ``m_i = b1 m + (1 - b1) g_i`` (``clip(s_l R m_i, +-K
        c_l)`` for the preconditioned exchange) as the pass that makes it inside the compression, and
        its 1-bit average, left in its rows for :meth:`update`. Into the gradient buffer: ``m``
        changes only in the update (a skipped step leaves it alone)."""
        st, group = bucket.state, self.param_groups[bucket.group_index]
        beta1 = group["betas"][0]
        r = st.buffers.preconditioner
        if r is None:
            r = self.preconditioner(bucket)
        if self.zero is not None:
            producer = self.zero.local_momentum(self, bucket, gradients, beta1, r)
            return Request(gradients.buffer, bucket.feedback, producer, True, self.engine.exchange.flat, False)
        sources = None if gradients.gathered else gradients.sources
        if r is None:
            producer = bucket.kernels.Lerp(gradients.buffer, st.buffers.exp_avg, 1 - beta1, bucket.segments, sources)
        else:
            producer = bucket.kernels.LerpScaleClamp(gradients.buffer, st.buffers.exp_avg, 1 - beta1, r,
                                                     self.exchange.bounds(st, group["betas"]), bucket.segments,
                                                     self.exchange_factors(bucket), sources)
        return Request(gradients.buffer, bucket.feedback, producer, True, expand=False)

    def update(self, step: int, buckets: list) -> None:
        """Every bucket's update. Warmup: AdamW (:meth:`_warmup`). Compression stage, from this
        step's exchange: with the preconditioned exchange ``m = y / (s_l R)`` and ``p <- p decay +
        alpha (f_l / s_l) y / (c_l + eps R)`` in one pass over memory (``m`` and the direction never
        written apart: ``cuda.divide_descend_``, from the result's rows); with the momentum exchange
        ``m <- y`` and ``p <- p decay + alpha f_l y / (sqrt(v_f) + eps)`` (``cuda.keep_descend_``),
        both else composed (the same bits). ``f_l / s_l`` is this step's tracking factor over the
        exchange's (``f_l`` where the exchange was not tracked; none without tracking)."""
        tracker, frozen = self.tracking, self.compressing
        if tracker is not None:
            tracker.before_update(buckets, step, not frozen, frozen, self.engine.statistics, self.param_groups)
        for b in buckets:
            group = self.param_groups[b.group_index]
            if not frozen:
                self._warmup(b, group, step)
                continue
            st, sync = b.state, b.sync
            beta1, beta2 = group["betas"]
            lr, wd = float(group["lr"]), group["weight_decay"]
            bc1, _ = bias_corrections(beta1, beta2, step, group["bias_correction"])
            decay, alpha = 1 - lr * wd, -lr / bc1
            result = sync.result if sync.result is not None else sync.padded[: b.numel]
            factors, s = (None, None) if tracker is None else (st.tracked.factors, st.exchange_factors)
            if s is not None:
                factors = list(map(operator.truediv, factors, s))
            if self.zero is not None:
                self.zero.update_(self, b, result, decay, alpha, factors, step)
            elif self.exchange.preconditioned:
                descend = kernels.Descend(b.params, float(group["eps"]), st.coefficients,
                                          factors or [1.0] * len(b.params), decay, alpha)
                no_variance = st.buffers.no_variance
                b.kernels.divide_descend_(result, st.buffers.preconditioner, st.buffers.exp_avg, b.segments, s,
                                        descend, no_variance if no_variance is not None else
                                        self.exchange.no_variance(st))
            else:  # m <- y; p <- p decay + alpha f_l y / (sqrt(v_f) + eps)
                b.kernels.keep_descend_(result, self.frozen_denominator(b), st.buffers.exp_avg, factors, b.params,
                                        b.segments, decay, alpha)
            if s is not None:  # (ZeRO's rows are in its units; checkpoints carry it)
                for state, v in zip(st.states, s):
                    state["exchange_factor"] = v

    # --- checkpoints ------------------------------------------------------------------------------------
    def stage_fields(self) -> dict:
        return {**self.schedule_.fields(), "exchange": self.exchange.name,
                "variance_tracking": self.tracking is not None}

    def load_stage(self, extra: dict) -> None:
        tracking.check_checkpoint(self.name, self.tracking is not None, extra)
        # checkpoints from before the preconditioned exchange carry no "exchange": the paper's
        saved = extra.get("exchange", "momentum")
        if extra["frozen"] and saved != self.exchange.name:
            raise ValueError(
                f"this checkpoint was saved in the compression stage of {self.name}(exchange={saved!r}); "
                f"its error-feedback buffers hold errors of that exchange, not of exchange={self.exchange.name!r}. "
                f"Resume it with {self.name}(..., exchange={saved!r})"
            )
        self.schedule_.load(extra)
        self.compressing = self.schedule_.frozen
        self.stage = int(self.compressing)
        #: a compression-stage checkpoint of format 2: its error buffers hold errors of s = 1
        self._unit_errors = bool(extra["frozen"] and extra.get("unit_exchange_factors", False)
                                 and self.tracking is not None)

    def restore_buckets(self, entries: list[dict]) -> None:
        super().restore_buckets(entries)
        if self.__dict__.pop("_unit_errors", False):
            for b in self.engine.buckets:
                b.state.unit_errors = True
