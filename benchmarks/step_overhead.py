"""Per-tensor overhead of ``optimizer.step()``: the same number of elements as many small tensors
or as a few large ones, one process (``SingleProcessBackend``: the compressed allreduce runs its
kernels, the collectives are local copies), compression stage.

The ratio many / few is what the optimizer pays per parameter tensor (Python loops, per-tensor
kernel launches) on top of the element-wise work both share. Median of the last steps.

    python -P benchmarks/step_overhead.py [--tensors 2000] [--elements 4200000] [--json out.json]
    python -P benchmarks/step_overhead.py --tracking on,off    # the variance tracking's cost
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn


def model_of(n_tensors: int, elements: int) -> list[nn.Parameter]:
    """``n_tensors`` parameters (weights and biases of square layers) of about ``elements`` in all."""
    layers = max(1, n_tensors // 2)
    width = max(1, int((elements / layers) ** 0.5))
    torch.manual_seed(0)
    return [p for _ in range(layers) for p in nn.Linear(width, width).parameters()]


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
    args = p.parse_args(argv)
    trackings = [{"on": True, "off": False}[t] for t in args.tracking.split(",")]
    torch.set_num_threads(1)
    from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam
    from compressed_opt.comm import SingleProcessBackend

    makers = {}
    for ex in args.exchanges.split(","):
        suffix = "" if args.exchanges == "preconditioned" else f"[{ex}]"
        single = dict(backend=SingleProcessBackend(), exchange=ex)
        tags = [(suffix + ("" if len(trackings) == 1 else f"[tracking {'on' if t else 'off'}]"),
                 dict(single, variance_tracking=t)) for t in trackings]
        for tag, kw in tags:
            makers[f"OnebitAdam{tag}"] = lambda ps, kw=kw: OnebitAdam(ps, lr=1e-4, freeze_step=2, **kw)
        makers[f"OnebitLamb{suffix}"] = lambda ps, kw=single: OnebitLamb(ps, lr=1e-4, freeze_step=2, **kw)
        for tag, kw in tags:  # phase B synchronises every step at first (local_step_interval 1)
            makers[f"ZeroOneAdam{tag}"] = lambda ps, kw=kw: ZeroOneAdam(ps, lr=1e-4, var_freeze_step=2, **kw)
    results = []
    print(f"{'optimizer':<34} {'few (2 tensors) ms':>19} {f'many ({args.tensors} tensors) ms':>24} {'many/few':>9}")
    for name, make in makers.items():
        row = {"optimizer": name}
        for label, n in (("few", 2), ("many", args.tensors)):
            params = model_of(n, args.elements)
            row[label] = {"tensors": len(params), "elements": sum(q.numel() for q in params),
                          "step_s": time_steps(make(params), params, args.steps)}
        row["many_over_few"] = row["many"]["step_s"] / row["few"]["step_s"]
        results.append(row)
        print(f"{name:<34} {row['few']['step_s'] * 1e3:19.1f} {row['many']['step_s'] * 1e3:24.1f} "
              f"{row['many_over_few']:9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
