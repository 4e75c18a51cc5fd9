"""Scaling model: bytes per rank and per node, and a modelled communication time per step, for
data-parallel training of ``n`` parameters on ``M`` nodes of ``L`` ranks (``N = M L``), by method.

Bytes a step sends (``n`` fp32 elements). A 1-bit element costs ``c = (1 + 32 / B) / 8`` bytes:
its bit and its share of the fp32 scale of its block of ``B`` elements (``--scale-block``, the
optimizers' ``scale_block``, 1024 by default: ``c = 1.03125 / 8``). Below, ``n / 8`` stands for
``c n`` (the headers, 16 bytes per row, left out):

* ``ddp_fp32`` / ``ddp_bf16``: a ring allreduce of ``b n`` bytes (``b`` = 4 or 2) over all ``N``
  ranks, the ring laid out node by node: each rank sends ``2 (N - 1) / N * b n``; one rank per
  node sends across the node boundary, so a node sends ``2 (N - 1) / N * b n`` between nodes.
* ``flat_1bit`` (today's compressed allreduce, every rank with every rank): an all-to-all of 1-bit
  chunks (pairwise: a rank sends ``(N - 1) / N * n / 8``, of which ``(N - L) / N * n / 8`` to other
  nodes) and a ring all-gather of the 1-bit results (``(N - 1) / N * n / 8`` per rank; one rank
  per node across the boundary). Between nodes, per node:
  ``L (N - L) / N * n / 8 + (N - 1) / N * n / 8`` (2 x 2 ranks: ``7 n / 32``; 2 x 4: ``23 n / 64``).
* ``hier_1bit`` (hierarchical): a full-precision reduce-scatter inside the node (each local rank
  then owns ``n / L``), the 1-bit compressed allreduce of that shard among the ``M`` ranks with
  the same local rank, an all-gather inside the node of the shards' results as their 1-bit rows.
  Between nodes, per node: ``L * 2 (M - 1) / M * n / (8 L) = 2 (M - 1) / M * n / 8`` (2 nodes:
  ``n / 8``, the floor); inside the node, per rank: ``(L - 1) / L * (4 n + n / 8)`` (the
  reduce-scatter in fp32, the all-gather in 1-bit rows).
* ``hier_fp32`` (not in the table: the warmup's fp32 average on the hierarchical exchange, which
  NCCL's topology-aware all-reduce also approaches): the same three steps at full precision;
  between nodes, per node, ``2 (M - 1) / M * 4 n`` (2 nodes: ``4 n``, where the ring sends
  ``2 (N - 1) / N * 4 n``).

Time: inter-node bytes per node over the node's link, plus intra-node bytes per rank over the
intra-node link, plus a latency per message of each collective's steps (ring: ``2 (N - 1)``;
all-to-all and all-gather: ``N - 1`` each), plus for 1-bit methods the compression passes (about
6 passes over the fp32 bucket at the memory bandwidth ``--mem-gbyte``). Overlap with backward is
ignored: this is the communication a step must hide or pay.

    python -P benchmarks/scaling_model.py --params 125e6 --inter-gbit 1,10,100
"""
from __future__ import annotations

import argparse
import os
import sys

METHODS = ("ddp_fp32", "ddp_bf16", "flat_1bit", "hier_1bit")
DEFAULT_BLOCK = 1024  # compressed_opt.comm.DEFAULT_BLOCK (this script does not import the package)


def onebit_bytes(n: float, block: int = DEFAULT_BLOCK) -> float:
    """Bytes of ``n`` elements in 1-bit rows: ``n / 8`` of bits and 4 per block of ``block``."""
    return n / 8 * (1 + 32 / block)


