"""Bytes on the wire of ONE compressed allreduce against ONE fp32 (and bf16) allreduce, counted.

Two ranks run in two network namespaces joined by a veth pair (``benchmarks/slowlink.py``); each
rank reads its own veth end's ``tx_bytes``/``rx_bytes`` counters (Ethernet frames: payload plus
TCP/IP/Ethernet headers and ACKs) around the calls:

1. after ``--warmup`` calls (connections made, buffers allocated), a barrier, read the counters;
2. ``--calls`` calls of the operation, a barrier, read the counters again;
3. the bytes of one barrier alone (read, barrier, read) are subtracted, and the rest divided by
   ``--calls``: the bytes one call puts on the wire, without connection setup.

Printed per operation: counted bytes per call and rank (tx), the backend's own accounting
(``backend.stats``) and the model (``comm.wire_bytes``), and the ratios fp32/compressed and
bf16/compressed of the counted bytes. Default: 16 Mi fp32 elements (64 MiB), 2 ranks, Gloo.

    python benchmarks/wire_bytes.py                      # Gloo over an unlimited veth
    python benchmarks/wire_bytes.py --no-gso --json out.json
    python benchmarks/wire_bytes.py --backend mpi        # MPICH (UCX over TCP) over the veth

Needs root (network namespaces); see ``slowlink.py``. ``--worker`` is the per-rank part that
``slowlink`` runs; it is not meant to be called by hand.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

RESULT_TAG = "WIRE_BYTES_RESULT "
OPS = ("fp32", "bf16", "compressed")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=16 * 1024 * 1024, help="fp32 elements (default 16Mi = 64 MiB)")
    p.add_argument("--calls", type=int, default=10, help="counted calls per operation (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="uncounted calls first (default 2)")
    p.add_argument("--backend", choices=("torch", "mpi"), default="torch", help="Gloo (default) or MPI")
    p.add_argument("--rate", default="none", help="link rate (default none: the count does not depend on it)")
    p.add_argument("--no-gso", action="store_true", help="count MTU-sized frames (see slowlink.create_link)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- per rank, inside a namespace ---------------------------------------------------------------------
def _read_counters(ifname: str) -> tuple[int, int]:
    base = f"/sys/class/net/{ifname}/statistics/"
    with open(base + "tx_bytes") as f_tx, open(base + "rx_bytes") as f_rx:
        return int(f_tx.read()), int(f_rx.read())


def worker(args) -> int:
    import torch

    from compressed_opt import comm

    torch.set_num_threads(1)
    ifname = os.environ["SLOWLINK_IFNAME"]
    if args.backend == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method="env://")
    backend = comm.get_backend(args.backend)
    n, world = args.numel, backend.world_size
    gen = torch.Generator().manual_seed(7 + backend.rank)
    src = torch.randn(n, generator=gen)
    worker_error, server_error = (torch.zeros(k) for k in comm.error_buffer_sizes(n, world))
    buffers = {"fp32": src.clone(), "bf16": src.to(torch.bfloat16), "compressed": src.clone()}
    calls = {
        "fp32": lambda: backend.all_reduce(buffers["fp32"], op="avg"),
        "bf16": lambda: backend.all_reduce(buffers["bf16"], op="avg"),
        "compressed": lambda: comm.compressed_allreduce(buffers["compressed"], worker_error, server_error, backend),
    }

    def barrier_bytes() -> tuple[int, int]:
        backend.barrier()
        tx0, rx0 = _read_counters(ifname)
        backend.barrier()
        tx1, rx1 = _read_counters(ifname)
        return tx1 - tx0, rx1 - rx0

    results = {}
    for op in OPS:
        for _ in range(args.warmup):
            calls[op]()
        base_tx, base_rx = barrier_bytes()
        backend.barrier()
        tx0, rx0 = _read_counters(ifname)
        backend.stats.reset()
        for _ in range(args.calls):
            calls[op]()
        accounted = backend.stats.total_bytes / args.calls
        backend.barrier()
        tx1, rx1 = _read_counters(ifname)
        results[op] = {
            "tx_bytes_per_call": (tx1 - tx0 - base_tx) / args.calls,
            "rx_bytes_per_call": (rx1 - rx0 - base_rx) / args.calls,
            "barrier_tx_bytes": base_tx,
            "accounted_bytes_per_call": accounted,
        }
    results["compressed"]["model_bytes_per_call"] = comm.wire_bytes(n, world)
    for op in ("fp32", "bf16"):
        results[op]["model_bytes_per_call"] = 2 * (world - 1) / world * n * (4 if op == "fp32" else 2)

    # rank 0 collects every rank's numbers
    keys = [(op, k) for op in OPS for k in ("tx_bytes_per_call", "rx_bytes_per_call")]
    mine = torch.tensor([results[op][k] for op, k in keys], dtype=torch.float64)
    everyone = torch.empty(world * len(keys), dtype=torch.float64)
    backend.all_gather(everyone, mine)
    if backend.rank == 0:
        per_rank = everyone.view(world, len(keys)).tolist()
        for op in OPS:
            for k in ("tx_bytes_per_call", "rx_bytes_per_call"):
                results[op][k + "_by_rank"] = [row[keys.index((op, k))] for row in per_rank]
        report = {"numel": n, "world_size": world, "calls": args.calls, "warmup": args.warmup,
                  "backend": repr(backend), "ops": results}
        print(RESULT_TAG + json.dumps(report), flush=True)
    backend.barrier()
    if args.backend == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
    return 0


# --- the driver -------------------------------------------------------------------------------------
def format_report(report: dict) -> str:
    ops = report["ops"]
    lines = [f"# wire bytes per call, {report['numel']} fp32 elements, {report['world_size']} ranks, "
             f"{report['backend']}, mean of {report['calls']} calls after {report['warmup']} warmup",
             f"{'op':<11} {'counted tx/rank':>16} {'(rank0, rank1)':>26} {'accounted':>12} {'model':>12}"]
    for op in OPS:
        r = ops[op]
        by_rank = ", ".join(f"{v:.0f}" for v in r["tx_bytes_per_call_by_rank"])
        mean_tx = sum(r["tx_bytes_per_call_by_rank"]) / len(r["tx_bytes_per_call_by_rank"])
        lines.append(f"{op:<11} {mean_tx:16.0f} {by_rank:>26} {r['accounted_bytes_per_call']:12.0f} "
                     f"{r['model_bytes_per_call']:12.0f}")
    lines.append(f"ratio fp32/compressed (counted): {report['ratio_fp32_over_compressed']:.2f}x; "
                 f"bf16/compressed: {report['ratio_bf16_over_compressed']:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import run_on_link, slowlink, write_json

    cmd = [sys.executable, "-P", os.path.abspath(__file__), "--worker", "--numel", str(args.numel),
           "--calls", str(args.calls), "--warmup", str(args.warmup), "--backend", args.backend]
    try:
        run = run_on_link(cmd, args.rate, timeout=args.timeout, mode="mpi" if args.backend == "mpi" else "torch",
                          gso=not args.no_gso)
    except slowlink().SlowLinkError as e:
        print(f"wire_bytes: {e}", file=sys.stderr)
        return 2
    line = next((ln for ln in run["outputs"][0].splitlines() if ln.startswith(RESULT_TAG)), None)
    if run["returncode"] != 0 or line is None:
        print(f"wire_bytes: the ranks failed (codes {run['returncodes']}, timed out: {run['timed_out']})",
              file=sys.stderr)
        for r, out in enumerate(run["outputs"]):
            print(f"--- rank {r} ---\n{out}", file=sys.stderr)
        return 1
    report = json.loads(line[len(RESULT_TAG):])

    def mean_tx(op):
        values = report["ops"][op]["tx_bytes_per_call_by_rank"]
        return sum(values) / len(values)

    report["ratio_fp32_over_compressed"] = mean_tx("fp32") / mean_tx("compressed")
    report["ratio_bf16_over_compressed"] = mean_tx("bf16") / mean_tx("compressed")
    report["link"] = {k: run[k] for k in ("rate", "tbf", "gso", "mode", "ifname", "tx_bytes", "rx_bytes", "elapsed_s")}
    print(format_report(report))
    print(f"# whole run (with connection setup and warmup): veth tx_bytes {run['tx_bytes']}")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
