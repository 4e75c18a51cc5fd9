"""Run a compressed optimizer under ``DistributedDataParallel``: a communication hook driven by
the optimizer's stage, so DDP's reducer (its buckets, its overlap with backward) carries the
exchange and DDP sends no other gradient traffic.

* Full-precision steps (warmup): the hook averages DDP's gradient bucket (one all-reduce, the
  same as DDP's default), and ``step()`` uses the averaged gradients without communicating again.
* Compression stage: for optimizers that can exchange inside the hook (:class:`OnebitAdam`), the
  hook forms the local momentum ``m_i = b1 m + (1 - b1) g_i`` of the bucket's parameters, runs the
  1-bit compressed allreduce on it, and hands DDP the averaged momentum, which ``step()`` takes as
  the new momentum. For the others (and under a ``GradScaler``, whose skip decision must come
  first) the hook passes the local gradients through untouched and ``step()`` runs the
  optimizer's own compressed exchange. Either way no full-precision gradient is sent.

The error-feedback buffers of the hook's exchanges are kept per DDP bucket, and saved in the
optimizer's state dict.

Both exchanges run on the bucket's parameters in the optimizer's own order (descending parameter
index, as the optimizer's buckets), not in DDP's: DDP rebuilds its buckets after the first
iteration, in the order the gradients became ready, so a resumed run's first iteration would
otherwise lay the same parameters out differently, and a 3+-rank all-reduce (or the 1-bit
exchange) would round differently. Laid out canonically, a resumed run repeats the uninterrupted
one bit for bit as long as DDP puts the same parameters together in a bucket (always so for a
model that fits one bucket). The copy in and out is skipped when DDP's order is already this one.
"""
import torch
import torch.distributed as dist

from compressed_opt.comm.backend import nbytes

from .optimizer import CompressedOptimizer


class DDPHookState:
    """What the hook needs: the optimizer, the process group, and which step it exchanged for."""

    def __init__(self, optimizer: CompressedOptimizer, process_group=None):
        self.optimizer = optimizer
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.exchanged_step = -1


class CanonicalLayout:
    """A DDP bucket's gradients in the optimizer's order: ``flat`` (DDP's own buffer when its
    order is already the optimizer's, else a scratch buffer kept per bucket), ``views`` of it per
    parameter, and ``key`` naming the bucket by its parameters' indices. ``dtype``: of ``flat``
    (a ``buffer`` of another dtype is copied)."""

    def __init__(self, opt: CompressedOptimizer, params, grads, buffer: torch.Tensor, dtype=None):
        dtype = buffer.dtype if dtype is None else dtype
        order = sorted(range(len(params)), key=lambda i: opt.param_index(params[i]), reverse=True)
        self.key = ",".join(str(opt.param_index(params[i])) for i in order)
        self.order, self.params = order, [params[i] for i in order]
        self.copied = order != list(range(len(params))) or dtype != buffer.dtype
        if not self.copied:
            self.flat, self.views = buffer, list(grads)
            return
        scratch = opt._ddp_scratch.get(self.key)
        if scratch is None or scratch.device != buffer.device or scratch.dtype != dtype:
            scratch = opt._ddp_scratch[self.key] = torch.empty(buffer.numel(), dtype=dtype, device=buffer.device)
        self.flat, self.views, offset = scratch, [], 0
        for p in self.params:
            self.views.append(scratch[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        torch._foreach_copy_(self.views, [grads[i] for i in order])

    def copy_back(self, grads) -> None:
        """DDP's gradients <- the views (nothing to do when ``flat`` is DDP's buffer)."""
        if self.copied:
            torch._foreach_copy_([grads[i] for i in self.order], self.views)


def _average(state: DDPHookState, bucket: dist.GradBucket):
    buffer, grads = bucket.buffer(), bucket.gradients()
    layout = CanonicalLayout(state.optimizer, bucket.parameters(), grads, buffer)
    state.optimizer.backend.stats.record("all_reduce", 2 * (state.world_size - 1) / state.world_size * nbytes(buffer))
    fut = dist.all_reduce(layout.flat, group=state.process_group, async_op=True).get_future()
    world = state.world_size

    def divide(f):
        layout.flat.div_(world)
        layout.copy_back(grads)
        return buffer

    return fut.then(divide)


def _done(value: torch.Tensor):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def compressed_comm_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    opt = state.optimizer
    step = opt.global_step + 1
    buffer = bucket.buffer()
    if opt._needs_average(step):
        return _average(state, bucket)
    # otherwise the local gradients go through, and step() runs the optimizer's own exchange
    if not opt._scaler_seen and opt.ddp_exchange(bucket.index(), bucket.parameters(), bucket.gradients(), buffer):
        state.exchanged_step = step
    return _done(buffer)


def register_ddp_comm_hook(ddp_model, optimizer, process_group=None) -> DDPHookState:
    """Let ``ddp_model``'s reducer carry ``optimizer``'s exchanges (see the module docstring).

    Call once, before the first backward. The optimizer then leaves the full-precision averaging
    to DDP and stops launching its own bucket communication.
    """
    if not isinstance(optimizer, CompressedOptimizer):
        raise TypeError(f"optimizer must be a compressed_opt optimizer, got {type(optimizer).__name__}")
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"ddp_model must be a DistributedDataParallel module, got {type(ddp_model).__name__}")
    if getattr(optimizer, "zero_stage", 0):
        raise ValueError("a ZeRO-sharded optimizer (zero_stage > 0) runs standalone, not under a DDP hook")
    if dist.get_world_size(process_group) != optimizer.backend.world_size:
        raise ValueError("the DDP process group and the optimizer's backend have different world sizes")
    state = DDPHookState(optimizer, process_group)
    optimizer._attach_ddp(state)
    ddp_model.register_comm_hook(state, compressed_comm_hook)
    return state
