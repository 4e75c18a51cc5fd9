"""The exchange variant: what the compression stage's 1-bit exchange carries.

Chosen once, when the optimizer is made (its ``exchange=`` argument), and held as
``optimizer.exchange_variant``, as the layout is held as ``optimizer.layout``. The algorithms call
the variant where the two differ; nothing else branches on the choice (docs/design.md 2.3).

``"preconditioned"`` (the default)
    A rank's momentum ``m_i`` is exchanged as ``s_l R m_i``, clipped to ``+-c_l K``: ``R = c_l /
    sqrt(v_f)`` per element, fixed from the freeze (0 where ``v_f == 0``), ``c_l`` the layer's
    coefficient (its values reach the compressor at comparable sizes), ``s_l`` the layer's
    variance-tracking factor of the last update, ``K`` the step bound. The average ``y`` gives
    back ``m = y / (s_l R)`` (0 where ``v_f == 0``). No coordinate's 1-bit noise exceeds its own
    Adam step.
``"momentum"`` (the papers')
    ``c_l m_i`` is exchanged (1-bit LAMB's per-layer coefficient; 1-bit Adam: ``m_i`` itself), and
    ``m = y / c_l``.

0/1 Adam's variants, which also carry its phase-A gradients, are with its exchange
(:mod:`compressed_opt.zero_one_exchange`). A variant keeps nothing of its own: what it makes
(``R``, the coefficients) is kept in the bucket and the optimizer's state, where checkpoints and
the layout find it. Its methods take the optimizer, as the layout's do, and use its public names.
"""
from __future__ import annotations

from typing import Callable

import torch

from compressed_opt import cuda as kernels

from . import scaling
from .moments import descend_
from .reductions import norms
from .validation import check_choice


