"""Where a bucket's 1-bit compressed average is made: over all ranks, or per node.

The optimizers average a bucket's vector ``x`` with error feedback through one object, chosen
once per optimizer (at its first step, on every rank alike) by its ``hierarchy`` argument:

* :class:`FlatAveraging`: the compressed allreduce over all ``W`` ranks (docs/design.md 2.2);
* :class:`NodeAveraging`: the hierarchical one (docs/design.md 2.2.1): fp32 inside each node of
  ``L`` ranks, 1-bit among the ``K`` nodes, so only the slow links carry 1-bit traffic.

``hierarchy="auto"`` (the default) takes the hierarchical exchange when the job spans at least
two nodes of at least two ranks each (:func:`compressed_opt.comm.discover_layout`; with
``path="measure"``, only where it measured faster than the flat one), else the
flat one (one node: compressing is the point of the library there too; one rank per node: both
are the same); uneven nodes fall back to flat with a log line. ``"node"`` asks for the
hierarchical exchange (one node: the exact fp32 average, nothing compressed); ``"flat"`` never
looks. ZeRO's shards are the flat exchange's server chunks, so a sharded optimizer is flat.

Per bucket, ``path`` (:data:`PATHS`, :func:`resolve_path`) may replace the 1-bit exchange by the
exact fp32 average: ``"1bit"`` (the default; ``"auto"`` is the same) never does, ``"fp32"``
always does, ``"measure"`` does where the link measured it faster (:func:`choose_measured`, once,
at the first step; also choosing between the flat and the hierarchical exchange).

Why the default is fixed, not measured (docs/design.md 2.2.2): a choice made by timing can differ
between two runs of the same seed where both paths take about as long, so the same job would not
reproduce. The default decides from the arguments and the node layout alone, the same in every
run; it compresses every bucket, which on a fast link (one node, NVLink) can cost more than the
fp32 average for small buckets. ``path="measure"`` trades that for speed where asked: its choice
is kept in checkpoints and in a per-machine cache (:mod:`compressed_opt.path_cache`, keyed by the
host, the ranks, the exchange and the bucket sizes), so a second run of the same job on the same
machine reuses the first run's measurement instead of measuring again.

Each holds the sizes of the error buffers it needs and which elements of the bucket they cover
(:meth:`error_ranges`: a per-element rescaling of the errors, when an exchange's factors change,
must know them), and a ``key`` saved in checkpoints: error buffers saved under another key hold
errors of another exchange and are reset, with a warning, when such a checkpoint is resumed.
"""
from __future__ import annotations

import logging
import os

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
)
from compressed_opt.validation import check_choice

logger = logging.getLogger("compressed_opt")

HIERARCHIES = ("auto", "flat", "node")
#: per bucket, the 1-bit exchange or the exact fp32 average: fixed, or measured on the link
PATHS = ("auto", "1bit", "fp32", "measure")
#: the environment variable that sets ``path`` where the optimizer is made without one
PATH_ENV = "COMPRESSED_OPT_PATH"
_PATH_REPS = 5


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


