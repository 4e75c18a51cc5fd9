"""Counting and timing communication, per step, without patching the library.

* DDP methods: torch's DDP hook modules get a stand-in for ``torch.distributed`` that counts the
  bytes of every ``all_reduce`` their hooks issue (ring volume) and, with ``--breakdown``, when
  each is in flight; the hooks are timed by a wrapper (:data:`RECORDER`).
* Ours (``--breakdown``), through the library's supported hooks (:class:`OurTiming`): the
  compression kernels and the launcher's waits are reported to an observer
  (``compressed_opt.comm.observe``); the collectives are timed by a :class:`TimedBackend` that
  the optimizer is given as its ``backend=``; ``step()`` is bracketed by torch's
  ``register_step_pre_hook`` / ``register_step_post_hook``.
"""
from __future__ import annotations

import math
import threading
import time

from compressed_opt.comm import Backend, add_observer, remove_observer


# --- DDP: counting and timing what the hooks send -------------------------------------------------
class _CommRecorder:
    """Bytes the DDP hooks send (ring volume), and, when ``timing``, the in-flight intervals of
    their allreduces and the time spent inside the hook calls."""

    def __init__(self):
        self.bytes = 0
        self.timing = False
        self.intervals: list[tuple[float, float]] = []
        self.hook_s = 0.0
        self.lock = threading.Lock()


RECORDER = _CommRecorder()


class _CountingDist:
    """Stands in for ``torch.distributed`` inside torch's DDP hook modules: ``all_reduce`` is
    counted (and timed), everything else is ``torch.distributed``'s own."""

    def __init__(self, dist_module):
        self._dist = dist_module

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        world = self._dist.get_world_size(kwargs.get("group"))
        with RECORDER.lock:
            RECORDER.bytes += int(2 * (world - 1) / world * tensor.numel() * tensor.element_size())
        start = time.perf_counter()
        work = self._dist.all_reduce(tensor, *args, **kwargs)
        if RECORDER.timing and work is not None:
            fut = work.get_future()

            def done(f, start=start):
                with RECORDER.lock:
                    RECORDER.intervals.append((start, time.perf_counter()))
                return f.value()

            return _WorkWithFuture(work, fut.then(done))
        return work


class _WorkWithFuture:
    def __init__(self, work, fut):
        self._work, self._fut = work, fut

    def get_future(self):
        return self._fut

    def wait(self, *a, **k):
        return self._work.wait(*a, **k)


def install_counting_dist() -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    for module in (default_hooks, powerSGD_hook):
        if not isinstance(module.dist, _CountingDist):
            module.dist = _CountingDist(dist)


def timed_hook(hook):
    def wrapper(state, bucket):
        if not RECORDER.timing:
            return hook(state, bucket)
        start = time.perf_counter()
        try:
            return hook(state, bucket)
        finally:
            with RECORDER.lock:
                RECORDER.hook_s += time.perf_counter() - start

    wrapper.__name__ = getattr(hook, "__name__", "hook")
    return wrapper


