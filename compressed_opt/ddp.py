"""Run a compressed optimizer under ``DistributedDataParallel``: a communication hook driven by
the optimizer's stage, so a DDP-wrapped model sends exactly what the optimizer alone would.

* Full-precision steps (warmup): the hook averages DDP's gradient bucket (one all-reduce, as
  DDP's default), so ``p.grad`` holds the rank average after backward, as without the hook.
* Compression stage: the hook hands the local gradients back untouched (no full-precision
  traffic), and ``step()`` runs the optimizer's 1-bit exchange on ``p.grad`` as the training
  loop left it, exactly as the optimizer does without DDP.

Found automatically: frameworks (transformers' Trainer, Lightning's DDP strategy, accelerate)
wrap the model in DDP themselves, after the optimizer was made. Until its first step, every
compressed optimizer's engine (:class:`compressed_opt.engine.GradientSync`) watches the forward
passes (one global forward pre-hook, removed once no engine is waiting); the first forward of a
``DistributedDataParallel`` module that holds its parameters registers the hook on it, before any
backward. :func:`register_ddp_comm_hook` does the same by hand. The hook drives the engine (and
through it its algorithm), never the optimizer.

The all-reduce runs on the bucket's parameters in the optimizer's own order (descending
parameter index, as the optimizer's buckets), not in DDP's: DDP rebuilds its buckets after the
first iteration, in the order the gradients became ready, so a resumed run's first iteration
would otherwise lay the same parameters out differently, and a 3+-rank all-reduce would round
differently. The copy in and out is skipped when DDP's order is already this one.
"""

import logging
import weakref

import torch
import torch.distributed as dist

from compressed_opt.comm.backend import nbytes
from compressed_opt.comm.torch_backend import hold
from compressed_opt.cuda import Segments, segment_sumsq

logger = logging.getLogger("compressed_opt")


class DDPHookState:
    """What the hook needs: the optimizer's engine (weakly), the process group, and per DDP bucket
    the scratch buffer that lays it out in the optimizer's order. The engine's averager (DDP made
    the ranks' initial parameters equal, and its hook asks the engine at each bucket)."""

    def __init__(self, engine, process_group=None):
        self._optimizer = weakref.ref(engine)
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.scratch = {}  # key -> torch.Tensor
        #: key -> (compressed_opt.cuda.Segments of the bucket's parameters, their indices in the
        #: optimizer's state_dict order as an int64 tensor): what the sums of squares need
        self.segments = {}
        #: this backward's buckets so far held inf/NaN on this rank (compression stage)
        self.nonfinite = False

    @property
    def optimizer(self):
        """The engine whose averaging the hook carries (``None`` once it is gone)."""
        return self._optimizer()


