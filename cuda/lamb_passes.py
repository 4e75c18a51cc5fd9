"""1-bit LAMB's compression-stage arithmetic in two native passes over a bucket (docs/design.md
2.4.2), in place of some fifteen PyTorch kernels and a Python loop of per-layer maxima.

From the exchanged average ``y`` (``m_t = y / R``, 0 where ``R == 0``, or ``y / c_l``), the momentum
of the step before ``m`` (``m_{t-1}``), the fresh variance ``v`` and the frozen denominator ``denom =
sqrt(v_f) + eps`` (``inf`` where ``v_f == 0``), segment ``l`` a layer:

:func:`variance_maxima_` (pass 1; reads ``y``, ``R``, ``m``, ``v``, ``denom``; writes ``m``, ``v``)::

    m_t = y / R  (or y / c_l, or y)         g = m_t - b1 m              (the exchange's m_t; (1 - b1) g~)
    v  <- b2 v + ((1 - b2) / (1 - b1)^2) g^2                            (v_fresh)
    f   = nan_to_num(denom / (sqrt(v) / sqrt(1 - b2^t) + eps), nan=0, posinf=0)
    m  <- m_t;   returns max_l f per layer (1.0 for an empty layer)

:func:`descend_` (pass 2; reads ``m``, ``denom``, each parameter; writes each parameter)::

    p_l <- p_l decay_l + alpha_l (m / denom)                            (no decay: p_l + alpha_l (m / denom))

written through each parameter's own memory (``alpha_l = -lr coeff_l / (1 - b1^t)``, ``decay_l = 1 - lr
coeff_l wd``). ``g``, the variance ratio and the direction ``m / denom`` never travel to memory.

``y`` may also be a :class:`~compressed_opt.cuda.rows.CompressedResult`, the 1-bit rows the
compressed allreduce's result travelled as (OnebitLamb's stage 0, as OnebitAdam's update): pass 1
then decompresses them tile by tile into the stack, as ``co_rows_divide_zero_descend`` does, and ``y``
never travels to memory (the same bits as decompressing it first: the same operations per element,
and a maximum does not depend on the order it is taken in).

Rounding: :func:`compose_variance_maxima_` and :func:`compose_descend_` are the PyTorch composition
OnebitLamb runs on other devices (one kernel per operation). Each operation of the passes is one
rounded IEEE operation in the composition's order (the C contracts nothing into an FMA), except
where PyTorch's kernel is one FMA itself: ``torch.add(m_t, m, alpha=-b1)`` rounds ``fma(m, -b1,
m_t)`` and ``addcmul_`` rounds ``fma(value * g, g, b2 v)``, in their vector loops and tails alike
(measured: torch 2.13 on AVX2), which the C writes as ``fmaf``. So ``m``, ``v`` and the parameters
are the composition's bit for bit. The maxima are not: PyTorch's ``torch.sqrt`` of fp32 CPU
tensors (2.13, AVX2) is not correctly rounded (it differs from the correctly rounded root by one
unit in the last place in about one element in five), the C's ``sqrtf`` is. Each maximum is within
``2^-21`` relative of the same formula in float64 on the same ``v`` (four fp32 roundings of at most
``2^-24`` each; tested), and within ``2^-20`` of the composition's. A check at first use in the
process (:func:`ready`) compares the passes with the composition on a small case (``m``, ``v``, the
parameters bit for bit, the maxima within ``2^-20``); where they differ (a PyTorch built without
those FMAs, a CPU without FMA) OnebitLamb composes in PyTorch. ``COMPRESSED_OPT_KERNELS=reference``
turns the passes off.
"""
from __future__ import annotations

import ctypes

import torch

from . import cpu, harness
from .cpu import addressable, c_doubles, destination_addresses, plain_cpu_floats
from .rows import CompressedResult
from .segments import Segments, check


