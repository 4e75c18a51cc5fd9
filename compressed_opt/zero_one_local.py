"""0/1 Adam's phase-B step (docs/design.md 2.5): a local step, or a local step and a
synchronisation, of one bucket (:class:`compressed_opt.zero_one_adam.ZeroOneAlgorithm` calls
:func:`local_step`).

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
composition below (:func:`composed_step`), which the passes give bit for bit where torch's CPU
kernels use FMA (the module doc of ``local_steps``).
"""
from __future__ import annotations

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel

from .adam import denominator_, momentum_
from .exchange import Request


def no_variance_no_move_(t: torch.Tensor, buffers, refreshed: bool) -> None:
    """``t = 0`` where ``v == 0``: a coordinate that never had a gradient on a refresh step is not
    moved. 1-bit compression gives it ``+-scale`` like every coordinate, and divided by ``eps`` that
    would blow it up. Those coordinates change only when ``v`` does (refresh steps), so they are kept
    between them: as indices when they are few (the usual case; ``index_fill_`` then touches only
    them, where a mask would cost a pass over the bucket), as a mask when they are many."""
    zeros = buffers.no_variance
    if zeros is None or refreshed:
        v = buffers.exp_avg_sq
        mask = v == 0
        few = int(torch.count_nonzero(mask)) * 16 <= v.numel()  # indices (8 bytes each): at most n/2 bytes
        zeros = buffers.no_variance = mask.nonzero().view(-1) if few else mask
    if zeros.dtype == torch.bool:
        t.masked_fill_(zeros, 0.0)
    elif zeros.numel():
        t.index_fill_(0, zeros, 0.0)


def frozen_denominator(buffers, eps: float, signed: bool = False) -> torch.Tensor:
    """Phase B's ``sqrt(v_hat) + eps``, made once while ``v`` (frozen) and ``eps`` stay as they are (a
    load or a change of ``eps`` makes it again): one buffer of the bucket's size (not saved: made from
    ``v``) in place of two passes per step. ``signed``: negated where ``v == 0``, as the C passes take
    it (:func:`compressed_opt.cuda.signed_denominator`)."""
    v = buffers.exp_avg_sq
    key = (v.data_ptr(), v._version, eps, signed)
    denom = buffers.frozen_denominator
    if denom is None or buffers.denominator_of != key:
        denom = buffers.frozen_denominator = denominator_(v, torch.empty_like(v), eps)
        if signed:
            kernels.signed_denominator(v, denom)
        buffers.denominator_of = key
    return denom


def local_step(alg, bucket, group) -> None:
    """A phase-B step of ``bucket``: local, or local and synchronising (the schedule's ``syncs_now``).
    Where the gather left the gradients in ``p.grad`` (the algorithm's ``sources``), the C passes read
    them there; the composition gathers them first."""
    st, schedule = bucket.state, alg.schedule_
    grad = bucket.sync.padded[: bucket.numel]
    tracked = alg.interval_factors(bucket)
    factors = tracked or [1.0] * len(bucket.params)
    lr, wd = float(group["lr"]), group["weight_decay"]
    sources = st.sources
    dests = kernels.Destinations.of(bucket.params, bucket.segments.sizes) or bucket.params
    if not schedule.syncs_now():
        if not _fused_local_step(bucket, group, grad, factors, sources, dests):
            composed_step(alg, bucket, group, _gathered(bucket, grad, sources), factors, None)
        return
    lr_sums, decays = schedule.group_lists(len(alg.param_groups))
    lr_sum = lr_sums[bucket.group_index] + lr
    decay = decays[bucket.group_index] * (1 - lr * wd)
    sync = (lr_sum, decay, tracked)
    if not _fused_sync(alg, bucket, group, grad, factors, sync, sources, dests):
        composed_step(alg, bucket, group, _gathered(bucket, grad, sources), factors, sync)


def _signed_denominator(bucket, group, grad, dests) -> torch.Tensor | None:
    """The frozen denominator the C passes take, or ``None`` where they do not run (then the
    unsigned one stays, or is made, for the composition)."""
    buffers = bucket.state.buffers
    flats = [buffers.exp_avg, buffers.momentum_accumulator, buffers.sync_params]
    if not kernels.zero_one_passes_serve(dests, bucket.segments, grad, buffers.exp_avg_sq, *flats):
        return None
    return frozen_denominator(buffers, group["eps"], signed=True)


