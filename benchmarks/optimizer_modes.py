"""The optimizer's modes measured: per-rank state memory, bytes per step, overlap's step time.

Two measurements (docs/design.md section 4):

``memory``: on N local Gloo ranks, an optimizer (``--optimizer``: OnebitAdam by default,
OnebitLamb, ZeroOneAdam) trains a deep MLP in every mode it runs in — standalone synchronous,
overlapped, under the DDP hook, ZeRO stage 1 and 2 (not 0/1 Adam) — and reports per rank the
optimizer-state bytes (``optimizer.state_bytes()``) in warmup and in the compression stage, and
the bytes sent per step in each stage (``backend.stats``) beside DDP + AdamW's (an fp32 ring
all-reduce of every gradient, ``2 (N-1)/N * 4n``, by the same counting convention).

``overlap``: 2 ranks joined by a rate-limited link (benchmarks/slowlink.py; root only): the step
time of the same model with ``overlap=True`` and ``overlap=False`` in each stage (median over
steps, max over ranks; with ``--rounds R`` the modes run R times interleaved and the median
round is reported).

0/1 Adam runs with ``var_update_scaler=1`` (its full-precision refreshes at steps 1, 2, 4, ...)
and a synchronisation every phase-B step (its default schedule at the start of phase B): its
"compression" column is the 1-bit phase B, measured at its most talkative.

    python -P benchmarks/optimizer_modes.py memory --launch 2 [--optimizer onebit_lamb]
    python -P benchmarks/optimizer_modes.py overlap --link 1gbit [--optimizer onebit_lamb]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

MODES = ("sync", "overlap", "ddp_hook", "zero1", "zero2")
OPTIMIZERS = ("onebit_adam", "onebit_lamb", "zero_one_adam")
NOT_SHARDED = ("zero_one_adam",)  # see compressed_opt.zero


def make_optimizer(name: str, params, freeze: int, **kwargs):
    import compressed_opt

    kwargs.setdefault("path", "1bit")  # the 1-bit exchange's memory (the default may take fp32 where faster)
    if name == "onebit_adam":
        return compressed_opt.OnebitAdam(params, lr=1e-3, freeze_step=freeze, **kwargs)
    if name == "onebit_lamb":
        return compressed_opt.OnebitLamb(params, lr=1e-3, freeze_step=freeze, **kwargs)
    if kwargs.pop("zero_stage"):
        raise ValueError("ZeroOneAdam is not sharded")
    return compressed_opt.ZeroOneAdam(params, lr=1e-3, var_freeze_step=freeze, var_update_scaler=1, **kwargs)


def deep_mlp(width: int, depth: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def batches(rank, world, steps, width, batch):
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        x = torch.randn(world * batch, width, generator=g)
        y = torch.randint(0, 10, (world * batch,), generator=g)
        yield x[rank * batch:(rank + 1) * batch], y[rank * batch:(rank + 1) * batch]


def frozen(opt) -> bool:
    """Past the warmup: 1-bit Adam's and LAMB's compression stage, 0/1 Adam's phase B."""
    import compressed_opt

    return opt.schedule.frozen if isinstance(opt, compressed_opt.ZeroOneAdam) else opt.compressing


def run_mode(mode: str, args, rank: int, world: int) -> dict:
    import compressed_opt

    model = deep_mlp(args.width, args.depth)
    net = model
    kwargs = dict(bucket_cap_mb=args.bucket_cap_mb, overlap=(mode != "sync"),
                  zero_stage={"zero1": 1, "zero2": 2}.get(mode, 0))
    if mode == "ddp_hook":
        net = nn.parallel.DistributedDataParallel(model)
        opt = make_optimizer(args.optimizer, net.parameters(), args.freeze, **kwargs)
        compressed_opt.register_ddp_comm_hook(net, opt)
    else:
        opt = make_optimizer(args.optimizer, model.parameters(), args.freeze, **kwargs)
    times = {"warmup": [], "compression": []}
    sent = {"warmup": [], "compression": []}
    memory = {}
    for _step, (x, y) in enumerate(batches(rank, world, args.steps, args.width, args.batch), start=1):
        stage = "compression" if frozen(opt) else "warmup"  # 0/1 Adam: phase B, and A
        dist.barrier()
        before = opt.backend.stats.total_bytes
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        elapsed = time.perf_counter() - t0
        times[stage].append(elapsed)
        sent[stage].append(opt.backend.stats.total_bytes - before)
        memory["compression" if frozen(opt) else "warmup"] = opt.state_bytes()
    numel = sum(p.numel() for p in model.parameters())
    # per stage, this rank's median step (the first step of a stage carries one-off setup), then the
    # slowest rank's (the backend's gather returns once torch let go of its tensors: docs/comm.md)
    medians = {stage: statistics.median(ts[1:] if len(ts) > 2 else ts) if ts else 0.0
               for stage, ts in times.items()}
    every = opt.backend.all_gather_object(medians)
    slowest = {stage: max(m[stage] for m in every) for stage in medians}
    return {
        "mode": mode, "params": numel, "buckets": len(opt.engine.buckets),
        "state_bytes": memory,
        "bytes_per_step": {k: (statistics.median(v[1:] or v) if v else 0) for k, v in sent.items()},
        "ddp_adamw_bytes_per_step": 2 * (world - 1) / world * 4 * numel,
        "step_time_s": slowest,
    }