def ready(tensors: list, params: list, segments: Segments) -> bool:
    """Whether :func:`variance_maxima_` and :func:`descend_` run natively on these flat buffers
    (``None`` entries: absent; a :class:`~compressed_opt.cuda.rows.CompressedResult`: its rows
    and its buffer) and parameters: all contiguous fp32 CPU tensors, flat buffers of
    ``segments.numel`` elements, CPU rows of at least that many elements, and one parameter per
    segment of its size; the C library loaded and allowed; its passes found equal to the composition
    bit for bit here (checked once per process)."""
    if not cpu.library_allowed() or len(params) != len(segments):
        return False
    flats = []
    for t in tensors:
        if isinstance(t, CompressedResult):
            if not (addressable(t.rows) and t.rows.is_cpu and _holds(t, segments.numel)):
                return False
            t = t.buffer
        if t is not None:
            flats.append(t)
    if not (plain_cpu_floats(flats) and all(t.dim() == 1 and t.numel() == segments.numel for t in flats)):
        return False
    if destination_addresses(params, segments.sizes) is None:
        return False
    return cpu.library() is not None and harness.agrees("lamb_passes")


def _holds(y: CompressedResult, n: int) -> bool:
    """Whether the rows of ``y`` carry at least ``n`` elements."""
    return y.rows.shape[0] * y.chunk >= n


def variance_maxima_(y, r: torch.Tensor | None, divisors, m: torch.Tensor, v: torch.Tensor,
                     denom: torch.Tensor, segments: Segments, beta1: float, beta2: float, bc2_sqrt: float,
                     eps: float) -> list[float]:
    """Pass 1 (the module doc): ``m`` (``m_{t-1}``) <- ``m_t`` formed from ``y`` (``y / r``, 0 where
    ``r == 0``; ``r`` ``None``: ``y / divisors[l]`` per layer, or ``y`` without ``divisors``), ``v``
    <- the fresh variance; returns the per-layer maxima of the variance ratio. Natively; the caller
    has checked :func:`ready`. ``y``: a flat tensor, or a
    :class:`~compressed_opt.cuda.rows.CompressedResult` (CPU rows), read from its 1-bit rows
    256 elements at a time, decompressed into the stack (``y`` never travels to memory; the same
    bits as decompressing it first)."""
    compressed = isinstance(y, CompressedResult)
    check(segments, m, v, denom, *(() if compressed else (y,)))
    if compressed and not _holds(y, segments.numel):
        raise ValueError(f"{y.rows.shape[0]} rows of {y.chunk} elements for {segments.numel} elements")
    nseg = len(segments)
    c, cp = (None, None) if divisors is None else c_doubles(divisors, nseg)
    out = (ctypes.c_float * nseg)()
    tail = (None if r is None else r.data_ptr(), cp, m.data_ptr(), v.data_ptr(), denom.data_ptr(),
            segments.offsets.data_ptr(), nseg, float(beta1), float(beta2), _variance_scale(beta1, beta2),
            float(bc2_sqrt), float(eps), out)
    lib = cpu.library()
    if compressed:
        lib.co_lamb_rows_variance_maxima(y.rows.data_ptr(), y.rows.stride(0), y.chunk, y.block, *tail)
    else:
        lib.co_lamb_variance_maxima(y.data_ptr(), *tail)
    return list(out)


def descend_(params: list, m: torch.Tensor, denom: torch.Tensor, segments: Segments, decays, alphas) -> None:
    """Pass 2 (the module doc): ``params[l] <- params[l] decays[l] + alphas[l] (m / denom)`` over
    segment ``l`` (``decays`` ``None``: no multiplication), natively; the caller has checked
    :func:`ready`."""
    check(segments, m, denom)
    nseg = len(segments)
    addresses = destination_addresses(params, segments.sizes)  # (ready() checked them: Destinations, as a rule)
    a, ap = c_doubles(alphas, nseg)
    d, dp = (None, None) if decays is None else c_doubles(decays, nseg)
    cpu.library().co_lamb_descend(addresses.data_ptr(), m.data_ptr(), denom.data_ptr(), segments.offsets.data_ptr(),
                                  nseg, dp, ap)


