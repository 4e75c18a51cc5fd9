"""How an optimizer's buckets are averaged: the exchange, the path per bucket, the error buffers.

One :class:`Exchanges` object per optimizer (``optimizer.exchanges``) owns everything about the
1-bit exchange that is not the algorithm's math:

* *which exchange*: flat or hierarchical (:mod:`compressed_opt.averaging`), chosen at the first
  step on every rank alike (:meth:`Exchanges.choose`; collective), from the ``hierarchy`` and
  ``path`` arguments and the node layout, or, with ``path="measure"``, measured and cached
  (:mod:`compressed_opt.path_cache`); a loaded checkpoint's choice is kept where it still applies;
* *which path per bucket*: the 1-bit exchange, or the exact fp32 average (:meth:`Exchanges.path_of`);
* *the error-feedback buffers* of each bucket (``worker_error``, ``server_error``; docs/design.md
  2.2), sized for the chosen exchange, dropped with a warning when a checkpoint's belong to
  another exchange;
* *running* the buckets' exchanges: each algorithm's exchange is a generator that yields its one
  request between the passes before and after it; :meth:`Exchanges.run` runs a group of them with
  their collectives coalesced (docs/design.md 2.2: exchange groups).

:func:`exchange_groups` says which consecutive buckets form an exchange group.
"""
from __future__ import annotations

import warnings

import torch

from . import averaging, path_cache
from .buckets import Bucket


