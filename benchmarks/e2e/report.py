"""What the runs mean: per-method summaries (step time, bytes, loss, the step breakdown), the
comparison with the baseline, the printed table, the JSON and the plots."""
from __future__ import annotations

import json
import math
import os
import re
import statistics
import sys
import textwrap

from common import fmt_bytes

from .methods import BASELINE, OURS


# --- JSON ----------------------------------------------------------------------------------------------------
def _rounded(obj, digits: int = 6):
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


def write_json(path: str, obj) -> None:
    """Indented JSON with floats to 6 significant digits and lists of scalars on one line."""
    text = json.dumps(_rounded(obj), indent=1)
    text = re.sub(r"\[[^\[\]{}]*\]", lambda m: re.sub(r"\n\s*", "", m.group(0)), text)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


# --- summaries -----------------------------------------------------------------------------------------------
SKIP_FIRST = 2  # steps left out at the start of each stage (allocation, first-call costs)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _stage_steps(stages: list[str], stage: str) -> list[int]:
    idx = [i for i, s in enumerate(stages) if s == stage]
    return idx[SKIP_FIRST:] if len(idx) > SKIP_FIRST + 2 else idx


def summarize(result: dict, cfg: dict) -> dict:
    """Per-method numbers from the raw curves (see the package docstring)."""
    c = result["curve"]
    stages, times = c["stage"], c["step_s"]
    steady_stage = "compression" if "compression" in stages else ("full" if "full" in stages else "warmup")
    out = {"steady_stage": steady_stage}
    for st in ("warmup", "compression", "full"):
        idx = _stage_steps(stages, st)
        out[f"step_s_{st}"] = _median([times[i] for i in idx]) if idx else None
        out[f"bytes_per_step_{st}"] = _mean([c["bytes"][i] for i in idx]) if idx else None
        if c.get("wire_bytes"):
            out[f"wire_bytes_per_step_{st}"] = _mean([c["wire_bytes"][i] for i in idx]) if idx else None
    steady = _stage_steps(stages, steady_stage)
    out["step_s"] = out[f"step_s_{steady_stage}"]
    out["samples_per_s"] = cfg["batch"] * result["world_size"] / out["step_s"]
    out["bytes_per_step"] = out[f"bytes_per_step_{steady_stage}"]
    out["wire_bytes_per_step"] = out.get(f"wire_bytes_per_step_{steady_stage}")
    out["bytes_total"] = sum(c["bytes"])
    out["train_time_s"] = sum(times)
    window = max(1, len(c["loss"]) // 10)
    out["loss_window_steps"] = window
    out["final_loss"] = statistics.fmean(c["loss"][-window:])
    out["eval_loss"] = result["eval_loss"]
    out["peak_memory_mb"] = max(result["peak_memory_bytes"]) / 2**20
    if "breakdown_per_rank" in result:
        out["breakdown"] = _breakdown(result["breakdown_per_rank"], steady)
    if c.get("link_s"):  # the modelled link (runner.model_link): its time is communication paid
        out["measured_step_s"] = _median([c["measured_step_s"][i] for i in steady])
        out["modelled_link_s"] = _median([c["link_s"][i] for i in steady])
        if "breakdown" in out:
            out["breakdown"]["comm_paid_s"] += out["modelled_link_s"]
    return out


def _breakdown(per_rank: list[dict], steady: list[int]) -> dict:
    """Medians over the steady steps, averaged over the ranks."""
    rows = []
    for r in per_rank:
        pick = lambda k: [r[k][i] for i in steady] if r[k] else []  # noqa: E731
        fwd_bwd = _median([a + b for a, b in zip(pick("fwd_s"), pick("bwd_s"))])
        wait = _median(pick("wait_s")) or 0.0
        opt = _median(pick("opt_s"))
        compute = r["compute_s"]
        rows.append({
            "compute_s": compute,
            "forward_backward_s": fwd_bwd,
            "optimizer_step_s": opt,
            "step_comm_wait_s": wait,
            "comm_paid_s": max(0.0, fwd_bwd - compute) + wait,
            "update_s": max(0.0, opt - wait),
            "compression_kernels_s": _median(pick("kernels_s")),
            "collectives_s": _median(pick("collectives_s")),
        })
    return {k: _mean([row[k] for row in rows]) for k in rows[0]}


def time_to_target(result: dict, target: float, window: int) -> float | None:
    """Training wall time until the running mean of the loss over ``window`` steps first
    reaches ``target`` (``None``: never)."""
    losses, times = result["curve"]["loss"], result["curve"]["step_s"]
    means, elapsed = _running_mean(losses, window), _cumsum(times)
    return next((t for i, (m, t) in enumerate(zip(means, elapsed)) if i + 1 >= window and m <= target), None)


def compare(entries: list[dict], cfg: dict) -> dict:
    ok = [e for e in entries if e["status"] == "ok"]
    for e in ok:
        e["summary"] = summarize(e["result"], cfg)
    base = next((e for e in ok if e["spec"] == BASELINE), ok[0] if ok else None)
    target = cfg.get("target_loss")
    target_rule = "given (--target-loss)"
    if target is None and base is not None:
        target = 1.05 * base["summary"]["final_loss"]
        target_rule = f"1.05 x {base['spec']}'s final loss"
    window = max(5, cfg["steps"] // 20)
    for e in ok:
        s = e["summary"]
        s["time_to_target_s"] = time_to_target(e["result"], target, window) if target is not None else None
        if base is not None:
            b = base["summary"]
            s["speedup_step"] = b["step_s"] / s["step_s"]
            s["speedup_train_time"] = b["train_time_s"] / s["train_time_s"]
            s["bytes_reduction"] = b["bytes_per_step"] / s["bytes_per_step"] if s["bytes_per_step"] else None
            s["loss_vs_baseline"] = s["final_loss"] / b["final_loss"] - 1
            s["eval_loss_vs_baseline"] = s["eval_loss"] / b["eval_loss"] - 1
    return {"baseline": base["spec"] if base else None, "target_loss": target, "target_rule": target_rule,
            "target_window_steps": window}


# --- output --------------------------------------------------------------------------------------------------
def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def format_table(entries: list[dict], comparison: dict, cfg: dict) -> str:
    wire = any(e.get("summary", {}).get("wire_bytes_per_step") is not None for e in entries)
    cols = [("method", 22), ("loss", 6), ("eval", 6), ("warmup ms", 9), ("step ms", 8), ("samples/s", 9),
            ("bytes/step", 10)] + ([("wire/step", 10)] if wire else []) + [
            ("speedup", 7), ("to target", 9), ("peak MB", 7)]
    lines = ([f"# {cfg['where']}"] if cfg.get("where") else []) + [
        "  ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(cols))]
    for e in entries:
        if e["status"] != "ok":
            lines.append(f"{e['spec']:<22}  FAILED: {e['error']}")
            continue
        s = e["summary"]
        has_warm = s["steady_stage"] == "compression"
        ttt = s.get("time_to_target_s")
        row = [f"{e['spec']:<22}", f"{s['final_loss']:6.3f}", f"{s['eval_loss']:6.3f}",
               f"{_ms(s['step_s_warmup'] if has_warm else None):>9}", f"{_ms(s['step_s']):>8}",
               f"{s['samples_per_s']:9.1f}", f"{fmt_bytes(s['bytes_per_step']):>10}"]
        if wire:
            row.append(f"{fmt_bytes(s.get('wire_bytes_per_step')):>10}")
        row += [f"{s.get('speedup_step', float('nan')):6.2f}x", f"{'-' if ttt is None else f'{ttt:.1f} s':>9}",
                f"{s['peak_memory_mb']:7.0f}"]
        lines.append("  ".join(row))
    notes = [f"loss: mean training loss of the last {max(1, cfg['steps'] // 10)} of {cfg['steps']} steps "
             f"(all methods the same steps); eval: held-out loss at the end",
             "step ms: median step (max over ranks) in the steady stage (ours: compression stage; "
             "warmup ms: full-precision warmup); bytes/step: sent per rank per step in that stage"]
    if comparison.get("baseline"):
        notes.append(f"speedup: {comparison['baseline']} step time / step time; to target: training time until "
                     f"the loss (mean of {comparison['target_window_steps']} steps) reaches "
                     f"{comparison['target_loss']:.3f} ({comparison['target_rule']})")
    if wire:
        notes.append("wire/step: bytes counted on the veth (tx_bytes: frames with TCP/IP/Ethernet headers and ACKs)")
    kinds = {e["result"].get("adamw_fused") for e in entries
             if e.get("status") == "ok" and e.get("result", {}).get("adamw_fused") is not None}
    if kinds:
        notes.append("AdamW in the baselines: " + ("torch's fused AdamW (fused=True)" if kinds == {True} else
                     "torch's default AdamW (no fused kernel here)" if kinds == {False} else
                     "fused where torch has it, else its default"))
    base = comparison.get("baseline")
    for e in entries:
        s = e.get("summary")
        if not s or e["spec"] == base or s.get("speedup_step") is None:
            continue
        fewer = f"{s['bytes_reduction']:.1f}x fewer bytes per step" if s.get("bytes_reduction") else "no bytes"
        notes.append(f"{e['spec']} vs {base}: step speed {s['speedup_step']:.2f}x, whole run "
                     f"{s['speedup_train_time']:.2f}x (warmup included), {fewer}, loss "
                     f"{100 * s['loss_vs_baseline']:+.1f}% (held-out {100 * s['eval_loss_vs_baseline']:+.1f}%)")
    if cfg.get("mode") == "local" and any(e.get("spec") in OURS for e in entries):
        notes.append("local ranks talk over loopback, far faster than a network: compression pays where "
                     "communication dominates the step (--link RATE: 2 ranks over a slow emulated link; make demo)")
    if cfg.get("mode") == "model":
        notes.append("MODELLED link, not measured on one: step ms = the step measured on local ranks over loopback "
                     "+ its bytes sent per rank x 1.046 (frame headers) x 8 / rate, with no overlap of that time "
                     "with compute (DDP overlaps part of its allreduce with backward on a real link: its modelled "
                     "step is an upper bound, and so are the speedups over it)"
                     + (f"; no emulated link here: {cfg['link_model_reason']}" if cfg.get("link_model_reason")
                        else ""))
    table = "\n".join(lines + ["# " + n for n in notes])
    if any("breakdown" in e.get("summary", {}) for e in entries):
        table += "\n\n" + format_breakdown(entries)
    return table


def format_breakdown(entries: list[dict]) -> str:
    cols = ("compute", "comm paid", "update", "step", "| kernels", "collectives")
    lines = [f"{'step breakdown (ms)':<22}  " + "  ".join(f"{c:>11}" for c in cols)]
    for e in entries:
        b = e.get("summary", {}).get("breakdown")
        if not b:
            continue
        vals = (b["compute_s"], b["comm_paid_s"], b["update_s"], e["summary"]["step_s"],
                b["compression_kernels_s"], b["collectives_s"])
        lines.append(f"{e['spec']:<22}  " + "  ".join(f"{_ms(v):>11}" for v in vals))
    lines.append("# compute: forward+backward with no communication (timed alone); comm paid: forward+backward "
                 "beyond it + step() waiting for communication; update: rest of step(); kernels (ours: "
                 "compression kernels; DDP: inside the hook) and collectives (time in flight) may overlap "
                 "backward, so they are not parts of the sum")
    return "\n".join(lines)


def plot(entries: list[dict], comparison: dict, path: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# plots skipped: matplotlib is not installed (pip install 'compressed-opt[bench]')", file=sys.stderr)
        return None
    ok = [e for e in entries if e["status"] == "ok"]
    if not ok:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    (ax_step, ax_time), (ax_bytes, ax_break) = axes
    window = comparison.get("target_window_steps", 5)
    for e in ok:
        c = e["result"]["curve"]
        smooth = _running_mean(c["loss"], window)
        steps = list(range(1, len(smooth) + 1))
        elapsed = list(_cumsum(c["step_s"]))
        ax_step.plot(steps, smooth, label=e["spec"], lw=1.2)
        ax_time.plot(elapsed, smooth, label=e["spec"], lw=1.2)
        ax_bytes.plot(steps, [max(b, 1) for b in c["bytes"]], label=e["spec"], lw=1.2)
    if comparison.get("target_loss"):
        for ax in (ax_step, ax_time):
            ax.axhline(comparison["target_loss"], color="grey", ls=":", lw=1)
    ax_step.set(xlabel="step", ylabel=f"training loss (mean of {window} steps)", title="loss vs step")
    ax_time.set(xlabel="training wall time (s)", ylabel="training loss", title="loss vs wall time")
    ax_bytes.set(xlabel="step", ylabel="bytes sent per rank", yscale="log", title="bytes per step")
    names = [e["spec"] for e in ok]
    bd = [e["summary"].get("breakdown") for e in ok]
    if all(bd):
        parts = (("compute_s", "compute"), ("comm_paid_s", "communication paid"), ("update_s", "update"))
        bottom = [0.0] * len(ok)
        for key, label in parts:
            vals = [b[key] * 1e3 for b in bd]
            ax_break.bar(names, vals, bottom=bottom, label=label)
            bottom = [x + y for x, y in zip(bottom, vals)]
        ax_break.set(ylabel="ms per step (steady stage)", title="step breakdown")
    else:
        ax_break.bar(names, [e["summary"]["step_s"] * 1e3 for e in ok])
        ax_break.set(ylabel="ms per step (steady stage)", title="step time")
    ax_break.tick_params(axis="x", labelrotation=30)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:  # (the step-time bars without a breakdown have no labels)
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(textwrap.fill(title, 130), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _running_mean(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _cumsum(values):
    total = 0.0
    for v in values:
        total += v
        yield total

