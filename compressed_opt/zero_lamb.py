"""1-bit LAMB's compression step under ZeRO in native passes (docs/design.md 2.4.2), with the
preconditioned exchange and fp32 parameters, on CPU tensors: the step of
:meth:`~compressed_opt.onebit_lamb.OnebitLamb._compressed_step` on the sharded layout
(:class:`compressed_opt.zero.Sharded`), without the whole momentum or the whole frozen denominator
in memory.

Rank ``j`` owns chunk ``j`` (elements ``[lo, hi)``) of the fresh variance. Before the exchange,
its previous momentum ``m_{t-1} = t / R`` is taken from the kept rows ``t``
(:func:`~compressed_opt.cuda.zero_passes.previous_momentum_`, in the layout's ``gather_local``);
the local momentum then runs inside the compression as OnebitAdam's does. After it, the result
stays in its 1-bit rows:

* pass 1 (:func:`variance_maxima_`, chunk ``j``): ``m_t = y / R`` from the result's row ``j``, the
  fresh variance and the variance ratio's per-layer maxima (:func:`compressed_opt.cuda.lamb_passes.
  variance_maxima_` over the chunk's pieces of the layers), then the maxima over the ranks (one
  all-gather of a float per layer, as the composition's);
* pass 2 (:func:`descend_`, every element): ``p <- p decay_l + (m_t / denom) alpha_l``, ``m_t`` and
  ``denom = (1 / R) c_l + eps`` formed from the rows and ``R`` element by element
  (:func:`~compressed_opt.cuda.zero_passes.lamb_rows_descend_`).

The variance, the parameters and the momentum are the composition's bit for bit given the same
coefficients; the maxima are within ``2^-20`` of its (the stage-0 passes' bound). A step that
measures the live trust ratio takes the same passes; its norms read the direction whole
(:func:`whole_direction`), and its local momentum is formed whole before the exchange (the norms
of ``u_i`` read it), natively where it can (``ZeroLocalMomentum.form_``).
"""
from __future__ import annotations

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel

from .buckets import Bucket
from .moments import preconditioned_denominator


def ready(opt, bucket: Bucket) -> bool:
    """Whether this bucket's compression step may run in the native passes: the sharded layout with
    the preconditioned exchange, fp32 parameters (no master chunk), the momentum as the kept rows,
    and CPU buffers and parameters the C passes can take (their checks at first use passed)."""
    layout = opt.layout
    if (not layout.sharded or not opt.exchange_variant.preconditioned or bucket.low_precision
            or "exp_avg" in bucket.flats or "momentum_rows" not in bucket.flats):
        return False
    r = opt.exchange_preconditioner(bucket)
    chunks = [layout.state(opt, bucket, "exp_avg_sq_fresh"), layout.previous_momentum(opt, bucket)]
    # (R whole and the parameters, as lamb_passes takes them; the chunk's buffers are the layout's own)
    return (bucket.flats["momentum_rows"].is_cpu and all(t.is_cpu and t.dtype == torch.float32 for t in chunks)
            and kernels.lamb_passes.ready([r], bucket.params, bucket.segments) and kernels.zero_passes.agrees())


def _chunk_segments(opt, bucket: Bucket, lo: int, hi: int) -> kernels.Segments:
    """Each layer's piece of the chunk ``[lo, hi)`` (0 for a layer outside it), as segments of the chunk."""
    key = (lo, hi)
    cached = bucket.derived.get("lamb_chunk_segments")
    if cached is None or cached[0] != key:
        sizes = [max(0, min(start + p.numel(), hi) - max(start, lo)) for start, p in zip(bucket.offsets, bucket.params)]
        cached = bucket.derived["lamb_chunk_segments"] = (key, kernels.Segments(sizes))
    return cached[1]


def _denominator_chunk(opt, bucket: Bucket, r: torch.Tensor, segments: kernels.Segments, eps: float) -> torch.Tensor:
    """The chunk's frozen denominator ``sqrt(v_f) + eps = (1 / R) c_l + eps`` (as the layout makes the
    whole one, on the chunk only), made again when ``R`` (a load writes it: its version), ``eps`` or
    the coefficients change."""
    coeffs = opt.exchange_coefficients(bucket)
    key = (r.data_ptr(), r.numel(), r._version, float(eps), tuple(coeffs))
    cached = bucket.derived.get("lamb_denominator_chunk")
    if cached is None or cached[0] != key:
        cached = (key, preconditioned_denominator(r, segments.split, coeffs, eps))
        bucket.derived["lamb_denominator_chunk"] = cached
    return cached[1]


def variance_maxima_(opt, bucket: Bucket, beta1: float, beta2: float, bc2_sqrt: float, eps: float) -> list[float]:
    """Pass 1 over this rank's chunk (the module doc): the fresh variance updated from the result's
    row ``j`` and the previous momentum; per layer, the variance ratio's maximum over every rank's
    chunk."""
    layout, world = opt.layout, opt.backend.world_size
    lo, hi, chunk = layout.own_range(opt, bucket)
    rows = bucket.flats["momentum_rows"].view(world, -1)
    j = opt.backend.rank
    own = kernels.CompressedResult(rows[j: j + 1], chunk, opt.scale_block, rows)
    segments = _chunk_segments(opt, bucket, lo, hi)
    r = opt.exchange_preconditioner(bucket)[lo:hi]
    found = kernels.lamb_passes.variance_maxima_(
        own, r, None, layout.previous_momentum(opt, bucket), layout.state(opt, bucket, "exp_avg_sq_fresh"),
        _denominator_chunk(opt, bucket, r, segments, eps), segments, beta1, beta2, bc2_sqrt, eps)
    return layout.maxima_over_ranks(opt, bucket, [f if k else 0.0 for f, k in zip(found, segments.sizes)])


def descend_(opt, bucket: Bucket, buffer: torch.Tensor, decays, alphas) -> None:
    """Pass 2 (the module doc): every element of the replica stepped from the result's rows;
    where the C pass cannot run, the rows are decompressed into ``buffer`` and the step composed."""
    world = opt.backend.world_size
    result = kernels.CompressedResult(bucket.flats["momentum_rows"].view(world, -1),
                                      chunk_numel(bucket.numel, world), opt.scale_block, buffer)
    args = (opt.exchange_preconditioner(bucket), opt.param_groups[bucket.group_index]["eps"],
            opt.exchange_coefficients(bucket), bucket.step_destinations(), bucket.segments, decays, alphas)
    if not kernels.zero_passes.lamb_rows_descend_(result, *args):
        kernels.zero_passes.compose_lamb_descend_(result.expand_(), *args, zero_index=opt.no_variance_indices(bucket))


def whole_direction(opt, bucket: Bucket, y) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m_t, denom)`` whole, for a measuring step's norms of the direction ``m_t / denom`` it
    applies: ``m_t = y / R`` (0 where ``R == 0``) in ``y``'s buffer, from the result's rows where
    ``y`` is them, and the frozen denominator made from ``R``; as the composition forms both."""
    if isinstance(y, kernels.CompressedResult):
        y = y.expand_()
    opt.momentum_from_exchange(bucket, y, out=y)
    return y, opt.frozen_denominator(bucket)
