"""What saving and loading the optimizer's state costs: seconds, bytes written, and the host memory
a save or a load takes beyond what the process held before it, against another revision.

One process (world size 1), a 25.2M-parameter stack of ``Linear(2048, 2048)`` layers,
``OnebitAdam(freeze_step=2)`` after 4 steps (in the compression stage: the error buffers held).
Each measurement runs in a fresh process: the peak resident set is reset just before
(``/proc/self/clear_refs``), and the figure is the peak during the save or load less the resident
set just before it. The ways a user saves:

* ``torch.save``: ``torch.save(optimizer.state_dict())``, then ``torch.load`` and ``load_state_dict``;
* ``dcp``: ``dcp.save`` of torch's ``get_optimizer_state_dict`` (sharded), then ``dcp.load`` into a
  fresh optimizer's and ``set_optimizer_state_dict``;
* ``dcp-flat``: the same with ``flatten_optimizer_state_dict=True`` (torchtitan's).

    python -P benchmarks/checkpoint_cost.py --against 911fc37 --json out.json

``--against`` installs that revision (as ``bit_identity.py`` does) and measures it the same way,
alternating the two, ``--repeats`` times each; the table gives medians and the ratio to it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("torch.save", "dcp", "dcp-flat")
LAYERS, WIDTH = 6, 2048


def _status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measured(fn):
    """``(seconds, bytes of peak resident set beyond the one before)`` of ``fn()``."""
    import gc

    gc.collect()
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # (resets VmHWM to the current resident set)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, _status("VmHWM") - before


def _make(seed: int, width: int):
    import torch

    import compressed_opt

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(LAYERS)])
    return model, compressed_opt.OnebitAdam(model.parameters(), lr=1e-4, freeze_step=2)


def _child(mode: str, out: str, width: int) -> None:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model, opt = _make(0, width)
    for step in range(4):
        x = torch.randn(8, width, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    result = {"params": sum(p.numel() for p in model.parameters())}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        options = StateDictOptions(flatten_optimizer_state_dict=mode == "dcp-flat")
        try:
            if mode == "torch.save":
                result["save_s"], result["save_peak"] = _measured(lambda: torch.save(opt.state_dict(), path))
            else:
                result["save_s"], result["save_peak"] = _measured(
                    lambda: dcp.save({"optim": get_optimizer_state_dict(model, opt, options=options)},
                                     checkpoint_id=path))
        except Exception as exc:  # noqa: BLE001 - a revision that cannot save this way: recorded as such
            result["refused"] = f"{type(exc).__name__}: {exc}"[:200]
            with open(out, "w") as f:
                json.dump(result, f)
            return
        result["bytes"] = sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(tmp) for n in names)
        opt.close()
        fresh_model, fresh = _make(1, width)
        fresh_model.load_state_dict(model.state_dict())

        def load():
            if mode == "torch.save":
                fresh.load_state_dict(torch.load(path))
            else:
                state = {"optim": get_optimizer_state_dict(fresh_model, fresh, options=options)}
                dcp.load(state, checkpoint_id=path)
                set_optimizer_state_dict(fresh_model, fresh, state["optim"], options=options)
        result["load_s"], result["load_peak"] = _measured(load)
        assert fresh.global_step == 4 and fresh.compressing
    with open(out, "w") as f:
        json.dump(result, f)


def _run(site: str | None, mode: str, width: int = WIDTH) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if site:
        env["PYTHONPATH"] = site
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        subprocess.run([sys.executable, "-P", os.path.abspath(__file__), "--width", str(width), "--child", mode, out],
                       env=env, check=True, cwd=tempfile.gettempdir())
        with open(out) as f:
            return json.load(f)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", metavar="REV", help="also measure an install of git revision REV")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--width", type=int, default=WIDTH, help="of the 6 square layers (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="of %(default)s")
    p.add_argument("--json", metavar="FILE", help="write every measurement here")
    p.add_argument("--child", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(*args.child, args.width)
        return 0
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes: {sorted(set(modes) - set(MODES))} are not among {MODES}")
    sys.path.insert(0, HERE)
    from bit_identity import _install

    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": None}
        if args.against:
            trees[args.against] = _install(args.against, tmp)
        runs = {tree: {mode: [] for mode in modes} for tree in trees}
        for _ in range(args.repeats):
            for mode in modes:
                for tree, site in trees.items():  # (alternated: the machine's drift falls on both alike)
                    runs[tree][mode].append(_run(site, mode, args.width))
    print(f"{'mode':<11} {'tree':<9} {'save s':>7} {'save peak MB':>13} {'load s':>7} {'load peak MB':>13} "
          f"{'MB written':>11}")
    for mode in modes:
        for tree in trees:
            done = [r for r in runs[tree][mode] if "refused" not in r]
            if not done:
                print(f"{mode:<11} {tree:<9} refused: {runs[tree][mode][0]['refused']}")
                continue
            med = {k: statistics.median(r[k] for r in done) for k in ("save_s", "save_peak", "load_s", "load_peak",
                                                                        "bytes")}
            print(f"{mode:<11} {tree:<9} {med['save_s']:7.2f} {med['save_peak'] / 1e6:13.0f} {med['load_s']:7.2f} "
                  f"{med['load_peak'] / 1e6:13.0f} {med['bytes'] / 1e6:11.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": LAYERS, "width": args.width, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
