"""A compression-stage ``step()`` against ``torch.optim.AdamW(fused=True)`` on the same parameters:
the optimizer's own element-wise work, no communication (one process, ``SingleProcessBackend``:
the compressed exchange runs its kernels, the collectives are local copies), one thread.

Each row times one optimizer (defaults, one exchange, one ZeRO stage) and fused AdamW, each over
its own copy of the parameters with fixed gradients, their steps in turn (the machine's drift
hits both alike), the median of ``--steps`` steps after the freeze and a few unmeasured ones. The
ratio is the optimizer's median over fused AdamW's. Beside it, the roofline: a plain copy of the
parameters' bytes (``torch.Tensor.copy_``) gives this machine's memory bandwidth, and each step's
time is turned into the bandwidth its memory traffic would need, counting AdamW's 7 streams of
the parameters' bytes (read p, g, m, v; write p, m, v) for both (the compression stage's passes
move about as much: docs/benchmarks.md, "A step against fused AdamW"). Each row also has the mean
over the timed steps and its ratio to fused AdamW's mean: 1-bit LAMB measures its live trust ratio
one step in ``trust_ratio_interval`` (10), a step that costs more, which the median leaves out; its
compression rows time whole intervals of at least ``--steps`` steps, so that the mean is a run's.

    python -P benchmarks/step_vs_fused.py                                   # the table of the docs
    python -P benchmarks/step_vs_fused.py --shapes 9000000x100 --optimizers OnebitAdam --steps 5
    python -P benchmarks/step_vs_fused.py --shapes 4000000x1,4000000x100,4000000x2000   # per tensor

``--stage warmup`` times full-precision warmup steps instead (the freeze never comes): OnebitAdam's
AdamW, OnebitLamb's LAMB, ZeroOneAdam's phase A (its first steps all refresh the variance).
``--stage phase-a`` times ZeroOneAdam's phase-A 1-bit gradient steps (most of its phase A: its
refreshes grow sparse), with ``var_update_scaler=1`` so that they come soon.

ZeroOneAdam's phase B synchronises every step while its ``local_step_interval`` is 1, which it stays
for ``local_step_scaler`` steps (32678 by default): the rows time synchronising steps.
``--local-step-scaler 1`` doubles the interval every step up to its clipper (16), so that the
median is a local step's (no communication, no exchange kernels).

``--passes`` times ``--steps`` more steps of the same kind with a clock on each native pass (C, on
the CPU; :mod:`native_passes`) and reports, per row, each pass's time, the streams of the bucket's
bytes it reads and writes, the bandwidth those needed and that over a plain copy's, and the step's
time outside the native passes: the issue's measure of passes close to the memory-bandwidth limit.
On the CPU each pass also gets its stream floor (:mod:`stream_floor`: a loop that moves only its
streams, about the least time they take here) and its time over it, and the row the floor of the step
(the sum) against fused AdamW's step timed in turn with the floor loops: the best ratio to fused
AdamW that the passes' memory traffic allows on this machine.

    python -P benchmarks/step_vs_fused.py --shapes 9000000x100 --exchanges preconditioned --zero-stages 0 --passes
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

OPTIMIZERS = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")
#: bytes of the parameters' size each step moves, by AdamW's count (see the module doc)
STREAMS = 7


def _params(numel: int, tensors: int, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [numel // tensors + (1 if i < numel % tensors else 0) for i in range(tensors)]
    out = []
    for n in sizes:
        p = torch.nn.Parameter((torch.randn(n, generator=g) * 0.02).to(device))
        p.grad = (torch.randn(n, generator=g) * 1e-3).to(device)
        out.append(p)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _clone(params):
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = p.grad.clone()
        out.append(q)
    return out


def _make(name: str, params, exchange: str, zero_stage: int, local_step_scaler: int | None = None,
          freeze: int = 2, var_update_scaler: int | None = None):
    import compressed_opt
    from compressed_opt.comm import SingleProcessBackend

    kw = dict(lr=1e-4, backend=SingleProcessBackend(), exchange=exchange, overlap=False)
    if name == "ZeroOneAdam":
        if zero_stage:
            return None
        if local_step_scaler is not None:
            kw["local_step_scaler"] = local_step_scaler
        if var_update_scaler is not None:
            kw["var_update_scaler"] = var_update_scaler
        return compressed_opt.ZeroOneAdam(params, var_freeze_step=freeze, **kw)
    return getattr(compressed_opt, name)(params, freeze_step=freeze, zero_stage=zero_stage, **kw)


def copy_bandwidth(numel: int, device: str, repeats: int = 7) -> float:
    """Bytes per second of a plain fp32 copy of ``numel`` elements (read + write counted)."""
    a, b = torch.randn(numel, device=device), torch.empty(numel, device=device)
    times = []
    for _ in range(repeats):
        _sync(device)
        s = time.perf_counter()
        b.copy_(a)
        _sync(device)
        times.append(time.perf_counter() - s)
    return 2 * 4 * numel / statistics.median(times)


def measure(name: str, numel: int, tensors: int, exchange: str, zero_stage: int, steps: int,
            device: str = "cpu", local_step_scaler: int | None = None, warmup: bool = False,
            phase_a: bool = False, passes_against: float | None = None) -> dict | None:
    """One row (module doc). ``phase_a``: ZeroOneAdam's phase-A compressed steps (``var_update_scaler=1``:
    refreshes at steps 1, 2, 4, 8, ..., the 1-bit gradient steps between them timed); ``None`` for
    the other optimizers. ``passes_against``: a plain copy's bandwidth; then the row also has
    ``passes``: ``rows`` (:func:`native_passes.pass_rows`) and ``step_ms`` (their mean time, the
    clocks on), from as many more steps of the same kind as were timed."""
    if phase_a and name != "ZeroOneAdam":
        return None
    warmup = warmup or phase_a
    base = _params(numel, tensors, device)
    mine = _clone(base)
    opt = _make(name, mine, exchange, zero_stage, local_step_scaler, freeze=10**9 if warmup else 2,
                var_update_scaler=1 if phase_a else None)
    if opt is None:
        return None
    adamw = torch.optim.AdamW(base, lr=1e-4, fused=True)
    for _ in range(4):  # the freeze (step 2), then the first compression steps: buffers made
        opt.step()
        adamw.step()
    assert not opt.schedule.frozen if phase_a else opt.compressing != warmup
    ours, theirs, kinds = [], [], []
    timed = _whole_intervals(opt, steps) if not warmup else steps
    while len(ours) < timed:
        _sync(device)
        s = time.perf_counter()
        opt.step()
        _sync(device)
        took = time.perf_counter() - s
        # (ZeroOneAdam's: "local" or "sync"; phase A's)
        kind = getattr(getattr(opt, "schedule", None), "last_step_kind", None)
        s = time.perf_counter()
        adamw.step()
        _sync(device)
        if phase_a and kind != "compressed":
            continue  # (a refresh)
        ours.append(took)
        kinds.append(kind)
        theirs.append(time.perf_counter() - s)
    passes = None
    if passes_against is not None:
        passes = _native_passes(opt, timed, phase_a, numel, passes_against, adamw.step if device == "cpu" else None)
    opt.close()
    a, b = statistics.median(ours), statistics.median(theirs)
    mean_a, mean_b = statistics.fmean(ours), statistics.fmean(theirs)
    return {"device": device, "optimizer": name, "exchange": exchange, "zero_stage": zero_stage, "numel": numel,
            "mean_ms": 1e3 * mean_a, "mean_ratio": mean_a / mean_b,
            "tensors": tensors, "stage": "phase-a" if phase_a else "warmup" if warmup else "compression",
            "step_ms": 1e3 * a, "fused_adamw_ms": 1e3 * b, "ratio": a / b, "passes": passes,
            "needed_bandwidth": STREAMS * 4 * numel / a, "fused_adamw_bandwidth": STREAMS * 4 * numel / b,
            "step_kinds": kinds}


def _whole_intervals(opt, steps: int) -> int:
    """How many compression steps to time: ``steps``, or for 1-bit LAMB measuring its live trust
    ratio (one step in ``trust_ratio_interval`` costs more) whole intervals of at least as many, so
    that the mean counts its measuring steps as a run does."""
    algorithm = opt.engine.client  # (1-bit LAMB's trust-ratio options are its algorithm's)
    interval = getattr(algorithm, "trust_ratio_interval", None)
    if interval is None or getattr(algorithm, "trust_ratio", None) != "live":
        return steps
    return -(-steps // interval) * interval


def _native_passes(opt, steps: int, phase_a: bool, numel: int, copy_bw: float, baseline=None) -> dict:
    """:func:`native_passes.pass_rows` of ``steps`` more steps (phase A: its 1-bit gradient steps),
    and those steps' mean time (``step_ms``, with the clocks on). With ``baseline`` (fused AdamW's
    step), the stream floors (:func:`_floor_of`) too, their loops and ``baseline`` run after each
    of those steps."""
    from native_passes import STREAMS, pass_rows, timed_passes
    from stream_floor import Floors

    from compressed_opt.cuda import cpu

    lib = cpu.library()
    totals: dict[str, list] = {}
    kept, spent = 0, 0.0
    floors = Floors(numel, baseline) if baseline is not None else None
    while lib is not None and kept < steps:
        with timed_passes(lib) as step_totals:
            start = time.perf_counter()
            opt.step()
            took = time.perf_counter() - start
        if phase_a and getattr(getattr(opt, "schedule", None), "last_step_kind", None) != "compressed":
            continue  # (a refresh)
        kept, spent = kept + 1, spent + took
        for pass_name, (seconds, calls) in step_totals.items():
            entry = totals.setdefault(pass_name, [0.0, 0])
            entry[0] += seconds
            entry[1] += calls
            if floors is not None and pass_name in STREAMS and pass_name not in floors.names:
                try:
                    floors.add(pass_name, STREAMS[pass_name])
                except RuntimeError as e:  # (no compiler for the floor loops)
                    print(f"  (no stream floors: {e})", flush=True)
                    floors = None
        if floors is not None:
            floors.run_once()
    out = {"step_ms": 1e3 * spent / max(kept, 1), "rows": pass_rows(totals, max(kept, 1), numel, copy_bw)}
    if floors is not None and out["rows"]:
        out["floor"] = _floor_of(out, floors.medians())
    return out


def _floor_of(passes: dict, times: dict) -> dict:
    """Each pass of ``passes`` whose streams the table knows gets its stream floor (``floor_ms``, for
    the share of the elements it covers a step, from ``times``: :meth:`stream_floor.Floors.medians`) and its time
    over it (``over_floor``); returns the step's: their sum, fused AdamW's step timed in turn with
    the floor loops, the ratio of the two (the best these streams allow against fused AdamW here),
    the step's time over the sum, and whether every pass was known."""
    rows = passes["rows"]
    total, known = 0.0, 0
    for r in rows:
        if r["pass"] in times:
            r["floor_ms"] = 1e3 * times[r["pass"]] * r["share"]
            r["over_floor"] = r["ms"] / r["floor_ms"]
            total, known = total + r["floor_ms"], known + 1
    adamw_ms = 1e3 * times[None]
    return {"ms": total, "fused_adamw_ms": adamw_ms, "ratio": total / adamw_ms,
            "step_over_floor": passes["step_ms"] / total if total else None, "complete": known == len(rows)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="9000000x100,64000000x4,4000000x1,4000000x100,4000000x2000",
                   help="comma-separated ELEMENTSxTENSORS")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--exchanges", default="preconditioned,momentum")
    p.add_argument("--zero-stages", default="0,1")
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (the CuPy kernels)")
    p.add_argument("--local-step-scaler", type=int, default=None,
                   help="ZeroOneAdam's local_step_scaler (default: its own, every timed step synchronises; "
                        "1: local steps, see the module doc)")
    p.add_argument("--stage", choices=("compression", "warmup", "phase-a"), default="compression",
                   help="warmup: time full-precision warmup steps (OnebitAdam's and OnebitLamb's warmup, "
                        "ZeroOneAdam's phase A; the exchange argument then only names the row); phase-a: "
                        "ZeroOneAdam's phase-A 1-bit gradient steps (between its refreshes)")
    p.add_argument("--passes", action="store_true",
                   help="also time each native pass inside steps of the same kind (module doc)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "step_vs_fused.json"))
    args = p.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device")
    torch.set_num_threads(1)
    rows = []
    for shape in args.shapes.split(","):
        numel, tensors = (int(float(x)) for x in shape.split("x"))
        bandwidth = copy_bandwidth(numel, args.device)
        print(f"{numel:,} elements in {tensors} tensors: a plain copy moves {bandwidth / 1e9:.2f} GB/s", flush=True)
        for name in args.optimizers.split(","):
            for exchange in args.exchanges.split(","):
                for zero in (int(z) for z in args.zero_stages.split(",")):
                    row = measure(name, numel, tensors, exchange, zero, args.steps, args.device,
                                  args.local_step_scaler, warmup=args.stage == "warmup",
                                  phase_a=args.stage == "phase-a",
                                  passes_against=bandwidth if args.passes else None)
                    if row is None:
                        continue
                    row["copy_bandwidth"] = bandwidth
                    rows.append(row)
                    print(f"  {name:11s} {exchange:14s} zero {zero}: {row['step_ms']:8.1f} ms, fused AdamW "
                          f"{row['fused_adamw_ms']:7.1f} ms, {row['ratio']:5.2f}x; at AdamW's 7 streams "
                          f"{row['needed_bandwidth'] / bandwidth:.2f} of a copy's bandwidth (fused AdamW "
                          f"{row['fused_adamw_bandwidth'] / bandwidth:.2f}); the mean over "
                          f"{len(row['step_kinds'])} steps {row['mean_ms']:.1f} ms, {row['mean_ratio']:.2f}x",
                          flush=True)
                    if row["passes"] is not None:
                        from native_passes import describe

                        print(describe(row["passes"]["rows"], row["passes"]["step_ms"]), flush=True)
                        floor = row["passes"].get("floor")
                        if floor:
                            print(f"      stream floor of the passes{'' if floor['complete'] else ' known'}: "
                                  f"{floor['ms']:.2f} ms, {floor['ratio']:.2f}x fused AdamW's "
                                  f"{floor['fused_adamw_ms']:.2f} ms timed in turn with it; the step took "
                                  f"{floor['step_over_floor']:.2f}x the floor", flush=True)
    from common import write_json

    write_json(args.out, {"device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
                          "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
