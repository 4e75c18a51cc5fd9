"""The exchange: how flat buffers are averaged over the ranks, at full precision or 1-bit with
error feedback, and which way each takes.

One :class:`Exchange` per engine (``optimizer.engine.exchange``) owns everything about averaging
that is not an algorithm's math:

* *which 1-bit exchange*: :class:`FlatAveraging`, the compressed allreduce over all ``W`` ranks
  (docs/design.md 2.2), or :class:`NodeAveraging`, the hierarchical one (docs/design.md 2.2.1):
  fp32 inside each node of ``L`` ranks, 1-bit among the ``K`` nodes, so only the slow links carry
  1-bit traffic. Chosen at the first step on every rank alike (:meth:`Exchange.choose`;
  collective) from ``hierarchy`` (``"auto"``: hierarchical on two or more nodes of two or more
  ranks, else flat; ``"node"``; ``"flat"``), ``path`` and the node layout; ZeRO's shards are the
  flat exchange's server chunks, so a sharded state is flat;
* *which path per buffer size*: the 1-bit exchange, or the exact fp32 average (``path``:
  ``"1bit"``, the default, never; ``"fp32"`` always; ``"measure"`` where the link measured it
  faster, :mod:`compressed_opt.path_cache`). The default decides from the arguments and the node
  layout alone, so the same seeded job gives the same result in every run (docs/design.md 2.2.2);
* *the error feedback* of each exchanged buffer (:class:`ErrorFeedback`, sized for the exchange),
  dropped with a warning when a checkpoint's belong to another exchange;
* *running* requests (:class:`Request`, :meth:`Exchange.run`): the fp32 averages one by one, the
  1-bit ones of a group with their collectives coalesced (docs/design.md 2.2: exchange groups).

A request's buffer may be made by an element-wise pass not run yet (a
:class:`compressed_opt.comm.Producer`, e.g. the local momentum): the collective runs it, fused with
its compression where it can (the comm layer's one declared interface for it).
"""
from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass

import torch

from compressed_opt.comm import (
    DEFAULT_BLOCK,
    CommStats,
    chunk_numel,
    coalesced_compressed_allreduce,
    compressed_allreduce,
    compressed_allreduce_plan,
    discover_layout,
    error_buffer_sizes,
    hierarchical_average,
    hierarchical_compressed_allreduce,
    hierarchical_compressed_allreduce_plan,
    hierarchical_error_buffer_sizes,
    node_backends,
    realize,
)

from . import path_cache
from .state import SAVED, buffer
from .validation import check_choice

logger = logging.getLogger("compressed_opt")

HIERARCHIES = ("auto", "flat", "node")
#: per buffer size, the 1-bit exchange or the exact fp32 average: fixed, or measured on the link
PATHS = ("auto", "1bit", "fp32", "measure")
#: the environment variable that sets ``path`` where the optimizer is made without one
PATH_ENV = "COMPRESSED_OPT_PATH"


def resolve_path(path: str | None, sharded: bool, world_size: int) -> str:
    """The path an optimizer uses, ``"1bit"``, ``"fp32"`` or ``"measure"``, from its ``path``
    argument (``None``: the :data:`PATH_ENV` environment variable, else ``"1bit"``; ``"auto"``:
    ``"1bit"``). Nothing here depends on timing: the same arguments give the same path in every
    run."""
    name = "path"
    if path is None:
        path, name = os.environ.get(PATH_ENV) or "1bit", PATH_ENV
    check_choice(name, path, PATHS)
    if path == "auto":
        return "1bit"
    if path != "1bit" and sharded:
        raise ValueError(f"{name}={path!r} with zero_stage > 0: ZeRO keeps the 1-bit exchange's rows as its momentum")
    return path


