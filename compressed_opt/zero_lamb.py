"""1-bit LAMB's compression step under ZeRO in native passes (docs/design.md 2.4.2), with the
preconditioned exchange and fp32 parameters, on CPU tensors: the step of
:meth:`~compressed_opt.onebit_lamb.LambAlgorithm._compressed_step` under ZeRO
(:class:`compressed_opt.zero.Sharding`), without the whole momentum or the whole frozen denominator
in memory.

Rank ``j`` owns chunk ``j`` (elements ``[lo, hi)``) of the fresh variance. Before the exchange,
its previous momentum ``m_{t-1} = t / R`` is taken from the kept rows ``t``
(:func:`~compressed_opt.cuda.zero_passes.previous_momentum_`, in ZeRO's ``local_momentum``);
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

from .adam import preconditioned_denominator


def ready(algorithm, bucket) -> bool:
    """Whether this bucket's compression step may run in the native passes (asked before its
    exchange): ZeRO with the preconditioned exchange, fp32 parameters (no master chunk), the momentum
    as the kept rows, and CPU buffers and parameters the C passes can take (their checks at first
    use passed)."""
    zero, shards = algorithm.zero, bucket.state.buffers
    if (zero is None or not algorithm.exchange.preconditioned or bucket.low_precision
            or shards.exp_avg is not None or shards.momentum_rows is None):
        return False
    r = shards.preconditioner
    chunks = [zero.moment(bucket, "exp_avg_sq_fresh"), zero.previous_momentum(bucket)]
    # (R whole and the parameters, as lamb_passes takes them; the chunk's buffers are the shards')
    return (shards.momentum_rows.is_cpu and all(t.is_cpu and t.dtype == torch.float32 for t in chunks)
            and kernels.lamb_passes.ready([r], bucket.params, bucket.segments) and kernels.zero_passes.agrees())


def _chunk_segments(bucket, lo: int, hi: int) -> kernels.Segments:
    """Each layer's piece of the chunk ``[lo, hi)`` (0 for a layer outside it), as segments of the chunk."""
    shards = bucket.state.buffers
    if shards.lamb_segments is None or shards.lamb_segments[0] != (lo, hi):
        sizes = [max(0, min(start + p.numel(), hi) - max(start, lo)) for start, p in zip(bucket.offsets, bucket.params)]
        shards.lamb_segments = ((lo, hi), kernels.Segments(sizes))
    return shards.lamb_segments[1]


def _denominator_chunk(algorithm, bucket, r: torch.Tensor, segments: kernels.Segments, eps: float) -> torch.Tensor:
    """The chunk's frozen denominator ``sqrt(v_f) + eps = (1 / R) c_l + eps`` (as the whole one is
    made, on the chunk only), made again when ``R`` (a load writes it: its version), ``eps`` or the
    coefficients change."""
    shards = bucket.state.buffers
    coeffs = algorithm.exchange.coefficients(bucket.state)
    key = (r.data_ptr(), r.numel(), r._version, float(eps), tuple(coeffs))
    if shards.lamb_denominator is None or shards.lamb_denominator[0] != key:
        shards.lamb_denominator = (key, preconditioned_denominator(r, segments.split, coeffs, eps))
    return shards.lamb_denominator[1]


def variance_maxima_(algorithm, bucket, beta1: float, beta2: float, bc2_sqrt: float, eps: float) -> list[float]:
    """Pass 1 over this rank's chunk (the module doc): the fresh variance updated from the result's
    row ``j`` and the previous momentum; per layer, the variance ratio's maximum over every rank's
    chunk."""
    zero, engine = algorithm.zero, algorithm.engine
    world = engine.backend.world_size
    lo, hi, chunk = zero.own_range(bucket)
    rows = bucket.state.buffers.momentum_rows.view(world, -1)
    j = engine.backend.rank
    own = kernels.CompressedResult(rows[j: j + 1], chunk, engine.scale_block, rows)
    segments = _chunk_segments(bucket, lo, hi)
    r = bucket.state.buffers.preconditioner[lo:hi]
    found = kernels.lamb_passes.variance_maxima_(
        own, r, None, zero.previous_momentum(bucket), zero.moment(bucket, "exp_avg_sq_fresh"),
        _denominator_chunk(algorithm, bucket, r, segments, eps), segments, beta1, beta2, bc2_sqrt, eps)
    return zero.maxima_over_ranks(bucket, [f if k else 0.0 for f, k in zip(found, segments.sizes)])


def descend_(algorithm, bucket, buffer: torch.Tensor, decays, alphas, dests) -> None:
    """Pass 2 (the module doc): every element of the replica stepped from the result's rows;
    where the C pass cannot run, the rows are decompressed into ``buffer`` and the step composed."""
    engine, st = algorithm.engine, bucket.state
    world = engine.backend.world_size
    result = kernels.CompressedResult(st.buffers.momentum_rows.view(world, -1),
                                      chunk_numel(bucket.numel, world), engine.scale_block, buffer)
    args = (st.buffers.preconditioner, algorithm.param_groups[bucket.group_index]["eps"],
            algorithm.exchange.coefficients(st), dests, bucket.segments, decays, alphas)
    if not kernels.zero_passes.lamb_rows_descend_(result, *args):
        kernels.zero_passes.compose_lamb_descend_(result.expand_(), *args,
                                                  zero_index=algorithm.exchange.no_variance(st))


def whole_direction(algorithm, bucket, y) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m_t, denom)`` whole, for a measuring step's norms of the direction ``m_t / denom`` it
    applies: ``m_t = y / R`` (0 where ``R == 0``) in ``y``'s buffer, from the result's rows where
    ``y`` is them, and the frozen denominator made from ``R``; as the composition forms both."""
    if isinstance(y, kernels.CompressedResult):
        y = y.expand_()
    algorithm.exchange.momentum_from_exchange(bucket.state, bucket, y, y)
    return y, algorithm.frozen_denominator(bucket)
