"""Reference implementation of the compression kernels in plain PyTorch.

Readable, allocating, slow: the definition the fast paths (``cpu``, ``gpu``) are tested against,
and the CPU fallback where no C compiler is available. The math (docs/design.md 2.1, 2.2):

* compress: ``u = x + e``; ``s = ||u|| / sqrt(n)``; ``b_k = [u_k >= 0]``; ``e <- u - s (2b - 1)``.
* average-compress (server): ``z = e + (1/N) sum_i s_i (2 b_i - 1)``, then compress ``z`` with ``e``.
* decompress: ``out_k = s_{k // c} (2 b_k - 1)`` for chunks of ``c = 8 * row_bytes`` elements.

Bit ``k`` of a packed buffer is bit ``k % 8`` (least significant first) of byte ``k // 8``.
"""
from __future__ import annotations

import torch

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


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


def _scale(u: torch.Tensor) -> torch.Tensor:
    if u.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=u.device)
    return (torch.linalg.vector_norm(u.double()) / u.numel() ** 0.5).float()


def _compress_in_place(u: torch.Tensor, packed: torch.Tensor, scale_out: torch.Tensor, finish: bool) -> None:
    packed.copy_(pack_bits(u >= 0, packed.numel()))
    scale_out.copy_(_scale(u).reshape(scale_out.shape))
    if finish:
        finish_(u, scale_out)


def finish_(error, scale_out):
    scale = scale_out.reshape(())
    error.sub_(torch.where(error >= 0, scale, -scale))


def compress_(x, error, packed, scale_out, finish=True):
    if x is not None:
        error.add_(x)
    _compress_in_place(error, packed, scale_out, finish)


def average_compress_(chunks, scales, error, packed, scale_out, finish=True):
    world = chunks.shape[0]
    n = error.numel()
    signs = unpack_bits(chunks).view(world, -1)[:, :n].float() * 2 - 1
    error.add_(((scales.view(world, 1) / world) * signs).sum(dim=0))
    _compress_in_place(error, packed, scale_out, finish)


def decompress_(packed, scales, out):
    chunk = packed.shape[-1] * 8
    signs = unpack_bits(packed.contiguous())[: out.numel()].float() * 2 - 1
    per_element = scales.repeat_interleave(chunk)[: out.numel()]
    out.copy_(per_element * signs)
