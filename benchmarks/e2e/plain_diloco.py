"""DiLoCo written plainly, as the reference beside ``compressed_opt.DiLoCo`` in the end-to-end
benchmark (issue 44's "peer, side by side" with no dependency; torchft's own DiLoCo is set beside ours
by ``benchmarks/diloco_peer.py``, in a venv of its own): every ``H`` inner
steps each parameter's pseudo-gradient ``A - theta`` is averaged with one fp32
``torch.distributed.all_reduce``, ``torch.optim.SGD(momentum=0.9, nesterov=True, lr=0.7)`` steps the
anchor with it, and the parameters are set to the anchor (Douillard et al. 2023, Algorithm 1). No
fragments, no delay, no compression, no rank agreement, nothing of the library."""
from __future__ import annotations

import torch
import torch.distributed as dist


class PlainDiLoCo:
    """``inner`` steps every call; every ``sync_every`` calls, the outer step (see the module doc).
    ``bytes_sent``: the ring all-reduce volume of those all-reduces, ``2 (R-1)/R`` times their bytes
    (how the benchmark counts DDP's)."""

    def __init__(self, params, inner: torch.optim.Optimizer, sync_every: int, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9):
        self.params = [p for p in params if p.requires_grad]
        self.inner, self.sync_every, self.t, self.bytes_sent = inner, sync_every, 0, 0
        with torch.no_grad():
            for p in self.params:  # every replica starts from rank 0's parameters
                dist.broadcast(p, src=0)
        self.anchors = [p.detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.anchors, lr=outer_lr, momentum=outer_momentum, nesterov=True)

    @property
    def param_groups(self):  # (the benchmark loop reads and schedules the inner optimizer's lr)
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.inner.step(closure)
        self.t += 1
        if self.t % self.sync_every == 0:
            world = dist.get_world_size()
            for a, p in zip(self.anchors, self.params):
                a.grad = a - p
                dist.all_reduce(a.grad)
                a.grad.div_(world)
                self.bytes_sent += int(2 * (world - 1) / world * a.grad.numel() * a.grad.element_size())
            self.outer.step()
            for a, p in zip(self.anchors, self.params):
                p.copy_(a)
        return loss
