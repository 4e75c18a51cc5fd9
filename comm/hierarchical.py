"""Hierarchical compressed allreduce: full precision inside a node, 1-bit between nodes
(docs/design.md 2.2.1).

``W = K L`` ranks in ``K`` nodes of ``L`` (a :class:`~compressed_opt.comm.topology.NodeLayout`);
rank ``(k, l)`` is local rank ``l`` of node ``k`` and holds ``x_kl`` (``n`` fp32 elements). With
the shard ``s = chunk_numel(n, L)`` (``ceil(n / L)`` rounded up to 32; ``s = n`` when ``L = 1``),
local rank ``l`` owns elements ``[l s, min((l+1) s, n))``: ``v_l = max(0, min(s, n - l s))`` of
them (the input is padded with zeros to ``L s``; the padding takes no part in what follows).

1. intra-node reduce-scatter, fp32: ``a_kl = (1/L) sum_j x_kj[shard l]``;
2. inter-node: the compressed allreduce of docs/design.md 2.2 (one scale per ``block``) of
   ``a_kl`` over the ``K`` ranks with local rank ``l`` (:class:`~compressed_opt.comm.compressed.
   CompressedAllreduce`, on the ``v_l`` real elements), with the worker error ``e_kl`` (``v_l``
   elements) and the server error ``E_kl`` (``chunk_numel(v_l, K)``) of this rank: ``y_l ~
   (1/K) sum_k a_kl``, the same on the ``K`` ranks;
3. intra-node all-gather of each ``y_l`` *as it travelled between the nodes*: the ``K`` 1-bit
   rows of step 2's last exchange (``[block scales | sign bits]``, about ``v_l / 8`` bytes, padded
   to local rank 0's size), not its ``4 v_l`` fp32 bytes; every rank expands the ``L`` row sets
   into ``y = concat_l y_l`` (``n`` elements) with the decompression step 2 itself ends with.

So ``y`` approximates ``(1/W) sum_kl x_kl``, and is identical, bit for bit, on every rank (each
``y_l`` is one compressed allreduce's result, and every rank decompresses the same rows the same
way). Error feedback runs
in step 2, so the time-average of ``y`` converges to the time-average of the exact average, as
with the flat exchange. Degenerate layouts: ``K = 1`` (one node) compresses nothing, ``y`` is
the full-precision average (steps 1 and 3); ``L = 1`` is exactly the flat compressed allreduce
over the ``K = W`` ranks (step 2 alone; ``W = 1`` returns the input unchanged).
:func:`hierarchical_average` takes the same steps with an fp32 all-reduce in step 2: the exact
average, with the same bytes inside the node and ``2 (K-1)/K * 4n`` per node between nodes.

The error buffers have the same size on every rank (:func:`hierarchical_error_buffer_sizes`:
``s`` and ``chunk_numel(s, K)``; none when ``K = 1``); rank ``(k, l)`` uses their first ``v_l``
and ``chunk_numel(v_l, K)`` elements, the rest stays zero.

Before any of that, every rank says whether its arguments are valid and which ``n`` and dtype it
has, and its block (an all-gather of 32 bytes inside the node, then one between the nodes, which
also stands for step 2's own check of its header): if any rank's are
not valid, or the ranks disagree, every rank raises instead of some hanging in a collective.

Bytes one rank sends per call (:func:`hierarchical_wire_bytes`): inside its node
``(L-1) 4 s ~ (L-1)/L * 4n`` (the fp32 reduce-scatter) plus ``(L-1) K r`` (the rows' all-gather,
``r = row_bytes(s, K, block)``, ``~ (L-1)/L * n (1/8 + 4/block)``) plus ``32 (L-1)``;
between nodes ``wire_bytes(v_l, K) ~ 2 (K-1)/K * n / (8 L)`` plus ``16 (K-1)`` (32 for the
agreement, less the 16 of step 2's header, left out): a node sends
``~ 2 (K-1)/K * n/8`` to the other nodes, where the flat exchange over ``W`` ranks sends
``~ (L (W-L) + W-1)/W * n/8``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .compressed import (
    _DTYPE_CODES,
    DEFAULT_BLOCK,
    CompressedAllreduce,
    _overlaps,
    _plan_key,
    chunk_numel,
    error_buffer_problem,
    error_buffer_sizes,
    expand_result_rows,
    row_bytes,
    wire_bytes,
)
from .topology import NodeBackends

_HEADER = 4  # int64: status, numel, dtype code, block
_HEADER_BYTES = 8 * _HEADER
_OK, _INVALID, _DISAGREE = 0, 1, 2


def shard_numel(numel: int, local_size: int) -> int:
    """``s``: elements of each local rank's shard (``numel`` when ``local_size`` is 1, else
    ``chunk_numel(numel, local_size)``)."""
    return numel if local_size == 1 else chunk_numel(numel, local_size)


def shard_valid_numel(numel: int, local_size: int, local_rank: int) -> int:
    """``v_l``: how many elements of local rank ``local_rank``'s shard are real (not padding)."""
    s = shard_numel(numel, local_size)
    return max(0, min(s, numel - local_rank * s))