def _fused_local_step(bucket, group, grad, factors, sources, dests) -> bool:
    """A local step in one C pass; ``False`` (nothing done) where it does not run here."""
    lr, wd = float(group["lr"]), group["weight_decay"]
    buffers = bucket.state.buffers
    sden = _signed_denominator(bucket, group, grad, dests)
    return sden is not None and kernels.zero_one_local_step_(
        dests, grad, buffers.exp_avg, sden, buffers.momentum_accumulator, bucket.segments, 1 - group["betas"][0], lr,
        1 - lr * wd if wd != 0 else 1.0, [-lr * f for f in factors], sources)


def _fused_sync(alg, bucket, group, grad, factors, sync, sources, dests) -> bool:
    """A synchronising step as the C passes: the pass before the exchange inside its compression
    (:class:`~compressed_opt.cuda.ZeroOneSyncBefore`), the pass after it; ``False`` (nothing done)
    where they do not run here."""
    lr_sum, decay, tracked = sync
    lr, weight = float(group["lr"]), 1 - group["betas"][0]
    buffers = bucket.state.buffers
    m, acc, anchor = buffers.exp_avg, buffers.momentum_accumulator, buffers.sync_params
    sden = _signed_denominator(bucket, group, grad, dests)
    if sden is None:
        return False
    if lr_sum <= 0:  # nothing moved over the interval: no exchange; p = p_sync
        kernels.zero_one_sync_before_(dests, grad, m, sden, acc, bucket.segments, weight, lr, sources=sources)
        torch._foreach_copy_(bucket.params, bucket.views(anchor))
        acc.zero_()
        return True
    scales, r, bounds, divisors = alg.exchange.sync_plan(alg, bucket, lr_sum, tracked)
    producer = kernels.ZeroOneSyncBefore(grad, m, sden, acc, bucket.segments, weight, lr, scales, r, bounds,
                                         sources=sources)
    # (expand=False: the flat 1-bit exchange leaves y in its rows, the pass after reads them right
    # away; the hierarchical and fp32 averages leave y in acc)
    rows = alg.engine.run([Request(acc, bucket.feedback, producer, expand=False)])[0]
    result = acc if rows is None else kernels.CompressedResult(rows, chunk_numel(acc.numel(), rows.shape[0]),
                                                               alg.engine.scale_block, acc)
    kernels.zero_one_sync_after_(dests, result, sden, m, anchor, bucket.segments, lr_sum, decay, [-f for f in factors],
                                 r, divisors)
    return True


def composed_step(alg, bucket, group, grad, factors, sync) -> None:
    """The phase-B step composed of PyTorch's ops (``sync``: ``(lr_sum, decay, tracked)`` on a
    synchronising step, else ``None``): other devices, and the oracle of the C passes."""
    buffers = bucket.state.buffers
    m, acc, anchor = buffers.exp_avg, buffers.momentum_accumulator, buffers.sync_params
    beta1 = group["betas"][0]
    lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
    momentum_(m, grad, beta1)

    no_variance_no_move_(m, buffers, False)
    denom = frozen_denominator(buffers, eps)
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
        alg.engine.run([alg.exchange.request(alg, bucket, acc, lr_sum, tracked)])
        alg.exchange.after(alg, bucket, acc)
        no_variance_no_move_(acc, buffers, False)
        torch.div(acc, lr_sum, out=m)
        if decay != 1.0:
            anchor.mul_(decay)
        if bucket.params:  # anchor -= f_l y / (sqrt(v) + eps): one pass
            torch._foreach_addcdiv_(bucket.views(anchor), bucket.views(acc), bucket.views(denom),
                                    [-f for f in factors])
    # p = p_sync D - y / (sqrt(v) + eps): the same numbers on every rank (lr_sum == 0: p_sync)
    torch._foreach_copy_(bucket.params, bucket.views(anchor))
    acc.zero_()


def _gathered(bucket, grad: torch.Tensor, sources) -> torch.Tensor:
    """``grad`` holding the bucket's gradients: gathered from ``sources`` where the gather left them
    in place."""
    if sources is not None:
        kernels.gather_(sources, grad, bucket.segments)
    return grad
