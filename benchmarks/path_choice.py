"""Warmup (fp32) steps against compression-stage steps, per ``path``: is the compression stage
ever slower than full precision on this link?

2 Gloo ranks on this machine's loopback (``--launch`` spawns them; or run under
``benchmarks/slowlink.py`` for a limited link), an MLP of ``--params`` parameters in ``--layers``
layers, cut into buckets of ``--bucket-mb`` (8 buckets or more by default), OnebitAdam with ``overlap=False``. For each
``path`` ("1bit", "measure") the same job: median ``step()`` time (forward and backward
included) of the warmup steps and of the compression steps, the slowest rank's; and, for
"measure", the path each bucket size took.

    python -P benchmarks/path_choice.py --launch
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def job(rank, world, args):
    import torch
    import torch.distributed as dist

    import compressed_opt

    torch.set_num_threads(1)
    width = int(round((args.params / args.layers) ** 0.5))
    out = {}
    for path in args.paths.split(","):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(args.layers)])
        opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=args.warmup, path=path,
                                        bucket_cap_mb=args.bucket_mb, overlap=False)
        g = torch.Generator().manual_seed(rank)
        times = []
        for _ in range(args.warmup + args.steps):
            x = torch.randn(16, width, generator=g)
            dist.barrier()
            start = time.perf_counter()
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        mine = (statistics.median(times[1:args.warmup]), statistics.median(times[args.warmup + 1:]))
        every = opt.backend.all_gather_object(mine)  # returns once torch let go of its tensors (docs/comm.md)
        out[path] = {"warmup_step_s": max(m[0] for m in every), "compression_step_s": max(m[1] for m in every),
                     "buckets": len(opt.engine.buckets),
                     "paths": {str(k): v for k, v in opt.engine.exchange.paths.items()}}
        opt.close()
    return out


def _rank(rank, world, port, args, result_path):
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = job(rank, world, args)
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=int, default=3_200_000)
    p.add_argument("--layers", type=int, default=8, help="Linear layers (a bucket each at most)")
    p.add_argument("--bucket-mb", type=float, default=1.0)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--paths", default="1bit,measure")
    p.add_argument("--launch", action="store_true", help="spawn 2 ranks on loopback")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not args.launch:  # under a launcher (torchrun, slowlink): env:// rendezvous
        import torch.distributed as dist

        dist.init_process_group("gloo")
        out = job(dist.get_rank(), dist.get_world_size(), args)
        dist.destroy_process_group()
    else:
        import socket
        import tempfile

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "out.json")
            mp.start_processes(_rank, args=(2, port, args, path), nprocs=2, start_method="spawn")
            with open(path) as f:
                out = json.load(f)
    if int(os.environ.get("RANK", "0")) == 0:
        for path, r in out.items():
            print(f"path={path}: {r['buckets']} buckets; median step warmup {r['warmup_step_s'] * 1e3:.1f} ms, "
                  f"compression {r['compression_step_s'] * 1e3:.1f} ms "
                  f"({r['compression_step_s'] / r['warmup_step_s']:.2f}x); paths {r['paths']}")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import write_json

        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
