"""Gradient synchronisation from backward: readiness hooks, an in-order launcher, and the end of
backward.

The rule this module keeps (docs/design.md 3.1): after the last ``backward()``
of a step, ``p.grad`` holds

* in a full-precision step (warmup; 0/1 Adam's variance refreshes): the rank average of the
  gradients, exactly what ``DistributedDataParallel`` leaves there;
* in a compression-stage step: this rank's own gradient (nothing is averaged at full precision;
  the 1-bit exchange of ``step()`` carries the momentum formed from it),

and ``step()`` uses ``p.grad`` as the training loop left it (clipped, unscaled, scaled in place).

How: every trainable parameter gets a post-accumulate-grad hook. The first hook of a backward
queues an end-of-backward callback on the autograd engine (as DDP's reducer does). When a bucket's
gradients are complete (``accumulation_steps`` times over), the hook copies them into the bucket's
flat buffer on the autograd thread, and buckets are launched strictly in bucket order (bucket
``i`` waits for ``0..i-1``) on one communication thread, so every rank issues the same
collectives in the same order. The communication thread only ever touches the flat buffers,
never ``p.grad``: nothing races the training loop. At the end of backward, the callback waits for
what is in flight, communicates what never became ready (parameters without gradients), and, in a
full-precision step, writes the averages into ``p.grad`` before ``backward()`` returns.

In the compression stage the exchange changes state (momentum, error feedback), so it may only
run ahead of ``step()`` when the loop does not touch the gradients in between: the optimizer
watches (the gradients' version counters, recorded here when backward left them) and launches
the 1-bit exchange from backward only while the ranks agree that the loop leaves ``p.grad`` alone.

What holds the calling thread (:meth:`BucketLauncher.wait`, :meth:`BucketLauncher.run_inline`) is
reported to the observers of :mod:`compressed_opt.comm.observe` (``kind="wait"``).

Horovod's life cycle: launch, keep computing, wait. The hooks hold the launcher weakly and are
removed by :meth:`BucketLauncher.close` or when the launcher is garbage collected, so a discarded
optimizer stops communicating.
"""
from __future__ import annotations

import contextlib
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from compressed_opt.comm import observe

from .buckets import Bucket


class GradientsAccumulatedWithoutNoSync(RuntimeError):
    pass


class GradientsChangedAfterLaunch(RuntimeError):
    pass


def _release(handles: list, pool: dict) -> None:
    """Remove the hooks and stop the thread (``close()`` or garbage collection)."""
    for h in handles:
        h.remove()
    handles.clear()
    executor = pool.pop("executor", None)
    if executor is not None:
        executor.shutdown(wait=False)


@torch._disable_dynamo
def _hook(ref: weakref.ref, param: torch.Tensor) -> None:
    launcher = ref()
    if launcher is not None:
        launcher._on_gradient(param)


