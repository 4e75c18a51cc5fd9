"""0/1 Adam's 1-bit exchanges (Lu et al., ICLR 2023; docs/design.md 2.5): what goes through the
compressed allreduce, and how it comes back.

A part (mixin) of :class:`compressed_opt.ZeroOneAdam`, and its two exchange variants
(:mod:`compressed_opt.exchange_variant`), chosen once by ``exchange=``: with
:class:`ZeroOnePreconditioned` (``"preconditioned"``, the default) every exchange sends its values
preconditioned and bounded: phase A's gradients times
``R = 1 / sqrt(v_hat)`` (fixed between variance refreshes; the error buffers are carried to the
new ``R`` at each refresh), phase B's accumulated update times ``R = c_l / sqrt(v_f)``; with
:class:`ZeroOneMomentum` (``"momentum"``, the paper's) each layer is scaled by its coefficient
``c_l`` (:mod:`compressed_opt.scaling`).
A coordinate whose variance is 0 is never moved by what comes back (:func:`_no_variance_no_move_`).
"""
from __future__ import annotations

import math

import torch

from compressed_opt import cuda as kernels

from . import scaling
from .buckets import param_states
from .exchange_variant import ExchangeVariant
from .moments import COMPRESSED_STEP_BOUND, PRECONDITIONED_GRADIENT_BOUND, denominator_, variance_


# --- the math, on flat buffers -------------------------------------------------------------------
def _no_variance_no_move_(t: torch.Tensor, bucket, v: torch.Tensor, refreshed: bool) -> None:
    """``t = 0`` where ``v == 0``: a coordinate that never had a gradient on a refresh step is
    not moved. 1-bit compression gives it ``+-scale`` like every coordinate, and divided by
    ``eps`` that would blow it up (see OnebitAdam's frozen denominator). Those coordinates change
    only when ``v`` does (refresh steps), so they are kept per bucket between them: as indices
    when they are few (the usual case; ``index_fill_`` then touches only them, where a mask
    would cost a pass over the bucket), as a mask when they are many."""
    zeros = bucket.flats.get("no_variance")
    if zeros is None or refreshed:
        mask = v == 0
        few = int(torch.count_nonzero(mask)) * 16 <= v.numel()  # indices (8 bytes each): at most n/2 bytes
        zeros = bucket.flats["no_variance"] = mask.nonzero().view(-1) if few else mask
    if zeros.dtype == torch.bool:
        t.masked_fill_(zeros, 0.0)
    elif zeros.numel():
        t.index_fill_(0, zeros, 0.0)



