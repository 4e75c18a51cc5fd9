"""Per-layer scaling coefficients for a bucket compressed with one 1-bit scale.

The compressed allreduce sends each element of a buffer as ``+-scale``, one ``scale`` (the RMS)
for the whole buffer (docs/design.md 2.1). A bucket holds many layers whose values differ in magnitude
by orders: with one scale, a layer of small values gets 1-bit noise of the size of the large ones
(error feedback corrects it only over many steps). 1-bit LAMB's paper fixes this with a
coefficient per layer; we use the same for every optimizer that exchanges a bucket:

    c_l = mean_k s_k / s_l      (s_l: the RMS of layer l; k over the bucket's non-empty layers)

Each layer is multiplied by ``c_l`` before the exchange and divided by it after, so every layer
reaches the compressor with the same RMS and gets a scale of its own size. The average over the
ranks is linear, so the coefficients change only how the compression error is spread. They must
be the same on every rank (computed from state every rank shares) and, with error feedback, fixed
between changes or carried over: :func:`rescale_errors` moves the error buffers to new
coefficients. A layer with ``s_l = 0`` (or no elements) keeps ``c_l = 1``.
"""
from __future__ import annotations

import math

import torch

from .reductions import norms


def coefficients(rms: list[float], sizes: list[int]) -> list[float]:
    """``mean_k s_k / s_l`` per layer (1 where ``s_l`` is 0, not finite, or the layer empty)."""
    layers = [r for r, n in zip(rms, sizes) if n]
    mean = sum(layers) / len(layers) if layers else 0.0
    return [mean / r if r > 0 and mean > 0 and math.isfinite(mean / r) else 1.0 for r in rms]


def coefficients_of(views: list[torch.Tensor]) -> list[float]:
    """The coefficients of fp32 layers ``views`` (one fused norm pass): ``mean_k s_k / s_l``, ``s_l``
    each layer's RMS."""
    sizes = [v.numel() for v in views]
    return coefficients(rms_from_norms(norms(views).tolist(), sizes), sizes)


def rms_from_norms(norms: list[float], sizes: list[int]) -> list[float]:
    """The RMS of each layer from its L2 norm."""
    return [n / math.sqrt(k) if k else 0.0 for n, k in zip(norms, sizes)]


def rms_from_variance(variances: list[torch.Tensor]) -> list[float]:
    """The RMS a layer's values have when ``v`` (per element, >= 0) is their mean square:
    ``sqrt(sum v / n)``."""
    sums = norms(variances, 1).tolist()
    return [math.sqrt(s / v.numel()) if v.numel() else 0.0 for s, v in zip(sums, variances)]


def scale_(views: list[torch.Tensor], coeffs: list[float]) -> None:
    """Each layer's view times its coefficient (nothing when they are all 1)."""
    if any(c != 1.0 for c in coeffs):
        torch._foreach_mul_(views, coeffs)


def unscale_(views: list[torch.Tensor], coeffs: list[float]) -> None:
    if any(c != 1.0 for c in coeffs):
        torch._foreach_div_(views, coeffs)


def rescale_errors(bucket, ranges, old: list[float], new: list[float]) -> None:
    """Carry the bucket's error-feedback buffers (``bucket.feedback``) from coefficients ``old`` to
    ``new``: both hold errors of scaled values (the worker's of its whole input, the server's of its
    chunk), so each element is multiplied by ``new / old`` of its layer. ``ranges``: the bucket
    elements each error covers (:meth:`compressed_opt.exchange.Exchange.error_ranges`)."""
    worker_error, server_error = bucket.feedback.worker_error, bucket.feedback.server_error
    if worker_error is None or old == new:
        return
    ratios = [n / o for n, o in zip(new, old)]
    per_element = torch.ones(bucket.numel, dtype=server_error.dtype, device=server_error.device)
    torch._foreach_mul_(bucket.views(per_element), ratios)
    (wlo, whi), (slo, shi) = ranges  # the elements each error covers
    worker_error[: whi - wlo].mul_(per_element[wlo:whi])
    server_error[: shi - slo].mul_(per_element[slo:shi])
