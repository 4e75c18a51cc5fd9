"""Per-tensor overhead of ``optimizer.step()``: the same number of elements as many small tensors
or as a few large ones, one process (``SingleProcessBackend``: the compressed allreduce runs its
kernels, the collectives are local copies), compression stage.

The ratio many / few is what the optimizer pays per parameter tensor (Python loops, per-tensor
kernel launches) on top of the element-wise work both share. Median of the last steps; the
optimizers of one table step in turn, each over its own copy of the model (the machine's drift
hits them alike).

    python -P benchmarks/step_overhead.py [--tensors 2000] [--elements 4200000] [--json out.json]
    python -P benchmarks/step_overhead.py --tracking on,off    # the variance tracking's cost
    python -P benchmarks/step_overhead.py --groups one,each    # a bucket's cost: a param group per tensor
    python -P benchmarks/step_overhead.py --against REV        # this checkout against git revision REV
    python -P benchmarks/step_overhead.py --against REV --in-process   # the same, steps in turn
    python -P benchmarks/step_overhead.py --against REV --in-process --groups each --tensors 200   # per bucket

``--against`` installs REV (``git archive``, ``pip install --target``) into a temporary folder and
times each optimizer with its defaults in alternating processes, REV then this checkout, for
``--rounds`` rounds (the machine's drift hits both alike); it reports the median over the rounds
of each process's median step, and their ratio. ``--in-process`` times both in one process per
round instead, their steps in turn (REV's package copied as ``compressed_opt_rev``, its imports
renamed): on a shared machine the processes' medians spread by +-30%, steps in turn far less.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (python -P: the folder's common.py)
from common import write_json  # noqa: E402


def model_of(n_tensors: int, elements: int) -> list[nn.Parameter]:
    """``n_tensors`` parameters (weights and biases of square layers) of about ``elements`` in all."""
    layers = max(1, n_tensors // 2)
    width = max(1, int((elements / layers) ** 0.5))
    torch.manual_seed(0)
    return [p for _ in range(layers) for p in nn.Linear(width, width).parameters()]


def time_interleaved(makers: dict, n_tensors: int, elements: int, steps: int) -> dict:
    """Per maker, the median ``step()`` (last half of ``steps``) of an optimizer over its own copy
    of the model, the optimizers stepping in turn: the machine's drift hits every one alike."""
    models = {name: model_of(n_tensors, elements) for name in makers}
    opts = {name: make(models[name]) for name, make in makers.items()}
    grads = [torch.randn_like(p) * 1e-3 for p in next(iter(models.values()))]
    times = {name: [] for name in makers}
    for _ in range(steps):
        for name, opt in opts.items():
            for p, g in zip(models[name], grads):
                p.grad = g
            t0 = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - t0)
    for opt in opts.values():
        opt.close()
    return {name: statistics.median(t[steps // 2:]) for name, t in times.items()}


def time_steps(opt, params, steps: int) -> float:
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    times = []
    for _ in range(steps):
        for p, g in zip(params, grads):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[steps // 2:])


GROUPINGS = ("one", "each")
FREEZE = {"OnebitAdam": {"freeze_step": 2}, "OnebitLamb": {"freeze_step": 2}, "ZeroOneAdam": {"var_freeze_step": 2}}


def child(name: str, tensors: int, elements: int, steps: int, grouping: str = "one") -> dict:
    """One process's medians for ``name`` with its defaults, as few and as many tensors."""
    torch.set_num_threads(1)
    import compressed_opt
    from compressed_opt.comm import SingleProcessBackend

    cls = getattr(compressed_opt, name)
    out = {}
    for label, n in (("few", 2), ("many", tensors)):
        params = model_of(n, elements)
        opt = cls(grouped(params, grouping), lr=1e-4, backend=SingleProcessBackend(), **FREEZE[name])
        out[label] = time_steps(opt, params, steps)
        if hasattr(opt, "close"):
            opt.close()
    return out


REV_PACKAGE = "compressed_opt_rev"


def rename_package(site: str, dest: str) -> None:
    """``site``'s ``compressed_opt`` copied into ``dest`` as :data:`REV_PACKAGE`, every reference
    to the package renamed, so that it imports beside this checkout's."""
    target = pathlib.Path(dest, REV_PACKAGE)
    shutil.copytree(os.path.join(site, "compressed_opt"), target, ignore=shutil.ignore_patterns("__pycache__"))
    pattern = re.compile(r"\bcompressed_opt\b(?=\.| import|\n)")
    left = re.compile(r"^\s*(from|import)\s+compressed_opt\b", re.MULTILINE)
    for path in target.rglob("*.py"):
        text = pattern.sub(REV_PACKAGE, path.read_text())
        if left.search(text):  # it would time this checkout's code as the revision's
            raise RuntimeError(f"{path}: an import of compressed_opt was not renamed")
        path.write_text(text)


def grouped(params: list, grouping: str) -> list:
    """``params`` as one param group (``"one"``) or as a group per tensor (``"each"``: a bucket each)."""
    return params if grouping == "one" else [{"params": [p]} for p in params]


def child_pair(name: str, tensors: int, elements: int, steps: int, grouping: str = "one") -> dict:
    """One process's medians for ``name`` of :data:`REV_PACKAGE` and of this checkout, their steps
    in turn, as few and as many tensors (``grouping``: as one param group or a group per tensor):
    ``{label: {"rev": s, "this": s}}``."""
    import importlib

    torch.set_num_threads(1)
    out = {}
    for label, n in (("few", 2), ("many", tensors)):
        makers = {}
        for version, package in (("rev", REV_PACKAGE), ("this", "compressed_opt")):
            cls = getattr(importlib.import_module(package), name)
            single = importlib.import_module(package + ".comm").SingleProcessBackend
            makers[version] = lambda ps, cls=cls, single=single: cls(grouped(ps, grouping), lr=1e-4, backend=single(),
                                                                     **FREEZE[name])
        out[label] = time_interleaved(makers, n, elements, steps)
    return out


def against(rev: str, args) -> int:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    names = args.optimizers.split(",")
    if args.groups not in GROUPINGS:
        raise SystemExit(f"--groups with --against: one of {GROUPINGS}, got {args.groups!r}")
    unknown = sorted(set(names) - set(FREEZE))
    if unknown:
        raise SystemExit(f"--optimizers: unknown {unknown}; choose among {list(FREEZE)}")
    with tempfile.TemporaryDirectory() as tmp:
        src, site = os.path.join(tmp, "src"), os.path.join(tmp, "site")
        os.makedirs(src)
        archive = subprocess.run(["git", "-C", root, "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", site, src], check=True, capture_output=True)
        if args.in_process:
            renamed = os.path.join(tmp, "renamed")
            rename_package(site, renamed)
        sizes = ["--tensors", str(args.tensors), "--elements", str(args.elements), "--steps", str(args.steps),
                 "--groups", args.groups]
        runs = {(v, n): [] for v in ("rev", "this") for n in names}

        def run_child(path: str | None, *flags: str) -> dict:
            env = dict(os.environ, OMP_NUM_THREADS="1")
            env.pop("PYTHONPATH", None)
            if path:
                env["PYTHONPATH"] = path
            cmd = [sys.executable, "-P", "-W", "ignore", os.path.abspath(__file__), *flags, *sizes]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=tmp)
            return json.loads(done.stdout.strip().splitlines()[-1])

        for r in range(args.rounds):
            for name in names:
                if args.in_process:
                    pair = run_child(renamed, "--child-pair", name)
                    for version in ("rev", "this"):
                        runs[version, name].append({label: pair[label][version] for label in pair})
                    continue
                for version in ("rev", "this"):
                    runs[version, name].append(run_child(site if version == "rev" else None, "--child", name))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    results = []
    print(f"{'optimizer':<12} {'tensors':>7} {rev[:12]:>12} ms {'this':>8} ms {'this/rev':>9}")
    for name in names:
        for label, n in (("few", 2), ("many", args.tensors)):
            old = statistics.median(x[label] for x in runs["rev", name])
            new = statistics.median(x[label] for x in runs["this", name])
            results.append({"optimizer": name, "tensors": n, "rev_step_s": old, "this_step_s": new, "ratio": new / old,
                            "rev_runs": [x[label] for x in runs["rev", name]],
                            "this_runs": [x[label] for x in runs["this", name]]})
            print(f"{name:<12} {n:>7} {old * 1e3:15.1f} {new * 1e3:11.1f} {new / old:9.3f}")
    if args.json:
        rev_hash = subprocess.run(["git", "-C", root, "rev-parse", rev], capture_output=True, text=True).stdout.strip()
        write_json(args.json, {"args": vars(args), "rev": rev_hash, "results": results})
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=2000)
    p.add_argument("--elements", type=int, default=4_200_000)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--exchanges", default="preconditioned",
                   help="comma-separated exchange= values to time (e.g. 'momentum,preconditioned': the "
                        "preconditioned exchange's element-wise cost against the paper's, same run)")
    p.add_argument("--tracking", default="on",
                   help="comma-separated variance_tracking settings of OnebitAdam and ZeroOneAdam to time "
                        "('on,off': the tracking's cost, same run; OnebitLamb has none)")
    p.add_argument("--groups", default="one",
                   help="comma-separated param groupings to time: 'one' group, or one group per tensor "
                        "('each': a bucket per tensor, as per-layer learning rates make them); 'one,each': "
                        "the cost of a bucket, same run")
    p.add_argument("--against", default=None, metavar="REV", help="time this checkout against git revision REV")
    p.add_argument("--rounds", type=int, default=6, help="--against: alternating rounds")
    p.add_argument("--optimizers", default=",".join(FREEZE), help="--against: which (default: %(default)s)")
    p.add_argument("--in-process", action="store_true",
                   help="--against: both versions in one process per round, their steps in turn")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-pair", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.tensors, args.elements, args.steps, args.groups)))
        return 0
    if args.child_pair:
        print(json.dumps(child_pair(args.child_pair, args.tensors, args.elements, args.steps, args.groups)))
        return 0
    if args.against:
        return against(args.against, args)
    trackings = [{"on": True, "off": False}[t] for t in args.tracking.split(",")]
    torch.set_num_threads(1)
    from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam
    from compressed_opt.comm import SingleProcessBackend

    groupings = args.groups.split(",")
    if not set(groupings) <= set(GROUPINGS):
        raise SystemExit(f"--groups: each of {groupings} must be one of {GROUPINGS}")

    makers = {}
    for grouping in groupings:
        for ex in args.exchanges.split(","):
            suffix = "" if args.exchanges == "preconditioned" else f"[{ex}]"
            if len(groupings) > 1:
                suffix += f"[groups: {grouping}]"
            single = dict(backend=SingleProcessBackend(), exchange=ex)
            tags = [(suffix + ("" if len(trackings) == 1 else f"[tracking {'on' if t else 'off'}]"),
                     dict(single, variance_tracking=t)) for t in trackings]
            for tag, kw in tags:
                makers[f"OnebitAdam{tag}"] = lambda ps, kw=kw, g=grouping: OnebitAdam(grouped(ps, g), lr=1e-4,
                                                                                      freeze_step=2, **kw)
            makers[f"OnebitLamb{suffix}"] = lambda ps, kw=single, g=grouping: OnebitLamb(grouped(ps, g), lr=1e-4,
                                                                                         freeze_step=2, **kw)
            for tag, kw in tags:  # phase B synchronises every step at first (local_step_interval 1)
                makers[f"ZeroOneAdam{tag}"] = lambda ps, kw=kw, g=grouping: ZeroOneAdam(grouped(ps, g), lr=1e-4,
                                                                                        var_freeze_step=2, **kw)
    rows = {name: {"optimizer": name} for name in makers}
    for label, n in (("few", 2), ("many", args.tensors)):
        for name, step_s in time_interleaved(makers, n, args.elements, args.steps).items():
            rows[name][label] = {"tensors": n, "step_s": step_s}
    results = []
    print(f"{'optimizer':<34} {'few (2 tensors) ms':>19} {f'many ({args.tensors} tensors) ms':>24} {'many/few':>9}")
    for name, row in rows.items():
        row["many_over_few"] = row["many"]["step_s"] / row["few"]["step_s"]
        results.append(row)
        print(f"{name:<34} {row['few']['step_s'] * 1e3:19.1f} {row['many']['step_s'] * 1e3:24.1f} "
              f"{row['many_over_few']:9.2f}")
    write_json(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
