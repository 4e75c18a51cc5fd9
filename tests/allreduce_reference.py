"""A single-process reference of the compressed allreduce (docs/design.md 2.2), written from the math
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


def mismatches(actual, expected, scale_tol=1e-4) -> int:
    """How many values of ``actual`` differ from ``expected`` beyond float rounding."""
    actual, expected = actual.float().reshape(-1), expected.float().reshape(-1)
    return int((~torch.isclose(actual, expected, rtol=scale_tol, atol=1e-6)).sum())


def assert_matches_reference(actual, expected, scale_tol=1e-4):
    """Same values, except where float rounding flipped the sign of a value within ~1e-6 of
    zero: at most one value in 1000."""
    bad = mismatches(actual, expected, scale_tol)
    assert bad <= actual.numel() // 1000, f"{bad} of {actual.numel()} values differ from the reference"
