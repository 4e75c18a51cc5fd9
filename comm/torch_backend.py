"""The ``torch.distributed`` backend: NCCL for CUDA tensors, Gloo for CPU tensors, any group.

*Torch's threads and the interpreter's exit.* Gloo's worker threads (and NCCL's watchdog) hold a
reference to every tensor of a collective until a moment after it completed, and letting go of a
tensor that has a Python object takes the GIL (torch decrefs the object, whether or not Python
still holds it). Once the interpreter has begun to exit, taking the GIL ends the thread with
``pthread_exit``, whose unwind through torch's C++ destructors aborts the process ("terminate
called without an active exception"): a job whose last collective finished just before exit died
now and then (seen here: 1 exit in about 50, under load; torch's ``destroy_process_group`` does
not join those threads while a DDP module still holds the group; dropping that module joins
them with the GIL held, which hangs a thread that has a tensor left to let go of). So the backend keeps the
tensors of its recent collectives with their reference counts from before it sent them
(:func:`hold`), and at exit, while the interpreter is still whole, waits until torch has let go
of them (:func:`_drain`, registered with ``atexit``; at most :data:`DRAIN_TIMEOUT_S`).
"""
from __future__ import annotations

import atexit
import collections
import pickle
import threading
import time

import torch
import torch.distributed as dist

from .backend import Backend, ThenWork, Work

# torch >= 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


#: the tensors of the last collectives that torch may still hold, one entry per call: pairs of
#: the tensor and its reference count before the call
_HELD: collections.deque[tuple[tuple[torch.Tensor, int], ...]] = collections.deque(maxlen=16)
_HELD_LOCK = threading.Lock()  # collectives are issued from the training and the communication thread
#: the longest the interpreter's exit waits for torch's threads to let go of the held tensors
DRAIN_TIMEOUT_S = 5.0


def _released(entry) -> bool:
    return all(t._use_count() <= before for t, before in entry)


def hold(*tensors: torch.Tensor) -> None:
    """Keep ``tensors`` (about to be sent) with their reference counts now, in an entry of the last
    16 calls; the entries torch has let go of since (every count back where it was) are dropped.
    Cost per call: at most 32 reference counts read. Every tensor the library hands to a
    ``torch.distributed`` collective goes through here first: this backend's calls, and the one
    made on torch's own terms (the DDP hook's average, whose future DDP waits for)."""
    entry = []
    for t in tensors:
        entry.append((t, t._use_count()))
    with _HELD_LOCK:
        kept = []
        for e in _HELD:
            for t, before in e:
                if t._use_count() > before:  # (not let go of yet: _released)
                    kept.append(e)
                    break
        _HELD.clear()
        _HELD.extend(kept)
        _HELD.append(tuple(entry))


def _drain(timeout: float = DRAIN_TIMEOUT_S, tensors=None) -> bool:
    """Wait (sleeping, so torch's threads can take the GIL) until torch has let go of every held
    tensor, or of the held ones among ``tensors``, at most ``timeout`` seconds; whether it did.
    Run at exit (every tensor)."""
    deadline = time.monotonic() + timeout
    ids = None if tensors is None else {id(t) for t in tensors}
    while True:
        with _HELD_LOCK:
            pending = [e for e in _HELD if not _released(e)]
            _HELD.clear()
            _HELD.extend(pending)
        if ids is not None:
            pending = [e for e in pending if any(id(t) in ids for t, _ in e)]
        if not pending:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


atexit.register(_drain)


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
        hold(tensor)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return self._mean_after(work, tensor, op, async_op)

    def _all_gather(self, output, input, async_op) -> Work | None:
        hold(output, input)
        return _all_gather_single(output, input, group=self.group, async_op=async_op)

    def _all_to_all(self, output, input, async_op) -> Work | None:
        hold(output, input)
        return dist.all_to_all_single(output, input, group=self.group, async_op=async_op)

    def _reduce_scatter(self, output, input, op, async_op) -> Work | None:
        if self.process_group_backend == "gloo" and input.device.type == "cpu" and self.world_size > 1:
            return self._reduce_scatter_by_all_to_all(output, input, op, async_op)
        hold(output, input)
        work = _reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return self._mean_after(work, output, op, async_op)

    def _reduce_scatter_by_all_to_all(self, output, input, op, async_op) -> Work | None:
        """Gloo's reduce-scatter as an all-to-all of the chunks and the sum of the ``W`` received
        chunks here, in rank order: the same ``(W-1)/W`` of the bytes on the wire, in less than half
        the time of Gloo's own (9M fp32 elements on 2 loopback ranks: 33-42 ms against 75-91 ms;
        4M on 4 ranks: 30 against 52). The received chunks go to one buffer per thread and dtype,
        as large as the largest call so far (a fresh one for an asynchronous call)."""
        W = self.world_size
        if async_op:
            received = torch.empty_like(input)
        else:
            slot = self.workspace(("reduce_scatter", threading.get_ident(), input.dtype, input.device), list)
            if not slot or slot[0].numel() < input.numel():
                slot[:] = [torch.empty_like(input)]
            received = slot[0][: input.numel()]
        hold(received, input)
        work = dist.all_to_all_single(received, input, group=self.group, async_op=async_op)

        def reduce():
            chunks = received.view(W, -1)
            torch.add(chunks[0], chunks[1], out=output)
            for j in range(2, W):
                output.add_(chunks[j])
            if op == "avg":
                output.mul_(1.0 / W)

        if async_op:
            return ThenWork(work, reduce)
        reduce()
        return work

    def _broadcast(self, tensor, src, async_op) -> Work | None:
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        hold(tensor)
        return dist.broadcast(tensor, src=global_src, group=self.group, async_op=async_op)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (picklable, small: results, logs), in rank order; a collective.
        What ``torch.distributed.all_gather_object`` does, but it returns only once torch's
        threads have let go of its tensors (the module docstring): safe as a script's last
        collective, before its exit or before it drops a DDP module, whose process group's
        destructor joins those threads while holding the GIL (a Gloo thread that still has to let
        go of a tensor then waits for the GIL forever: a hang, seen 1 in about 150 jobs)."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.process_group_backend == "nccl" else None
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        self.all_gather(sizes, mine)
        counts = sizes.tolist()
        padded = torch.zeros(max(counts), dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        rows = torch.empty(self.world_size * padded.numel(), dtype=torch.uint8, device=device)
        self.all_gather(rows, padded)
        _drain(tensors=(mine, sizes, rows, padded))  # once torch let go of them (module docstring; before any view)
        rows = rows.view(self.world_size, -1).cpu()
        return [pickle.loads(rows[r, :n].numpy().tobytes()) for r, n in enumerate(counts)]

    def _duplicate(self):
        """A new process group of the same ranks, made by those ranks alone
        (``use_local_synchronization``: with HSDP every replicate group makes its own)."""
        ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        return TorchBackend(group=dist.new_group(ranks, backend=self.process_group_backend,
                                                 use_local_synchronization=True))

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

