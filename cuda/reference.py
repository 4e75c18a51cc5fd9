"""Reference implementation of the compression kernels in plain PyTorch.

Readable, allocating, slow: the definition the fast paths (``cpu``, ``gpu``) are tested against,
and the CPU fallback where no C compiler is available. The math (docs/design.md 2.1, 2.2):

A buffer of ``world`` chunks of ``chunk`` elements travels as ``world`` *rows*, row ``j`` holding
chunk ``j``: ``nb = ceil(chunk / block)`` fp32 scales, then ``chunk / 8`` bytes of sign bits
(:func:`rows_layout`). Block ``b`` of a chunk is its elements ``[b block, min((b + 1) block,
chunk))``; of those, only the valid ones (below ``n`` in the whole buffer) count.

* compress (worker): ``u = x + e``; per block ``s = sqrt(sum u^2 / count)`` over its valid
  elements (0 when it has none); ``bit_k = [u_k >= 0]``; ``e <- u - s (2 bit - 1)``.
* average-compress (server, one chunk): ``z = e + sum_i (s_ib / world) (2 bit_ik - 1)``, ``s_ib``
  the scale of row ``i``'s block ``b``; then compress ``z`` with ``e`` into one row.
* decompress: ``out_k = s_rb (2 bit_k - 1)``, ``r = k // chunk``, ``b = (k % chunk) // block``.

Bit ``k`` of a row's bits is bit ``k % 8`` (least significant first) of byte ``k // 8``; bits of
invalid elements are 1. Scales are the fp32 values, the errors subtract exactly those.
"""
from __future__ import annotations

import torch

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def rows_layout(chunk: int, block: int) -> tuple[int, int]:
    """``(blocks per chunk, bytes per row)``: ``ceil(chunk / block)`` scales of 4 bytes, then
    ``chunk / 8`` bytes of bits."""
    nb = -(-chunk // block)
    return nb, 4 * nb + chunk // 8


def pack_bits(bits: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Pack a bool vector into ``nbytes`` bytes, little bit order; missing bits are 1."""
    padded = torch.ones(nbytes * 8, dtype=torch.bool, device=bits.device)
    padded[: bits.numel()] = bits
    weights = _BIT_WEIGHTS.to(bits.device)
    return (padded.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """Bool vector of the ``8 * numel`` bits of ``packed``, little bit order."""
    weights = _BIT_WEIGHTS.to(packed.device)
    return (packed.reshape(-1, 1) & weights).ne(0).reshape(-1)


def row_scales(rows: torch.Tensor, nb: int) -> torch.Tensor:
    """The ``[R, nb]`` fp32 scales at the start of each row of ``rows`` (``[R, row_len]`` bytes)."""
    # (a copy: a view of the rows may start at any byte, and fp32 needs 4-byte alignment)
    scales = rows[:, : 4 * nb].clone(memory_format=torch.contiguous_format).reshape(-1)
    return scales.view(torch.float32).view(rows.shape[0], nb)


def _blocks(chunk: int, block: int, valid: int):
    """``(b, lo, hi, end)`` per block of a chunk: its elements ``[lo, end)`` of the chunk, of
    which ``[lo, hi)`` are valid (``valid`` elements of the chunk are)."""
    for b, lo in enumerate(range(0, chunk, block)):
        end = min(lo + block, chunk)
        yield b, lo, max(lo, min(end, valid)), end


def _compress_chunk(u: torch.Tensor, chunk: int, block: int, row: torch.Tensor) -> None:
    """``u`` (the chunk's valid elements, in place) -> row ``row`` (scales, bits); ``u`` becomes
    the error ``u - C(u)``."""
    nb, _ = rows_layout(chunk, block)
    scales = torch.zeros(nb, dtype=torch.float32, device=u.device)
    bits = torch.ones(chunk, dtype=torch.bool, device=u.device)
    for b, lo, hi, _ in _blocks(chunk, block, u.numel()):
        if hi > lo:
            part = u[lo:hi]
            scales[b] = (torch.linalg.vector_norm(part.double()) / (hi - lo) ** 0.5).float()
            bits[lo:hi] = part >= 0
            part.sub_(torch.where(part >= 0, scales[b], -scales[b]))
    row[: 4 * nb].copy_(scales.view(torch.uint8))
    row[4 * nb:].copy_(pack_bits(bits, chunk // 8))


def compress_rows_(x, error, rows, chunk, block):
    if x is not None:
        error.add_(x)
    n = error.numel()
    for j in range(rows.shape[0]):
        lo = min(n, j * chunk)
        _compress_chunk(error[lo: min(n, lo + chunk)], chunk, block, rows[j])


def _signs(rows: torch.Tensor, nb: int, chunk: int) -> torch.Tensor:
    """``[R, chunk]`` +-1 of the rows' bits."""
    return unpack_bits(rows[:, 4 * nb:].contiguous().reshape(-1)).view(rows.shape[0], chunk).float() * 2 - 1


def average_compress_rows_(rows, error, out_row, chunk, block):
    world = rows.shape[0]
    nb, _ = rows_layout(chunk, block)
    m = error.numel()
    weights = row_scales(rows, nb) / world  # [world, nb], fp32 as the kernels form them
    per_element = weights.repeat_interleave(block, dim=1)[:, :chunk]
    terms = (per_element * _signs(rows, nb, chunk))[:, :m]
    for i in range(world):  # in rank order, as the kernels add them
        error.add_(terms[i])
    _compress_chunk(error, chunk, block, out_row)


def decompress_rows_(rows, out, chunk, block):
    nb, _ = rows_layout(chunk, block)
    n = out.numel()
    r = -(-n // chunk) if n else 0
    scales = row_scales(rows[:r], nb).repeat_interleave(block, dim=1)[:, :chunk]
    out.copy_((scales * _signs(rows[:r], nb, chunk)).reshape(-1)[:n])
