"""1-bit LAMB's warmup step (full-precision LAMB, docs/design.md 2.4) in two native passes around
PyTorch's square root, in place of some ten PyTorch kernels:

:func:`warmup_moments_` (reads ``g``, ``m``, ``v``; writes ``m``, ``v``)::

    m <- lerp(m, g, 1 - b1)                 m.lerp_(g, 1 - b1)
    v <- b2 v + (1 - b2) g^2                v.mul_(b2).addcmul_(g, g, value=1 - b2)

then ``torch.sqrt(v, out=u)`` (PyTorch's own: its fp32 CPU square root is not the correctly rounded
``sqrtf``, and the update must be the composition's), then :func:`warmup_direction_` (reads ``u``,
``m`` and, with weight decay, the values; writes ``u``)::

    u <- m / (((u / bc2_sqrt) + eps) bc1) + wd p

``u`` is then the update direction of every layer; the trust ratios are the composition's
(:mod:`compressed_opt.onebit_lamb`), and :func:`step_layers_` steps each layer by its own (reads
``u`` and the parameters, writes the parameters)::

    p_l <- p_l + u_l s_l                    torch._foreach_mul_ of u's views by s, then torch._foreach_add_

The values ``p`` are the parameters (one per segment, read and written through their own memory)
or, for the direction, a flat tensor (ZeRO's chunk of them).

Rounding: every operation rounded on its own in the composition's order, but where PyTorch's CPU
kernel is one FMA itself: ``torch.lerp``'s vector kernel (``fma(w, g - m, m)``; ``fma(w - 1, g - m,
g)`` for ``|w| >= 1/2``), ``addcmul_`` (``fma(value g, g, b2 v)``) and add-with-alpha (``fma(p, wd,
u)``). A check at first use in the process (:func:`ready`) compares both passes with the composition
on a small case, bit for bit (segments with and without a vector loop's tail, an empty one, both
lerp formulas, with and without weight decay and the division by ``bc2_sqrt``); where they differ
OnebitLamb composes. ``COMPRESSED_OPT_KERNELS=reference`` turns the passes off.
"""
from __future__ import annotations

import torch

from . import cpu, harness
from .cpu import c_doubles, destination_addresses, plain_cpu_float
from .segments import Segments, check


def ready(*tensors: torch.Tensor) -> bool:
    """Whether the passes run natively on these flat buffers (contiguous fp32 CPU tensors), the C
    library loaded and allowed and its passes found equal to the composition here (once per process)."""
    if not cpu.library_allowed() or not all(plain_cpu_float(t) and t.dim() == 1 for t in tensors):
        return False
    lib = cpu.library()
    return lib is not None and harness.agrees("lamb_warmup")


def warmup_moments_(g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, beta1: float, beta2: float) -> bool:
    """``m`` and ``v`` from the averaged gradient ``g`` (the module doc), natively; ``False``, nothing
    done, where :func:`ready` says no (the caller composes)."""
    if m.numel() != g.numel() or v.numel() != g.numel() or not ready(g, m, v):
        return False
    _moments(cpu.library(), g, m, v, beta1, beta2)
    return True


def warmup_direction_(u: torch.Tensor, m: torch.Tensor, values, segments: Segments, bc2_sqrt: float, eps: float,
                      bc1: float, wd: float) -> bool:
    """``u`` (``sqrt(v)``, PyTorch's) <- the update direction (the module doc); ``values``: the
    parameters, one per segment of ``segments``, or a flat tensor of ``u``'s size (then one segment,
    ``segments`` unused); ``wd == 0``: not read. ``False``, nothing done, where it cannot run natively."""
    flat = isinstance(values, torch.Tensor)
    if flat:
        segments = Segments([u.numel()])
        check(segments, m, *((values,) if wd != 0 else ()))
    check(segments, u, m)
    if not ready(u, m, *((values,) if flat and wd != 0 else ())):
        return False
    dests = None if flat else destination_addresses(values, segments.sizes)
    if not flat and dests is None:
        return False
    _direction(cpu.library(), u, m, values if flat else None, dests, segments, bc2_sqrt, eps, bc1, wd)
    return True