def rank_main(args) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    modes = args.modes.split(",")
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.rounds):  # modes interleaved, so that drift in the machine's speed hits all alike
        for mode in modes:
            rounds[mode].append(run_mode(mode, args, rank, world))
            dist.barrier()
    results = []
    for mode in modes:
        r = dict(rounds[mode][0])
        r["step_time_s"] = {stage: statistics.median(x["step_time_s"][stage] for x in rounds[mode])
                            for stage in r["step_time_s"]}
        r["step_time_s_rounds"] = [x["step_time_s"] for x in rounds[mode]]
        results.append(r)
    if rank == 0:
        report = {"world_size": world, "optimizer": args.optimizer, "args": vars(args), "results": results}
        print(format_table(report), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)


def format_table(report: dict) -> str:
    lines = [f"# {report.get('optimizer', 'onebit_adam')} modes on {report['world_size']} ranks, "
             f"{report['results'][0]['params']:,} parameters, {report['results'][0]['buckets']} buckets",
             f"{'mode':<9} {'state warmup':>13} {'state 1-bit':>12} {'sent warmup':>12} {'sent 1-bit':>11} "
             f"{'DDP+AdamW':>11} {'1-bit vs DDP':>12} {'step warm ms':>12} {'step 1-bit ms':>13}"]
    base = next((r for r in report["results"] if r["mode"] in ("overlap", "sync")), report["results"][0])
    for r in report["results"]:
        sb, bs, st = r["state_bytes"], r["bytes_per_step"], r["step_time_s"]
        ratio = r["ddp_adamw_bytes_per_step"] / bs["compression"] if bs.get("compression") else float("nan")
        lines.append(
            f"{r['mode']:<9} {sb.get('warmup', 0) / 2**20:10.2f} MiB {sb.get('compression', 0) / 2**20:8.2f} MiB "
            f"{bs.get('warmup', 0) / 2**20:8.2f} MiB {bs.get('compression', 0) / 2**20:7.3f} MiB "
            f"{r['ddp_adamw_bytes_per_step'] / 2**20:7.2f} MiB {ratio:11.1f}x "
            f"{st['warmup'] * 1e3:12.1f} {st['compression'] * 1e3:13.1f}")
    for r in report["results"]:
        if r["mode"].startswith("zero"):
            for stage in ("warmup", "compression"):
                z, b = r["state_bytes"].get(stage, 0), base["state_bytes"].get(stage, 1)
                lines.append(f"# {r['mode']} {stage}: state {z / b:.2f}x of stage 0")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("memory", "overlap"))
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="onebit_adam")
    p.add_argument("--launch", type=int, default=0, help="spawn this many local Gloo ranks")
    p.add_argument("--link", default="1gbit", help="overlap: the link rate for slowlink (or 'none')")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times, interleaved")
    p.add_argument("--freeze", type=int, default=5)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--modes", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=float, default=900)
    args = p.parse_args(argv)
    if args.modes is None:
        modes = [m for m in MODES if not (m.startswith("zero") and args.optimizer in NOT_SHARDED)]
        args.modes = ",".join(modes) if args.what == "memory" else "sync,overlap"
    return args


def _spawned(rank, world, store, argv):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        rank_main(parse_args(argv))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.what == "overlap" and "RANK" not in os.environ:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import run_on_link

        cmd = [sys.executable, "-P", os.path.abspath(__file__), *argv]  # ranks have RANK set: no relaunch
        out = run_on_link(cmd, args.link, threads=1, timeout=args.timeout)
        print(out["outputs"][0])
        if out["returncode"]:
            print(out["outputs"][1], file=sys.stderr)
        return out["returncode"]
    if args.launch:
        import torch.multiprocessing as mp

        child = argv  # the ranks run rank_main directly
        with tempfile.TemporaryDirectory(prefix="co-modes-") as tmp:
            mp.start_processes(_spawned, args=(args.launch, os.path.join(tmp, "store"), child),
                               nprocs=args.launch, start_method="spawn")
        return 0
    dist.init_process_group("gloo", init_method="env://")
    try:
        rank_main(args)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
