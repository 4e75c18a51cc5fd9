"""Which ranks share a node: the layout a hierarchical exchange needs (docs/design.md 2.2.1).

A :class:`NodeLayout` is a partition of the ``W`` ranks into ``K`` nodes of ``L`` ranks each
(``W = K L``). Its canonical form: each node's ranks in ascending order, the nodes in the order
of their lowest rank. Rank ``r`` is *local rank* ``l`` of node ``k`` when ``r`` is the ``l``-th
rank of node ``k``; the usual placement (node ``k`` holds ranks ``[k L, (k+1) L)``) is one case,
round-robin placements are others.

:func:`discover_layout` finds it (a collective over a backend). Every rank contributes one
fixed-size row, what it knows locally:

* ``COMPRESSED_OPT_RANKS_PER_NODE`` (:data:`RANKS_PER_NODE_ENV`): an explicit ``L``; node ``k``
  is then ranks ``[k L, (k+1) L)``. It overrides everything below, e.g. to emulate several nodes
  on one machine;
* the launcher's variables: ``GROUP_RANK`` (the node's index), ``LOCAL_RANK`` and
  ``LOCAL_WORLD_SIZE``, which ``torchrun`` sets;
* for an :class:`~compressed_opt.comm.MPIBackend`: the lowest rank sharing memory with this one
  (``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``);
* the host name (``socket.gethostname()``, sent as a fixed-size byte row).

The rows are all-gathered once, and every rank decides from the same gathered table, so every
rank reaches the same decision: the override if every rank set the same one; else the launcher's
variables if every rank has them; else the MPI node leaders if every rank has one; else the host
names. A layout that cannot be used (nodes of different sizes, an override that does not divide
``W``, ranks that set different overrides, launcher variables that contradict each other) gives
``None`` on every rank — use the flat exchange — and rank 0 logs one line on the
``"compressed_opt"`` logger saying why.

:func:`node_backends` makes the two sub-backends of a layout: *intra* (the ``L`` ranks of this
rank's node, numbered by local rank) and *inter* (the ``K`` ranks with this rank's local rank,
one per node).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Optional

import torch

from .backend import Backend

logger = logging.getLogger("compressed_opt")

#: The environment variable that sets the ranks per node explicitly (node ``k``: ranks ``[k L, (k+1) L)``).
RANKS_PER_NODE_ENV = "COMPRESSED_OPT_RANKS_PER_NODE"
#: torchrun's variables: the node's index, the rank's index in its node, the ranks in its node.
LAUNCHER_ENV = ("GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

_HOST_BYTES = 256  # a DNS name has at most 253 characters; a longer name travels as its SHA-256
_INTS = 5  # override, group rank, local rank, local world size, MPI node leader
_ROW_BYTES = 8 * _INTS + _HOST_BYTES
_INVALID = -2  # an override that is set but not a positive integer


@dataclasses.dataclass(frozen=True)
class NodeLayout:
    """``nodes``: the ranks of each node (``K`` groups of ``L`` ranks partitioning ``range(W)``);
    ``rank``: this rank. Stored in canonical form (see the module docstring); ``source`` says
    where the layout came from."""

    nodes: tuple
    rank: int
    source: str = "given"

    def __post_init__(self):
        nodes = tuple(sorted(tuple(sorted(int(r) for r in node)) for node in self.nodes))
        world = sum(len(node) for node in nodes)
        if not nodes or sorted(r for node in nodes for r in node) != list(range(world)):
            raise ValueError(f"nodes must partition the ranks 0..W-1, got {self.nodes}")
        if len({len(node) for node in nodes}) != 1 or not nodes[0]:
            raise ValueError(f"every node must hold the same number (>= 1) of ranks, got {self.nodes}")
        if not 0 <= self.rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {self.rank}")
        object.__setattr__(self, "nodes", nodes)

    @classmethod
    def contiguous(cls, world_size: int, local_size: int, rank: int, source: str = "given") -> NodeLayout:
        """Node ``k`` holds ranks ``[k L, (k+1) L)``; ``local_size`` (``L``) must divide ``world_size``."""
        if local_size < 1 or world_size < 1 or world_size % local_size:
            raise ValueError(f"{world_size} ranks do not split into nodes of {local_size}")
        nodes = tuple(tuple(range(k, k + local_size)) for k in range(0, world_size, local_size))
        return cls(nodes, rank, source)

    @property
    def world_size(self) -> int:
        """``W``: ranks in all."""
        return self.node_count * self.local_size

    @property
    def local_size(self) -> int:
        """``L``: ranks per node."""
        return len(self.nodes[0])

    @property
    def node_count(self) -> int:
        """``K = W / L``: nodes."""
        return len(self.nodes)

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This rank's index in its node."""
        return self.nodes[self.node].index(self.rank)

    def node_of(self, rank: int) -> int:
        """The index of the node that holds ``rank``."""
        return next(k for k, node in enumerate(self.nodes) if rank in node)

    @property
    def intra_ranks(self) -> tuple:
        """The ranks of this rank's node, by local rank."""
        return self.nodes[self.node]

    @property
    def inter_ranks(self) -> tuple:
        """The ranks with this rank's local rank, one per node, by node."""
        return tuple(node[self.local_rank] for node in self.nodes)

    def inter_groups(self) -> tuple:
        """For each local rank ``l``: the ranks with local rank ``l``, by node."""
        return tuple(tuple(node[j] for node in self.nodes) for j in range(self.local_size))

    @property
    def is_contiguous(self) -> bool:
        """Whether node ``k`` holds ranks ``[k L, (k+1) L)``."""
        return self == NodeLayout.contiguous(self.world_size, self.local_size, self.rank, self.source)

    def __str__(self) -> str:
        placement = "" if self.is_contiguous else ", not contiguous"
        return f"{self.node_count} node(s) x {self.local_size} rank(s) (from {self.source}{placement})"