class ZeroOneExchange:
    """0/1 Adam's exchanges (see the module docstring)."""

    # --- per-layer scaling of the 1-bit exchanges ------------------------------------------------
    def _layer_coeffs(self, bucket) -> list[float]:
        """The bucket's per-layer coefficients (:mod:`compressed_opt.scaling`), from ``v``."""
        states = [self.state[p] for p in bucket.params]
        if any("scaling_coeff" not in st for st in states):
            self._set_layer_coeffs(bucket)
        return [st["scaling_coeff"] for st in states]

    def _set_layer_coeffs(self, bucket) -> None:
        """``c_l = mean_k s_k / s_l`` with ``s_l = sqrt(mean v_l)``: a layer's typical gradient
        (phase A), and of its momentum (phase B). ``v`` is the same on every rank, so are the
        coefficients. Called after every refresh and at the freeze; the error buffers are moved
        to the new coefficients."""
        rms = scaling.rms_from_variance(bucket.views(bucket.flat("exp_avg_sq")))
        new = scaling.coefficients(rms, [p.numel() for p in bucket.params])
        states = [self.state[p] for p in bucket.params]
        if all("scaling_coeff" in st for st in states):
            scaling.rescale_errors(self, bucket, [st["scaling_coeff"] for st in states], new)
        for st, c in zip(states, new):
            st["scaling_coeff"] = c

    def _exchange(self, bucket, x, lr_sum: float = 1.0, factors: list[float] | None = None) -> None:
        """``x`` <- the 1-bit compressed average of the ranks' ``x``, as the exchange variant
        carries it: preconditioned and bounded (:meth:`_preconditioner`), or each layer scaled by
        its coefficient. ``lr_sum``, ``factors``: phase B's sum of lr over the
        interval and its tracking factors (the bound of ``sum lr m / sqrt(v)``)."""
        self.exchanges.run([self._exchange_steps(bucket, x, lr_sum, factors)])

    def _exchange_steps(self, bucket, x, lr_sum: float = 1.0, factors: list[float] | None = None,
                        keep_result: bool = False):
        """:meth:`_exchange` as a generator that yields its compressed average's request between
        the passes before and after it (phase A's exchange groups run theirs together).
        ``keep_result``: phase A's, whose update takes the result (the variant's ``phase_a_update_``)."""
        return self.exchange_variant.exchange_steps(self, bucket, x, lr_sum, factors, keep_result)

    def _phase_a_corrections(self, group, step: int, refresh: bool) -> tuple[float, float]:
        """Phase A's bias corrections of ``m`` and ``v`` at ``step``, ``(1 - b1^t, 1 - b2^r)``, ``r`` the
        refreshes counting this step's (``(1, 1)`` without bias correction; the module doc of
        :mod:`compressed_opt.zero_one_adam`)."""
        if not group["bias_correction"]:
            return 1.0, 1.0
        beta1, beta2 = group["betas"]
        return 1.0 - beta1**step, 1.0 - beta2 ** (self.var_refreshes + (1 if refresh else 0))

    def _phase_a_denominator(self, bucket, group, bc2_sqrt: float, direction: torch.Tensor | None = None):
        """Phase A's denominator ``sqrt(v) / bc2_sqrt + eps`` (PyTorch's, as :func:`~compressed_opt.
        moments.denominator_` makes it), its sign bit set where ``v == 0`` (the native pass's ``sden``,
        :func:`~compressed_opt.cuda.signed_denominator`): fixed between refreshes, so kept (derived,
        never saved; dropped at the freeze) and made again where ``v`` or ``eps`` changed. A refresh
        step makes it (``direction``: its own ``m / den`` is divided into it first) for the
        compressed steps after it: the passes it takes anyway, and a fill of the few coordinates
        without variance (``den`` is ``eps`` there) in place of a pass over ``v``."""
        v = bucket.flat("exp_avg_sq")
        kept = bucket.derived.get("phase_a_denominator")
        key = (v.data_ptr(), v._version, group["eps"], bc2_sqrt)
        if kept is not None and kept[0] == key and direction is None:
            return kept[1]
        den = kept[1] if kept is not None and kept[1].shape == v.shape else torch.empty_like(v)
        denominator_(v, den, group["eps"], bc2_sqrt)
        zeros = bucket.flats.get("no_variance")  # (a refresh's: v == 0 after it, _no_variance_no_move_)
        if direction is None or zeros is None:
            kernels.signed_denominator(v, den)
        else:
            torch.div(bucket.flat("exp_avg"), den, out=direction)
            eps = -torch.tensor(group["eps"], dtype=den.dtype)  # (-0.0 where eps is 0: the sign bit)
            if zeros.dtype == torch.bool:
                den.masked_fill_(zeros, eps)
            else:
                den.index_fill_(0, zeros, eps)
        bucket.derived["phase_a_denominator"] = (key, den)
        return den

    def _phase_a_pass(self, bucket, group, result, r, step) -> bool:
        """:meth:`_phase_a_step` of a compressed step in one native pass from the exchange's ``result``
        (its 1-bit rows; ``r``: the preconditioner it divides by), bit for bit the composition
        (:func:`~compressed_opt.cuda.zero_one_phase_a_update_`); ``False``, nothing done, where it
        cannot run."""
        lr, wd = float(group["lr"]), group["weight_decay"]
        bc1, bc2 = self._phase_a_corrections(group, step, refresh=False)
        sden = self._phase_a_denominator(bucket, group, math.sqrt(bc2))
        return kernels.zero_one_phase_a_update_(bucket.step_destinations(), result, r, sden, bucket.flat("exp_avg"),
                                                bucket.segments, 1 - group["betas"][0], 1 - lr * wd, -lr / bc1)

    # --- the preconditioned exchange -------------------------------------------------------------
    def _preconditioner(self, bucket) -> torch.Tensor:
        """``R`` per element, 0 where ``v == 0``. Phase A: ``1 / sqrt(v_hat)`` (the exchanged gradient
        ``R g_i`` has RMS ~1 in every layer: no coefficients needed), fixed between refreshes.
        Phase B: ``c_l / sqrt(v_f)`` with ``c_l = mean_k s_k / s_l``, ``s_l`` the RMS of ``m /
        sqrt(v_f)`` over layer ``l`` at the freeze (as OnebitAdam's exchange, :mod:`compressed_opt.
        onebit_adam`). Made again from ``v`` and the coefficients after a load."""
        r = bucket.flats.get("preconditioner")
        if r is None:
            r = bucket.flats["preconditioner"] = self._make_preconditioner(bucket, self.var_refreshes)
        return r

    def _make_preconditioner(self, bucket, refreshes: int) -> torch.Tensor:
        """``R`` from ``v`` after ``refreshes`` refreshes: ``v`` bias-corrected whatever
        ``bias_correction`` says (an EMA of few refreshes is ``1 - b2^r`` of the mean square it
        estimates, and the bound is relative to the mean square)."""
        v = bucket.flat("exp_avg_sq")
        group = self.param_groups[bucket.group_index]
        corrected = self.frozen and group["bias_correction"]  # the freeze bias-corrected v
        correction = 1.0 if corrected else 1.0 - group["betas"][1] ** max(refreshes, 1)
        r = torch.sqrt(v).reciprocal_().mul_(math.sqrt(correction)).masked_fill_(v == 0, 0.0)
        if self.frozen:
            if any("scaling_coeff" not in self.state[p] for p in bucket.params):  # parameters added in phase B
                self._set_freeze_coeffs(bucket)
            scaling.scale_(bucket.views(r), [self.state[p]["scaling_coeff"] for p in bucket.params])
        return r

    def _exchange_bounds(self, bucket, lr_sum: float, factors: list[float] | None) -> list[float]:
        """Per layer, the bound on ``|R x_i|``. Phase A (gradients): :data:`~compressed_opt.moments.
        PRECONDITIONED_GRADIENT_BOUND` (3; what ``|g_i| / sqrt(v)`` may be, in units of its RMS).
        Phase B (``sum lr m``):
        ``c_l lr_sum K / f_l``, ``K`` the compression stage's bound on ``|m / sqrt(v_f)|``
        (:data:`~compressed_opt.moments.COMPRESSED_STEP_BOUND`), ``f_l`` the interval's tracking factor
        (``factors``; ``None``: 1), which multiplies the synchronised step."""
        if not self.frozen:
            return [PRECONDITIONED_GRADIENT_BOUND] * len(bucket.params)
        k = COMPRESSED_STEP_BOUND * lr_sum
        if factors is None:
            return [k * st["scaling_coeff"] for st in param_states(self.state, bucket)]
        return [k * st["scaling_coeff"] / f for st, f in zip(param_states(self.state, bucket), factors)]

    def _refresh_preconditioner(self, bucket, old: torch.Tensor) -> None:
        """After a refresh (``v`` changed; ``old``: the ``R`` before it): the new ``R``, and the
        error buffers carried over to it (they hold errors of ``R_old x``: each element times
        ``R_new / R_old``)."""
        new = bucket.flats["preconditioner"] = self._make_preconditioner(bucket, self.var_refreshes + 1)
        if "worker_error" not in bucket.flats:
            return
        ratio = torch.div(new, old).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        worker_error, server_error = self.error_buffers(bucket)
        (wlo, whi), (slo, shi) = self.error_ranges(bucket)
        worker_error[: whi - wlo].mul_(ratio[wlo:whi])
        server_error[: shi - slo].mul_(ratio[slo:shi])

    def _set_freeze_coeffs(self, bucket) -> None:
        """At the freeze (``m``, ``v`` bias-corrected): phase B's per-layer coefficients from the
        RMS of ``m / sqrt(v_f)``, and its ``R``."""
        # (a per-layer RMS ratio: v's correction cancels)
        preconditioned = torch.sqrt(bucket.flat("exp_avg_sq")).reciprocal_().mul_(bucket.flat("exp_avg"))
        preconditioned.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        for p, c in zip(bucket.params, scaling.coefficients_of(bucket.views(preconditioned))):
            self.state[p]["scaling_coeff"] = c
        bucket.flats.pop("preconditioner", None)


