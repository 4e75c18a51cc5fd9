"""Launching bucket communication from backward: readiness hooks and an in-order launcher.

Each parameter gets a post-accumulate-grad hook. When backward has produced every gradient of a
bucket (``accumulation_steps`` times over, with gradient accumulation), the bucket is *ready*;
ready buckets are launched strictly in bucket order (bucket ``i`` waits for ``0..i-1``), the way
DDP's reducer does, so every rank issues the same collectives in the same order whatever the
timing of its backward. A launch runs the optimizer's communication for the bucket on one
communication thread (the kernels and collectives release the GIL), overlapping with the rest of
backward; ``step()`` waits for them (``wait()``) and communicates inline what never became ready
(parameters without gradients this step), in order. Horovod's life cycle: launch, keep computing, wait.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .buckets import Bucket


class GradientsAccumulatedWithoutNoSync(RuntimeError):
    pass


class BucketLauncher:
    def __init__(self, launch: Callable[[Bucket], None], accumulation_steps: int = 1):
        self._launch = launch
        self.accumulation_steps = accumulation_steps
        self.enabled = False  # set by the optimizer for the coming backward
        self._suspended = 0
        self._handles: list = []
        self._buckets: list[Bucket] = []
        self._executor: ThreadPoolExecutor | None = None
        self._reset()

    def _reset(self) -> None:
        n = len(self._buckets)
        self._fired = [0] * n
        self._ready = [False] * n
        self._next = 0
        self._futures: list[Future | None] = [None] * n
        self._late = False

    def attach(self, buckets: list[Bucket], hooks: bool = True) -> None:
        """Take ``buckets`` (replacing earlier ones); with ``hooks``, watch their gradients."""
        self.detach()
        self._buckets = buckets
        self._reset()
        for b in buckets if hooks else ():
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook_for(b.index)))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook_for(self, index: int):
        def hook(_param):
            self._on_gradient(index)

        return hook

    @contextlib.contextmanager
    def suspended(self):
        """Backward passes inside do not count (gradient accumulation: ``no_sync``)."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _on_gradient(self, index: int) -> None:
        if not self.enabled or self._suspended:
            return
        self._fired[index] += 1
        need = len(self._buckets[index].params) * self.accumulation_steps
        if self._fired[index] > need:
            self._late = True  # a gradient arrived after its bucket was sent
        elif self._fired[index] == need:
            self._ready[index] = True
            while self._next < len(self._buckets) and self._ready[self._next]:
                self._submit(self._next)

    def _submit(self, index: int) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compressed_opt_comm")
        self._futures[index] = self._executor.submit(self._launch, self._buckets[index])
        self._next = index + 1

    @property
    def launched(self) -> int:
        """How many buckets were launched from backward in this step."""
        return self._next

    def wait(self) -> list[int]:
        """Wait for the buckets backward launched, in order; their indices. Re-raises the first
        error of the communication thread; raises if gradients arrived after their bucket left."""
        done = []
        for i, fut in enumerate(self._futures):
            if fut is not None:
                fut.result()
                done.append(i)
        if self._late:
            raise GradientsAccumulatedWithoutNoSync(
                "gradients arrived after their bucket had been communicated: several backward "
                "passes ran before step(). For gradient accumulation wrap all but the last in "
                "`with optimizer.no_sync():`, or pass accumulation_steps=N to the optimizer "
                "(or overlap=False)."
            )
        return done

    def run_inline(self, indices) -> None:
        """Communicate these buckets now, on the calling thread, in bucket order."""
        for i in sorted(indices):
            self._launch(self._buckets[i])

    def reset(self) -> None:
        """Forget this step's readiness (after ``step()`` or a skipped step)."""
        self._reset()

    def close(self) -> None:
        self.detach()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