# --- what one rank knows ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RankInfo:
    """What one rank knows about its placement, before any communication. ``override``: the
    value of ``COMPRESSED_OPT_RANKS_PER_NODE`` (0 unset, -2 not a positive integer);
    ``group_rank``/``local_rank``/``local_world_size``: torchrun's variables (-1 when any is
    missing); ``mpi_leader``: the lowest rank sharing memory with it (-1 without MPI)."""

    override: int = 0
    group_rank: int = -1
    local_rank: int = -1
    local_world_size: int = -1
    mpi_leader: int = -1
    hostname: str = ""


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name, "").strip()
    return int(raw) if raw.isdigit() else None


def rank_info(env: Optional[Mapping[str, str]] = None, hostname: Optional[str] = None,
              mpi_leader: int = -1) -> RankInfo:
    """This rank's :class:`RankInfo` from ``env`` (default ``os.environ``) and ``hostname``
    (default ``socket.gethostname()``)."""
    env = os.environ if env is None else env
    raw = env.get(RANKS_PER_NODE_ENV, "").strip()
    override = 0 if not raw else (int(raw) if raw.isdigit() and int(raw) > 0 else _INVALID)
    launcher = [_env_int(env, name) for name in LAUNCHER_ENV]
    if None in launcher:
        launcher = [-1, -1, -1]
    host = socket.gethostname() if hostname is None else hostname
    return RankInfo(override, *launcher, mpi_leader=mpi_leader, hostname=host)


def encode_info(info: RankInfo) -> torch.Tensor:
    """``info`` as a fixed-size uint8 row (five int64, then the host name, zero-padded)."""
    ints = torch.tensor([info.override, info.group_rank, info.local_rank, info.local_world_size, info.mpi_leader],
                        dtype=torch.int64)
    name = info.hostname.encode()
    if len(name) > _HOST_BYTES:
        name = hashlib.sha256(name).hexdigest().encode()
    row = torch.zeros(_ROW_BYTES, dtype=torch.uint8)
    row[: 8 * _INTS] = ints.view(torch.uint8)
    row[8 * _INTS : 8 * _INTS + len(name)] = torch.frombuffer(bytearray(name), dtype=torch.uint8)
    return row


def decode_info(row: torch.Tensor) -> RankInfo:
    """The :class:`RankInfo` that :func:`encode_info` wrote into ``row``."""
    row = row.cpu()
    ints = row[: 8 * _INTS].clone().view(torch.int64).tolist()
    name = bytes(row[8 * _INTS :].tolist()).rstrip(b"\0").decode(errors="replace")
    return RankInfo(*ints, hostname=name)


# --- the decision, from the gathered table ---------------------------------------------------------
def layout_from_infos(infos: Sequence[RankInfo], rank: int) -> tuple[Optional[NodeLayout], str]:
    """``(layout, reason)`` from every rank's :class:`RankInfo` (index = rank): a pure function of
    the table, so ranks that hold the same table decide the same. ``layout`` is ``None`` when the
    ranks cannot be grouped into equal nodes, and ``reason`` says why (else where it came from).
    Raises ``ValueError`` when an override is set but is not a positive integer."""
    world = len(infos)
    overrides = [info.override for info in infos]
    bad = [r for r, v in enumerate(overrides) if v == _INVALID]
    if bad:
        raise ValueError(f"{RANKS_PER_NODE_ENV} must be a positive integer (ranks per node); "
                         f"rank(s) {_ranks(bad)} set something else")
    if len(set(overrides)) > 1:
        values = ", ".join(f"rank {r}: {v or 'unset'}" for r, v in enumerate(overrides))
        return None, f"{RANKS_PER_NODE_ENV} differs between ranks ({values})"
    if overrides[0]:
        per_node = overrides[0]
        if world % per_node:
            return None, f"{RANKS_PER_NODE_ENV}={per_node} does not divide the {world} ranks"
        return NodeLayout.contiguous(world, per_node, rank, RANKS_PER_NODE_ENV), RANKS_PER_NODE_ENV
    if all(info.group_rank >= 0 for info in infos):
        return _from_launcher(infos, rank)
    if all(info.mpi_leader >= 0 for info in infos):
        return _grouped([info.mpi_leader for info in infos], rank, "MPI shared-memory nodes")
    return _grouped([info.hostname for info in infos], rank, "host names")


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))


