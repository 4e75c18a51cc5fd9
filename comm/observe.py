"""Observers: a supported way to see where the library's communication time goes.

Profilers and benchmarks register an *observer*; the library reports to it

* ``kind="kernel"``: each compression kernel the compressed allreduce runs, ``name`` one of
  ``"compress_"``, ``"finish_"``, ``"average_compress_"``, ``"decompress_"``
  (:mod:`compressed_opt.cuda`); on whichever thread runs the allreduce (the optimizer's
  communication thread while buckets go out during backward, else the caller's);
* ``kind="wait"``: each time a thread is held by an optimizer's gradient buckets
  (:class:`compressed_opt.engine.GradientSync`): ``name="wait"``, waiting for the buckets
  launched from backward; ``name="run_inline"``, communicating buckets itself (their kernels and
  collectives run inside, and are reported too).

An observer is a callable ``observer(kind, name, start, end)``; ``start`` and ``end`` are
``time.perf_counter()`` seconds around the call. It is called on the thread that made the call,
right after the call returns (or raises), so events of one thread nest: a ``run_inline`` ends
after the kernels it ran. Observers may be called from several threads at once: they must be
thread-safe, quick (they run inside ``backward()`` and ``step()``) and must not raise.

Collectives are not reported here: wrap the backend instead (any :class:`~compressed_opt.comm.Backend`
instance can be passed as an optimizer's ``backend=``), and time the optimizer's ``step()`` with
torch's ``Optimizer.register_step_pre_hook`` / ``register_step_post_hook``.

    from compressed_opt.comm import observing

    def observer(kind, name, start, end):
        totals[kind] += end - start      # (a lock, if the totals are shared across threads)

    with observing(observer):
        train()

Cost when nothing observes: each reporting site checks one module-level tuple (one ``if``) and
allocates nothing. Registering and removing are thread-safe; a call that was already under way
when its observer was removed may still report to it, once.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable

Observer = Callable[[str, str, float, float], None]

#: what a reporting site reads: replaced, never mutated (readers need no lock)
OBSERVERS: tuple[Observer, ...] = ()
_lock = threading.Lock()


def add_observer(observer: Observer) -> Observer:
    """Report every event from now on to ``observer`` (see the module doc); returns it."""
    if not callable(observer):
        raise TypeError(f"an observer must be callable as observer(kind, name, start, end), got {observer!r}")
    global OBSERVERS
    with _lock:
        OBSERVERS = OBSERVERS + (observer,)
    return observer


def remove_observer(observer: Observer) -> None:
    """Stop reporting to ``observer`` (added once per :func:`add_observer`; unknown: nothing)."""
    global OBSERVERS
    with _lock:
        found = list(OBSERVERS)
        if observer in found:
            found.remove(observer)
            OBSERVERS = tuple(found)


@contextlib.contextmanager
def observing(observer: Observer):
    """``observer`` sees the events of the ``with`` block (added on entry, removed on exit)."""
    add_observer(observer)
    try:
        yield observer
    finally:
        remove_observer(observer)


class _Span:
    """One reported call: the observers registered when it started see it when it ends."""

    __slots__ = ("kind", "name", "observers", "start")

    def __init__(self, kind: str, name: str, observers: tuple[Observer, ...]):
        self.kind, self.name, self.observers = kind, name, observers

    def __enter__(self) -> _Span:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        end = time.perf_counter()
        for observer in self.observers:
            observer(self.kind, self.name, self.start, end)
        return False


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc) -> bool:
        return False


_NO_SPAN = _NoSpan()


def span(kind: str, name: str):
    """For the library's reporting sites: ``with span("kernel", "compress_"): ...`` reports the
    block to the observers; with none registered, a shared do-nothing context (no allocation)."""
    observers = OBSERVERS
    if not observers:
        return _NO_SPAN
    return _Span(kind, name, observers)