def union_length(intervals) -> float:
    """Seconds covered by the union of ``(start, end)`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# --- ours: the library's hooks (--breakdown) --------------------------------------------------------
class _TimedWork:
    """The handle of an asynchronous collective, whose ``wait()`` is timed."""

    def __init__(self, work, timing: OurTiming):
        self._work, self._timing = work, timing

    def wait(self) -> None:
        start = time.perf_counter()
        try:
            return self._work.wait()
        finally:
            self._timing.collective(start, time.perf_counter())

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


class TimedBackend(Backend):
    """``inner`` with its collectives timed: the time each call holds its thread and, for
    ``async_op=True``, the time its handle's ``wait()`` does. Bytes are counted once, by
    ``inner`` (``stats`` is ``inner.stats``); buffers kept for the compressed allreduce live here,
    so that its collectives come through this backend."""

    def __init__(self, inner: Backend, timing: OurTiming):
        super().__init__(inner.rank, inner.world_size)
        self.inner, self._timing = inner, timing
        self.name = inner.name
        self.stats = inner.stats

    def __repr__(self) -> str:
        return f"TimedBackend({self.inner!r})"

    def _timed(self, call, async_op: bool, *args, **kwargs):
        start = time.perf_counter()
        try:
            work = call(*args, async_op=async_op, **kwargs)
        finally:
            self._timing.collective(start, time.perf_counter())
        return _TimedWork(work, self._timing) if async_op else work

    def all_reduce(self, tensor, op="sum", async_op=False):
        return self._timed(self.inner.all_reduce, async_op, tensor, op=op)

    def all_gather(self, output, input, async_op=False):
        return self._timed(self.inner.all_gather, async_op, output, input)

    def all_to_all(self, output, input, async_op=False):
        return self._timed(self.inner.all_to_all, async_op, output, input)

    def reduce_scatter(self, output, input, op="sum", async_op=False):
        return self._timed(self.inner.reduce_scatter, async_op, output, input, op=op)

    def broadcast(self, tensor, src=0, async_op=False):
        return self._timed(self.inner.broadcast, async_op, tensor, src=src)

    def barrier(self) -> None:
        self.inner.barrier()

    # the public collectives above delegate to ``inner``; these are never reached
    def _all_reduce(self, tensor, op, async_op):  # pragma: no cover
        raise NotImplementedError

    _all_gather = _all_to_all = _broadcast = _all_reduce

    def _reduce_scatter(self, output, input, op, async_op):  # pragma: no cover
        raise NotImplementedError

    def _barrier(self) -> None:  # pragma: no cover
        raise NotImplementedError


class OurTiming:
    """Per step, for one of our optimizers: seconds in compression kernels (any thread), seconds
    in collectives (any thread: calls and waits of handles), and the seconds ``step()`` waits for
    or runs communication on the training thread (the launcher's ``wait``/``run_inline`` and the
    kernels and collectives ``step()`` runs itself, e.g. 0/1 Adam's synchronisations; nested
    calls count once). :meth:`wrap` the backend before the optimizer is made, :meth:`attach` the
    optimizer, :meth:`take` after each step, :meth:`remove` at the end."""

    def __init__(self):
        self._main = threading.get_ident()  # the training thread
        self._lock = threading.Lock()
        self._in_step = False
        self._kernels_s = 0.0
        self._collectives_s = 0.0
        self._held: list[tuple[float, float]] = []  # the training thread in step(): kernels, collectives, waits
        self._handles: list = []
        self._observing = False

    def wrap(self, backend: Backend) -> TimedBackend:
        return TimedBackend(backend, self)

    def attach(self, optimizer) -> None:
        self._handles += [optimizer.register_step_pre_hook(self._step_starts),
                          optimizer.register_step_post_hook(self._step_ends)]
        add_observer(self._observe)
        self._observing = True

    def _step_starts(self, optimizer, args, kwargs) -> None:
        self._in_step = True

    def _step_ends(self, optimizer, args, kwargs) -> None:
        self._in_step = False

    def _holds(self) -> bool:
        """Whether the call that just ended held the training thread inside ``step()``."""
        return self._in_step and threading.get_ident() == self._main

    def _observe(self, kind: str, name: str, start: float, end: float) -> None:
        if kind not in ("kernel", "wait"):
            return
        held = self._holds()
        with self._lock:
            if kind == "kernel":
                self._kernels_s += end - start
            if held:
                self._held.append((start, end))

    def collective(self, start: float, end: float) -> None:
        """A call of the wrapped backend (or a wait of its handle) took ``[start, end]``."""
        held = self._holds()
        with self._lock:
            self._collectives_s += end - start
            if held:
                self._held.append((start, end))

    def take(self) -> tuple[float, float, float]:
        """``(kernels_s, collectives_s, wait_s)`` since the last call; starts counting anew."""
        with self._lock:
            kernels, collectives, held = self._kernels_s, self._collectives_s, self._held
            self._kernels_s = self._collectives_s = 0.0
            self._held = []
        return kernels, collectives, union_length(held)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._observing:
            remove_observer(self._observe)
            self._observing = False