def _grouped(keys: Sequence, rank: int, source: str) -> tuple[Optional[NodeLayout], str]:
    """Ranks with equal ``keys`` share a node; equal node sizes or ``None``."""
    groups: dict = {}
    for r, key in enumerate(keys):
        groups.setdefault(key, []).append(r)
    sizes = sorted({len(g) for g in groups.values()})
    if len(sizes) > 1:
        shown = "; ".join(f"{key}: {len(g)}" for key, g in groups.items())
        return None, f"nodes of different sizes by {source} ({shown})"
    return NodeLayout(tuple(groups.values()), rank, source), source


def _from_launcher(infos: Sequence[RankInfo], rank: int) -> tuple[Optional[NodeLayout], str]:
    """Group by ``GROUP_RANK``; each node's ``LOCAL_RANK`` values must be ``0..L-1`` and its
    ``LOCAL_WORLD_SIZE`` its size."""
    layout, reason = _grouped([info.group_rank for info in infos], rank, "GROUP_RANK")
    if layout is None:
        return None, reason
    for node in layout.nodes:
        local = sorted(infos[r].local_rank for r in node)
        sizes = {infos[r].local_world_size for r in node}
        if local != list(range(len(node))) or sizes != {len(node)}:
            return None, (f"the launcher's variables contradict each other on the node of ranks {_ranks(node)} "
                          f"(LOCAL_RANK {local}, LOCAL_WORLD_SIZE {sorted(sizes)})")
    return dataclasses.replace(layout, source="launcher variables (GROUP_RANK, LOCAL_RANK)"), reason


# --- collectives -----------------------------------------------------------------------------------
def _collective_device(backend: Backend) -> torch.device:
    """Where a small tensor must live to go through ``backend`` (NCCL moves only CUDA tensors)."""
    if getattr(backend, "process_group_backend", None) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_infos(backend: Backend, info: RankInfo) -> list:
    """Every rank's :class:`RankInfo`, by rank, through one all-gather of fixed-size rows."""
    device = _collective_device(backend)
    row = encode_info(info).to(device)
    table = torch.empty(backend.world_size * _ROW_BYTES, dtype=torch.uint8, device=device)
    backend.all_gather(table, row)
    return [decode_info(r) for r in table.cpu().view(backend.world_size, _ROW_BYTES)]


def discover_layout(backend: Backend, env: Optional[Mapping[str, str]] = None,
                    hostname: Optional[str] = None) -> Optional[NodeLayout]:
    """The node layout of ``backend``'s ranks, or ``None`` (use the flat exchange): the same on
    every rank. Collective: every rank calls it. ``env`` (default ``os.environ``) and
    ``hostname`` (default ``socket.gethostname()``) are this rank's; see the module docstring
    for the order in which they are used. Rank 0 logs the outcome in one line (a warning when
    it is ``None``)."""
    leader = backend.node_leader() if hasattr(backend, "node_leader") else -1
    infos = gather_infos(backend, rank_info(env, hostname, leader))
    layout, reason = layout_from_infos(infos, backend.rank)
    if backend.rank == 0:
        report_layout(layout, reason, infos)
    return layout


def report_layout(layout: Optional[NodeLayout], reason: str, infos: Sequence[RankInfo]) -> None:
    """Rank 0's line on the outcome: a warning where a node layout was missed that would matter
    (the ranks are on several hosts, or ``COMPRESSED_OPT_RANKS_PER_NODE`` asked for one), else
    an info line. Ranks that all share one host lose nothing to the flat exchange: a sub-group of a
    job (a mesh dimension, FSDP2's replicas) whose launcher variables describe the whole job
    leaves no layout for a reason that is no one's mistake."""
    if layout is not None:
        logger.info("compressed_opt: %d ranks in %s", layout.world_size, layout)
        return
    missed = any(info.override for info in infos) or len({info.hostname for info in infos}) > 1
    (logger.warning if missed else logger.info)(
        "compressed_opt: no node layout for a hierarchical exchange (%s); the flat compressed allreduce applies",
        reason)


@dataclasses.dataclass(frozen=True)
class NodeBackends:
    """A layout and its two sub-backends: ``intra`` over this rank's node (its rank = the local
    rank) and ``inter`` over the ranks with this rank's local rank, one per node."""

    layout: NodeLayout
    intra: Backend
    inter: Backend


def node_backends(backend: Backend, layout: NodeLayout) -> NodeBackends:
    """Split ``backend`` by ``layout`` into its intra-node and inter-node backends. Collective:
    every rank calls it with the same layout (from :func:`discover_layout`). Make them once and
    keep them: with ``torch.distributed`` each makes process groups."""
    if not isinstance(layout, NodeLayout):
        raise TypeError(f"layout must be a NodeLayout, got {type(layout).__name__}")
    if (layout.world_size, layout.rank) != (backend.world_size, backend.rank):
        raise ValueError(f"the layout is for rank {layout.rank} of {layout.world_size}, "
                         f"the backend is rank {backend.rank} of {backend.world_size}")
    intra = backend.split(layout.nodes)
    inter = backend.split(layout.inter_groups())
    return NodeBackends(layout, intra, inter)