class CanonicalLayout:
    """A DDP bucket's gradients in the optimizer's order: ``flat`` (DDP's own buffer when its
    order is already the optimizer's, else a scratch buffer kept per bucket), ``views`` of it per
    parameter, and ``key`` naming the bucket by its parameters' indices."""

    def __init__(self, state: DDPHookState, params, grads, buffer: torch.Tensor):
        opt = state.optimizer
        order = sorted(range(len(params)), key=lambda i: opt.param_index(params[i]), reverse=True)
        self.key = ",".join(str(opt.param_index(params[i])) for i in order)
        self.order, self.params = order, [params[i] for i in order]
        self.copied = order != list(range(len(params)))
        if not self.copied:
            self.flat, self.views = buffer, list(grads)
            return
        scratch = state.scratch.get(self.key)
        if scratch is None or scratch.device != buffer.device or scratch.dtype != buffer.dtype:
            scratch = state.scratch[self.key] = torch.empty(buffer.numel(), dtype=buffer.dtype, device=buffer.device)
        self.flat, self.views, offset = scratch, [], 0
        for p in self.params:
            self.views.append(scratch[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        torch._foreach_copy_(self.views, [grads[i] for i in order])

    def copy_back(self, grads) -> None:
        """DDP's gradients <- the views (nothing to do when ``flat`` is DDP's buffer)."""
        if self.copied:
            torch._foreach_copy_([grads[i] for i in self.order], self.views)


def _observe_sums(state: DDPHookState, opt, layout: CanonicalLayout, averaged: bool) -> None:
    """The bucket's per-parameter sums of squares, as the optimizer's gather takes them (of fp32
    values), handed to the optimizer (its variance tracking calibrates with them)."""
    flat = layout.flat if layout.flat.dtype == torch.float32 else layout.flat.float()
    sums = torch.empty(len(layout.params), dtype=torch.float64, device=flat.device)
    known = state.segments.get(layout.key)
    if known is None:
        indices = torch.tensor([opt.param_index(p) for p in layout.params], dtype=torch.int64, device=flat.device)
        known = state.segments[layout.key] = (Segments([p.numel() for p in layout.params]), indices)
    segments, indices = known
    segment_sumsq(flat, segments, sums)
    opt.client.observe_hooked_sums(indices, sums, averaged)


def _average(state: DDPHookState, bucket: dist.GradBucket):
    buffer, grads = bucket.buffer(), bucket.gradients()
    opt = state.optimizer
    layout = CanonicalLayout(state, bucket.parameters(), grads, buffer)
    observe = opt.client.observes_square_sums
    if observe:
        _observe_sums(state, opt, layout, averaged=False)  # the local gradients, before the average
    opt.backend.stats.record("all_reduce", 2 * (state.world_size - 1) / state.world_size * nbytes(buffer))
    hold(layout.flat)  # until torch lets go of it (a Gloo thread letting go after the exit began aborts)
    fut = dist.all_reduce(layout.flat, group=state.process_group, async_op=True).get_future()
    world = state.world_size

    def divide(f):
        layout.flat.div_(world)
        if observe:
            _observe_sums(state, opt, layout, averaged=True)  # the average, before the loop sees it
        layout.copy_back(grads)
        return buffer

    return fut.then(divide)


def _done(value: torch.Tensor):
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _share_nonfinite(state: DDPHookState, opt, bucket: dist.GradBucket) -> None:
    """Compression stage, where DDP sends nothing: whether this rank's buckets hold inf/NaN, and
    at the last bucket whether any rank's do; if so, every rank's last bucket gets a NaN (DDP
    writes it into ``p.grad``), as an all-reduce would have carried one, so every rank's
    GradScaler, or ``step()``, skips alike (:mod:`compressed_opt.engine`)."""
    buffer = bucket.buffer()
    if bucket.index() == 0:
        state.nonfinite = False
    mine = bool(buffer.numel()) and not bool(torch.linalg.vector_norm(buffer, float("inf")).isfinite())
    state.nonfinite = state.nonfinite or mine
    if bucket.is_last() and opt.any_rank_nonfinite(state.nonfinite) and not state.nonfinite and buffer.numel():
        buffer[0] = float("nan")


def compressed_comm_hook(state: DDPHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    opt = state.optimizer
    if opt is not None and bucket.index() == 0:  # (DDP runs its buckets in index order)
        opt.enter_backward()  # every rank in backward, or every rank raises
    if opt is not None and opt.full_precision_next():
        return _average(state, bucket)
    if opt is not None:
        _share_nonfinite(state, opt, bucket)
    return _done(bucket.buffer())  # compression stage: step() runs the optimizer's own exchange


def register_ddp_comm_hook(ddp_model, optimizer, process_group=None) -> DDPHookState:
    """Let ``ddp_model``'s reducer carry ``optimizer``'s full-precision averaging and send
    nothing else (see the module docstring). Done automatically at the first forward of a
    DDP-wrapped model; calling it by hand, before the first backward, is still allowed.
    ``optimizer``: a compressed optimizer, or its engine."""
    engine = getattr(optimizer, "engine", None) if not hasattr(optimizer, "attach_averager") else optimizer
    if engine is None or not callable(getattr(engine, "attach_averager", None)):  # (a CompressedOptimizer)
        raise TypeError(f"optimizer must be a compressed_opt optimizer, got {type(optimizer).__name__}")
    optimizer = engine
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"ddp_model must be a DistributedDataParallel module, got {type(ddp_model).__name__}")
    if optimizer.averager is not None:
        if getattr(ddp_model, "_compressed_opt_state", None) is optimizer.averager:
            return optimizer.averager  # already attached (automatically or by an earlier call)
        raise ValueError(f"this {optimizer.name} already drives another DDP model's hook")
    if getattr(ddp_model, "_comm_hooks", None):
        raise ValueError(
            "this DistributedDataParallel model already has a communication hook; a compressed_opt "
            "optimizer needs its own (it decides what DDP sends). Remove the other hook (e.g. a "
            "framework's ddp_comm_hook option)"
        )
    _check_same_group(optimizer, process_group)
    state = DDPHookState(optimizer, process_group)
    optimizer.attach_averager(state)
    ddp_model.register_comm_hook(state, compressed_comm_hook)
    ddp_model._compressed_opt_state = state
    forget(optimizer)
    return state


def _check_same_group(optimizer, process_group) -> None:
    """Raise unless DDP averages over the ranks the optimizer exchanges over: the same world size
    and, for a ``torch.distributed`` backend, the same ranks (warmup averages over DDP's group and
    the 1-bit exchange over the backend's: other members would silently mix other replicas)."""
    ddp_ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
    backend = optimizer.backend
    fix = (f"pass backend=compressed_opt.comm.TorchBackend(group=<the DDP model's process_group>) to "
           f"{optimizer.name}")
    if len(ddp_ranks) != backend.world_size:
        raise ValueError(f"the DDP model averages over {len(ddp_ranks)} ranks and the optimizer's backend over "
                         f"{backend.world_size}: {fix}")
    group = getattr(backend, "group", False)
    if group is not False:  # (a TorchBackend: its process group's members are known)
        ours = dist.get_process_group_ranks(group or dist.group.WORLD)
        if sorted(ours) != sorted(ddp_ranks):
            raise ValueError(f"the DDP model averages over ranks {sorted(ddp_ranks)} and the optimizer's backend "
                             f"exchanges over ranks {sorted(ours)}: {fix}")


# --- finding the DDP module a framework wrapped the model in --------------------------------------
_waiting: weakref.WeakSet = weakref.WeakSet()
_handle = None


def watch_for_ddp(optimizer) -> bool:
    """Until ``forget(optimizer)`` (an engine: its first step, or attached), the first forward of a
    DDP module holding its parameters attaches it to it; whether it is watched (one rank: never)."""
    global _handle
    if optimizer.backend.world_size == 1 or not dist.is_available() or not dist.is_initialized():
        return False
    _waiting.add(optimizer)
    if _handle is None:
        _handle = torch.nn.modules.module.register_module_forward_pre_hook(_on_forward)
    return True


def forget(optimizer) -> None:
    global _handle
    _waiting.discard(optimizer)
    if not _waiting and _handle is not None:
        _handle.remove()
        _handle = None


def _on_forward(module, args):
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return None
    for opt in list(_waiting):
        ours = {id(p) for g in opt.param_groups for p in g["params"]}
        if any(id(p) in ours for p in module.module.parameters()):
            try:
                opt.client.check_ddp()  # (ZeRO cannot: DDP keeps whole replicas)
            except ValueError:
                forget(opt)
                raise
            register_ddp_comm_hook(module, opt, module.process_group)
            logger.info("%s: found its parameters in a DistributedDataParallel model; its communication "
                        "hook now sends only what the optimizer needs", opt.name)
    return None
