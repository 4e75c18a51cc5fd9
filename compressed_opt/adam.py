"""Adam's formulas, each written once: 1-bit Adam, 1-bit LAMB, 0/1 Adam and ZeRO's shards take them
from here (Kingma & Ba 2015; the compression stage's bounds, docs/design.md 2.3)."""
from __future__ import annotations

import math

import torch

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