class ZeroOnePreconditioned(ExchangeVariant):
    """0/1 Adam's default exchange: ``R x_i`` bounded, ``R`` :meth:`ZeroOneExchange._preconditioner`."""

    name = "preconditioned"
    #: phase A's compressed steps run one native pass from the exchange's rows (:meth:`phase_a_update_`)
    phase_a_pass = True

    def exchange_steps(self, opt, bucket, x, lr_sum, factors, keep_result=False):
        """``x`` times ``R``, clipped to the bounds, in one pass (not run yet: the request carries it,
        and the compression runs it fused where it can); the request; ``x / R`` (0 / 0 where ``v ==
        0``: the callers zero those coordinates, :meth:`phase_a_update_`). ``keep_result``: the
        result is left where the layout keeps it (its 1-bit rows: ``opt.layout.exchanged``), for
        :meth:`phase_a_update_`."""
        r = opt._preconditioner(bucket)
        bounds = opt._exchange_bounds(bucket, lr_sum, factors)
        sources = bucket.derived.pop("step.gradients_in_place", None) if keep_result else None  # (phase A's)
        pending = kernels.ScaleClamp(x, r, bounds, bucket.segments, sources=sources)
        if keep_result:
            yield from opt.layout.exchange(opt, bucket, x, pending, keep_result=True)
            return
        yield bucket, x, None, pending, True
        x.div_(r)

    def sync_plan(self, opt, bucket, lr_sum, factors):
        """Phase B's synchronisation in the C passes (:mod:`compressed_opt.zero_one_local`): ``(per-layer
        scales before the exchange, R and the per-layer bounds of its clamp(R x), per-layer divisors
        after it)``: no scales, ``R`` and the bounds (``y`` divided by ``R`` after), none."""
        return None, opt._preconditioner(bucket), opt._exchange_bounds(bucket, lr_sum, factors), None

    def phase_a_update_(self, opt, bucket, group, grad, step) -> bool:
        """Phase A, a compressed step, after :meth:`exchange_steps` with ``keep_result``: the update
        from the result's 1-bit rows in one native pass (``True``: done, ``grad`` untouched), or the
        averaged gradient ``y / R`` into ``grad``, 0 where ``v == 0`` (``y / R`` is 0 / 0 there),
        and ``False``: the caller composes the update from it."""
        result, r = opt.layout.exchanged(opt, bucket, grad), opt._preconditioner(bucket)
        if isinstance(result, kernels.CompressedResult):
            if opt._phase_a_pass(bucket, group, result, r, step):
                return True
            result.expand_()
        grad.div_(r)
        _no_variance_no_move_(grad, bucket, bucket.flat("exp_avg_sq"), False)
        return False

    def refresh_variance_(self, opt, bucket, v, grad, beta2: float) -> None:
        """A refresh: ``v <- b2 v + (1 - b2) g^2``, a new ``R`` from it, and the error buffers
        carried to the new ``R``."""
        old = opt._preconditioner(bucket)  # (after a load: made from v)
        variance_(v, grad, beta2)
        opt._refresh_preconditioner(bucket, old)

    def after_refresh(self, opt, bucket) -> None:
        """Nothing more: the new ``R`` was made in :meth:`refresh_variance_`."""

    def at_freeze(self, opt, bucket) -> None:
        """Phase B's coefficients from the RMS of ``m / sqrt(v_f)``, and its ``R``."""
        opt._set_freeze_coeffs(bucket)