def step_layers_(params: list, u: torch.Tensor, segments: Segments, scales: list[float]) -> bool:
    """``params[s] <- params[s] + u_s scales[s]`` over segment ``s`` of ``u`` (the module doc; ``u``
    only read), natively, through each parameter's own memory; ``False``, nothing done, where it
    cannot run here."""
    check(segments, u)
    if len(params) != len(segments) or len(scales) != len(segments) or not ready(u):
        return False
    dests = destination_addresses(params, segments.sizes)
    if dests is None:
        return False
    _step_layers(cpu.library(), dests, u, segments, scales)
    return True


def _step_layers(lib, dests, u, segments: Segments, scales) -> None:
    keep, at = c_doubles(scales, len(segments))  # (keep: alive through the call)
    lib.co_lamb_step_layers(dests.data_ptr(), u.data_ptr(), segments.offsets.data_ptr(), len(segments), at)


def _moments(lib, g, m, v, beta1: float, beta2: float) -> None:
    lib.co_lamb_warmup_moments(g.data_ptr(), m.data_ptr(), v.data_ptr(), g.numel(), 1.0 - beta1, beta2, 1.0 - beta2)


def _direction(lib, u, m, flat, dests, segments: Segments, bc2_sqrt, eps, bc1, wd) -> None:
    lib.co_lamb_warmup_direction(u.data_ptr(), m.data_ptr(), None if flat is None else flat.data_ptr(),
                                 None if dests is None else dests.data_ptr(), segments.offsets.data_ptr(),
                                 len(segments), float(bc2_sqrt), bc2_sqrt != 1.0, float(eps), float(bc1), float(wd),
                                 wd != 0)


def compose_warmup_(g, m, v, u, values, segments: Segments, beta1, beta2, bc2_sqrt, eps, bc1, wd) -> None:
    """The two passes and the square root as OnebitLamb's warmup composes them (``values``: the
    parameters or a flat tensor): the oracle of the check."""
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    torch.sqrt(v, out=u)
    if bc2_sqrt != 1.0:
        u.div_(bc2_sqrt)
    u.add_(eps).mul_(bc1)
    torch.div(m, u, out=u)
    if wd != 0:
        if isinstance(values, torch.Tensor):
            u.add_(values, alpha=wd)
        else:
            torch._foreach_add_([x.view_as(p) for x, p in zip(segments.split(u), values)], values, alpha=wd)


def _check_case(seed: int, beta1: float, wd: float, bc2_sqrt: float, flat: bool, native: bool):
    """The harness's case: the two passes and the square root against :func:`compose_warmup_` (layers
    with and without a vector loop's tail, an empty one, zeros in the gradient and the variance),
    then the layers' step."""
    lib = cpu.library()
    if lib is None:
        return None
    g = torch.Generator().manual_seed(seed)
    segments = Segments([37, 0, 1000, 5, 8, 64, 1])
    n = segments.numel
    grad = torch.randn(n, generator=g)
    grad[::13] = 0.0
    m, v = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 1e-3
    v[::17] = 0.0
    params = [torch.randn(k, generator=g) for k in segments.sizes]
    values = torch.cat(params) if flat else params
    u = torch.empty(n)
    scalars = (bc2_sqrt, 1e-8, 1.0 - beta1 ** 3, wd)
    if native:
        _moments(lib, grad, m, v, beta1, 0.999)
        torch.sqrt(v, out=u)
        dests = None if flat else destination_addresses(values, segments.sizes)
        _direction(lib, u, m, values if flat else None, dests, segments, *scalars)
    else:
        compose_warmup_(grad, m, v, u, values, segments, beta1, 0.999, *scalars)
    if flat:
        return m, v, u
    scales = [-0.01 * (i + 1) for i in range(len(segments))]
    stepped = [p.clone() for p in params]
    if native:
        _step_layers(lib, destination_addresses(stepped, segments.sizes), u, segments, scales)
    else:
        views = segments.split(u.clone())
        torch._foreach_mul_(views, scales)
        torch._foreach_add_(stepped, views)
    return m, v, u, stepped


harness.register("lamb_warmup", harness.Check(((29, 0.9, 0.01, 0.3, False), (30, 0.3, 0.0, 1.0, False),
                                               (31, 0.9, 0.1, 0.7, True)), _check_case))
