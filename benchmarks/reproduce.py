"""Does the same seeded job give the same model every run? The README's loop, launched N times.

Each run is ``torchrun --standalone --nproc-per-node 2`` of this file in ``--child`` mode: a
70k-parameter MLP, each rank its own seeded data, the optimizer with every argument at its
default but ``lr`` and ``freeze_step`` (as the README's snippet), ``--steps`` steps across the
freeze. The child prints the sha256 of rank 0's final parameters and of rank 1's; the parent
prints one line per run and whether every run ended bit-identical.

    python -P benchmarks/reproduce.py                           # 6 runs of each optimizer
    python -P benchmarks/reproduce.py --runs 3 --optimizers OnebitAdam --steps 300 --freeze-step 100

Writes ``--out`` (default ``benchmarks/results/reproduce.json``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import child_env  # noqa: E402


def child(args) -> None:
    import torch
    import torch.distributed as dist

    import compressed_opt

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 128),
                                torch.nn.Tanh(), torch.nn.Linear(128, 64))
    cls = getattr(compressed_opt, args.optimizer)
    freeze = {"var_freeze_step" if cls is compressed_opt.ZeroOneAdam else "freeze_step": args.freeze_step}
    opt = cls(model.parameters(), lr=1e-3, **freeze)
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(args.steps):
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.flip(1).tanh()).backward()
        opt.step()
    sha = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    # (the backend's all_gather_object, not torch's: as a job's last collective, torch's can abort
    # the exit now and then; compressed_opt.comm.torch_backend)
    shas = opt.backend.all_gather_object(sha)
    report = opt.comm_stats()
    if rank == 0:
        print("RESULT " + json.dumps({"shas": shas, "params": sum(p.numel() for p in model.parameters()),
                                      "compression_steps": report.compression_steps,
                                      "paths": report.paths, "ratio": report.compression_ratio}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--optimizer", default="OnebitAdam", help=argparse.SUPPRESS)
    p.add_argument("--optimizers", default="OnebitAdam,OnebitLamb,ZeroOneAdam")
    p.add_argument("--runs", type=int, default=6)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--freeze-step", type=int, default=100)
    p.add_argument("--out", default=os.path.join(HERE, "results", "reproduce.json"))
    args = p.parse_args()
    if args.child:
        child(args)
        return
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = child_env()
    env.pop("COMPRESSED_OPT_PATH", None)  # what users run: nothing pinned
    table = {}
    start = time.time()
    for name in args.optimizers.split(","):
        runs = []
        for i in range(args.runs):
            cmd = [torchrun, "--standalone", "--nproc-per-node", "2", os.path.abspath(__file__), "--child",
                   "--optimizer", name, "--steps", str(args.steps), "--freeze-step", str(args.freeze_step)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode != 0 or line is None:
                raise SystemExit(f"{name} run {i + 1} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            result = json.loads(line[len("RESULT "):])
            runs.append(result)
            print(f"{name} run {i + 1}: rank shas {result['shas']}, {result['compression_steps']} compression steps, "
                  f"paths {result['paths']}, {result['ratio']:.1f}x fewer bytes than fp32", flush=True)
        identical = len({tuple(r["shas"]) for r in runs}) == 1 and len(set(runs[0]["shas"])) == 1
        table[name] = {"runs": runs, "identical": identical}
        print(f"{name}: {args.runs} runs {'bit-identical' if identical else 'DIFFER'}", flush=True)
    out = {"command": " ".join(sys.argv), "steps": args.steps, "freeze_step": args.freeze_step,
           "seconds": round(time.time() - start, 1), "optimizers": table}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.out}")
    if not all(v["identical"] for v in table.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