class ZeroOneMomentum(ExchangeVariant):
    """The paper's exchanges: each layer scaled by its coefficient ``c_l`` from ``v``."""

    name = "momentum"
    phase_a_pass = False

    def exchange_steps(self, opt, bucket, x, lr_sum, factors, keep_result=False):
        """``x`` times ``c_l`` per layer; the request; divided by ``c_l`` (``keep_result``: ignored,
        the result is always in ``x``)."""
        coeffs, views = opt._layer_coeffs(bucket), bucket.views(x)
        scaling.scale_(views, coeffs)
        yield bucket, x, None, None, True
        scaling.unscale_(views, coeffs)

    def sync_plan(self, opt, bucket, lr_sum, factors):
        """Phase B's synchronisation in the C passes (as :meth:`ZeroOnePreconditioned.sync_plan`): each
        layer times ``c_l`` before, divided by it after (``None``, nothing, where every ``c_l`` is 1)."""
        coeffs = opt._layer_coeffs(bucket)
        scaled = coeffs if any(c != 1.0 for c in coeffs) else None
        return scaled, None, None, scaled

    def phase_a_update_(self, opt, bucket, group, grad, step) -> bool:
        """``False``: ``grad`` holds the averaged gradient (the layers' coefficients divided out)."""
        return False

    def refresh_variance_(self, opt, bucket, v, grad, beta2: float) -> None:
        """A refresh: ``v <- b2 v + (1 - b2) g^2``."""
        variance_(v, grad, beta2)

    def after_refresh(self, opt, bucket) -> None:
        """``v`` changed, so do the layers' coefficients (the error buffers move with them)."""
        opt._set_layer_coeffs(bucket)

    def at_freeze(self, opt, bucket) -> None:
        """The layers' coefficients from the frozen ``v``."""
        opt._set_layer_coeffs(bucket)


VARIANTS = (ZeroOnePreconditioned, ZeroOneMomentum)
