"""Drop-in under the frameworks: the compressed optimizers, made with default arguments (but ``lr`` and the
freeze step), under the three frameworks that wrap the model in DistributedDataParallel
themselves — the HF transformers ``Trainer``, Lightning's DDP strategy, an accelerate loop
(``examples/``).

For each framework and optimizer (OnebitAdam, OnebitLamb, ZeroOneAdam, and the framework's
AdamW as the baseline), 2 CPU ranks on Gloo train a tiny byte-level GPT-2 for ``--steps`` steps
(freeze at ``--freeze-step``), ``--repeats`` times with the same seed, each run launched as users
launch it (torchrun; Lightning's own launcher) with a timeout. Reported per row: whether it ran
(a crash or hang is a failed row, not an abort), the ranks' final parameters identical, the runs
bit-identical, bytes per step and rank in warmup and in the compression stage (the library's
``backend.stats``; for AdamW a counting DDP hook; see ``examples/harness.py``), the ratio of
AdamW's compression-stage bytes to the row's, the same on the wire when run as root (a private
network namespace per job, its loopback's bytes), the final training loss and the held-out loss
beside AdamW's. OnebitLamb has no LAMB baseline here: it is compared with AdamW too (its lr is
1e-2 by default, AdamW's 2e-3).

    python -P benchmarks/integrations.py                      # 200 steps, freeze 50: 24 jobs
    python -P benchmarks/integrations.py --steps 8 --freeze-step 4 --repeats 2 --frameworks accelerate_loop

Writes ``benchmarks/results/integrations.json`` (``--out``) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import harness  # noqa: E402

OPTIMIZERS = ("onebitadam", "onebitlamb", "zerooneadam", "adamw")
NAMES = {"onebitadam": "OnebitAdam", "onebitlamb": "OnebitLamb", "zerooneadam": "ZeroOneAdam", "adamw": "AdamW"}


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "accelerate", "pytorch-lightning", "compressed-opt"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _git() -> dict:
    def run(*args):
        try:
            return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = run("status", "--porcelain", "--", "compressed_opt", "comm", "cuda")
    return {"commit": run("rev-parse", "HEAD"), "library_modified": bool(status)}


def _library_fingerprint() -> str:
    """sha256 of the library's sources (compressed_opt/, comm/, cuda/), to tell whether the
    working tree changed while the benchmark ran."""
    import hashlib

    h = hashlib.sha256()
    for folder in ("compressed_opt", "comm", "cuda"):
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in sorted(os.walk(base)):
            dirnames.sort()
            for name in sorted(filenames):
                if name.endswith((".py", ".c", ".cu")):
                    path = os.path.join(dirpath, name)
                    h.update(os.path.relpath(path, ROOT).encode())
                    with open(path, "rb") as f:
                        h.update(f.read())
    return h.hexdigest()


def run_row(script: str, optimizer: str, args, netns, tmp: str) -> dict:
    runs = []
    for i in range(args.repeats):
        out = os.path.join(tmp, f"{script}-{optimizer}-{i}.json")
        run = harness.launch(script, optimizer, steps=args.steps, freeze=args.freeze_step, seed=args.seed, out=out,
                             compat=args.compat, timeout=args.timeout, netns=netns,
                             extra=() if optimizer == "adamw" else ("--path", "1bit"))  # the 1-bit exchange
        status = "ok"
        if run["timed_out"]:
            status = f"hung (killed after {args.timeout:.0f} s)"
        elif run["returncode"] != 0 or run["result"] is None:
            lines = [ln for ln in run["output"].splitlines() if "Error" in ln or "error" in ln]
            status = f"failed (exit {run['returncode']}): " + (lines[-1].strip()[:300] if lines else "no results")
        print(f"  {script} {optimizer} run {i + 1}/{args.repeats}: {status}, {run['seconds']:.1f} s", flush=True)
        runs.append({"status": status, "seconds": run["seconds"], "result": run["result"],
                     "output_tail": None if status == "ok" else run["output"][-4000:]})
    ok = [r["result"] for r in runs if r["status"] == "ok"]
    row = {"framework": script, "optimizer": optimizer, "runs": runs, "ok": len(ok) == len(runs)}
    if ok:
        first = ok[0]
        row.update({
            "ranks_identical": all(r["params_identical"] for r in ok),
            "runs_identical": len(ok) == len(runs) and len({r["params_sha256"] for r in ok}) == 1
            and all(r["loss"] == first["loss"] for r in ok),
            "bytes_warmup": first["bytes"]["warmup"],
            "bytes_compression": first["bytes"]["compression"],
            "unhooked_steps": first["bytes"]["unhooked_steps"],
            "wire_warmup": (first["wire"] or {}).get("warmup"),
            "wire_compression": (first["wire"] or {}).get("compression"),
            "final_loss": first["loss"][-1] if first["loss"] else None,
            "eval_loss": first["eval_loss"],
            "losses_finite": first["losses_finite"],
            "train_seconds": first["wall_s"],
        })
    return row


def _fmt(v, spec="{:.0f}"):
    return "-" if v is None else spec.format(v)


def table(rows: list[dict]) -> str:
    base = {r["framework"]: r for r in rows if r["optimizer"] == "adamw" and r.get("bytes_compression")}
    out = ["| framework | optimizer | ran | ranks identical | runs bit-identical | bytes/step warmup | "
           "bytes/step compression | AdamW / this | wire compression (AdamW / this) | final loss | "
           "held-out loss (AdamW) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "bytes_compression" not in r:
            status = next(x["status"] for x in r["runs"] if x["status"] != "ok")
            out.append(f"| {r['framework']} | {NAMES[r['optimizer']]} | {status} | | | | | | | | |")
            continue
        b = base.get(r["framework"])
        ratio = b["bytes_compression"] / r["bytes_compression"] if b and r["bytes_compression"] else None
        wire = "-"
        if r["wire_compression"] is not None:
            wr = b["wire_compression"] / r["wire_compression"] if b and b.get("wire_compression") else None
            wire = f"{r['wire_compression']:.0f} ({_fmt(wr, '{:.1f}x')})"
        held = f"{r['eval_loss']:.3f}" + (f" ({b['eval_loss']:.3f})" if b else "")
        ran = "yes" if r["ok"] else "partly"
        if r["unhooked_steps"]:
            ran += (f"; DDP's own all-reduce at steps {r['unhooked_steps'][:3]}"
                    f"{'...' if len(r['unhooked_steps']) > 3 else ''}")
        out.append(f"| {r['framework']} | {NAMES[r['optimizer']]} | {ran} | {r['ranks_identical']} | "
                   f"{r['runs_identical']} | {_fmt(r['bytes_warmup'])} | {_fmt(r['bytes_compression'])} | "
                   f"{_fmt(ratio, '{:.1f}x')} | {wire} | {_fmt(r['final_loss'], '{:.3f}')} | {held} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", default=",".join(harness.SCRIPTS),
                   help="comma-separated: " + ", ".join(harness.SCRIPTS))
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated: " + ", ".join(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--freeze-step", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2, help="runs of the same seed per row (bit-identical?)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds per job before it counts as hung")
    p.add_argument("--wire", choices=("auto", "on", "off"), default="auto",
                   help="count loopback bytes in a private network namespace per job (needs root; auto: if possible)")
    p.add_argument("--compat", choices=("none", "manual-hook", "no-overlap"), default="none",
                   help="none (the acceptance): default arguments; the others check the harness before "
                        "automatic DDP detection (see examples/harness.py)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "integrations.json"))
    args = p.parse_args(argv)
    frameworks = [f for f in args.frameworks.split(",") if f]
    optimizers = [o for o in args.optimizers.split(",") if o]
    for f in frameworks:
        if f not in harness.SCRIPTS:
            p.error(f"unknown framework {f!r}")
    for o in optimizers:
        if o not in OPTIMIZERS:
            p.error(f"unknown optimizer {o!r}")
    optimizers = [o for o in OPTIMIZERS if o in optimizers]  # AdamW (the baseline) last is fine; keep order
    netns = None if args.wire == "off" else harness.private_netns()
    if args.wire == "on" and netns is None:
        p.error("--wire on needs root, unshare and ip (a private network namespace per job)")
    started = time.time()
    fingerprint = _library_fingerprint()
    rows = []
    with tempfile.TemporaryDirectory(prefix="co-integrations-") as tmp:
        for script in frameworks:
            for optimizer in optimizers:
                rows.append(run_row(script, optimizer, args, netns, tmp))
    result = {
        "what": "drop-in acceptance: compressed optimizers with default arguments under HF Trainer, Lightning DDP, "
                "accelerate",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"steps": args.steps, "freeze_step": args.freeze_step, "repeats": args.repeats, "seed": args.seed,
                   "compat": args.compat, "world_size": 2, "wire": netns is not None, "model": "GPT-2, 2 layers, "
                   "d 64, 2 heads, 256 byte vocabulary, context 64 (120,576 parameters)",
                   "batch_per_rank": harness.BATCH, "lr": harness.DEFAULT_LR},
        "versions": _versions(),
        "git": {**_git(), "library_sha256_start": fingerprint, "library_sha256_end": _library_fingerprint()},
        "machine": {"cpus": os.cpu_count(), "loadavg_end": os.getloadavg()},
        "wall_seconds": time.time() - started,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(table(rows))
    print(f"\nOnebitLamb is compared with AdamW (no LAMB baseline). {len(rows)} rows in "
          f"{result['wall_seconds']:.0f} s; {args.out}")
    if fingerprint != result["git"]["library_sha256_end"]:
        print("WARNING: the library's sources changed while the benchmark ran", file=sys.stderr)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
