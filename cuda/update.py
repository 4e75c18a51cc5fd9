"""The preconditioned exchange's last pass: the momentum taken back from the exchanged average and
the update it makes, in one pass over memory (docs/design.md 2.3.1).

``divide_descend_(y, r, out, segments, divisors, descend, zero_index=None)``
    ``out <- y / r`` (0 where ``r == 0``), divided by ``divisors[s]`` on segment ``s`` (none:
    ``None``), then ``descend`` (a :class:`Descend`, ``dests[s] <- dests[s] * decay +
    (scales[s] * y) * a``) with the same ``y``.

It is :func:`~compressed_opt.cuda.segmented.divide_where_nonzero_` then
:func:`~compressed_opt.cuda.segmented.descend_scaled_`, bit for bit: on contiguous fp32 CPU tensors
``onebit_cpu.c`` runs both in one loop (``y``, ``r``, ``a`` and each destination read once; the C
library forms each element with the same inline functions as the two passes), elsewhere the two
passes run in turn.
"""
from __future__ import annotations

import torch

from .segmented import Segments, _addressable, _c_doubles, _check, _native, descend_scaled_, divide_where_nonzero_


class Descend:
    """``descend_scaled_(dests, y, a, segments, decay, scales)``'s arguments but ``y`` and
    ``segments``: an update to run with the ``y`` of another pass (:func:`divide_descend_`)."""

    def __init__(self, dests: list, a: torch.Tensor, decay: float, scales):
        self.dests, self.a, self.decay, self.scales = dests, a, float(decay), scales

    def apply_(self, y: torch.Tensor, segments: Segments) -> None:
        descend_scaled_(self.dests, y, self.a, segments, self.decay, self.scales)


def _destination_addresses(dests: list, segments: Segments) -> torch.Tensor | None:
    """Each destination's address (0 for an empty one), or ``None`` where one is not contiguous fp32
    CPU memory; raises where one's size is not its segment's."""
    for p, n in zip(dests, segments.sizes):
        if p.numel() != n:
            raise ValueError(f"a destination of {p.numel()} elements for a segment of {n}")
    if not all(_addressable(p) and p.is_cpu and p.dtype is torch.float32 and p.is_contiguous() for p in dests):
        return None
    return torch.tensor([p.data_ptr() if p.numel() else 0 for p in dests], dtype=torch.int64)


def divide_descend_(y: torch.Tensor, r: torch.Tensor, out: torch.Tensor, segments: Segments, divisors,
                    descend: Descend, zero_index: torch.Tensor | None = None) -> None:
    """``out <- y / r`` (0 where ``r == 0``; then ``/ divisors[s]`` on segment ``s`` unless
    ``divisors`` is ``None``) and ``descend.dests[s] <- dests[s] * decay + (scales[s] * y) * a``,
    over the segments' elements of the flat ``y``, ``r``, ``out`` and ``descend.a`` (``out`` not
    ``y``). ``zero_index``: as for :func:`divide_where_nonzero_` (the two passes' mask)."""
    if len(descend.dests) != len(segments):
        raise ValueError(f"one destination per segment is needed ({len(segments)}), got {len(descend.dests)}")
    _check(segments, y, r, out, descend.a)
    n = segments.numel
    lib = _native(y, r, out, descend.a) if out.data_ptr() != y.data_ptr() else None
    addresses = _destination_addresses(descend.dests, segments) if lib is not None else None
    if addresses is None:
        with_divisors = () if divisors is None else (segments, divisors)
        divide_where_nonzero_(y[:n], r[:n], out[:n], zero_index, *with_divisors)
        descend.apply_(y, segments)
        return
    nseg = len(segments)
    v, vp = (None, None) if divisors is None else _c_doubles(divisors, nseg)
    c, cp = _c_doubles(descend.scales, nseg)
    lib.co_divide_descend(y.data_ptr(), r.data_ptr(), out.data_ptr(), vp, segments.offsets.data_ptr(), nseg,
                          addresses.data_ptr(), descend.a.data_ptr(), descend.decay, descend.decay != 1.0, cp)