@dataclass(eq=False)
class ErrorFeedback:
    """The error-feedback buffers of one exchanged buffer (docs/design.md 2.2): this rank's worker
    error ``e_i`` and server error ``E_i``, sized for the exchange in use, zero when made."""

    worker_error: torch.Tensor | None = buffer(SAVED)
    server_error: torch.Tensor | None = buffer(SAVED)

    def reset(self) -> None:
        """Zero both (they hold another quantity from now on)."""
        for t in (self.worker_error, self.server_error):
            if t is not None:
                t.zero_()


@dataclass(eq=False)
class Request:
    """One buffer's 1-bit average over the ranks, with its error feedback.

    ``x`` (fp32, contiguous) is averaged in place, unless ``expand`` is ``False``: then the caller
    reads the result from its 1-bit rows (:meth:`Exchange.run` returns them where the flat
    exchange ran; elsewhere the result is in ``x``) and ``x``'s values afterwards are unspecified.
    ``keep_rows``: the caller keeps the rows (the engine copies them out of the exchange's reused
    buffers). ``producer``: the element-wise pass that makes ``x``, not run yet
    (:class:`compressed_opt.comm.Producer`). ``averaging``: another averaging than the chosen one
    (ZeRO's: always the flat one, whose server chunks are its shards)."""

    x: torch.Tensor
    feedback: ErrorFeedback
    producer: object = None
    keep_rows: bool = False
    averaging: object = None
    expand: bool = True


