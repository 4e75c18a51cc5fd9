"""The backend interface: the few collectives the compressed allreduce and the optimizers need.

A backend is an object with ``rank``, ``world_size`` and equal-split collectives on flat,
contiguous tensors. Every collective takes ``async_op``: with ``False`` it returns once the result
is in ``output``; with ``True`` it returns a :class:`Work` whose ``wait()`` does that (Horovod's
handle life cycle: launch, do other work, ``wait()`` before reading the result).

Each backend counts the bytes it sends (:class:`CommStats`), by the usual algorithms' per-rank
volume: ring allreduce ``2 (N-1)/N * bytes``; allgather ``(N-1) * input bytes``; all-to-all and
reduce-scatter ``(N-1)/N * input bytes``; broadcast ``bytes`` (pipelined). Benchmarks report these beside the
bytes counted on the wire.
"""
from __future__ import annotations

import abc
import collections
from typing import Callable
from collections.abc import Hashable

import torch


class Work:
    """Handle of a collective in flight; ``wait()`` blocks until its output is ready."""

    def wait(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def is_completed(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError


class CompletedWork(Work):
    """The handle of a collective that already finished (synchronous calls, world size 1)."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


#: the handle every finished collective returns (nothing to wait for)
_DONE = CompletedWork()


class ThenWork(Work):
    """A handle that runs ``then()`` once, after ``inner`` completes (e.g. divide after a sum)."""

    def __init__(self, inner: Work, then: Callable[[], None]):
        self._inner, self._then, self._done = inner, then, False

    def wait(self) -> None:
        if not self._done:
            self._inner.wait()
            self._then()
            self._done = True

    def is_completed(self) -> bool:
        return self._done


class CommStats:
    """Bytes sent and calls made by one backend, per collective name; ``total`` of every
    collective, ``inter_node`` of those recorded under ``"inter_node.*"`` (what crossed between
    nodes: :mod:`compressed_opt.exchange`), kept as they are recorded."""

    #: the prefix of what crossed between nodes
    INTER_NODE = "inter_node."

    def __init__(self) -> None:
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.total = 0
        self.inter_node = 0

    def record(self, op: str, nbytes: float) -> None:
        n = int(nbytes)
        self.bytes_sent[op] += n
        self.calls[op] += 1
        self.total += n
        if op.startswith(self.INTER_NODE):
            self.inter_node += n

    @property
    def total_bytes(self) -> int:
        return self.total

    def reset(self) -> None:
        self.bytes_sent.clear()
        self.calls.clear()
        self.total = self.inter_node = 0

    def snapshot(self) -> dict:
        return {"bytes_sent": dict(self.bytes_sent), "calls": dict(self.calls), "total_bytes": self.total_bytes}

    def __repr__(self) -> str:
        ops = ", ".join(f"{op}: {self.calls[op]} calls, {self.bytes_sent[op]:,} B" for op in sorted(self.calls))
        return f"{type(self).__name__}(total {self.total_bytes:,} B sent; {ops or 'nothing yet'})"


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def check_flat(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


class Backend(abc.ABC):
    """Collectives over a fixed group of ``world_size`` ranks. Subclasses implement the ``_``
    methods; the public ones validate shapes and count bytes."""

    name = "abstract"
    max_workspaces = 32

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.stats = CommStats()
        self._workspaces: collections.OrderedDict[Hashable, object] = collections.OrderedDict()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # --- buffers owned by the backend --------------------------------------------------------
    def workspace(self, key: Hashable, factory: Callable[[], object]) -> object:
        """The reusable object stored under ``key`` (made by ``factory`` on first use).

        Communication buffers live as long as the backend that sends them; the least recently
        used are dropped past ``max_workspaces`` entries.
        """
        if key in self._workspaces:
            self._workspaces.move_to_end(key)
            return self._workspaces[key]
        value = factory()
        self._workspaces[key] = value
        while len(self._workspaces) > self.max_workspaces:
            self._workspaces.popitem(last=False)
        return value

    def find_workspace(self, key: Hashable) -> object | None:
        """The object stored under ``key``, or ``None`` (nothing is made)."""
        return self._workspaces.get(key)

    # --- sub-groups --------------------------------------------------------------------------------
    def split(self, groups) -> Backend:
        """A backend over the group of ``groups`` that holds this rank, its ranks numbered in
        ascending order of their rank here.

        ``groups`` is a partition of ``range(world_size)`` (a list of lists of ranks), the same
        on every rank: this is a collective, every rank calls it with the same ``groups`` and in
        the same order relative to other splits. When every group is a single rank no
        communication is needed and each rank gets a :class:`SingleProcessBackend`.
        """
        groups = [sorted(int(r) for r in g) for g in groups]
        members = sorted(r for g in groups for r in g)
        if members != list(range(self.world_size)) or any(not g for g in groups):
            raise ValueError(f"groups must partition the {self.world_size} ranks into non-empty groups, got {groups}")
        mine = next(i for i, g in enumerate(groups) if self.rank in g)
        if all(len(g) == 1 for g in groups):
            return SingleProcessBackend()
        return self._split(groups, mine)

    def duplicate(self) -> Backend:
        """A backend over the same ranks on a communicator of its own: its collectives never
        interleave with this one's, so one thread may communicate on it while another uses this
        backend (or the group it was made from). Collective over this backend's ranks only."""
        if self.world_size == 1:
            return SingleProcessBackend()
        return self._duplicate()

    def _duplicate(self) -> Backend:
        """Subclasses that can make a communicator of their own (see :meth:`duplicate`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot make a communicator of its own")

    def _split(self, groups: list[list[int]], mine: int) -> Backend:
        """Subclasses that can make sub-groups: the backend of ``groups[mine]`` (validated,
        sorted; see :meth:`split`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot split into sub-groups")

    # --- collectives ---------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Work:
        """In place: ``tensor`` becomes the sum (``op="sum"``) or mean (``op="avg"``) over ranks."""
        check_flat("tensor", tensor)
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        n = self.world_size
        self.stats.record("all_reduce", 2 * (n - 1) / n * self._reduction_bytes(tensor))
        return self._finish(self._all_reduce(tensor, op, async_op), async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """``output`` (``world_size * input.numel()``) gets every rank's ``input``, rank-major."""
        check_flat("input", input)
        check_flat("output", output)
        if output.numel() != self.world_size * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"all_gather output must have world_size * {input.numel()} elements of {input.dtype}, "
                f"got {output.numel()} of {output.dtype}"
            )
        self.stats.record("all_gather", (self.world_size - 1) * nbytes(input))
        return self._finish(self._all_gather(output, input, async_op), async_op)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """Equal splits: chunk ``j`` of ``input`` goes to rank ``j``; chunk ``i`` of ``output``
        comes from rank ``i``."""
        check_flat("input", input)
        check_flat("output", output)
        n = self.world_size
        if output.numel() != input.numel() or output.dtype != input.dtype or input.numel() % n:
            raise ValueError(
                "all_to_all needs input and output of equal size and dtype, divisible by world_size; "
                f"got {input.numel()} {input.dtype} and {output.numel()} {output.dtype} for {n} ranks"
            )
        self.stats.record("all_to_all", (n - 1) / n * nbytes(input))
        return self._finish(self._all_to_all(output, input, async_op), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: str = "sum",
                       async_op: bool = False) -> Work:
        """``output`` (``input.numel() / world_size`` elements) gets chunk ``rank`` of the sum
        (``op="sum"``) or mean (``op="avg"``) over ranks of ``input``."""
        check_flat("input", input)
        check_flat("output", output)
        if op not in ("sum", "avg"):
            raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
        if output.numel() * self.world_size != input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"reduce_scatter needs an output of input.numel() / world_size elements of the input's dtype, "
                f"got {output.numel()} {output.dtype} for {input.numel()} {input.dtype} on {self.world_size} ranks"
            )
        n = self.world_size
        self.stats.record("reduce_scatter", (n - 1) / n * self._reduction_bytes(input))
        return self._finish(self._reduce_scatter(output, input, op, async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False) -> Work:
        """In place: every rank's ``tensor`` becomes rank ``src``'s."""
        check_flat("tensor", tensor)
        if not 0 <= src < self.world_size:
            raise ValueError(f"src must be a rank in [0, {self.world_size}), got {src}")
        if self.world_size > 1:
            self.stats.record("broadcast", nbytes(tensor))
        return self._finish(self._broadcast(tensor, src, async_op), async_op)

    def barrier(self) -> None:
        self._barrier()

    def _reduction_bytes(self, t: torch.Tensor) -> int:
        """Bytes a reduction of ``t`` puts on the wire (a backend that reduces a dtype in a wider
        one, like MPI's bf16 in fp32, says so here)."""
        return nbytes(t)

    @staticmethod
    def _finish(work: Work | None, async_op: bool) -> Work:
        """The handle a collective returns: its own where it runs on (``async_op``), else waited
        for; a finished one is the shared :data:`_DONE` (nothing allocated per call)."""
        if async_op:
            return work if work is not None else _DONE
        if work is not None:
            work.wait()
        return _DONE

    @abc.abstractmethod
    def _all_reduce(self, tensor, op, async_op) -> Work | None: ...

    @abc.abstractmethod
    def _all_gather(self, output, input, async_op) -> Work | None: ...

    @abc.abstractmethod
    def _all_to_all(self, output, input, async_op) -> Work | None: ...

    @abc.abstractmethod
    def _reduce_scatter(self, output, input, op, async_op) -> Work | None: ...

    @abc.abstractmethod
    def _broadcast(self, tensor, src, async_op) -> Work | None: ...

    @abc.abstractmethod
    def _barrier(self) -> None: ...


class SingleProcessBackend(Backend):
    """World size 1: every collective is a local copy. What ``get_backend("auto")`` gives a
    plain, non-distributed run."""

    name = "single"

    def __init__(self) -> None:
        super().__init__(rank=0, world_size=1)

    def _all_reduce(self, tensor, op, async_op):
        return None

    def _all_gather(self, output, input, async_op):
        output.copy_(input)

    def _all_to_all(self, output, input, async_op):
        output.copy_(input)

    def _reduce_scatter(self, output, input, op, async_op):
        output.copy_(input)

    def _broadcast(self, tensor, src, async_op):
        return None

    def _barrier(self) -> None:
        return None
