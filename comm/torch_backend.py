"""The ``torch.distributed`` backend: NCCL for CUDA tensors, Gloo for CPU tensors, any group."""
from __future__ import annotations

import torch.distributed as dist

from .backend import Backend, ThenWork, Work

# torch >= 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class TorchBackend(Backend):
    """Collectives of a ``torch.distributed`` process group (``group=None``: the default group).

    The process group must be initialised first (``dist.init_process_group``, as ``torchrun``
    scripts do). Gloo has no ``AVG`` reduction: ``op="avg"`` sums, then divides.
    """

    name = "torch"

    def __init__(self, group=None):
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "TorchBackend needs an initialised torch.distributed process group: call "
                "torch.distributed.init_process_group(...) first (torchrun sets the environment "
                "it reads), or use get_backend('mpi') under mpiexec"
            )
        self.group = group
        super().__init__(rank=dist.get_rank(group), world_size=dist.get_world_size(group))
        self.process_group_backend = dist.get_backend(group)

    def _mean_after(self, work, result, op, async_op):
        """Gloo has no AVG: divide the sum once it has arrived."""
        if op != "avg":
            return work
        scale = 1.0 / self.world_size
        if async_op:
            return ThenWork(work, lambda: result.mul_(scale))
        result.mul_(scale)
        return work

    def _all_reduce(self, tensor, op, async_op):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return self._mean_after(work, tensor, op, async_op)

    def _all_gather(self, output, input, async_op) -> Work | None:
        return _all_gather_single(output, input, group=self.group, async_op=async_op)

    def _all_to_all(self, output, input, async_op) -> Work | None:
        return dist.all_to_all_single(output, input, group=self.group, async_op=async_op)

    def _reduce_scatter(self, output, input, op, async_op) -> Work | None:
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return self._mean_after(work, output, op, async_op)

    def _broadcast(self, tensor, src, async_op) -> Work | None:
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        return dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _split(self, groups, mine):
        """``new_group`` for every group, in order, on every rank (what ``torch.distributed``
        requires of a group made without local synchronisation); the group of one that spans
        this backend's whole group is that group itself."""
        if len(groups) == 1:
            return TorchBackend(group=self.group)
        if self.world_size != dist.get_world_size():
            raise ValueError(
                f"TorchBackend.split needs a backend over the whole job (its {self.world_size} ranks are a "
                f"sub-group of {dist.get_world_size()}): the ranks outside it would have to join every new_group"
            )
        global_rank = (lambda r: r) if self.group is None else (lambda r: dist.get_global_rank(self.group, r))
        made = None
        for i, group in enumerate(groups):
            pg = dist.new_group([global_rank(r) for r in group], backend=self.process_group_backend)
            if i == mine:
                made = pg
        return TorchBackend(group=made)

    def __repr__(self) -> str:
        return f"TorchBackend({self.process_group_backend}, rank={self.rank}, world_size={self.world_size})"