class Exchanges:
    """The exchange of one optimizer's buckets over ``backend`` (see the module docstring)."""

    def __init__(self, backend, hierarchy: str, path: str, sharded: bool, block: int, name: str):
        self.backend, self.hierarchy, self.path = backend, hierarchy, path
        self.sharded, self.block, self.name = sharded, block, name
        #: per bucket size (elements), "1bit" or "fp32" (path="measure": what the link measured)
        self.paths: dict[int, str] = {}
        #: the averaging key of a loaded checkpoint's (or a copy's) error buffers, until the next choice
        self.saved_key: tuple | None = None
        self._averaging = None  # chosen at the first step, on every rank alike
        self._candidates = None  # the exchanges it is chosen from

    # --- the choice, at the first step ----------------------------------------------------------------
    @property
    def chosen(self):
        """The averaging in use (``None`` before the first step's choice)."""
        return self._averaging

    @property
    def needs_choice(self) -> bool:
        """Whether :meth:`choose` must run before the next exchange (first step, or after a load)."""
        return self._averaging is None or self.saved_key is not None

    @property
    def averaging(self):
        """The averaging in use; on one rank made on first use (nothing to choose)."""
        if self._averaging is None:
            if self.backend.world_size > 1:  # (choosing is collective: in step(), on every rank)
                raise RuntimeError(f"{self.name}: the exchange is chosen at the first step()")
            self._averaging = averaging.FlatAveraging(self.backend, self.block)
        return self._averaging

    def choose(self, buckets: list[Bucket], device) -> None:
        """In ``step()`` on every rank (collective), at the first step and after a load: the flat
        or the hierarchical exchange (:func:`averaging.candidates`; with ``path="measure"`` the
        faster on these links, or a loaded checkpoint's where it is one of them), and the path of
        each bucket size; error buffers of another exchange are dropped (warned)."""
        if self._candidates is None:
            self._candidates = averaging.candidates(self.backend, self.hierarchy, self.sharded, self.block)
        measured = self.path == "measure"
        saved = self.saved_key
        keep = next((a for a in self._candidates if a.key == saved), None) if measured else None
        numels = [b.numel for b in buckets]
        if keep is not None:  # the measured choice of the run that saved it
            self._averaging = keep
        elif self._averaging is None and measured and len(self._candidates) > 1 and numels:
            self._averaging, self.paths = self._measured(self._candidates, numels, device)
        elif self._averaging is None:
            self._averaging = self._candidates[0]
        self._drop_foreign_errors(buckets)
        if measured and not self.paths and numels:
            _, self.paths = self._measured([self._averaging], numels, device)

    def _measured(self, candidates, numels, device):
        """``path="measure"``: the exchange and the paths per bucket size, from rank 0's cache of
        an earlier run of this job, else measured on the link and kept there (collective)."""
        return path_cache.choose(candidates, self.backend, numels, device, self.block, averaging.choose_measured)

    def _drop_foreign_errors(self, buckets: list[Bucket]) -> None:
        saved, self.saved_key = self.saved_key, None
        if saved is None or self._averaging is None or tuple(saved) == self._averaging.key:
            return
        self.paths = {}  # measured on another exchange: measured again
        dropped = False
        for b in buckets:
            for name in ("worker_error", "server_error"):
                dropped |= b.flats.pop(name, None) is not None
        if dropped:
            warnings.warn(
                f"{self.name}: the checkpoint's error-feedback buffers belong to another exchange "
                f"({tuple(saved)}, now {self._averaging.key}: hierarchy or node layout changed); they were reset to "
                "zero", RuntimeWarning, stacklevel=5,
            )

    # --- what it is ------------------------------------------------------------------------------------
    def path_of(self, bucket: Bucket) -> str:
        """``"fp32"`` where the bucket's compressed exchange is replaced by the exact fp32 average."""
        if self.path == "fp32" or (self.path == "measure" and self.paths.get(bucket.numel) == "fp32"):
            return "fp32"
        return "1bit"

    def describe(self) -> str | None:
        """The exchange in words (``None`` before the first step's choice)."""
        if self.backend.world_size == 1:
            return "none (one rank)"
        if self._averaging is None:
            return None
        key = self._averaging.key
        if key[0] == "node":
            return f"hierarchical: fp32 inside {key[2]} nodes of {key[1]} ranks, 1-bit between them"
        return f"flat 1-bit over {key[1]} ranks"

    @property
    def hierarchical(self) -> bool:
        return self._averaging is not None and self._averaging.key[0] == "node"

    # --- error feedback ----------------------------------------------------------------------------------
    def error_buffers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's (worker_error, server_error), zero on first use, sized for the exchange."""
        if "worker_error" not in bucket.flats:
            we, se = self.averaging.error_sizes(bucket.numel)
            bucket.flats["worker_error"] = torch.zeros(we, dtype=torch.float32, device=bucket.device)
            bucket.flats["server_error"] = torch.zeros(se, dtype=torch.float32, device=bucket.device)
        return bucket.flats["worker_error"], bucket.flats["server_error"]

    def error_ranges(self, bucket: Bucket) -> tuple[tuple[int, int], tuple[int, int]]:
        """The bucket elements ``[lo, hi)`` the worker and the server error cover (their first
        ``hi - lo`` elements): what a per-element rescaling of the errors multiplies."""
        return self.averaging.error_ranges(bucket)

    @staticmethod
    def reset_errors(buckets: list[Bucket]) -> None:
        for b in buckets:
            for name in ("worker_error", "server_error"):
                if name in b.flats:
                    b.flats[name].zero_()

    # --- running exchanges -------------------------------------------------------------------------------
    def average(self, x: torch.Tensor) -> None:
        """``x`` <- the exact average over all ranks, the chosen exchange's way."""
        self.averaging.average(x)

    def requests(self, requests: list) -> list:
        """Each ``(bucket, x, averaging, pending, expand)`` of ``requests``
        (``averaging``: ``None`` for the chosen one, with its path per bucket; ``pending``: an
        element-wise pass on ``x`` not run yet, which the 1-bit exchange runs fused with its
        compression where it can, and anything else first; ``expand=False``: a caller that reads the
        result's rows, where they are returned, lets the exchange leave ``x`` as it is): the fp32
        averages one by one, then each averaging's 1-bit exchanges together (the flat one coalesces
        their collectives). Returns per request the result's 1-bit rows where the averaging gives
        them (else ``None``: the result is in ``x``)."""
        rows: list = [None] * len(requests)
        together: dict[int, tuple] = {}
        for i, (bucket, x, way, pending, expand) in enumerate(requests):
            if way is None:
                if self.path != "1bit" and self.path_of(bucket) == "fp32":
                    if pending is not None:
                        pending.apply_()
                    self.averaging.average(x)
                    continue
                way = self.averaging
            entry = together.setdefault(id(way), (way, [], []))
            entry[1].append((x, *self.error_buffers(bucket), pending, expand))
            entry[2].append(i)
        for way, items, where in together.values():
            for i, r in zip(where, way.exchange_many(items)):
                rows[i] = r
        return rows

    def run(self, exchanges: list) -> None:
        """Run the buckets' exchanges (generators that yield their one request ``(bucket, x,
        averaging)`` between the passes before and after it, and receive the result's 1-bit rows
        or ``None``) together: every pass before, the requests at once, every pass after."""
        pending = []
        for exchange in exchanges:
            if exchange is None:
                continue
            request = next(exchange, None)
            if request is not None:
                pending.append((exchange, request))
        results = self.requests([request for _, request in pending])
        for (exchange, _), rows in zip(pending, results):
            try:
                exchange.send(rows)  # (the result's rows, for a layout that keeps them)
            except StopIteration:
                continue
            raise RuntimeError("an exchange asked for a second compressed average")

    # --- copies ------------------------------------------------------------------------------------------
    def carried(self) -> dict:
        """What a copy of the optimizer carries: the paths and the choice (as a saved key)."""
        key = self._averaging.key if self._averaging is not None else self.saved_key
        return {"paths": dict(self.paths), "saved_key": None if key is None else tuple(key)}


def exchange_groups(buckets: list[Bucket], cap_bytes: int) -> list[list[int]]:
    """Consecutive buckets whose fp32 bytes together stay within ``cap_bytes``, as runs of their
    indices: their 1-bit exchanges share collectives. Buckets are cut at the cap, so only buckets
    a param group's end cut short merge (a per-layer group's, a no-decay group's): each small
    exchange's time on a link is its collectives' latency. The same on every rank (the layout is)."""
    groups: list[list[int]] = []
    size = 0
    for b in buckets:
        nbytes = 4 * b.numel
        if groups and size + nbytes <= cap_bytes:
            groups[-1].append(b.index)
            size += nbytes
        else:
            groups.append([b.index])
            size = nbytes
    return groups
