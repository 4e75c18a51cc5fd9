"""0/1 Adam's phase-B step (docs/design.md 2.5): a local step, or a local step and a
synchronisation. A part (mixin) of :class:`compressed_opt.ZeroOneAdam`.

Per element, with ``den = sqrt(v) + eps`` (``v`` frozen) and the interval's tracking factor
``f_l`` of the element's layer::

    m = lerp(m, g, 1 - b1), 0 where v == 0;      acc += (lr m) / den
    local step:   p <- p (1 - lr wd) + (-lr f_l m) / den
    sync step:    y = the 1-bit average of acc den (sum lr m), 0 where v == 0;    m = y / lr_sum
                  p_sync <- p_sync D + (-f_l y) / den;    p <- p_sync;    acc <- 0

On contiguous fp32 CPU tensors these are the C passes of :mod:`compressed_opt.cuda.local_steps`:
one pass for a local step; for a synchronisation, the pass before the exchange (``m``, ``acc den``,
the exchange's own ``clamp(R x)`` or ``c_l x``) runs inside the exchange's compression
(:class:`~compressed_opt.cuda.ZeroOneSyncBefore`; ``acc den`` never travels to memory), and one
pass after it (``y / R`` or ``y / c_l``, the masking, ``m``, ``p_sync``, ``p``, ``acc <- 0``), which
reads ``y`` from the flat 1-bit exchange's result rows, decompressed in cache (the exchange does not
decompress them into ``acc``; the hierarchical and fp32 averages leave ``y`` in ``acc``, read there).
Each reads every buffer once. Elsewhere, and with ``COMPRESSED_OPT_KERNELS=reference``, the PyTorch
composition below (:meth:`ZeroOneLocalSteps._composed_local_step`), which the passes give bit for
bit where torch's CPU kernels use FMA (the module doc of ``local_steps``).
"""
from __future__ import annotations

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel

from .moments import denominator_, momentum_
from .zero_one_exchange import _no_variance_no_move_