def _time_paths(averaging, backend, numel: int, device) -> tuple[float, float]:
    """Median seconds of this rank's 1-bit exchange and fp32 all-reduce of ``numel`` elements
    (scratch buffers; one untimed call of each first)."""
    import time

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(device)
    we, se = (torch.zeros(k, dtype=torch.float32, device=device) for k in averaging.error_sizes(numel))
    times = {"1bit": [], "fp32": []}
    for rep in range(_PATH_REPS + 1):
        for path in ("1bit", "fp32"):
            y = x.clone()
            start = time.perf_counter()
            if path == "1bit":
                averaging(y, we, se)
            else:
                averaging.average(y)
            if rep:
                times[path].append(time.perf_counter() - start)
    return sorted(times["1bit"])[_PATH_REPS // 2], sorted(times["fp32"])[_PATH_REPS // 2]


def measure_times(averaging, backend, numels, device) -> dict[int, tuple[float, float]]:
    """Per bucket size, the seconds of ``averaging``'s 1-bit exchange and of the fp32 all-reduce
    on this link, as the slowest rank timed them (collective: every rank times both, one
    all-gather shares the times, so every rank holds the same numbers)."""
    sizes = sorted(set(int(n) for n in numels if n > 0))
    mine = torch.tensor([t for n in sizes for t in _time_paths(averaging, backend, n, device)], dtype=torch.float64)
    everyone = torch.empty(backend.world_size * mine.numel(), dtype=torch.float64, device=device)
    backend.all_gather(everyone, mine.to(device))
    slowest = everyone.view(backend.world_size, len(sizes), 2).amax(dim=0).cpu().tolist()
    return {n: (onebit, fp32) for n, (onebit, fp32) in zip(sizes, slowest)}


def faster_paths(times: dict[int, tuple[float, float]]) -> dict[int, str]:
    """Per bucket size, ``"fp32"`` where the fp32 all-reduce took less time, else ``"1bit"``."""
    return {n: ("fp32" if fp32 < onebit else "1bit") for n, (onebit, fp32) in times.items()}


def choose_measured(candidates, backend, numels, device):
    """``(averaging, paths, times)``: of ``candidates`` (flat and hierarchical exchanges), the one
    whose buckets, each on its faster path, take the least time in all on this link, its paths per
    bucket size, and its measured ``(1-bit, fp32)`` seconds per size (collective; every rank
    decides from the same shared times). :func:`compressed_opt.path_cache.choose` keeps the
    choice for a rerun."""
    best = None
    for averaging in candidates:
        times = measure_times(averaging, backend, numels, device)
        total = sum(min(times[int(n)]) for n in numels if n > 0)
        paths = faster_paths(times)
        if backend.rank == 0:
            timings = ", ".join(f"{n}: {a * 1e3:.2f} / {b * 1e3:.2f} -> {paths[n]}" for n, (a, b) in times.items())
            logger.info("compressed_opt: measured the %s exchange per bucket size (elements: 1-bit ms / fp32 ms -> "
                        "path): %s; %.2f ms per step", averaging.key[0], timings, total * 1e3)
        if best is None or total < best[0]:
            best = (total, averaging, paths, times)
    return best[1:]


class FlatAveraging:
    """The compressed allreduce over all ranks of ``backend``, one 1-bit scale per ``block``."""

    def __init__(self, backend, block: int = DEFAULT_BLOCK):
        self.backend, self.block = backend, block
        self.key = ("flat", backend.world_size)
        #: (numel, device) -> the plan, for the sizes one checked exchange has agreed on: the
        #: optimizer's later exchanges of them skip the checks and the header all-gather (its
        #: buffers are its own, and its ranks agree on the bucket layout before every step)
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

    def exchange_many(self, items: list) -> list[torch.Tensor | None]:
        """Each ``(x, worker_error, server_error, pending, expand)`` of ``items`` exchanged as by a
        call, bit for bit (``pending``: an element-wise pass on ``x`` not run yet, or ``None``; the
        compression runs it, fused where the kernels can: ``comm.compressed.compress_pending_``;
        ``expand=False``: the result is left in its rows, not decompressed into ``x``, where a
        coalesced exchange runs): a size not agreed yet alone (checked and agreed by it, its result in
        ``x``), then the rest with their collectives coalesced (one all-to-all and one all-gather for
        all of them). Returns each one's result rows as they travelled (``[world, row]`` bytes: views
        of reused buffers, valid until the next exchange; ``None`` for an empty one)."""
        rows: list = [None] * len(items)
        plans, rest, where = [], [], []
        for i, (x, worker_error, server_error, pending, expand) in enumerate(items):
            plan = self._agreed.get((x.numel(), x.device))
            if plan is None or x.dtype != torch.float32 or not x.is_contiguous():
                if pending is not None:
                    pending.apply_()
                self(x, worker_error, server_error)
                plan = self._agreed[(x.numel(), x.device)]
                rows[i] = plan.gathered.view(self.backend.world_size, -1).clone()  # (the plan's buffer is reused)
            elif x.numel():
                plans.append(plan)
                rest.append((x, worker_error, server_error, pending, expand))
                where.append(i)
            elif pending is not None:
                pending.apply_()
        if len(plans) == 1:  # (alone: the plan's own buffers, no packed copy of them)
            x, worker_error, server_error, pending, expand = rest[0]
            plans[0](x, worker_error, server_error, agreed=True, pending=pending, expand=expand)
            rows[where[0]] = plans[0].gathered.view(self.backend.world_size, -1)
        elif plans:
            for i, r in zip(where, coalesced_compressed_allreduce(plans, *(list(c) for c in zip(*rest)))):
                rows[i] = r
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

    def exchange_many(self, items: list) -> list[None]:
        """Each ``(x, worker_error, server_error, pending, expand)`` of ``items`` exchanged as by a
        call, bit for bit (``pending``, an element-wise pass on ``x`` not run yet, or ``None``, runs
        first; ``expand`` is not used: every result is decompressed into its ``x``):
        a size not agreed yet alone (checked and agreed by it), then the rest together: each one's
        reduce-scatter inside the node, one coalesced 1-bit exchange of all their shards between
        the nodes (an all-to-all and an all-gather over the slow links), each one's all-gather of
        rows inside the node. No rows are returned (the result travelled as shards' rows)."""
        together = []
        for x, worker_error, server_error, pending, _ in items:
            if pending is not None:  # (the reduce-scatter inside the node reads x first)
                pending.apply_()
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
    """The error buffers' sizes of a bucket of ``numel`` elements under a saved ``key``."""
    if key[0] == "node":
        return hierarchical_error_buffer_sizes(numel, key[1], key[2])
    return error_buffer_sizes(numel, key[1])


def candidates(backend, hierarchy: str, sharded: bool, block: int = DEFAULT_BLOCK) -> list:
    """The averagings an optimizer on ``backend`` may use, the preferred first (collective: every
    rank calls it, at the same point; see the module docstring): with ``hierarchy="auto"`` on
    several nodes of several ranks, the hierarchical one and then the flat one (``path="measure"``
    times both); else the one exchange."""
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
