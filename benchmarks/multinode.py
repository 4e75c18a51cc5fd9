"""Bytes between two emulated nodes per compression step: the flat 1-bit exchange against the
hierarchical one (``hierarchy="flat"`` / ``"node"``), counted on the link.

Two network namespaces are the two nodes, joined by a veth limited with ``tc tbf``
(``benchmarks/slowlink.py``); each node runs ``--ranks-per-node`` ranks, started as on a
cluster: ``--launcher torchrun`` (the default) by ``torchrun --nnodes 2 --node-rank i`` with c10d
rendezvous at node 0's address (``--rendezvous static``: ``--master-addr``), the ranks on Gloo;
``--launcher mpiexec`` by MPICH's ``mpiexec -ppn L`` (Hydra, one proxy per node), the ranks on
the MPI backend, which finds the nodes by MPI's shared-memory split (MPICH follows Hydra's
hosts: one node per namespace, though they share one machine). The
ranks of a node talk over its loopback, the nodes over the veth. Each rank trains the same MLP
(``--params``, about 3.2M by default, one 25 MB bucket) with OnebitAdam, freeze at step 2; the
first rank of each node reads its namespace's veth ``tx_bytes`` (Ethernet frames: payload and
TCP/IP headers) after a barrier before and after the measured compression steps, so each
node's bytes per step are the mean over those steps (the barriers' few bytes included). The
warmup steps are measured the same way (fp32 all-reduce of the gradients: DDP + AdamW's
traffic). Needs root (namespaces) and ``ip``/``tc``.

    python -P benchmarks/multinode.py --nodes 2 --ranks-per-node 2 --link 1gbit
    python -P benchmarks/multinode.py --launcher mpiexec

``--hsdp``: HSDP instead, the model sharded inside each node (FSDP2) and replicated across the
two: FSDP2's own HSDP (a ("replicate", "shard") mesh: FSDP all-reduces each shard's gradients
across the nodes in fp32) with ``torch.optim.AdamW(fused=True)``, against FSDP2 on
``mesh["shard"]`` with ``OnebitAdam(backend=mesh["replicate"])`` (the optimizer's exchange across
the nodes: fp32 in warmup, 1-bit after the freeze); step time and bytes on the link per step,
each method's steps after the same warmup (``results/multinode_hsdp.json``)::

    python -P benchmarks/multinode.py --hsdp --ranks-per-node 2 --link 1gbit
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results", "multinode.json")


# --- the ranks --------------------------------------------------------------------------------------
def _tx_bytes() -> int:
    with open(f"/sys/class/net/{os.environ['SLOWLINK_IFNAME']}/statistics/tx_bytes") as f:
        return int(f.read())


def worker(args) -> None:
    """Every exchange of ``--hierarchies`` in turn, in one launch (a fresh model and optimizer each)."""
    import torch
    import torch.distributed as dist

    import compressed_opt

    torch.set_num_threads(1)
    if args.launcher == "torchrun":
        dist.init_process_group("gloo")
    backend = compressed_opt.get_backend("torch" if args.launcher == "torchrun" else "mpi")
    if args.hsdp:
        results = [_measure_hsdp(args, backend, method) for method in ("hsdp_fused_adamw", "hsdp_onebit_adam")]
    else:
        results = [_measure(args, backend, h) for h in args.hierarchies.split(",")]
    if backend.rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    if args.launcher == "torchrun":
        dist.destroy_process_group()


def _stepper(model, opt, width: int, rank: int):
    """One training step of the benchmark's MLP on this rank's random batch."""
    import torch

    g = torch.Generator().manual_seed(rank)

    def step():
        model(torch.randn(16, width, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def _measured(backend, step, n: int) -> tuple[float, float]:
    """``n`` steps between two barriers: this node's link bytes per step, the median step time."""
    backend.barrier()
    before, times = _tx_bytes(), []
    for _ in range(n):
        s = time.perf_counter()
        step()
        times.append(time.perf_counter() - s)
    backend.barrier()
    return (_tx_bytes() - before) / n, statistics.median(times)