def _variance_scale(beta1: float, beta2: float) -> float:
    """The weight of ``((1 - b1) g~)^2`` in the fresh variance: ``(1 - b2) / (1 - b1)^2``."""
    return (1 - beta2) / (1 - beta1) ** 2


def compose_variance_maxima_(y, r, divisors, m, v, denom, segments: Segments, beta1, beta2, bc2_sqrt,
                             eps) -> list[float]:
    """:func:`variance_maxima_` composed in PyTorch, as OnebitLamb composes it on other devices
    (``momentum_from_exchange``, ``_compressed_step``, ``keep_momentum``): the oracle of the check."""
    n = segments.numel
    y, m, v, denom = y[:n], m[:n], v[:n], denom[:n]
    mt = torch.empty_like(y)
    if r is not None:
        torch.div(y, r[:n], out=mt)
        mt.masked_fill_(r[:n] == 0, 0.0)
    else:
        mt.copy_(y)
        if divisors is not None and segments.sizes:
            torch._foreach_div_(segments.split(mt), [float(c) for c in divisors])
    g = torch.add(mt, m, alpha=-beta1)
    v.mul_(beta2).addcmul_(g, g, value=_variance_scale(beta1, beta2))
    ratio = torch.sqrt(v).div_(bc2_sqrt).add_(eps)
    torch.div(denom, ratio, out=ratio).nan_to_num_(nan=0.0, posinf=0.0)
    m.copy_(mt)
    return [float(part.max()) if part.numel() else 1.0 for part in segments.split(ratio)]


def compose_descend_(params: list, m, denom, segments: Segments, decays, alphas) -> None:
    """:func:`descend_` composed in PyTorch, as OnebitLamb's update composes it."""
    update = torch.div(m[: segments.numel], denom[: segments.numel])
    if decays is not None:
        torch._foreach_mul_(params, list(decays))
    views = [u.view_as(p) for u, p in zip(segments.split(update), params)]
    torch._foreach_mul_(views, list(alphas))
    torch._foreach_add_(params, views)


#: how far (relative) the passes' maxima may be from the composition's (see the module doc)
MAXIMA_TOLERANCE = 2.0**-20


def _check_case(seed: int, form: str, native: bool):
    """The harness's case: both passes against their compositions, each of the exchanges' forms of
    ``m_t`` (layers with and without a vector loop's tail, empty, and coordinates with ``v_f == 0``,
    ``R == 0``, ``v == 0``); the maxima within :data:`MAXIMA_TOLERANCE`."""
    if cpu.library() is None:
        return None
    g = torch.Generator().manual_seed(seed)
    segments = Segments([37, 0, 1000, 5, 8, 64, 1])
    n = segments.numel
    y, m = torch.randn(n, generator=g), torch.randn(n, generator=g)
    v = torch.rand(n, generator=g) * 1e-3
    root = torch.rand(n, generator=g) * 1e-2
    denom = root + 1e-8
    denom[::11] = float("inf")  # v_f == 0
    r = 1.0 / root
    r[::11] = 0.0
    r[5::13] = 0.0
    v[::17] = 0.0
    y[::19] = 0.0
    r = r if form == "r" else None
    divisors = [0.5 + 0.25 * i for i in range(len(segments))] if form == "divisors" else None
    args = (segments, 0.9, 0.999, 0.0316, 1e-8)
    m, v = m.clone(), v.clone()
    maxima = (variance_maxima_ if native else compose_variance_maxima_)(y, r, divisors, m, v, denom, *args)
    stepped = []
    for decays in (None, [1.0 - 0.01 * i for i in range(len(segments))]):
        alphas = [-0.03 * (i + 1) for i in range(len(segments))]
        params = [(torch.randn(k, generator=g) * 0.1) for k in segments.sizes]
        (descend_ if native else compose_descend_)(params, m, denom, segments, decays, alphas)
        stepped += params
    return maxima, m, v, stepped


harness.register("lamb_passes", harness.Check(
    tuple((seed, form) for seed in (29, 30) for form in ("r", "divisors", "none")), _check_case,
    close=MAXIMA_TOLERANCE))