def hierarchical_error_buffer_sizes(numel: int, local_size: int, node_count: int) -> tuple[int, int]:
    """``(worker_numel, server_numel)``: fp32 elements of the two error buffers to allocate
    (zero-initialised, the same sizes on every rank) for a hierarchical compressed allreduce of
    ``numel`` elements over ``node_count`` nodes of ``local_size`` ranks: ``s`` and
    ``chunk_numel(s, K)``; ``(0, 0)`` for one node (nothing is compressed)."""
    if local_size < 1 or node_count < 1:
        raise ValueError(f"need local_size >= 1 and node_count >= 1, got {local_size}, {node_count}")
    if node_count == 1:
        return 0, 0
    return error_buffer_sizes(shard_numel(numel, local_size), node_count)


class WireBytes(NamedTuple):
    """Bytes one rank sends in one call: ``intra`` to the ranks of its node, ``inter`` to other nodes."""

    intra: int
    inter: int


def hierarchical_wire_bytes(numel: int, local_size: int, node_count: int, local_rank: int = 0,
                            block: int = DEFAULT_BLOCK, exact: bool = False) -> WireBytes:
    """Bytes local rank ``local_rank`` sends in one hierarchical compressed allreduce of
    ``numel`` elements (see the module docstring), or with ``exact`` in one
    :func:`hierarchical_average` (the shard's fp32 all-reduce between the nodes: ``2 (K-1)/K * 4``
    bytes per element). Local rank 0 holds the largest shard."""
    L, K = local_size, node_count
    intra = (L - 1) * _HEADER_BYTES
    inter = (K - 1) * _HEADER_BYTES
    if numel == 0:
        return WireBytes(intra, inter)
    s = shard_numel(numel, L)
    intra += (L - 1) * 4 * s  # reduce-scatter: (L-1)/L of L s floats
    # all-gather of the shard's result: fp32 (the exact average, or one node), else its 1-bit rows
    intra += (L - 1) * (4 * s if exact or K == 1 else K * row_bytes(s, K, block))
    valid = shard_valid_numel(numel, L, local_rank)
    if K > 1 and valid:  # (the compressed allreduce's own header is left out: agreed before)
        inter += round(2 * (K - 1) / K * 4 * valid) if exact else wire_bytes(valid, K, block, agreed=True)
    return WireBytes(intra, inter)


