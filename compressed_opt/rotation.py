"""A randomized Hadamard rotation (DRIVE, Vargaftik et al. 2021): ``R = H S`` on each whole run of
:data:`BLOCK` elements of a flat buffer, ``S`` a diagonal of random signs, ``H`` the orthonormal
Walsh-Hadamard matrix (symmetric: ``H H = I``). Rotated, a run's coordinates are sums over
:data:`BLOCK` elements, close to Gaussian whatever the layers they came from, so a sign code and
its RMS scale lose less of them; ``R`` is orthonormal, so ``R^T`` undoes it and norms are kept.
:class:`compressed_opt.DiLoCo`'s ``"1bit"`` exchange rotates its pseudo-gradients with it."""
from __future__ import annotations

import torch

#: elements per rotation (a power of 2, a square: ``H_1024 = H_32 (x) H_32``)
BLOCK = 1024


def hadamard_(x: torch.Tensor) -> None:
    """``x`` (``[rows, n]``, ``n`` a power of 2) <- ``x H`` in place, ``H`` the orthonormal
    Walsh-Hadamard matrix (symmetric: its own inverse)."""
    rows, n = x.shape
    h = 1
    while h < n:
        pairs = x.view(rows, n // (2 * h), 2, h)
        low = pairs[:, :, 0].clone()
        pairs[:, :, 0].add_(pairs[:, :, 1])
        pairs[:, :, 1].sub_(low).neg_()  # (low - high)
        h *= 2
    x.mul_(n ** -0.5)


def hadamard_runs_(runs: torch.Tensor) -> None:
    """Each row of ``runs`` (``[rows, BLOCK]``) <- its Walsh-Hadamard transform, as two
    products with the factor ``H_32`` (``H_1024 = H_32 (x) H_32``: a row viewed as a 32 x 32 matrix
    ``X`` becomes ``H_32 X H_32``): two batched matrix products where the butterfly of
    :func:`hadamard_` makes ten passes with a copy each (a 3M-element fragment rotated and back in
    24.5 ms against 64.7 ms, one CPU thread)."""
    side = int(round(BLOCK ** 0.5))
    factor = torch.eye(side, dtype=runs.dtype)  # (32 x 32, once per exchange: no cache to keep)
    hadamard_(factor)
    factor = factor.to(runs.device)
    square = runs.view(-1, side, side)
    square.copy_(torch.matmul(torch.matmul(factor, square), factor))


def rotate_(flat: torch.Tensor, signs: torch.Tensor | None, forward: bool) -> None:
    """The whole runs of ``flat`` <- ``H S x`` (``forward``) or ``S H x`` (its inverse), in place."""
    if signs is None:
        return
    runs = flat[: signs.numel()].view(signs.shape)
    if forward:
        runs.mul_(signs)
        hadamard_runs_(runs)
    else:
        hadamard_runs_(runs)
        runs.mul_(signs)
