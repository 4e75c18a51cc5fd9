"""A single-process reference of the compressed allreduce (DESIGN 2.2), written from the math
with plain tensor operations, independent of the library's kernels and buffers."""
from __future__ import annotations

import math

import torch


def chunk_of(numel: int, world: int) -> int:
    return math.ceil(math.ceil(numel / world) / 32) * 32 if numel else 0


def _compress(u: torch.Tensor):
    """(scale, signs as +-1, new error) of u; zero counts as +."""
    scale = (u.double().norm() / math.sqrt(u.numel())).float() if u.numel() else torch.tensor(0.0)
    signs = torch.where(u >= 0, 1.0, -1.0)
    return scale, signs, u - scale * signs


def simulate(inputs, worker_errors, server_errors):
    """Output (same on every rank) of one compressed allreduce of ``inputs[i]`` on rank i;
    updates the error lists in place. ``server_errors[j]`` has the chunk size of the library."""
    world = len(inputs)
    n = inputs[0].numel()
    c = chunk_of(n, world)
    sent = []
    for i in range(world):
        scale, signs, err = _compress(inputs[i].float().reshape(-1) + worker_errors[i])
        worker_errors[i].copy_(err)
        sent.append(scale * signs)
    out = torch.empty(n)
    for j in range(world):
        lo, hi = j * c, min(n, (j + 1) * c)
        if hi <= lo:
            continue
        v = hi - lo
        z = sum(sent[i][lo:hi] / 1.0 for i in range(world)) / world + server_errors[j][:v]
        scale, signs, err = _compress(z)
        server_errors[j][:v] = err
        out[lo:hi] = scale * signs
    return out.view(inputs[0].shape)
