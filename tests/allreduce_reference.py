"""A single-process reference of the compressed allreduce (docs/design.md 2.2: one scale per block of
``block`` elements of each rank's chunk), written from the math with plain tensor operations,
independent of the library's kernels and buffers."""
from __future__ import annotations

import math

import torch


def chunk_of(numel: int, world: int) -> int:
    return math.ceil(math.ceil(numel / world) / 32) * 32 if numel else 0


BLOCK = 1024  # the library's default block


def _compress(u: torch.Tensor):
    """(decompressed value, new error) of u, one scale per block; zero counts as +."""
    scale = (u.double().norm() / math.sqrt(u.numel())).float() if u.numel() else torch.tensor(0.0)
    value = torch.where(u >= 0, 1.0, -1.0) * scale
    return value, u - value


def _compress_blocks(u: torch.Tensor, c: int, block: int):
    """``_compress`` of every block of a chunk of ``c`` elements (``u``: its valid ones)."""
    value, err = torch.empty_like(u), torch.empty_like(u)
    for b in range(0, c, block):
        part = slice(min(b, u.numel()), min(b + block, u.numel()))
        value[part], err[part] = _compress(u[part])
    return value, err


def simulate(inputs, worker_errors, server_errors, block: int = BLOCK):
    """Output (same on every rank) of one compressed allreduce of ``inputs[i]`` on rank i;
    updates the error lists in place. ``server_errors[j]`` has the chunk size of the library."""
    world = len(inputs)
    n = inputs[0].numel()
    c = chunk_of(n, world)
    sent = []
    for i in range(world):
        u = inputs[i].float().reshape(-1) + worker_errors[i]
        value = torch.empty(n)
        for j in range(world):
            lo, hi = j * c, min(n, (j + 1) * c)
            if hi > lo:
                value[lo:hi], worker_errors[i][lo:hi] = _compress_blocks(u[lo:hi], c, block)
        sent.append(value)
    out = torch.empty(n)
    for j in range(world):
        lo, hi = j * c, min(n, (j + 1) * c)
        if hi <= lo:
            continue
        v = hi - lo
        z = sum(sent[i][lo:hi] / 1.0 for i in range(world)) / world + server_errors[j][:v]
        out[lo:hi], server_errors[j][:v] = _compress_blocks(z, c, block)
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