class ExchangeVariant:
    """One way of carrying the momentum through the 1-bit exchange (see the module doc)."""

    #: the ``exchange=`` argument that chooses it, and the name checkpoints record
    name = ""
    #: whether the local momentum is exchanged as ``s_l R m_i``, bounded (a fused pass the
    #: compression runs: :class:`compressed_opt.cuda.LerpScaleClamp`)
    preconditioned = False

    def reads_compressed_result(self, opt) -> bool:
        """Whether its update reads the exchange's result through the layout's ``exchanged`` (which
        may give it as 1-bit rows, never decompressed into memory), not from the exchanged buffer."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(exchange={self.name!r})"


def choose(name, variants: tuple[type[ExchangeVariant], ...]) -> ExchangeVariant:
    """The variant of ``variants`` called ``name`` (the ``exchange=`` argument), made once."""
    by_name = {v.name: v for v in variants}
    check_choice("exchange", name, tuple(by_name))
    return by_name[name]()


# --- 1-bit Adam ---------------------------------------------------------------------------------
class AdamPreconditioned(ExchangeVariant):
    """1-bit Adam's default: ``s_l R m_i`` exchanged, bounded (the bound: the optimizer's
    ``bound_exchanged_``, applied by the layout in the pass that forms ``m_i``)."""

    name = "preconditioned"
    preconditioned = True

    def reads_compressed_result(self, opt) -> bool:
        return True  # (the layout's step_preconditioned_)

    def preconditioner(self, opt, bucket) -> torch.Tensor:
        """``R = c_l / sqrt(v_f)`` per element (0 where ``v_f == 0``), made at the first compressed
        exchange from ``v_f`` and the momentum, both the same on every rank; after a load, from
        ``v_f`` and the saved ``c_l``. The layout keeps beside it what its compression steps need
        (:meth:`~compressed_opt.layout.Layout.keep_exchange_factors`)."""
        r = bucket.flats.get("preconditioner")
        if r is None:
            group = opt.param_groups[bucket.group_index]
            denom = opt.frozen_denominator(bucket)  # sqrt(v_f) + eps, inf where v_f == 0
            # sqrt(v_f), from the denominator every mode holds (inf where v_f == 0); floored where
            # it sank below eps's rounding (R and A only need to agree with each other)
            root = torch.sub(denom, group["eps"]).clamp_(min=group["eps"] * 2.0**-20)
            r = torch.reciprocal(root)  # 0 where v_f == 0
            coeffs = self.coefficients(opt, bucket, r)
            scaling.scale_(bucket.views(r), coeffs)
            bucket.flats["preconditioner"] = r
            opt.layout.keep_exchange_factors(opt, bucket, root, denom, coeffs)
        return r

    @staticmethod
    def coefficients(opt, bucket, inv_root: torch.Tensor) -> list[float]:
        """Each layer's ``c_l = mean_k s_k / s_l``, ``s_l`` the RMS of ``m / sqrt(v_f)`` over layer
        ``l``: set once, from the momentum of the freeze (whole on every rank), and kept in
        ``state[p]["scaling_coeff"]`` (checkpoints carry it)."""
        states = [opt.state[p] for p in bucket.params]
        if any("scaling_coeff" not in st for st in states):
            m = bucket.flats.get("exp_avg")
            if m is None:
                raise RuntimeError(f"{type(opt).__name__}: the exchange's scaling coefficients are missing from "
                                   "the state of a checkpoint saved in the compression stage")
            for st, c in zip(states, scaling.coefficients_of(bucket.views(torch.mul(m, inv_root)))):
                st["scaling_coeff"] = c
        return [st["scaling_coeff"] for st in states]

    def exchange_factors(self, tracked: Callable[[], list[float] | None]) -> list[float] | None:
        """``s_l``: the layers' tracking factors of the last update (``tracked()``; ``None``
        without tracking), so that every layer reaches the compressor at the size of its step."""
        return tracked()

    def exchange_scales(self, opt, bucket) -> None:
        """No separate per-layer scale: ``c_l`` is inside ``R``."""
        return None

    def momentum_from_exchange(self, opt, bucket, y, out, factors) -> None:
        """``m = y / (s_l R)`` into ``out`` (0 where ``v_f == 0``; the cached indices of those zeros
        spare a mask pass per step; ``factors``: the exchange's ``s_l``, divided in the same pass)."""
        n = bucket.numel
        segments = (bucket.segments, factors) if factors is not None else ()
        kernels.divide_where_nonzero_(y[:n], self.preconditioner(opt, bucket)[:n], out[:n],
                                      opt.no_variance_indices(bucket), *segments)

    def momentum_and_update_(self, opt, bucket, y, out, factors, descend):
        """:meth:`momentum_from_exchange`, and the update ``descend`` (a
        :class:`compressed_opt.cuda.Descend` of ``y``) in the same pass over memory; the
        :class:`compressed_opt.cuda.KeptMomentum` of ``out`` where the pass formed it from the
        result's rows, else ``None``."""
        return kernels.divide_descend_(y, self.preconditioner(opt, bucket), out, bucket.segments, factors, descend,
                                       opt.no_variance_indices(bucket))

    def update_(self, opt, bucket, y, decay: float, alpha: float, step: int) -> None:
        """The compression stage's Adam update from the average ``y`` of ``s_l R m_i``: the
        layout's fused pass ``p <- decay p + alpha f_l / s_l A y`` keeping ``m = y / (s_l R)``."""
        opt.layout.step_preconditioned_(opt, bucket, y, decay, alpha, step)


class AdamMomentum(ExchangeVariant):
    """The paper's 1-bit Adam exchange: ``m_i`` itself."""

    name = "momentum"

    def preconditioner(self, opt, bucket) -> None:
        return None

    def exchange_factors(self, tracked) -> None:
        """Each layer is exchanged as it is (the tracking factors apply to the update only)."""
        return None

    def exchange_scales(self, opt, bucket) -> list[float] | None:
        return None

    def momentum_from_exchange(self, opt, bucket, y, out, factors) -> None:
        """``m = y / c_l`` into ``out`` (``c_l``: :meth:`exchange_scales`; none: ``m = y``)."""
        n = bucket.numel
        if out is not y:
            out[:n].copy_(y[:n])
        coeffs = self.exchange_scales(opt, bucket)
        if coeffs is not None:
            scaling.unscale_(bucket.views(out), coeffs)

    def reads_compressed_result(self, opt) -> bool:
        return True  # (update_: from the result's rows where the layout kept them)

    def update_(self, opt, bucket, y, decay: float, alpha: float, step: int) -> None:
        """``m <- y``; ``p <- decay p + alpha f_l m / (sqrt(v_f) + eps)`` (``f_l``: the layers'
        tracking factors, ``opt.update_factors``). From the result's rows in one native pass where
        the layout kept them and the pass can run (``kernels.rows_keep_descend_``: ``m`` the
        layout's whole momentum, none under ZeRO, whose momentum is the rows; bit for bit this
        composition), else composed here."""
        layout = opt.layout
        factors = opt.update_factors(bucket)
        result = layout.exchanged(opt, bucket, y)
        if isinstance(result, kernels.CompressedResult):
            m = layout.whole_momentum(opt, bucket)
            if kernels.rows_keep_descend_(result, opt.frozen_denominator(bucket), m, factors, bucket.params,
                                          bucket.segments, decay, alpha):
                return
            result.expand_()  # into y
        layout.keep_momentum(opt, bucket, y)
        direction = y  # m / (sqrt(v_f) + eps), in place
        torch.div(y, opt.frozen_denominator(bucket), out=direction)
        if factors is not None:
            scaling.scale_(bucket.views(direction[: bucket.numel]), factors)
        descend_(bucket.params, bucket.views(direction), decay, alpha)
        layout.update_masters(opt, bucket, step, decay, direction, alpha)


# --- 1-bit LAMB ---------------------------------------------------------------------------------
class LambPreconditioned(AdamPreconditioned):
    """1-bit LAMB's default: 1-bit Adam's preconditioned momentum (``c_l`` inside ``R``)."""

    def momentum_divisors(self, opt, bucket) -> tuple[torch.Tensor, None]:
        """What :meth:`momentum_from_exchange` divides ``y`` by, for a pass that forms ``m`` itself
        (:mod:`compressed_opt.cuda.lamb_passes`): ``(R, None)``, ``m = y / R``, 0 where ``R == 0``."""
        return self.preconditioner(opt, bucket), None

    def local_direction_sq(self, opt, bucket, x, scales: list[float], wd: float) -> torch.Tensor:
        """Per layer ``||u_i||^2``, ``u_i = m_i_hat / sqrt(v_f) + wd p`` the rank's LAMB direction,
        from the exchanged ``x = R m_i`` (bounded): ``m_i_hat / sqrt(v_f) = x scales``, ``scales =
        1 / (c_l bc1)`` (the bound aside, and ``eps``: where ``sqrt(v_f) < eps`` it overstates the
        step's ``m_i / (sqrt(v_f) + eps)``, which only lowers the ratio towards its floor)."""
        if wd == 0:  # the norms of x, scaled
            sq = norms(bucket.views(x[: bucket.numel]), segments=bucket.segments).square_()
            return sq.mul_(torch.tensor(scales, dtype=sq.dtype, device=sq.device).square_())
        return kernels.direction_sumsq(x, None, scales, bucket.params, wd, bucket.segments).sqrt_().square_()


class LambMomentum(AdamMomentum):
    """The paper's 1-bit LAMB exchange: ``c_l m_i``, one coefficient per layer."""

    def momentum_divisors(self, opt, bucket) -> tuple[None, list[float] | None]:
        """What :meth:`momentum_from_exchange` divides ``y`` by, for a pass that forms ``m`` itself:
        ``(None, c_l)``, ``m = y / c_l`` per layer (``(None, None)`` when every ``c_l`` is 1: ``m = y``)."""
        coeffs = self.exchange_scales(opt, bucket)
        return None, (coeffs if any(c != 1.0 for c in coeffs) else None)

    def exchange_scales(self, opt, bucket) -> list[float]:
        """Each layer's ``c_l = mean_k RMS(m_k) / RMS(m_l)`` (1 for an all-zero or empty layer),
        set once from the momentum (the averaged one, the same on every rank; sharded: at the
        first exchange, while the momentum gathered at the freeze is whole) and kept in state."""
        states = [opt.state[p] for p in bucket.params]
        if any("scaling_coeff" not in st for st in states):
            m = bucket.flats.get("exp_avg")
            if m is None:  # cannot happen: the coefficients are set when the momentum is whole
                raise RuntimeError("1-bit LAMB: scaling coefficients missing after the first exchange")
            for st, c in zip(states, scaling.coefficients_of(bucket.views(m))):
                st["scaling_coeff"] = c
        return [st["scaling_coeff"] for st in states]

    def local_direction_sq(self, opt, bucket, x, scales: list[float], wd: float) -> torch.Tensor:
        """Per layer ``||u_i||^2`` from the exchanged ``x = c_l m_i``: ``m_i_hat / (sqrt(v_f) + eps)
        = x / (sqrt(v_f) + eps) scales``, ``scales = 1 / (c_l bc1)``."""
        return kernels.direction_sumsq(x, opt.frozen_denominator(bucket), scales, bucket.params if wd else None, wd,
                                       bucket.segments).sqrt_().square_()


ADAM = (AdamPreconditioned, AdamMomentum)
LAMB = (LambPreconditioned, LambMomentum)