class ZeroOneLocalSteps:
    """0/1 Adam's phase-B step (see the module doc)."""

    @staticmethod
    def _frozen_denominator(bucket, v: torch.Tensor, eps: float, signed: bool = False) -> torch.Tensor:
        """Phase B's ``sqrt(v_hat) + eps``, made once while ``v`` (frozen) and ``eps`` stay as they
        are (a load or a change of ``eps`` makes it again): one buffer of the bucket's size (not
        saved: made from ``v``) in place of two passes per step. ``signed``: negated where ``v ==
        0``, as the C passes take it (:func:`compressed_opt.cuda.signed_denominator`)."""
        key = (v.data_ptr(), v._version, eps, signed)
        denom = bucket.flats.get("frozen_denominator")
        if denom is None or bucket.derived.get("frozen_denominator_of") != key:
            denom = bucket.flats["frozen_denominator"] = denominator_(v, torch.empty_like(v), eps)
            if signed:
                kernels.signed_denominator(v, denom)
            bucket.derived["frozen_denominator_of"] = key
        return denom

    def _local_step(self, bucket, group, grad):
        """A phase-B step of ``bucket``: local, or local and synchronising (:meth:`_syncs_now`).
        Where the gather left the gradients in ``p.grad`` (``step.gradients_in_place``: the step's
        exchange runs here, ``Stepping.leave_gradients_in_place``), the C passes read them there;
        the composition gathers them first."""
        tracked = self._interval_factors(bucket)
        factors = tracked or [1.0] * len(bucket.params)
        lr, wd = float(group["lr"]), group["weight_decay"]
        sources = bucket.derived.pop("step.gradients_in_place", None)
        if not self._syncs_now():
            bucket.derived.pop(_ZERO_ACCUMULATOR, None)  # (the C pass writes it unseen by its version)
            if not self._fused_local_step(bucket, group, grad, factors, sources):
                self._composed_local_step(bucket, group, _gathered(bucket, grad, sources), factors, None)
            return
        lr_sums, decays = self._group_lists()
        lr_sum = lr_sums[bucket.group_index] + lr
        decay = decays[bucket.group_index] * (1 - lr * wd)
        sync = (lr_sum, decay, tracked)
        if not self._fused_sync(bucket, group, grad, factors, sync, sources):
            self._composed_local_step(bucket, group, _gathered(bucket, grad, sources), factors, sync)

    def _fused_local_step(self, bucket, group, grad, factors, sources) -> bool:
        """A local step in one C pass; ``False`` (nothing done) where it does not run here."""
        lr, wd = float(group["lr"]), group["weight_decay"]
        m, acc = bucket.flat("exp_avg"), bucket.flat("momentum_accumulator")
        sden = self._signed_denominator(bucket, group, grad)
        return sden is not None and kernels.zero_one_local_step_(
            bucket.step_destinations(), grad, m, sden, acc, bucket.segments, 1 - group["betas"][0], lr,
            1 - lr * wd if wd != 0 else 1.0, [-lr * f for f in factors], sources)

    def _signed_denominator(self, bucket, group, grad) -> torch.Tensor | None:
        """The frozen denominator the C passes take, or ``None`` where they do not run (then the
        unsigned one stays, or is made, for the composition)."""
        v = bucket.flat("exp_avg_sq")
        buffers = [bucket.flat(n) for n in ("exp_avg", "momentum_accumulator", "sync_params")]
        if not kernels.zero_one_passes_serve(bucket.step_destinations(), bucket.segments, grad, v, *buffers):
            return None
        return self._frozen_denominator(bucket, v, group["eps"], signed=True)

    def _fused_sync(self, bucket, group, grad, factors, sync, sources) -> bool:
        """A synchronising step as the C passes: the pass before the exchange inside its compression
        (:class:`~compressed_opt.cuda.ZeroOneSyncBefore`), the pass after it; ``False`` (nothing done)
        where they do not run here."""
        lr_sum, decay, tracked = sync
        lr, weight = float(group["lr"]), 1 - group["betas"][0]
        m, acc, anchor = bucket.flat("exp_avg"), bucket.flat("momentum_accumulator"), bucket.flat("sync_params")
        sden = self._signed_denominator(bucket, group, grad)
        if sden is None:
            return False
        if lr_sum <= 0:  # nothing moved over the interval: no exchange; p = p_sync
            kernels.zero_one_sync_before_(bucket.step_destinations(), grad, m, sden, acc, bucket.segments, weight, lr,
                                          sources=sources)
            torch._foreach_copy_(bucket.params, bucket.views(anchor))
            acc.zero_()
            _accumulator_zeroed(bucket, acc)
            return True
        scales, r, bounds, divisors = self.exchange_variant.sync_plan(self, bucket, lr_sum, tracked)
        pending = kernels.ZeroOneSyncBefore(grad, m, sden, acc, bucket.segments, weight, lr, scales, r, bounds,
                                            sources=sources, accumulator_zero=_holds_zero(bucket, acc))
        result = [acc]

        def request():  # expand=False: the flat 1-bit exchange leaves y in its rows, the pass after reads them
            rows = yield bucket, acc, None, pending, False
            if rows is not None:  # (None: the hierarchical and fp32 averages, y in acc)
                result[0] = kernels.CompressedResult(rows, chunk_numel(acc.numel(), rows.shape[0]), self.scale_block,
                                                     acc)

        self.exchanges.run([request()])
        # (the rows are views of the exchange's buffers, valid until the next exchange: read right now)
        kernels.zero_one_sync_after_(bucket.step_destinations(), result[0], sden, m, anchor, bucket.segments, lr_sum,
                                     decay, [-f for f in factors], r, divisors, accumulator_zero=pending.leaves_zero)
        _accumulator_zeroed(bucket, acc)
        return True

    def _composed_local_step(self, bucket, group, grad, factors, sync):
        """The phase-B step composed of PyTorch's ops (``sync``: ``(lr_sum, decay, tracked)`` on a
        synchronising step, else ``None``): other devices, and the oracle of the C passes."""
        m, v = bucket.flat("exp_avg"), bucket.flat("exp_avg_sq")
        acc, anchor = bucket.flat("momentum_accumulator"), bucket.flat("sync_params")
        beta1 = group["betas"][0]
        lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
        momentum_(m, grad, beta1)
        _no_variance_no_move_(m, bucket, v, False)
        denom = self._frozen_denominator(bucket, v, eps)
        acc.addcdiv_(m, denom, value=lr)  # acc += lr * m / (sqrt(v) + eps)
        if sync is None:
            if wd != 0:
                torch._foreach_mul_(bucket.params, 1 - lr * wd)
            if bucket.params:  # p -= lr f_l m / (sqrt(v) + eps): one pass, no direction buffer
                torch._foreach_addcdiv_(bucket.params, bucket.views(m), bucket.views(denom), [-lr * f for f in factors])
            return
        lr_sum, decay, tracked = sync
        if lr_sum > 0:
            # y = average of acc * (sqrt(v) + eps) = sum lr m, identical on every rank
            acc.mul_(denom)
            self._exchange(bucket, acc, lr_sum, tracked)
            _no_variance_no_move_(acc, bucket, v, False)
            torch.div(acc, lr_sum, out=m)
            if decay != 1.0:
                anchor.mul_(decay)
            if bucket.params:  # anchor -= f_l y / (sqrt(v) + eps): one pass
                torch._foreach_addcdiv_(bucket.views(anchor), bucket.views(acc), bucket.views(denom),
                                        [-f for f in factors])
        # p = p_sync D - y / (sqrt(v) + eps): the same numbers on every rank (lr_sum == 0: p_sync)
        torch._foreach_copy_(bucket.params, bucket.views(anchor))
        acc.zero_()
        _accumulator_zeroed(bucket, acc)


#: ``bucket.derived`` key: ``(address, version)`` of the accumulator where a synchronisation left it
#: ``+0``; valid while both hold (a load, or a user's in-place write, moves the version; the local
#: step's C pass does not, and drops the key). Then the next synchronisation, an interval of one
#: step (0/1 Adam's default for its first ``local_step_scaler`` steps of phase B), neither reads nor
#: writes it: two streams of the bucket's bytes fewer, the same bits.
_ZERO_ACCUMULATOR = "accumulator_zero_at"


def _accumulator_zeroed(bucket, acc: torch.Tensor) -> None:
    bucket.derived[_ZERO_ACCUMULATOR] = (acc.data_ptr(), acc._version)


def _holds_zero(bucket, acc: torch.Tensor) -> bool:
    return bucket.derived.get(_ZERO_ACCUMULATOR) == (acc.data_ptr(), acc._version)


def _gathered(bucket, grad: torch.Tensor, sources) -> torch.Tensor:
    """``grad`` holding the bucket's gradients: gathered from ``sources`` where the gather left them
    in place."""
    if sources is not None:
        kernels.gather_(sources, grad, bucket.segments)
    return grad