def _measure(args, backend, hierarchy: str) -> dict:
    import torch

    import compressed_opt

    width = int(round((args.params / 3) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=args.warmup, hierarchy=hierarchy,
                                    path="1bit", overlap=False, backend=backend)
    step = _stepper(model, opt, width, backend.rank)
    with opt:
        step()  # step 1: one-off checks and the choice of the exchange
        warm_bytes, warm_time = _measured(backend, step, args.warmup - 1)
        step()  # the first compression step (the exchange's buffers are made)
        comp_bytes, comp_time = _measured(backend, step, args.steps)
    row = torch.tensor([warm_bytes, comp_bytes, warm_time, comp_time], dtype=torch.float64)
    rows = torch.empty(backend.world_size, row.numel(), dtype=row.dtype)
    backend.all_gather(rows.view(-1), row)
    nodes = [r.tolist() for i, r in enumerate(rows) if i % args.ranks_per_node == 0]
    return {"hierarchy": hierarchy, "launcher": args.launcher, "exchange": list(opt.engine.exchange.averaging.key),
            "params": sum(p.numel() for p in model.parameters()),
            "per_node": [{"warmup_bytes_per_step": n[0], "compression_bytes_per_step": n[1]} for n in nodes],
            "median_step_s": {"warmup": nodes[0][2], "compression": nodes[0][3]}}


def _measure_hsdp(args, backend, method: str) -> dict:
    """One method under HSDP (see the module doc): ``args.warmup`` steps, then ``args.steps``
    measured ones; bytes on this node's side of the link and the median step time."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compressed_opt

    mesh = init_device_mesh("cpu", (2, args.ranks_per_node), mesh_dim_names=("replicate", "shard"))
    width = int(round((args.params / 3) ** 0.5))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(3)])
    native = method == "hsdp_fused_adamw"
    for layer in model:
        fully_shard(layer, mesh=mesh if native else mesh["shard"])
    fully_shard(model, mesh=mesh if native else mesh["shard"])
    if native:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=args.warmup, path="1bit",
                                        backend=mesh["replicate"])
    step = _stepper(model, opt, width, backend.rank)
    for _ in range(args.warmup + 1):  # (OnebitAdam: the warmup and the first compression step)
        step()
    sent, median = _measured(backend, step, args.steps)
    row = torch.tensor([sent, median], dtype=torch.float64)
    rows = torch.empty(backend.world_size, row.numel(), dtype=row.dtype)
    backend.all_gather(rows.view(-1), row)
    nodes = [r.tolist() for i, r in enumerate(rows) if i % args.ranks_per_node == 0]
    return {"method": method, "params": sum(p.numel() for p in model.parameters()),
            "optimizer": type(opt).__name__ + ("(fused=True)" if native else ""),
            "per_node_bytes_per_step": [n[0] for n in nodes], "median_step_s": nodes[0][1]}


# --- the launcher -----------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, choices=(2,), help="emulated nodes (the link joins two)")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--launcher", choices=("torchrun", "mpiexec"), default="torchrun")
    p.add_argument("--rendezvous", choices=("c10d", "static"), default="c10d", help="torchrun's")
    p.add_argument("--link", default="1gbit", help="tc rate of the link between the nodes (or none)")
    p.add_argument("--hierarchies", default="flat,node", help="the exchanges measured, in turn, in one launch")
    p.add_argument("--hsdp", action="store_true", help="HSDP: FSDP2 + fused AdamW against FSDP2 + OnebitAdam")
    p.add_argument("--params", type=int, default=3_200_000)
    p.add_argument("--warmup", type=int, default=4, help="freeze_step")
    p.add_argument("--steps", type=int, default=8, help="measured compression steps")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        args.out = args.worker_out
        worker(args)
        return 0
    sys.path.insert(0, HERE)
    import tempfile

    from common import write_json
    from slowlink import run_two_ranks

    with tempfile.TemporaryDirectory(prefix="co-multinode-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [os.path.abspath(__file__), "--worker", "--hierarchies", args.hierarchies, "--worker-out", out,
               "--params", str(args.params), "--warmup", str(args.warmup), "--steps", str(args.steps),
               "--launcher", args.launcher, "--ranks-per-node", str(args.ranks_per_node)]
        cmd += ["--hsdp"] if args.hsdp else []
        cmd = [sys.executable] + cmd
        run = run_two_ranks(cmd, rate=None if args.link == "none" else args.link, timeout=args.timeout,
                            mode="torch" if args.launcher == "torchrun" else "mpi",
                            ranks_per_node=args.ranks_per_node, rendezvous=args.rendezvous,
                            env={"PYTHONSAFEPATH": "1"})
        if run["returncode"] != 0 or not os.path.exists(out):
            print(f"failed ({run['returncode']})\n" + "\n".join(o[-3000:] for o in run["outputs"]))
            return 1
        with open(out) as f:
            results = json.load(f)
    if args.hsdp:
        for r in results:
            print(f"{r['method']:17s} {r['optimizer']}: between nodes per step and node "
                  f"{', '.join(f'{b / 1e6:.3f} MB' for b in r['per_node_bytes_per_step'])}; median step "
                  f"{r['median_step_s'] * 1e3:.1f} ms", flush=True)
        a, b = results
        print(f"OnebitAdam / fused AdamW under HSDP: {b['median_step_s'] / a['median_step_s']:.3f} of the step time, "
              f"{max(b['per_node_bytes_per_step']) / max(a['per_node_bytes_per_step']):.4f} of the bytes between nodes")
        out_path = args.out if args.out != RESULTS else os.path.join(HERE, "results", "multinode_hsdp.json")
        write_json(out_path, {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "link": args.link,
                              "launcher": args.launcher, "warmup": args.warmup, "steps": args.steps,
                              "results": results})
        return 0
    for result in results:
        per_node = [n["compression_bytes_per_step"] for n in result["per_node"]]
        warm = [n["warmup_bytes_per_step"] for n in result["per_node"]]
        print(f"{result['hierarchy']:5s} exchange {result['exchange']}: between nodes per step and node, compression "
              f"{', '.join(f'{b / 1e6:.3f} MB' for b in per_node)}; warmup (fp32) "
              f"{', '.join(f'{b / 1e6:.2f} MB' for b in warm)}; median step {result['median_step_s']}", flush=True)
    if len(results) == 2:
        a, b = (max(n["compression_bytes_per_step"] for n in r["per_node"]) for r in results)
        print(f"{results[1]['hierarchy']} / {results[0]['hierarchy']}: {b / a:.3f} of the bytes between the nodes")
    write_json(args.out, {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "link": args.link,
                          "launcher": args.launcher + (f" ({args.rendezvous})" if args.launcher == "torchrun" else ""),
                          "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