class FlatAveraging:
    """The compressed allreduce over all ranks of ``backend``, one 1-bit scale per ``block``."""

    def __init__(self, backend, block: int = DEFAULT_BLOCK):
        self.backend, self.block = backend, block
        self.key = ("flat", backend.world_size)
        #: (numel, device) -> the plan, for the sizes one checked exchange has agreed on: later
        #: exchanges of them skip the checks and the header all-gather (their buffers are the
        #: caller's own, and its ranks agree on their layout before every step)
        self._agreed: dict = {}

    def error_sizes(self, numel: int) -> tuple[int, int]:
        return error_buffer_sizes(numel, self.backend.world_size)

    def error_ranges(self, bucket) -> tuple[tuple[int, int], tuple[int, int]]:
        """The bucket elements ``[lo, hi)`` the worker error and the server error cover (their
        first ``hi - lo`` elements): the whole bucket, and this rank's server chunk."""
        lo, hi, _ = bucket.chunk_range(self.backend.world_size, self.backend.rank)
        return (0, bucket.numel), (lo, hi)

    def __call__(self, x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        key = (x.numel(), x.device)
        plan = self._agreed.get(key)
        if plan is not None:
            plan(x, worker_error, server_error, agreed=True)
            return
        compressed_allreduce(x, worker_error, server_error, self.backend, self.block)  # checked and agreed
        self._agreed[key] = compressed_allreduce_plan(x.numel(), self.backend, x.device, self.block)

    def exchange_many(self, items: list[Request]) -> list[torch.Tensor | None]:
        """Each request exchanged as by a call, bit for bit: a size not agreed yet alone (checked and
        agreed by it, its result in ``x``), then the rest with their collectives coalesced (one
        all-to-all and one all-gather for all of them). Returns each one's result rows as they
        travelled (``[world, row]`` bytes: views of reused buffers, valid until the next exchange;
        ``None`` for an empty one)."""
        rows: list = [None] * len(items)
        plans, rest, where = [], [], []
        for i, r in enumerate(items):
            x = r.x
            plan = self._agreed.get((x.numel(), x.device))
            if plan is None or x.dtype != torch.float32 or not x.is_contiguous():
                realize(x, r.producer)
                self(x, r.feedback.worker_error, r.feedback.server_error)
                plan = self._agreed[(x.numel(), x.device)]
                rows[i] = plan.gathered.view(self.backend.world_size, -1).clone()  # (the plan's buffer is reused)
            elif x.numel():
                plans.append(plan)
                rest.append(r)
                where.append(i)
            else:
                realize(x, r.producer)
        if len(plans) == 1:  # (alone: the plan's own buffers, no packed copy of them)
            r = rest[0]
            plans[0].run(r.x, r.feedback.worker_error, r.feedback.server_error, True, r.producer, r.expand)
            rows[where[0]] = plans[0].gathered.view(self.backend.world_size, -1)
        elif plans:
            results = coalesced_compressed_allreduce(
                plans, [r.x for r in rest], [r.feedback.worker_error for r in rest],
                [r.feedback.server_error for r in rest], [r.producer for r in rest], [r.expand for r in rest])
            for i, found in zip(where, results):
                rows[i] = found
        return rows

    def average(self, x: torch.Tensor) -> None:
        """``x`` <- the exact average over all ranks: the backend's all-reduce."""
        self.backend.all_reduce(x, op="avg")


class NodeAveraging:
    """The hierarchical compressed allreduce over ``backends`` (``node_backends(...)`` of the
    optimizer's ``backend``), one 1-bit scale per ``block``."""

    def __init__(self, backends, backend, block: int = DEFAULT_BLOCK):
        self.backends, self.backend, self.block = backends, backend, block
        layout = backends.layout
        self.local_size, self.node_count = layout.local_size, layout.node_count
        self.key = ("node", self.local_size, self.node_count)
        self._agreed: dict = {}  # as FlatAveraging's: the exchange's plans, and the exact average's
        self._shards: torch.Tensor | None = None  # exchange_many's shards between the nodes (grown, reused)

    def error_sizes(self, numel: int) -> tuple[int, int]:
        return hierarchical_error_buffer_sizes(numel, self.local_size, self.node_count)

    def error_ranges(self, bucket) -> tuple[tuple[int, int], tuple[int, int]]:
        """The worker error covers this local rank's shard of the bucket, the server error the
        chunk of that shard this rank serves among the nodes (none with one node)."""
        start, end, _ = bucket.chunk_range(self.local_size, self.backends.intra.rank)
        if self.node_count == 1:
            return (start, start), (start, start)  # nothing compressed, no errors
        c = chunk_numel(end - start, self.node_count)
        lo = min(self.backends.inter.rank * c, end - start)
        return (start, end), (start + lo, start + min(lo + c, end - start))

    def __call__(self, x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor) -> None:
        key = ("exchange", x.numel(), x.device)
        plan = self._agreed.get(key)
        if plan is not None:
            plan(x, worker_error, server_error, agreed=True)
            return
        hierarchical_compressed_allreduce(x, worker_error, server_error, self.backends, self.block)
        self._agreed[key] = hierarchical_compressed_allreduce_plan(x, self.backends, self.block)

    def exchange_many(self, items: list[Request]) -> list[None]:
        """Each request exchanged as by a call, bit for bit (its producer runs first: the
        reduce-scatter inside the node reads ``x``; every result is decompressed into its ``x``): a
        size not agreed yet alone (checked and agreed by it), then the rest together: each one's
        reduce-scatter inside the node, one coalesced 1-bit exchange of all their shards between
        the nodes (an all-to-all and an all-gather over the slow links), each one's all-gather of
        rows inside the node. No rows are returned (the result travelled as shards' rows)."""
        together = []
        for r in items:
            x, worker_error, server_error = r.x, r.feedback.worker_error, r.feedback.server_error
            realize(x, r.producer)
            plan = self._agreed.get(("exchange", x.numel(), x.device))
            if plan is None or x.dtype != torch.float32 or not x.is_contiguous():
                self(x, worker_error, server_error)
            elif plan.node_count == 1 or plan.numel == 0:
                plan(x, worker_error, server_error, agreed=True)  # (nothing between the nodes)
            else:
                together.append((plan, x.view(-1), worker_error, server_error))
        if len(together) <= 1:  # (alone: the plan's own call)
            for plan, x, worker_error, server_error in together:
                plan(x, worker_error, server_error, agreed=True)
            return [None] * len(items)
        # 1. inside each node, one by one; a shard in a plan's reused buffer (two buckets of one
        # size share their plan) moves to a buffer of this exchange's shards
        need = sum(plan.valid for plan, *_ in together if plan.shard_buf is not None)
        if self._shards is None or self._shards.numel() < need or self._shards.device != together[0][1].device:
            self._shards = torch.empty(need, dtype=torch.float32, device=together[0][1].device)
        shards, offset = [], 0
        for plan, x, _, _ in together:
            shard = plan.scatter_(x)
            if plan.shard_buf is not None:
                shard = self._shards[offset: offset + plan.valid].copy_(shard)
                offset += plan.valid
            shards.append(shard)
        # 2. between the nodes, all at once
        inter = [(plan.inter_plan, shard, we[: plan.valid], se[: plan.inter_server_numel])
                 for (plan, _, we, se), shard in zip(together, shards) if plan.inter_plan is not None]
        rows = iter(coalesced_compressed_allreduce(*(list(c) for c in zip(*inter))) if inter else [])
        for plan, x, _, _ in together:  # 3. inside each node, one by one, each with its own rows
            plan.gather_(x, next(rows) if plan.inter_plan is not None else None, plan.rows_in is not None)
        return [None] * len(items)

    def average(self, x: torch.Tensor) -> None:
        """``x`` <- the exact average over all ranks, fp32 inside each node and between the nodes
        (:func:`~compressed_opt.comm.hierarchical_average`; other dtypes: the flat all-reduce)."""
        if x.dtype == torch.float32 and x.is_contiguous():
            key = ("average", x.numel(), x.device)
            plan = self._agreed.get(key)
            if plan is not None:
                plan.average(x, agreed=True)
                return
            hierarchical_average(x, self.backends, self.block)
            self._agreed[key] = hierarchical_compressed_allreduce_plan(x, self.backends, self.block)
        else:
            self.backend.all_reduce(x, op="avg")


class _CountedInParent(CommStats):
    """A sub-backend's byte counts, also recorded in its parent backend's stats as
    ``"<where>.<collective>"`` (``optimizer.backend.stats`` keeps counting everything the
    optimizer sends; ``inter_node.*`` is what crosses between nodes)."""

    def __init__(self, parent: CommStats, where: str):
        super().__init__()
        self.parent, self.where = parent, where

    def record(self, op: str, nbytes: float) -> None:
        super().record(op, nbytes)
        self.parent.record(f"{self.where}.{op}", nbytes)


def error_sizes_of(key, numel: int) -> tuple[int, int]:
    """The error buffers' sizes of a buffer of ``numel`` elements under a saved ``key``."""
    if key[0] == "node":
        return hierarchical_error_buffer_sizes(numel, key[1], key[2])
    return error_buffer_sizes(numel, key[1])


def candidates(backend, hierarchy: str, sharded: bool, block: int = DEFAULT_BLOCK) -> list:
    """The averagings on ``backend`` to choose from, the preferred first (collective: every rank
    calls it, at the same point): with ``hierarchy="auto"`` on several nodes of several ranks, the
    hierarchical one and then the flat one (``path="measure"`` times both); else the one exchange."""
    if backend.world_size == 1 or hierarchy == "flat":
        return [FlatAveraging(backend, block)]
    if sharded:
        logger.info("compressed_opt: ZeRO-sharded state: the flat 1-bit exchange (its chunks are the shards)")
        return [FlatAveraging(backend, block)]
    layout = discover_layout(backend)  # None (uneven nodes): logged there, on rank 0
    if layout is None:
        return [FlatAveraging(backend, block)]
    wanted = hierarchy == "node" or (layout.node_count > 1 and layout.local_size > 1)
    if not wanted:
        return [FlatAveraging(backend, block)]
    try:
        backends = node_backends(backend, layout)
    except ValueError as exc:  # (e.g. a torch.distributed sub-group: the same on every rank)
        if backend.rank == 0:
            logger.warning("compressed_opt: no per-node groups (%s): the flat 1-bit exchange", exc)
        return [FlatAveraging(backend, block)]
    if backend.rank == 0:
        logger.info("compressed_opt: hierarchical 1-bit exchange, %d nodes of %d ranks", layout.node_count,
                    layout.local_size)
    for sub, where in ((backends.intra, "intra_node"), (backends.inter, "inter_node")):
        sub.stats = _CountedInParent(backend.stats, where)
    node = NodeAveraging(backends, backend, block)
    return [node] if hierarchy == "node" else [node, FlatAveraging(backend, block)]


class Exchange:
    """How one engine's buffers are averaged over ``backend`` (see the module docstring)."""

    def __init__(self, backend, hierarchy: str, path: str, sharded: bool, block: int, name: str):
        self.backend, self.hierarchy, self.path = backend, hierarchy, path
        self.sharded, self.block, self.name = sharded, block, name
        #: per buffer size (elements), "1bit" or "fp32" (path="measure": what the link measured)
        self.paths: dict[int, str] = {}
        #: the averaging key of a loaded checkpoint's (or a copy's) error buffers, until the next choice
        self.saved_key: tuple | None = None
        #: the averaging in use: chosen at the first step, on every rank alike (``None`` before)
        self.chosen = None
        self._candidates = None  # the exchanges it is chosen from
        self._flat = None  # ZeRO's averaging (flat whatever was chosen), made at its first use

    # --- the choice, at the first step ----------------------------------------------------------------
    @property
    def averaging(self):
        """The averaging in use; on one rank made on first use (nothing to choose)."""
        if self.chosen is None:
            if self.backend.world_size > 1:  # (choosing is collective: in step(), on every rank)
                raise RuntimeError(f"{self.name}: the exchange is chosen at the first step()")
            self.chosen = FlatAveraging(self.backend, self.block)
        return self.chosen

    @property
    def flat(self) -> FlatAveraging:
        """The flat averaging over the backend, whatever was chosen (ZeRO's shards are its chunks)."""
        if self._flat is None:
            chosen = self.chosen
            self._flat = chosen if isinstance(chosen, FlatAveraging) else FlatAveraging(self.backend, self.block)
        return self._flat

    def choose(self, buckets: list, device) -> None:
        """In ``step()`` on every rank (collective), at the first step and after a load: the flat
        or the hierarchical exchange (:func:`candidates`; with ``path="measure"`` the faster on
        these links, or a loaded checkpoint's where it is one of them), and the path of each bucket
        size; error buffers of another exchange are dropped (warned)."""
        if self._candidates is None:
            self._candidates = candidates(self.backend, self.hierarchy, self.sharded, self.block)
        measured = self.path == "measure"
        saved = self.saved_key
        keep = next((a for a in self._candidates if a.key == saved), None) if measured else None
        numels = [b.numel for b in buckets]
        if keep is not None:  # the measured choice of the run that saved it
            self.chosen = keep
        elif self.chosen is None and measured and len(self._candidates) > 1 and numels:
            self.chosen, self.paths = path_cache.choose(self._candidates, self.backend, numels, device, self.block)
        elif self.chosen is None:
            self.chosen = self._candidates[0]
        self._drop_foreign_errors(buckets)
        if measured and not self.paths and numels:
            _, self.paths = path_cache.choose([self.chosen], self.backend, numels, device, self.block)

    def _drop_foreign_errors(self, buckets: list) -> None:
        saved, self.saved_key = self.saved_key, None
        if saved is None or self.chosen is None or tuple(saved) == self.chosen.key:
            return
        self.paths = {}  # measured on another exchange: measured again
        dropped = False
        for b in buckets:
            dropped |= b.feedback.worker_error is not None
            b.feedback.worker_error = b.feedback.server_error = None
        if dropped:
            warnings.warn(
                f"{self.name}: the checkpoint's error-feedback buffers belong to another exchange "
                f"({tuple(saved)}, now {self.chosen.key}: hierarchy or node layout changed); they were reset to "
                "zero", RuntimeWarning, stacklevel=5,
            )

    # --- what it is ------------------------------------------------------------------------------------
    def path_of(self, numel: int) -> str:
        """``"fp32"`` where a buffer of ``numel`` elements takes the exact fp32 average instead of
        the 1-bit exchange."""
        if self.path == "fp32" or (self.path == "measure" and self.paths.get(numel) == "fp32"):
            return "fp32"
        return "1bit"

    def describe(self) -> str | None:
        """The exchange in words (``None`` before the first step's choice)."""
        if self.backend.world_size == 1:
            return "none (one rank)"
        if self.chosen is None:
            return None
        key = self.chosen.key
        if key[0] == "node":
            return f"hierarchical: fp32 inside {key[2]} nodes of {key[1]} ranks, 1-bit between them"
        return f"flat 1-bit over {key[1]} ranks"

    @property
    def hierarchical(self) -> bool:
        return self.chosen is not None and self.chosen.key[0] == "node"

    # --- error feedback ----------------------------------------------------------------------------------
    def feedback_for(self, feedback: ErrorFeedback, numel: int, device, averaging=None) -> ErrorFeedback:
        """``feedback`` with its buffers made (zeros) for a buffer of ``numel`` on ``device`` where
        it has none, sized for ``averaging`` (default: the chosen one)."""
        if feedback.worker_error is None:
            we, se = (averaging or self.averaging).error_sizes(numel)
            feedback.worker_error = torch.zeros(we, dtype=torch.float32, device=device)
            feedback.server_error = torch.zeros(se, dtype=torch.float32, device=device)
        return feedback

    def error_ranges(self, bucket) -> tuple[tuple[int, int], tuple[int, int]]:
        """The bucket elements ``[lo, hi)`` the worker and the server error cover (their first
        ``hi - lo`` elements): what a per-element rescaling of the errors multiplies."""
        return self.averaging.error_ranges(bucket)

    # --- running exchanges -------------------------------------------------------------------------------
    def average(self, x: torch.Tensor) -> None:
        """``x`` <- the exact average over all ranks, the chosen exchange's way."""
        self.averaging.average(x)

    def run(self, requests: list[Request]) -> list:
        """Run ``requests`` together (collective: every rank the same requests in the same order):
        the fp32 averages one by one, then each averaging's 1-bit exchanges at once (the flat one
        coalesces their collectives). Returns per request the result's 1-bit rows where the
        averaging gives them (views of reused buffers: read or copy them before the next exchange),
        else ``None`` (the result is in ``x``)."""
        rows: list = [None] * len(requests)
        together: dict[int, tuple] = {}
        chosen = self.chosen if self.chosen is not None else self.averaging
        for i, r in enumerate(requests):
            way = r.averaging
            if way is None:
                if self.path != "1bit" and self.path_of(r.x.numel()) == "fp32":
                    realize(r.x, r.producer)
                    chosen.average(r.x)
                    continue
                way = chosen
            if r.feedback.worker_error is None:
                self.feedback_for(r.feedback, r.x.numel(), r.x.device, way)
            entry = together.get(id(way))
            if entry is None:
                entry = together[id(way)] = (way, [], [])
            entry[1].append(r)
            entry[2].append(i)
        for way, items, where in together.values():
            for i, found in zip(where, way.exchange_many(items)):
                rows[i] = found
        return rows

    # --- copies ------------------------------------------------------------------------------------------
    def carried(self) -> dict:
        """What a copy carries: the paths and the choice (as a saved key)."""
        key = self.chosen.key if self.chosen is not None else self.saved_key
        return {"paths": dict(self.paths), "saved_key": None if key is None else tuple(key)}
