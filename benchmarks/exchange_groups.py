"""What a bucket costs a compression step on a real link, and what exchange groups save.

Ranks of Gloo over this machine's loopback (``--ranks``, spawned here; or under
``benchmarks/slowlink.py``), OnebitAdam with ``path="1bit"`` and ``overlap=False``, ``--tensors``
square layers' weights and biases (a bucket each when each tensor has a param group of its own,
as per-layer learning rates make them), the compression stage: the median ``step()`` of the
slowest rank for

* ``one group``: every tensor in one param group (one bucket);
* ``a group each``: a group per tensor, its buckets' 1-bit exchanges in exchange groups (the
  default: consecutive buckets within the bucket cap share one all-to-all and one all-gather);
* ``a group each, bucket by bucket``: the same, each bucket's exchange alone (two collectives each).

The difference per extra bucket is what a bucket costs: its passes, and, bucket by bucket, the
latency of its collectives.

    python -P benchmarks/exchange_groups.py [--ranks 2] [--tensors 48] [--json out.json]
    python -P benchmarks/slowlink.py --rate 1gbit -- python -P benchmarks/exchange_groups.py
    COMPRESSED_OPT_RANKS_PER_NODE=2 python -P benchmarks/exchange_groups.py --ranks 4 --hierarchy node
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (python -P: the folder's common.py)
from common import write_json  # noqa: E402

MODES = ("one group", "a group each", "a group each, bucket by bucket")


def _rank(rank, world, store, args, out):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = _measure(rank, world, args)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _measure(rank, world, args) -> dict:
    """On the initialised process group: per mode, the slowest rank's median step and the buckets."""
    import torch
    import torch.distributed as dist

    import compressed_opt

    torch.set_num_threads(1)
    medians = {}
    for mode in MODES:
        torch.manual_seed(0)
        width = args.width
        params = [p for _ in range(args.tensors // 2) for p in torch.nn.Linear(width, width).parameters()]
        groups = params if mode == MODES[0] else [{"params": [p]} for p in params]
        # bucket by bucket: a cap below the smallest tensor, so no two buckets fit in one exchange group
        cap_mb = 25.0 if mode != MODES[2] else 4 * (width - 1) / 2**20
        opt = compressed_opt.OnebitAdam(groups, lr=1e-4, freeze_step=2, path="1bit", overlap=False,
                                        hierarchy=args.hierarchy, bucket_cap_mb=cap_mb)
        g = torch.Generator().manual_seed(rank)
        grads = [torch.randn(p.shape, generator=g) * 1e-3 for p in params]
        times = []
        for _ in range(args.steps):
            for p, grad in zip(params, grads):
                p.grad = grad.clone()
            dist.barrier()
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        medians[mode] = (statistics.median(times[args.steps // 2:]), len(opt.engine.buckets))
        opt.close()
    # returns once torch let go of its tensors (docs/comm.md)
    slowest = compressed_opt.comm.TorchBackend().all_gather_object(medians)
    return {mode: (max(m[mode][0] for m in slowest), medians[mode][1]) for mode in MODES}


def _spawned(args) -> dict:
    """:func:`_measure` on ``args.ranks`` spawned ranks (a file store: no port to collide)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, os.path.join(tmp, "store"), args, out))
                 for r in range(args.ranks)]
        for proc in procs:
            proc.start()
        try:
            return out.get(timeout=args.timeout)
        finally:
            for proc in procs:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tensors", type=int, default=48, help="weights and biases of square layers (even)")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hierarchy", default="flat", choices=("flat", "node", "auto"),
                   help="the exchange ('node': with COMPRESSED_OPT_RANKS_PER_NODE set, emulated nodes)")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.tensors < 2 or args.steps < 4:
        p.error("need --ranks >= 2, --tensors >= 2 and --steps >= 4")
    if "RANK" in os.environ:  # under a launcher (torchrun, benchmarks/slowlink.py): env:// rendezvous
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world = dist.get_world_size()
        result = _measure(dist.get_rank(), world, args)
        dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        result, world = _spawned(args), args.ranks
    base, one_buckets = result[MODES[0]]
    rows = []
    print(f"{world} Gloo ranks, {args.hierarchy} exchange, {args.tensors} tensors of width {args.width}: median step "
          "of the slowest rank")
    for mode in MODES:
        step_s, buckets = result[mode]
        per = (step_s - base) / (buckets - one_buckets) if buckets > one_buckets else None
        rows.append({"mode": mode, "step_s": step_s, "buckets": buckets, "per_extra_bucket_s": per})
        print(f"  {mode:<32} {step_s * 1e3:8.2f} ms  {buckets:3d} buckets"
              + (f"  {per * 1e3:.3f} ms per extra bucket" if per is not None else ""))
    write_json(args.json, {"args": vars(args), "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