def bytes_per_step(method: str, n: float, nodes: int, per_node: int, block: int = DEFAULT_BLOCK) -> dict:
    """``{"inter_node": bytes a node sends to other nodes, "intra_rank": bytes a rank sends inside
    its node, "messages": sequential message steps}`` for one step of ``n`` fp32 gradients."""
    world = nodes * per_node
    bits = onebit_bytes(n, block)
    if method in ("ddp_fp32", "ddp_bf16"):
        b = 4 if method == "ddp_fp32" else 2
        ring = 2 * (world - 1) / world * b * n
        inter = ring if nodes > 1 else 0.0
        intra = ring if per_node > 1 else 0.0
        return {"inter_node": inter, "intra_rank": intra, "messages": 2 * (world - 1)}
    if method == "flat_1bit":
        if world == 1:
            return {"inter_node": 0.0, "intra_rank": 0.0, "messages": 0}
        a2a_out = per_node * (world - per_node) / world * bits
        gather_out = (world - 1) / world * bits if nodes > 1 else 0.0
        a2a_in = (per_node - 1) / world * bits
        gather_in = (world - 1) / world * bits if per_node > 1 else 0.0
        return {"inter_node": a2a_out + gather_out, "intra_rank": a2a_in + gather_in, "messages": 2 * (world - 1)}
    if method in ("hier_1bit", "hier_fp32"):
        inter = 2 * (nodes - 1) / nodes * (bits if method == "hier_1bit" else 4 * n) if nodes > 1 else 0.0
        # the reduce-scatter in fp32; the all-gather of the result in 1-bit rows (fp32 on one node)
        gathered = bits if method == "hier_1bit" and nodes > 1 else 4 * n
        intra = (per_node - 1) / per_node * (4 * n + gathered) if per_node > 1 else 0.0
        return {"inter_node": inter, "intra_rank": intra, "messages": 2 * (per_node - 1) + 2 * (nodes - 1)}
    raise ValueError(f"unknown method {method!r} (one of {', '.join(METHODS)})")


def comm_seconds(method: str, n: float, nodes: int, per_node: int, inter_bps: float, intra_bps: float,
                 latency_s: float, mem_bps: float, block: int = DEFAULT_BLOCK) -> float:
    """The modelled communication time of one step (see the module doc)."""
    b = bytes_per_step(method, n, nodes, per_node, block)
    t = b["inter_node"] / inter_bps + b["intra_rank"] / intra_bps + b["messages"] * latency_s
    if method.endswith("1bit") and nodes * per_node > 1:
        t += 6 * 4 * n / mem_bps
    return t


def table(n: float, nodes_list, per_node_list, inter_gbits, intra_gbyte: float, latency_us: float,
          mem_gbyte: float, block: int = DEFAULT_BLOCK) -> list[dict]:
    rows = []
    for gbit in inter_gbits:
        for per_node in per_node_list:
            for nodes in nodes_list:
                row = {"inter_gbit": gbit, "nodes": nodes, "ranks_per_node": per_node}
                for m in METHODS:
                    b = bytes_per_step(m, n, nodes, per_node, block)
                    row[m] = {"inter_node_bytes": b["inter_node"], "intra_rank_bytes": b["intra_rank"],
                              "comm_s": comm_seconds(m, n, nodes, per_node, gbit * 1e9 / 8, intra_gbyte * 1e9,
                                                     latency_us * 1e-6, mem_gbyte * 1e9, block)}
                rows.append(row)
    return rows


def _mb(x: float) -> str:
    return f"{x / 1e6:9.2f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=125e6, help="parameters (fp32 gradients) per step")
    p.add_argument("--nodes", default="2,4,8,16,64,256,1024")
    p.add_argument("--ranks-per-node", default="1,8")
    p.add_argument("--inter-gbit", default="1,10,100", help="inter-node bandwidth per node, Gbit/s")
    p.add_argument("--intra-gbyte", type=float, default=200.0, help="intra-node bandwidth per rank, GB/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="latency per message step")
    p.add_argument("--mem-gbyte", type=float, default=2000.0, help="memory bandwidth for the compression passes")
    p.add_argument("--scale-block", type=int, default=DEFAULT_BLOCK,
                   help="elements per 1-bit scale (the optimizers' scale_block)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    rows = table(args.params, ints(args.nodes), ints(args.ranks_per_node),
                 [float(x) for x in args.inter_gbit.split(",")], args.intra_gbyte, args.latency_us, args.mem_gbyte,
                 args.scale_block)
    print(f"# {args.params / 1e6:.0f}M parameters; MB a node sends to other nodes per step, and modelled "
          f"communication ms per step")
    head = "".join(f" {m + ' MB':>15} {m + ' ms':>15}" for m in METHODS)
    print(f"{'Gbit/s':>7} {'L':>3} {'nodes':>6}{head}")
    for r in rows:
        cells = "".join(f" {_mb(r[m]['inter_node_bytes']):>15} {r[m]['comm_s'] * 1e3:15.1f}" for m in METHODS)
        print(f"{r['inter_gbit']:7g} {r['ranks_per_node']:3d} {r['nodes']:6d}{cells}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import write_json

    write_json(args.json, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