class HierarchicalCompressedAllreduce:
    """The buffers and exchanges of hierarchical compressed allreduces of ``numel`` fp32
    elements on ``backends`` (from :func:`~compressed_opt.comm.topology.node_backends`), on
    ``device``. Made once, reused by every call: the padded input, the shard, the gathered
    result, the headers and the inter-node :class:`CompressedAllreduce` are allocated here; a
    call allocates no buffer (only a 3-element header is staged when its content changes: the
    first call, or a call whose arguments are invalid)."""

    def __init__(self, numel: int, backends: NodeBackends, device, block: int = DEFAULT_BLOCK):
        if not isinstance(backends, NodeBackends):
            raise TypeError(f"backends must be a NodeBackends (node_backends(...)), got {type(backends).__name__}")
        layout = backends.layout
        self.numel, self.backends, self.device = numel, backends, torch.device(device)
        L, K = self.local_size, self.node_count = layout.local_size, layout.node_count
        if (backends.intra.world_size, backends.intra.rank, backends.inter.world_size) != (L, layout.local_rank, K):
            raise ValueError(f"backends of sizes {backends.intra.world_size} and {backends.inter.world_size} "
                             f"do not match the layout {layout}")
        self.shard = shard_numel(numel, L)
        self.valid = shard_valid_numel(numel, L, layout.local_rank)
        self.worker_numel, self.server_numel = hierarchical_error_buffer_sizes(numel, L, K)
        self.inter_server_numel = chunk_numel(self.valid, K) if K > 1 else 0
        i64 = dict(dtype=torch.int64, device=self.device)
        self.header = torch.zeros(_HEADER, **i64)
        self.intra_headers = torch.empty(L * _HEADER, **i64)
        self.node_row = torch.zeros(_HEADER, **i64)
        self.inter_rows = torch.empty(K * _HEADER, **i64)
        self._written: dict[str, tuple] = {}
        f32 = dict(dtype=torch.float32, device=self.device)
        padded = L * self.shard
        split = L > 1 and numel > 0
        # the reduce-scatter reads the tensor itself, and the all-gather writes into it, when no padding is needed
        self.padded_in = torch.zeros(padded, **f32) if split and padded != numel else None
        self.shard_buf = torch.empty(self.shard, **f32) if split else None
        self.gathered = torch.empty(padded, **f32) if split and padded != numel else None
        compress = K > 1 and self.valid > 0
        self.inter_plan = CompressedAllreduce(self.valid, backends.inter, self.device, block) if compress else None
        # step 3 of the compressed exchange: every local rank's rows, padded to local rank 0's size
        self.block = block
        self.rows_len = K * row_bytes(self.shard, K, block) if split and K > 1 else 0
        self.rows_out = torch.zeros(self.rows_len, dtype=torch.uint8, device=self.device) if self.rows_len else None
        self.rows_in = torch.empty(L * self.rows_len, dtype=torch.uint8, device=self.device) if self.rows_len else None
        self.row_spans = []  # per local rank j with elements: (j, its shard's start, its elements, its rows' bytes)
        for j in range(L if self.rows_len else 0):
            v = shard_valid_numel(numel, L, j)
            if v:
                self.row_spans.append((j, j * self.shard, v, K * row_bytes(v, K, block)))

    # --- agreement: every rank goes on, or every rank raises ------------------------------------
    def _write(self, name: str, buf: torch.Tensor, values: tuple) -> None:
        if self._written.get(name) != values:
            buf.copy_(torch.tensor(values, dtype=torch.int64))
            self._written[name] = values

    def _agree(self, problem: Exception | None, dtype: torch.dtype) -> None:
        """All-gather (status, numel, dtype) inside the node, then each node's verdict between
        the nodes; raise on every rank unless every rank is valid and all agree."""
        backends, L, K = self.backends, self.local_size, self.node_count
        mine = (_INVALID if problem else _OK, self.numel, _DTYPE_CODES.get(dtype, 0), self.block)
        if L > 1:
            self._write("header", self.header, mine)
            backends.intra.all_gather(self.intra_headers, self.header)
            local = [tuple(r) for r in self.intra_headers.view(L, _HEADER).tolist()]
        else:
            local = [mine]
        verdict = _INVALID if any(r[0] for r in local) else _DISAGREE if len({r[1:] for r in local}) > 1 else _OK
        row = (verdict, *mine[1:])
        if K > 1:
            self._write("node_row", self.node_row, row)
            backends.inter.all_gather(self.inter_rows, self.node_row)
            nodes = [tuple(r) for r in self.inter_rows.view(K, _HEADER).tolist()]
        else:
            nodes = [row]
        if all(r[0] == _OK for r in nodes) and len({r[1:] for r in nodes}) == 1:
            return
        if problem is not None:
            raise problem
        raise ValueError(self._describe(local, nodes))

    def _describe(self, local: list, nodes: list) -> str:
        """What this rank saw of the ranks that cannot go on: its own node in full, the other
        nodes by their verdicts (``nodes`` is in the inter backend's rank order)."""
        layout = self.backends.layout
        names = {code: str(dtype).replace("torch.", "") for dtype, code in _DTYPE_CODES.items()}

        def what(numel, code, block):
            return f"{numel} x {names.get(code, 'a dtype other than float32')} in blocks of {block}"

        seen = []
        for j, (status, *agreed) in enumerate(local):
            rank = layout.intra_ranks[j]
            seen.append(f"rank {rank}: " + ("invalid arguments" if status == _INVALID else what(*agreed)))
        parts = [f"node {layout.node}: " + ", ".join(seen)]
        for rank, (verdict, *agreed) in zip(sorted(layout.inter_ranks), nodes):
            k = layout.node_of(rank)
            if k != layout.node:
                state = {_INVALID: "a rank with invalid arguments", _DISAGREE: "ranks that disagree"}
                parts.append(f"node {k}: " + state.get(verdict, what(*agreed)))
        return ("hierarchical_compressed_allreduce: not every rank can go on, so every rank raises "
                "(every rank must pass valid arguments and a tensor of the same numel and dtype, with the same block; "
                f"this rank saw {'; '.join(parts)})")

    def _check(self, tensor: torch.Tensor, errors: tuple | None) -> Exception | None:
        """This rank's arguments' first problem, as the exception to raise, or ``None``;
        ``errors``: the exchange's ``(worker_error, server_error)``, ``None`` for the exact average."""
        if tensor.dtype != torch.float32:
            return TypeError(f"hierarchical_compressed_allreduce takes float32 tensors, got {tensor.dtype}")
        if tensor.device != self.device:
            return ValueError(f"tensor is on {tensor.device}, this allreduce's buffers on {self.device}")
        if tensor.numel() != self.numel or not tensor.is_contiguous():
            return ValueError(f"tensor must be contiguous with {self.numel} elements, got "
                              f"{tensor.numel()}{'' if tensor.is_contiguous() else ', not contiguous'}")
        if tensor.requires_grad:
            return ValueError("tensor requires grad: the allreduce writes the average into it in place, which "
                              "autograd cannot see; pass tensor.detach() under torch.no_grad()")
        if errors is None:
            return None
        worker_error, server_error = errors
        sizes = (f"{self.numel} elements on {self.node_count} node(s) of {self.local_size} (see "
                 "hierarchical_error_buffer_sizes)")
        for name, buf, expected in (("worker_error", worker_error, self.worker_numel),
                                    ("server_error", server_error, self.server_numel)):
            problem = error_buffer_problem(name, buf, expected, self.device, sizes)
            if problem is not None:
                return problem
        for name, a, other, b in (("worker_error", worker_error, "tensor", tensor),
                                  ("server_error", server_error, "tensor", tensor),
                                  ("server_error", server_error, "worker_error", worker_error)):
            if _overlaps(a, b):
                return ValueError(f"{name} overlaps {other} in memory: each must be a buffer of its own")
        return None

    # --- the exchange -----------------------------------------------------------------------------
    def __call__(self, tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                 agreed: bool = False) -> torch.Tensor:
        """The exchange; ``agreed``: the caller checked its buffers and its ranks agreed on the
        sizes before (an earlier call of the same tensor), so the agreement's two all-gathers are
        left out."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if not agreed:
            self._agree(self._check(tensor, (worker_error, server_error)), tensor.dtype)
        if self.node_count == 1:
            return self._through_shards(tensor, None)

        def between_nodes(shard):
            if self.inter_plan is not None:  # (every rank agreed on n, dtype and block: the shards' sizes follow)
                self.inter_plan(shard, worker_error[: self.valid], server_error[: self.inter_server_numel], agreed=True)

        return self._through_shards(tensor, between_nodes, as_rows=self.rows_in is not None)

    def average(self, tensor: torch.Tensor, agreed: bool = False) -> torch.Tensor:
        """The exact fp32 average, the same three steps with an fp32 all-reduce between the nodes
        in place of the 1-bit one (no error buffers); the agreement first (unless ``agreed``), as
        for the exchange."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if not agreed:
            self._agree(self._check(tensor, None), tensor.dtype)
        inter = self.backends.inter
        return self._through_shards(tensor, (lambda shard: inter.all_reduce(shard, op="avg"))
                                    if self.node_count > 1 and self.valid > 0 else None)

    def _through_shards(self, tensor: torch.Tensor, between_nodes, as_rows: bool = False) -> torch.Tensor:
        """Steps 1 and 3 of the module docstring around ``between_nodes(shard)`` (in place);
        ``as_rows``: step 3 gathers the 1-bit rows of ``between_nodes``' compressed allreduce."""
        if self.numel == 0:
            return tensor
        x = tensor.view(-1)
        shard = self.scatter_(x)
        # 2. among the nodes: the 1-bit compressed allreduce of the shard, or its fp32 average
        if between_nodes is not None:
            between_nodes(shard)
        self.gather_(x, self.inter_plan.gathered if as_rows and self.inter_plan is not None else None, as_rows)
        return tensor

    def scatter_(self, x: torch.Tensor) -> torch.Tensor:
        """Step 1 on ``x`` (flat, this plan's numel): this rank's shard of the node's average
        (reduce-scattered inside the node), a view of a reused buffer, or ``x`` with one rank."""
        if self.shard_buf is None:
            return x
        source = x if self.padded_in is None else self.padded_in
        if self.padded_in is not None:
            self.padded_in[: self.numel].copy_(x)
        self.backends.intra.reduce_scatter(self.shard_buf, source, op="avg")
        return self.shard_buf[: self.valid]

    def gather_(self, x: torch.Tensor, rows: torch.Tensor | None, as_rows: bool) -> None:
        """Step 3 into ``x``: with ``as_rows``, every local rank's 1-bit rows of its shard's result
        (``rows``: this rank's, ``[K, row]`` bytes, ``None`` when it has no shard), else the fp32
        shards."""
        intra = self.backends.intra
        if as_rows:
            self._gather_rows(x, rows)
        elif self.shard_buf is not None:
            target = x if self.gathered is None else self.gathered
            intra.all_gather(target, self.shard_buf)
            if self.gathered is not None:
                x.copy_(self.gathered[: self.numel])

    def _gather_rows(self, x: torch.Tensor, mine: torch.Tensor | None) -> None:
        """Every local rank's rows of its shard's result (the inter-node exchange's gathered rows,
        ``K`` of them; ``mine``: this rank's), all-gathered inside the node, each expanded into its
        shard of ``x``."""
        if mine is not None:
            self.rows_out[: mine.numel()].view(mine.shape).copy_(mine)
        self.backends.intra.all_gather(self.rows_in, self.rows_out)
        rows = self.rows_in.view(self.local_size, self.rows_len)
        for j, start, valid, length in self.row_spans:
            expand_result_rows(rows[j, :length], valid, self.node_count, x[start: start + valid], self.block)


