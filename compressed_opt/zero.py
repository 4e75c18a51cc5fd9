"""ZeRO-style sharding of 1-bit Adam's state by the compressed allreduce's server chunks.

Rank ``j`` owns chunk ``j`` of every bucket (elements ``[j c, (j+1) c)``, ``c`` the server chunk
of :func:`compressed_opt.comm.chunk_numel`), the same elements whose server error it holds.

Warmup (full precision):

* stage 1: the gradient bucket is all-reduced; stage 2: reduce-scattered, so each rank receives
  only the average of its own chunk;
* rank ``j`` keeps only ``m_j`` and ``v_j`` (chunk ``j`` of the momentum and the variance),
  computes the new parameter values of its chunk, and one all-gather of the chunks gives every
  rank the new parameters (in place of the fp32 gradient all-reduce's second half).

At the freeze the chunks of ``m`` and ``v`` are all-gathered once: every rank then holds the frozen
denominator ``sqrt(v_f) + eps`` of the whole bucket (the compression-stage update needs it for
every element, on every rank, so that no full-precision parameter all-gather is needed).

Compression stage: the averaged momentum is identical on every rank and is exactly what the last
exchange's second all-gather carried: ``N`` rows of ``[scale | sign bits]``, ``n/8 + 4N`` bytes.
Each rank keeps those rows instead of an fp32 momentum (32x less) and expands them when it forms
its next local momentum; every rank applies the same update to its replica of the parameters, so
the parameters stay identical without any full-precision traffic.

Parameters in bf16/fp16 get an fp32 master chunk on their owner (``master_shard``): warmup
updates it and gathers it into the parameters; in the compression stage every rank updates its
low-precision parameters as without ZeRO, the owner also its exact fp32 chunk, and every
``master_resync_interval`` steps one all-gather of the master chunks replaces the parameters,
bounding the drift of their rounding (an fp32 all-gather: ``4n (N-1)/N`` bytes per rank then).

Per-rank state, fp32 parameters, ``n`` elements, ``N`` ranks (bytes): stage 0 warmup ``8n``
(``m``, ``v``); ZeRO warmup ``8n/N``; stage 0 compression ``16n + 4n/N`` (``m``, ``v``, the
frozen denominator, the worker error, the server error); ZeRO compression ``8n + 4n/N + n/8``
(denominator, worker error, server error, the momentum rows).
"""
from __future__ import annotations

import torch

from compressed_opt.comm import chunk_numel, compressed_allreduce, expand_result_rows, result_rows

from .buckets import Bucket


def shard_range(bucket: Bucket, world: int, rank: int) -> tuple[int, int, int]:
    """``(lo, hi, chunk)``: this rank's elements ``[lo, hi)`` of the bucket, and the chunk size."""
    c = chunk_numel(bucket.numel, world)
    lo = min(rank * c, bucket.numel)
    return lo, min(lo + c, bucket.numel), c


def _buffer(bucket: Bucket, name: str, numel: int, dtype=torch.float32) -> torch.Tensor:
    buf = bucket.flats.get(name)
    if buf is None or buf.numel() != numel:
        buf = bucket.flats[name] = torch.zeros(numel, dtype=dtype, device=bucket.device)
    return buf


def grad_buffer(opt, bucket: Bucket) -> torch.Tensor:
    """The gradient workspace, padded to ``N c`` elements so it splits into equal chunks."""
    world = opt.backend.world_size
    return _buffer(bucket, "grad_padded", world * chunk_numel(bucket.numel, world))[: bucket.numel]


def average(opt, bucket: Bucket, grad: torch.Tensor) -> None:
    """Stage 1: all-reduce. Stage 2: reduce-scatter into this rank's chunk (``grad_shard``)."""
    if opt.zero_stage == 1:
        opt.backend.all_reduce(grad, op="avg")
        return
    world = opt.backend.world_size
    c = chunk_numel(bucket.numel, world)
    opt.backend.reduce_scatter(_buffer(bucket, "grad_shard", c), bucket.flats["grad_padded"], op="avg")


def warmup_update(opt, bucket: Bucket, group: dict, grad: torch.Tensor, step: int) -> None:
    """AdamW on this rank's chunk; one all-gather brings every rank the new parameters."""
    from .optimizer import bias_corrections

    world, rank = opt.backend.world_size, opt.backend.rank
    lo, hi, c = shard_range(bucket, world, rank)
    k = hi - lo
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    bc1, bc2_sqrt = bias_corrections(beta1, beta2, step, group["bias_correction"])
    g = grad[lo:hi] if opt.zero_stage == 1 else bucket.flats["grad_shard"][:k]
    m = _buffer(bucket, "exp_avg_shard", c)[:k]
    v = _buffer(bucket, "exp_avg_sq_shard", c)[:k]
    update = _buffer(bucket, "update_shard", c)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    direction = update[:k]
    torch.sqrt(v, out=direction).div_(bc2_sqrt).add_(eps)
    torch.div(m, direction, out=direction)
    padded = bucket.flats["grad_padded"]
    master = master_shard(opt, bucket)
    if master is not None:  # low-precision parameters: the fp32 master chunk is the truth
        master[:k].mul_(1 - lr * wd).add_(direction, alpha=-lr / bc1)
        update.copy_(master)
    else:  # fp32 parameters are their own master: this rank's chunk of their current values
        torch._foreach_copy_(bucket.views(padded[: bucket.numel]), bucket.params)
        chunk = padded[lo:hi]
        chunk.mul_(1 - lr * wd).add_(direction, alpha=-lr / bc1)
        update[:k].copy_(chunk)
        update[k:].zero_()
    opt.backend.all_gather(padded, update)
    torch._foreach_copy_(bucket.params, bucket.views(padded[: bucket.numel]))


