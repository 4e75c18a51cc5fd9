"""Convergence under HSDP: GPT-2 (the ``gpt2`` task of ``benchmarks/convergence.py``: a GPT-2 from
a ``transformers`` config, next-byte prediction) on a ("replicate", "shard") = (2, 2) mesh of 4
Gloo ranks, sharded with FSDP2 inside each replica:

* ``hsdp-adamw``: FSDP2's own HSDP (the 2-D mesh: FSDP all-reduces each shard's gradients across
  the replicas in fp32) with ``torch.optim.AdamW(fused=True)``;
* ``hsdp-onebitadam``: FSDP2 on ``mesh["shard"]`` with ``OnebitAdam(backend=mesh["replicate"])``
  (fp32 across the replicas in warmup, the 1-bit exchange after the freeze).

Both on the same global batches (8 sequences per rank), no weight decay, the schedule of
``convergence.py`` (300 steps, freeze at 50), per seed. Recorded: the global training loss per
step, the held-out loss at the end, the bytes the optimizer sent across the replicas per
compression step. The summary: each seed's held-out loss ratio (OnebitAdam / AdamW) and their
mean. Result: ``benchmarks/results/convergence_hsdp.json``.

    python -P benchmarks/convergence_hsdp.py                 # seeds 0, 1, 2
    python -P benchmarks/convergence_hsdp.py --seeds 0 --steps 60 --freeze 10
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from convergence import SCHEDULE, GPT2Task, gloo_runs  # noqa: E402

WORLD = 4
METHODS = ("hsdp-adamw", "hsdp-onebitadam")


def run_one(method: str, seed: int, steps: int, freeze: int, rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import compressed_opt
    from compressed_opt.comm.torch_backend import hold

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    task = GPT2Task(seed)
    torch.manual_seed(seed)
    model = task.model()
    native = method == "hsdp-adamw"
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh if native else mesh["shard"])
    fully_shard(model, mesh=mesh if native else mesh["shard"])
    if native:
        opt = torch.optim.AdamW(model.parameters(), lr=task.lr, weight_decay=0.0, fused=True)
    else:
        opt = compressed_opt.OnebitAdam(model.parameters(), lr=task.lr, weight_decay=0.0, freeze_step=freeze,
                                        backend=mesh["replicate"])
    losses, sent = [], []
    loss_buf = torch.zeros(1)
    started = time.perf_counter()
    for step in range(1, steps + 1):
        before = 0 if native else opt.backend.stats.total_bytes
        loss = task.loss(model, task.batch_for(step, rank, WORLD))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if not native and opt.compressing and step > freeze + 1:
            sent.append(opt.backend.stats.total_bytes - before)
        loss_buf.fill_(loss.item())
        hold(loss_buf)  # the exit waits until torch lets go of it (docs/comm.md)
        dist.all_reduce(loss_buf)
        losses.append(loss_buf.item() / WORLD)
    model.eval()
    with torch.no_grad():
        held = [task.loss(model, b).item() for b in task.eval_batches()]
    tail = max(1, steps // 10)
    return {"method": method, "seed": seed, "steps": steps, "freeze": freeze, "losses": losses,
            "final_loss": sum(losses[-tail:]) / tail, "eval_loss": sum(held) / len(held),
            "compression_bytes_per_step": sorted(sent)[len(sent) // 2] if sent else None,
            "train_s": time.perf_counter() - started}


def _worker(rank: int, store_path: str, runs: list, steps: int, freeze: int, out_dir: str):
    gloo_runs(rank, WORLD, store_path, runs, lambda item: run_one(item[0], item[1], steps, freeze, rank),
              lambda item: os.path.join(out_dir, f"{item[0]}-{item[1]}.json"),
              lambda item, r: f"  {item[0]:16s} seed {item[1]}: final {r['final_loss']:.4f} held-out "
                              f"{r['eval_loss']:.4f} ({r['train_s']:.0f} s)")


def summarize(results: list[dict]) -> dict:
    by = {(r["method"], r["seed"]): r for r in results}
    seeds = sorted({r["seed"] for r in results})
    ratios = {s: by[("hsdp-onebitadam", s)]["eval_loss"] / by[("hsdp-adamw", s)]["eval_loss"] for s in seeds
              if ("hsdp-onebitadam", s) in by and ("hsdp-adamw", s) in by}
    return {"held_out_ratio_per_seed": ratios,
            "held_out_ratio_mean": sum(ratios.values()) / len(ratios) if ratios else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=SCHEDULE["gpt2"][0])
    p.add_argument("--freeze", type=int, default=SCHEDULE["gpt2"][1])
    p.add_argument("--out", default=os.path.join(HERE, "results", "convergence_hsdp.json"))
    args = p.parse_args(argv)
    runs = [(m, int(s)) for s in args.seeds.split(",") for m in METHODS]
    with tempfile.TemporaryDirectory(prefix="co-hsdp-conv-") as tmp:
        mp.start_processes(_worker, args=(os.path.join(tmp, "store"), runs, args.steps, args.freeze, tmp),
                           nprocs=WORLD, start_method="spawn")
        results = [json.load(open(os.path.join(tmp, f"{m}-{s}.json"))) for m, s in runs]
    summary = summarize(results)
    print(f"held-out loss, OnebitAdam / AdamW(fused) under HSDP: per seed "
          f"{ {s: round(r, 4) for s, r in summary['held_out_ratio_per_seed'].items()} }, mean "
          f"{summary['held_out_ratio_mean']:.4f}")
    from common import write_json

    write_json(args.out, {"mesh": {"replicate": 2, "shard": 2}, "model": "gpt2", "summary": summary,
                          "runs": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