def _plan(tensor, backends, block: int) -> HierarchicalCompressedAllreduce:
    """The reusable buffers for ``tensor``'s numel, device and ``block`` (checks what would
    raise on this rank alone, before any communication)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(backends, NodeBackends):
        raise TypeError(f"backends must be a NodeBackends (node_backends(...)), got {type(backends).__name__}")
    key = _plan_key(tensor.numel(), tensor.device, block, "hierarchical_compressed_allreduce")
    plan = backends.intra.workspace(key, lambda: HierarchicalCompressedAllreduce(tensor.numel(), backends,
                                                                                 tensor.device, block))
    return plan


def hierarchical_compressed_allreduce_plan(tensor: torch.Tensor, backends: NodeBackends,
                                           block: int = DEFAULT_BLOCK) -> HierarchicalCompressedAllreduce:
    """The reusable :class:`HierarchicalCompressedAllreduce` of ``tensor``'s numel and device that
    :func:`hierarchical_compressed_allreduce` and :func:`hierarchical_average` call. A caller that
    owns its buffers, after one checked call of each, may call its exchange and its ``average``
    with ``agreed=True``: no argument checks and no agreement (two all-gathers fewer per call,
    one of them between the nodes)."""
    return _plan(tensor, backends, block)


def hierarchical_compressed_allreduce(tensor: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                                      backends: NodeBackends, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """Average ``tensor`` (float32, contiguous) over all ranks of ``backends.layout``: fp32
    inside each node, 1-bit with error feedback between nodes (module docstring; with one node
    nothing is compressed and the result is the full-precision average; with one rank per node it
    is :func:`~compressed_opt.comm.compressed_allreduce` over all ranks).

    Writes the result into ``tensor`` and returns it — identical on every rank — and updates
    ``worker_error`` and ``server_error`` in place: allocate them once, zeroed, with the sizes of
    :func:`hierarchical_error_buffer_sizes` (the same on every rank), and pass the same ones for
    the same tensor on every call. Collective: every rank calls it with a tensor of the same
    numel. A rank whose arguments are invalid (dtype, device, sizes, contiguity, requires_grad,
    overlapping buffers) raises its error and every other rank a ``ValueError`` naming it, as do
    all ranks when they disagree on the numel; only ``tensor`` not being a tensor, or ``backends``
    not a :class:`~compressed_opt.comm.topology.NodeBackends`, raises on that rank alone, before
    any communication. Buffers are reused across calls (kept by ``backends.intra``).
    """
    return _plan(tensor, backends, block)(tensor, worker_error, server_error)


def hierarchical_average(tensor: torch.Tensor, backends: NodeBackends, block: int = DEFAULT_BLOCK) -> torch.Tensor:
    """The exact average of ``tensor`` (float32, contiguous) over all ranks of ``backends.layout``,
    the hierarchical way: an fp32 reduce-scatter inside each node, the fp32 all-reduce of each
    shard among the nodes, an all-gather inside the node. A node sends ``~ 2 (K-1)/K * 4n`` bytes
    to the other nodes where a ring over all ``W`` ranks sends ``2 (W-1)/W * 4n``, for backends
    whose all-reduce does not follow the nodes by itself (Gloo's ring; NCCL already does).

    Writes the result into ``tensor`` and returns it, identical on every rank (each shard is one
    all-reduce's result, and the all-gather copies it); it may differ from a flat all-reduce's
    in the last bits (another order of the sums). Collective, checked and agreed like
    :func:`hierarchical_compressed_allreduce`, whose buffers for the same numel and ``block`` it
    shares (kept by ``backends.intra``).
    """
    return _plan(tensor, backends, block).average(tensor)