def master_shard(opt, bucket: Bucket) -> torch.Tensor | None:
    """This rank's fp32 master copy of its chunk of a bucket that holds bf16/fp16 parameters
    (made from the parameters on first use); ``None`` for fp32 buckets."""
    if all(p.dtype == torch.float32 for p in bucket.params):
        return None
    master = bucket.flats.get("master_shard")
    if master is None:
        world, rank = opt.backend.world_size, opt.backend.rank
        lo, hi, c = shard_range(bucket, world, rank)
        padded = _buffer(bucket, "grad_padded", world * c)
        torch._foreach_copy_(bucket.views(padded[: bucket.numel]), bucket.params)
        master = bucket.flats["master_shard"] = torch.zeros(c, device=bucket.device)
        master[: hi - lo].copy_(padded[lo:hi])
    return master


def compression_update(opt, bucket: Bucket, group: dict, direction: torch.Tensor, step: int, scale: float) -> None:
    """Compression stage, low-precision parameters: every rank applies the update to its
    parameters (as without ZeRO) and, exactly, to its fp32 master chunk; every
    ``master_resync_interval`` steps one all-gather of the master chunks replaces the
    parameters, bounding what their rounding drifted."""
    master = master_shard(opt, bucket)
    if master is None:
        return
    world, rank = opt.backend.world_size, opt.backend.rank
    lo, hi, c = shard_range(bucket, world, rank)
    wd = group["weight_decay"]
    master[: hi - lo].mul_(1 - group["lr"] * wd).add_(direction[lo:hi], alpha=scale)
    if step % opt.master_resync_interval == 0:
        padded = bucket.flats["grad_padded"]
        opt.backend.all_gather(padded, master)
        torch._foreach_copy_(bucket.params, bucket.views(padded[: bucket.numel]))


def freeze(opt, bucket: Bucket) -> None:
    """Gather the chunks of ``m`` and ``v`` once: the full momentum (until the first compressed
    exchange replaces it by its 1-bit rows) and the frozen denominator of every element."""
    from .optimizer import bias_corrections

    world = opt.backend.world_size
    c = chunk_numel(bucket.numel, world)
    padded = _buffer(bucket, "grad_padded", world * c)
    n = bucket.numel
    opt.backend.all_gather(padded, _buffer(bucket, "exp_avg_shard", c))
    bucket.flats["exp_avg"] = padded[:n].clone()
    opt.backend.all_gather(padded, _buffer(bucket, "exp_avg_sq_shard", c))
    group = opt.param_groups[bucket.group_index]
    _, bc2_sqrt = bias_corrections(*group["betas"], opt.freeze_step, group["bias_correction"])
    v = padded[:n]
    denom = torch.sqrt(v).div_(bc2_sqrt).add_(group["eps"]).masked_fill_(v == 0, float("inf"))
    bucket.flats["frozen_denominator"] = denom
    # the momentum lives on whole, then as 1-bit rows; the variance only as the denominator
    del bucket.flats["exp_avg_shard"], bucket.flats["exp_avg_sq_shard"]


def local_momentum(opt, bucket: Bucket, x: torch.Tensor, beta1: float) -> None:
    """``x`` <- ``b1 m + (1 - b1) g_i`` with ``m`` expanded from the kept rows (or the momentum
    gathered at the freeze) and ``g_i`` read straight from ``p.grad``."""
    if "exp_avg" in bucket.flats:
        x.copy_(bucket.flats["exp_avg"])
    else:
        expand_result_rows(bucket.flats["momentum_rows"], bucket.numel, opt.backend.world_size, x)
    x.mul_(beta1)
    alpha = (1 - beta1) * (opt._gather_inv_scale if opt._gather_inv_scale is not None else 1.0)
    views, grads = [], []
    for p, view in zip(bucket.params, bucket.views(x)):
        if p.grad is not None:
            views.append(view)
            grads.append(p.grad if p.grad.dtype == torch.float32 else p.grad.float())
    if views:
        torch._foreach_add_(views, grads, alpha=alpha)


def exchange(opt, bucket: Bucket, x: torch.Tensor) -> None:
    """The compressed allreduce of the local momentum; keep the result's 1-bit rows."""
    worker_error, server_error = opt.error_buffers(bucket)
    compressed_allreduce(x, worker_error, server_error, opt.backend)
    rows = result_rows(bucket.numel, opt.backend, x.device)
    _buffer(bucket, "momentum_rows", rows.numel(), torch.uint8).copy_(rows)
    bucket.flats.pop("exp_avg", None)