class BucketLauncher:
    """The life cycle of one optimizer's gradient communication around backward.

    ``callbacks`` is what the optimizer provides (:class:`compressed_opt.stepping.LauncherCallbacks`,
    bound weakly to it): ``prepare()`` (at the first hook of a backward: buckets and the launch
    policy for this step), ``gather(bucket)`` (the bucket's gradients into its flat buffer),
    ``gather_ahead(bucket)`` (the same for a bucket launched from backward; whether it is finite),
    ``exchange_group(buckets)`` (the collectives on their buffers, thread-safe),
    ``finish_backward(launched)`` (at the end of a backward that completes the step's
    gradients)."""

    def __init__(self, callbacks, accumulation_steps: int = 1):
        self._owner = callbacks
        self.accumulation_steps = accumulation_steps
        self.enabled = True  # False while a DDP hook carries the communication, or after close()
        self.launch_ahead = False  # set per step by prepare(): buckets may go out during backward
        self._suspended = 0
        self._handles: list = []
        self._hooked: set[int] = set()
        self._pool: dict = {}
        self._buckets: list[Bucket] = []
        self._index: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _release, self._handles, self._pool)
        self._reset()

    def _reset(self) -> None:
        n = len(self._buckets)
        self._fired = [0] * n
        self._ready = [False] * n
        self._next = 0
        self._futures: list[Future | None] = [None] * n
        self._late = False
        self._in_backward = False
        self._passes = 0
        #: the step's gradients were completed by backward (and, in a full-precision step, averaged)
        self.finished = False
        #: a bucket launched ahead held inf/NaN (it went out as zeros; step() skips on every rank)
        self.nonfinite = False
        #: per parameter of the buckets: (grad tensor, version) when backward left it
        self._left: dict[int, tuple[torch.Tensor, int]] = {}

    # --- parameters and buckets -----------------------------------------------------------------
    def watch(self, params) -> None:
        """Hook every parameter of ``params`` that requires grad and has no hook yet."""
        if not self._finalizer.alive:
            return  # closed
        ref = weakref.ref(self)
        for p in params:
            if p.requires_grad and id(p) not in self._hooked:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda param, ref=ref: _hook(ref, param)))
                self._hooked.add(id(p))

    def attach(self, buckets: list[Bucket], groups: list[list[int]] | None = None) -> None:
        """Take ``buckets`` (replacing earlier ones); their parameters get hooks if they have none.
        ``groups``: consecutive runs of bucket indices exchanged together (a run goes out when its
        last bucket is ready); by default each bucket alone."""
        self._buckets = buckets
        groups = groups if groups is not None else [[b.index] for b in buckets]
        #: per bucket index, the last index of its exchange group
        self._group_last = {i: g[-1] for g in groups for i in g}
        self._index = {id(p): b.index for b in buckets for p in b.params}
        self.watch(p for b in buckets for p in b.params)
        self._reset()

    @contextlib.contextmanager
    def suspended(self):
        """Backward passes inside do not count (gradient accumulation: ``no_sync``)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    # --- during backward ------------------------------------------------------------------------
    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self.enabled or self._suspended:
            return
        if not self._in_backward:
            if self._passes == 0 and not self.finished:
                self._owner.prepare()  # may rebuild the buckets (nothing is in flight yet)
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        index = self._index.get(id(param))
        if index is None:
            return  # not in the current buckets (its requires_grad changed: the next step rebuilds)
        if self.finished:
            self._late = True  # a gradient arrived after its bucket had been communicated
            return
        self._fired[index] += 1
        need = len(self._buckets[index].params) * self.accumulation_steps
        if self._fired[index] == need:
            self._ready[index] = True
            if self.launch_ahead:
                while self._next < len(self._buckets) and all(self._ready[self._next: self._last(self._next) + 1]):
                    self._submit(self._next)

    def _last(self, index: int) -> int:
        return self._group_last.get(index, index)

    def _submit(self, index: int) -> None:
        """Launch the exchange group that starts at bucket ``index``."""
        buckets = self._buckets[index: self._last(index) + 1]
        # on the autograd thread: the communication thread never reads p.grad
        for bucket in buckets:
            if not self._owner.gather_ahead(bucket):
                self.nonfinite = True
        executor = self._pool.get("executor")
        if executor is None:
            executor = self._pool["executor"] = ThreadPoolExecutor(max_workers=1,
                                                                    thread_name_prefix="compressed_opt_comm")
        self._futures[index] = executor.submit(self._owner.exchange_group, buckets)
        self._next = index + len(buckets)

    @torch._disable_dynamo
    def _end_of_backward(self) -> None:
        self._in_backward = False
        self._passes += 1
        if self._passes < self.accumulation_steps or self.finished:
            return
        self.finished = True
        self._owner.finish_backward(self._next)
        self._remember_gradients()

    def _remember_gradients(self) -> None:
        left = self._left
        for b in self._buckets:
            for p in b.params:
                g = p.grad
                if g is not None:
                    left[id(p)] = (g, g._version)

    # --- in step() ------------------------------------------------------------------------------
    def touched(self) -> bool:
        """Whether the loop changed some ``p.grad`` since backward left it (in place, replaced,
        set or removed). Only meaningful when :attr:`finished`."""
        left = self._left
        for b in self._buckets:
            for p in b.params:
                g = p.grad
                seen = left.get(id(p))
                if seen is None:
                    if g is not None:
                        return True
                elif g is not seen[0] or g._version != seen[1]:
                    return True
        return False

    @property
    def launched(self) -> int:
        """How many buckets were launched from backward in this step."""
        return self._next

    def wait(self, late_ok: bool = False) -> list[int]:
        """Wait for the buckets backward launched, in order; their indices. Re-raises the first
        error of the communication thread (after all of them ended); raises if gradients arrived
        after their bucket left."""
        done, errors = [], []
        with observe.span("wait", "wait"):  # fut.exception() blocks until the bucket is done
            for i, fut in enumerate(self._futures):
                if fut is not None:
                    if fut.exception() is not None:
                        errors.append(fut.exception())
                    done.append(i)
        if errors:
            self._futures = [None] * len(self._futures)
            raise errors[0]
        if self._late and not late_ok:
            raise GradientsAccumulatedWithoutNoSync(
                "gradients arrived after their bucket had been communicated: several backward "
                "passes ran before step(). For gradient accumulation wrap all but the last in "
                "`with optimizer.no_sync():`, or pass accumulation_steps=N to the optimizer."
            )
        return done

    def run_inline(self, indices, gather: bool = True) -> None:
        """Communicate these buckets now, on the calling thread, in bucket order, each exchange
        group's together."""
        with observe.span("wait", "run_inline"):
            for members in self.groups_of(indices):
                buckets = [self._buckets[i] for i in members]
                if gather:
                    for b in buckets:
                        self._owner.gather(b)
                self._owner.exchange_group(buckets)

    def groups_of(self, indices) -> list[list[int]]:
        """``indices`` in order, cut where an exchange group ends."""
        out: list[list[int]] = []
        for i in sorted(indices):
            if out and out[-1][-1] == i - 1 and self._last(out[-1][0]) >= i:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def reset(self) -> None:
        """Forget this step's readiness (after ``step()`` or a skipped step)."""
        self._reset()

    def in_flight(self) -> bool:
        return any(f is not None and not f.done() for f in self._futures)

    def idle(self) -> bool:
        """Between steps: no backward of the coming step has reached the hooks yet (nothing
        gathered, launched or finished; what ``reset()`` leaves)."""
        return not (self.finished or self._passes or self._in_backward or self._next or any(self._fired))

    def close(self) -> None:
        """Wait for what is in flight, remove the hooks, stop the thread. Idempotent."""
        for fut in self._futures:
            if fut is not None:
                with contextlib.suppress(Exception):
                    fut.result()
        self.enabled = False
        executor = self._pool.get("executor")
        self._finalizer()
        if executor is not None:
            executor.shutdown(wait=True)
        self._hooked.clear()
