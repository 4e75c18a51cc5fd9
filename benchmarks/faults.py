"""Faults: every fault scenario re-run as users launch jobs, one table.

Each scenario is ``benchmarks/fault_child.py --scenario NAME`` on 2 CPU ranks, launched by
``torchrun --standalone --nproc-per-node 2`` (Gloo) or ``mpiexec -n 2 python`` (MPI), with a
wall-clock limit (``--limit``, 90 s from its start): a job still running then is a HANG and is
killed. Recorded per scenario: the launcher's exit code, whether a rank died by a signal (SIGABRT is a failure;
the injected SIGKILL and the launchers' own clean-up are not), the seconds from the fault's
injection (the child prints ``FAULT_AT``) until every rank's process and the launcher had exited,
each rank's outcome (the first line of its exception, or "trained on"), whether the final
parameters are equal across ranks and finite, what state was lost, and whether all of that is
what the scenario expects. Any process left behind (a stopped rank) is SIGKILLed at the end.

    python -P benchmarks/faults.py                       # every scenario, 4-6 minutes on 2 busy cores
    python -P benchmarks/faults.py --only stall_torch,stall_mpi

Prints a markdown table and writes ``benchmarks/results/faults.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # common, also under python -P

from common import child_env  # noqa: E402

CHILD = os.path.join(HERE, "fault_child.py")
BIN = os.path.dirname(sys.executable)


def _tool(name: str) -> str:
    local = os.path.join(BIN, name)
    return local if os.path.exists(local) else (shutil.which(name) or name)


TORCHRUN = [_tool("torchrun"), "--standalone", "--nproc-per-node", "2"]
MPIEXEC = [_tool("mpiexec"), "-n", "2", sys.executable, "-P"]


# --- what each rank's RESULT must say ----------------------------------------------------------------
def _ranks(r):
    return [r.ranks.get(i, {}) for i in (0, 1)]


def trained(r, steps=None, **want):
    return all(x.get("outcome") == "trained on" and (steps is None or x.get("global_step") == steps)
               and all(x.get(k) == v for k, v in want.items()) for x in _ranks(r)) and r.equal_finite


def raised(r, exc, pattern, **want):
    return all(exc in x.get("exception_types", []) and re.search(pattern, x.get("outcome", ""))
               and all(x.get(k) == v for k, v in want.items()) for x in _ranks(r))


def job_ended(r, bound):
    return r.rc not in (0, None) and r.seconds is not None and r.seconds < bound


def rank0_raised_after(r, low, high):
    x = r.ranks.get(0, {})
    return "error_at" in x and r.fault_at is not None and low <= x["error_at"] - r.fault_at <= high


NOTHING_LOADED = ("nothing loaded: the fresh optimizer kept global_step {global_step}, "
                  "state for {params_with_state} params")
UNSAVED = "unsaved progress since the last checkpoint (this run saves none: steps 1-9)"


@dataclass
class Scenario:
    name: str
    launcher: str  # "torchrun" or "mpiexec"
    fault: str
    expected: str
    check: object  # Result -> bool
    lost: str  # what state was dropped; formatted with each rank's RESULT
    args: tuple = ()
    env: dict = field(default_factory=dict)
    child: str = ""  # fault_child.py's scenario, when not ``name``


def _no_backward(stage: str, step: int) -> Scenario:
    """Rank 1 calls ``step()`` without a backward at ``step`` while rank 0 runs backward (whose
    hooks communicate), with Gloo's default 30-minute timeout: the entry agreement must end it."""
    where = "warmup; rank 0's backward averages" if stage == "warmup" else \
        "compression stage, exchanges launched from backward"
    return Scenario(
        f"no_backward_{stage}", "torchrun",
        f"rank 1 calls step() without a backward at step {step} ({where}); Gloo's default 30-minute timeout",
        f"RuntimeError on every rank at step {step} naming the ranks, within seconds",
        lambda r: raised(r, "RuntimeError", rf"step {step} rank\(s\) \[1\] called step\(\) without a backward",
                         global_step=step - 1) and job_ended(r, 30),
        f"nothing applied at step {step} (global_step {{global_step}}); unsaved progress since the last checkpoint",
        args=("--pg-timeout", "1800"))


SCENARIOS = [
    Scenario("recreate", "torchrun", "optimizer re-created 3 times mid-training (steps 10, 20, 30), old one dropped",
             "trains on; no hang; 1 comm thread",
             lambda r: trained(r, 31, comm_threads=1),
             "the dropped optimizers' state (as asked); the last one at step {global_step}, "
             "{comm_threads} comm thread"),
    Scenario("nan_compression", "torchrun", "one NaN in rank 1's input at step 25 (compression stage), no GradScaler",
             "every rank skips step 25 (RuntimeWarning), nonfinite_steps 1, buffers finite, ranks equal",
             lambda r: trained(r, 39, nonfinite_steps=1, frozen=True) and _warned(r, "non-finite gradient"),
             "none; step 25 skipped on every rank ({global_step} of {it} steps applied)"),
    Scenario("nan_warmup", "torchrun", "one NaN in rank 1's input at step 5 (warmup), no GradScaler",
             "every rank skips step 5 (RuntimeWarning), nonfinite_steps 1, buffers finite, ranks equal",
             lambda r: trained(r, 39, nonfinite_steps=1, frozen=True) and _warned(r, "non-finite gradient"),
             "none; step 5 skipped on every rank ({global_step} of {it} steps applied)"),
    Scenario("seeds", "torchrun", "ranks seeded differently when the model is made",
             "rank 0's parameters broadcast before the first update; ranks equal at the end",
             lambda r: trained(r, 40) and len({x.get("sha_at_start") for x in _ranks(r)}) == 2,
             "rank 1's initial parameters (replaced by rank 0's, as DDP does)"),
    Scenario("lr_rank1", "torchrun", "learning rate changed on rank 1 only at step 30",
             "ValueError on every rank at step 30 naming the learning rate",
             lambda r: raised(r, "ValueError", r"disagree at step 30: .*learning rate", global_step=29),
             "nothing applied at step 30 (global_step {global_step}); unsaved progress since the last checkpoint"),
    Scenario("ckpt_steps", "torchrun", "per-rank checkpoints of different steps (rank 0: 10, rank 1: 12)",
             "error on every rank at load", lambda r: raised(r, "ValueError", r"different steps", global_step=0),
             NOTHING_LOADED),
    Scenario("ckpt_stages", "torchrun", "per-rank checkpoints of different stages (rank 0: step 18, warmup; "
             "rank 1: step 22, compression)",
             "error on every rank at load",
             lambda r: raised(r, "ValueError", r"stages.*not frozen.*, frozen", global_step=0),
             NOTHING_LOADED),
    Scenario("ckpt_shape", "torchrun", "rank 1's checkpoint: exp_avg of shape (1,) for a (64,) bias (parameter 1)",
             "clear error naming the parameter and field",
             lambda r: raised(r, "ValueError", "", global_step=0)
             and re.search(r"parameter 1, 'exp_avg'", r.ranks.get(1, {}).get("outcome", "")),
             NOTHING_LOADED),
    Scenario("ckpt_format", "torchrun", "checkpoint format 999 (every rank)", "clear error",
             lambda r: raised(r, "ValueError", "format 999", global_step=0), NOTHING_LOADED),
    Scenario("requires_grad", "torchrun", "requires_grad=False on one parameter, rank 1 only, at step 5 (warmup)",
             "ValueError on every rank naming the rank whose trainable parameters differ, no SIGABRT",
             lambda r: raised(r, "ValueError", r"step 5 the trainable parameters of rank\(s\) \[1\] differ",
                              global_step=4) and not r.sigabrt,
             "nothing applied at step 5 (global_step {global_step}); unsaved progress since the last checkpoint"),
    *(_no_backward(stage, step) for stage, step in (("warmup", 5), ("compression", 25))),
    Scenario("mpi_raise", "mpiexec", "uncaught exception on rank 1 at step 10 (MPI backend)",
             "job aborts, exit non-zero, within seconds",
             lambda r: job_ended(r, 10) and "aborting the MPI job" in r.output,
             UNSAVED),
    Scenario("stall_torch", "torchrun", "rank 1 stops (SIGSTOP) at step 10; init_process_group(timeout=10 s)",
             "rank 0 raises after ~10 s; the job ends (torchrun SIGKILLs the stopped rank 30 s after its SIGTERM)",
             lambda r: re.search(r"(?i)timed out", r.ranks.get(0, {}).get("outcome", ""))
             and rank0_raised_after(r, 9, 15) and job_ended(r, 60),
             UNSAVED,
             args=("--pg-timeout", "10"), child="stall"),
    Scenario("stall_mpi", "mpiexec", "rank 1 stops (SIGSTOP) at step 10; COMPRESSED_OPT_TIMEOUT=10",
             "the job aborts after ~10 s",
             lambda r: job_ended(r, 20) and r.seconds >= 10 and "waited more than 10 s" in r.output,
             UNSAVED,
             env={"COMPRESSED_OPT_TIMEOUT": "10"}, child="stall"),
    Scenario("sigkill", "torchrun", "rank 1 killed (SIGKILL) at step 10", "the other rank ends within seconds",
             lambda r: job_ended(r, 10),
             UNSAVED),
    Scenario("ddp_after", "torchrun", "model wrapped in DDP after the optimizer was made (overlap=True), "
             "clip_grad_norm_ every step",
             "trains; compression-step bytes <= 1/20 of a warmup step's; ranks equal",
             lambda r: trained(r, 40) and all(x["bytes_compression_step"] * 20 <= x["bytes_warmup_step"]
                                              for x in _ranks(r)),
             "none; bytes/step warmup {bytes_warmup_step}, compression {bytes_compression_step} "
             "(1/{warmup_over_compression})"),
]


def _warned(r, text):
    return all(any(text in w for w in x.get("warnings", [])) for x in _ranks(r))


# --- the runner ----------------------------------------------------------------------------------------
@dataclass
class Result:
    command: str = ""
    rc: int | None = None  # the launcher's exit code (None: killed as a hang)
    hang: bool = False
    fault_at: float | None = None  # time.time() of the first FAULT_AT
    killed_at: float | None = None  # time.time() the runner killed a job past the limit
    seconds: float | None = None  # fault -> every process exited
    total: float = 0.0
    ranks: dict = field(default_factory=dict)
    signals: list = field(default_factory=list)
    left_behind: list = field(default_factory=list)
    output: str = ""

    @property
    def sigabrt(self) -> bool:
        return self.rc in (-6, 134) or any(s in (6, 134, -6) for s in self.signals) or "SIGABRT" in self.output

    @property
    def equal_finite(self) -> bool:
        ranks = _ranks(self)
        return all(x.get("finite") for x in ranks) and len({x.get("sha256") for x in ranks}) == 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except (OSError, IndexError):
        return False


def _pids(lines: list[str]) -> set[int]:
    return {int(m[1]) for ln in list(lines) for m in re.finditer(r"PID \d+ (\d+)", ln)}


def run(s: Scenario, limit: float) -> Result:
    cmd = (TORCHRUN if s.launcher == "torchrun" else MPIEXEC) + [CHILD, "--scenario", s.child or s.name, *s.args]
    res = Result(command=" ".join([*(f"{k}={v}" for k, v in s.env.items()), shlex.join(cmd)]))
    env = child_env(threads=1, PYTHONUNBUFFERED="1", **s.env)
    if "COMPRESSED_OPT_TIMEOUT" not in s.env:
        env.pop("COMPRESSED_OPT_TIMEOUT", None)
    lines: list[str] = []
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    exited = None
    while True:  # until the launcher and every rank it started have exited, or the limit
        running = [p for p in _pids(lines) if _alive(p)]
        if proc.poll() is not None and not running:
            exited = time.time()
            break
        if time.time() - started > limit:
            res.hang, res.left_behind = proc.poll() is None, running
            res.killed_at = time.time()
            break
        time.sleep(0.02)
    for pid in _pids(lines):
        if _alive(pid):  # a stopped rank, or anything the launcher left: nothing may stay behind
            os.kill(pid, signal.SIGKILL)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    reader.join(5)
    res.rc = None if res.hang else proc.returncode
    res.output = "".join(lines)
    res.total = time.time() - started
    faults = [float(m[1]) for m in re.finditer(r"FAULT_AT \d+ ([\d.]+)", res.output)]
    res.fault_at = min(faults) if faults else None
    if faults and exited is not None:
        res.seconds = exited - res.fault_at
    for m in re.finditer(r"RESULT (?=\{)", res.output):
        x = json.JSONDecoder().raw_decode(res.output, m.end())[0]
        res.ranks[x["rank"]] = x
    # ranks that died by a signal, as the launchers report them
    res.signals = [int(v) for v in re.findall(r"exitcode\s*:\s*(-\d+)", res.output)]  # torchrun
    res.signals += [int(v) for v in re.findall(r"KILLED BY SIGNAL: (\d+)", res.output)]  # mpich
    res.signals += [int(v) for v in re.findall(r"EXIT CODE: (1[2-9]\d)", res.output)]  # mpich, 128 + signal
    return res


def _key(text: str) -> str:
    """The key part of an error's first line: up to the end of its first sentence."""
    m = re.search(r"\.(?= [A-Z(])", text[60:])
    return text if m is None else text[: 60 + m.start() + 1]


def _summary(s: Scenario, r: Result) -> dict:
    outcomes = []
    for i in (0, 1):
        x = r.ranks.get(i)
        text = x and _key(x["outcome"])
        if x and "error_at" in x:
            after = "" if r.fault_at is None else f", {x['error_at'] - r.fault_at:.1f} s after the fault"
            text += f" (at step {x['it']}{after})"
        outcomes.append(text or "no result (ended by the launcher)")
    observed = (f"both: {outcomes[0]}" if outcomes[0] == outcomes[1]
                else f"r0: {outcomes[0]}; r1: {outcomes[1]}")
    aborted = re.search(r"compressed_opt[^\n]*[aA]borting the MPI job[^\n]*", r.output)
    if s.launcher == "mpiexec" and aborted:
        observed += f"; the job printed: {_key(aborted[0])}"
    lost = []
    for i in (0, 1):
        try:
            lost.append(s.lost.format(**r.ranks[i]))
        except (KeyError, IndexError):
            lost.append(s.lost if "{" not in s.lost else "?")
    ok = bool(s.check(r)) and not r.hang and not r.left_behind and not r.sigabrt
    silent_divergence = all(x.get("outcome") == "trained on" for x in _ranks(r)) and not r.equal_finite
    return {
        "scenario": s.name, "launcher": s.launcher, "fault": s.fault, "expected": s.expected,
        "observed": observed if not (r.hang or r.left_behind) else
        f"HANG: {'the job' if r.hang else f'pids {r.left_behind}'} still running "
        f"{r.killed_at - (r.fault_at or r.killed_at):.0f} s after the fault, killed; {observed}",
        "launcher_exit_code": r.rc, "rank_signals": sorted(set(r.signals)), "sigabrt": r.sigabrt,
        "seconds_fault_to_all_exited": None if r.seconds is None else round(r.seconds, 2),
        "seconds_total": round(r.total, 1),
        "ranks_equal_and_finite": r.equal_finite if all("sha256" in x for x in _ranks(r)) else None,
        "silent_divergence": silent_divergence, "left_behind": r.left_behind,
        "data_lost": lost[0] if lost[0] == lost[1] else f"r0: {lost[0]}; r1: {lost[1]}",
        "as_expected": ok, "ranks": r.ranks, "command": r.command, "output_tail": r.output[-3000:],
    }


def table(rows: list[dict]) -> str:
    def cut(text, n=220):
        text = str(text).replace("|", "\\|")
        return text if len(text) <= n else text[: n - 3] + "..."

    out = ["| # | fault | launcher | expected | observed | launcher exit code | ranks ended by signal | "
           "s fault -> all exited | ranks equal, finite | data lost | as expected |", "|" + " --- |" * 11]
    for i, r in enumerate(rows, 1):
        sig = ", ".join(f"{v}" for v in r["rank_signals"]) or "none"
        secs = "-" if r["seconds_fault_to_all_exited"] is None else f"{r['seconds_fault_to_all_exited']:.1f}"
        eq = {True: "yes", False: "NO", None: "-"}[r["ranks_equal_and_finite"]]
        out.append(f"| {i} | {cut(r['fault'])} | {r['launcher']} | {cut(r['expected'])} | "
                   f"{cut(r['observed'], 400)} | {r['launcher_exit_code']} | "
                   f"{sig}{' (SIGABRT)' if r['sigabrt'] else ''} | {secs} | {eq} | {cut(r['data_lost'])} | "
                   f"{'yes' if r['as_expected'] else '**NO**'} |")
    out.append("\nSignals as the launcher reports them: -15 is torchrun's SIGTERM to the other rank once one failed, "
               "-9 a SIGKILL (the injected one, or torchrun's 30 s after a SIGTERM that was not acted on).")
    return "\n".join(out)


def library_fingerprint() -> str:
    """sha256 of the library's sources, to tell whether they changed while the table ran."""
    h = hashlib.sha256()
    for folder in ("compressed_opt", "comm", "cuda"):
        for dirpath, dirnames, filenames in sorted(os.walk(os.path.join(ROOT, folder))):
            dirnames.sort()
            for name in sorted(n for n in filenames if n.endswith((".py", ".c", ".cu"))):
                with open(os.path.join(dirpath, name), "rb") as f:
                    h.update(name.encode() + f.read())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated scenario names")
    parser.add_argument("--limit", type=float, default=90.0,
                        help="wall-clock limit per scenario (s): start-up (~15 s on 2 busy cores) + the 10 s timeout "
                             "+ torchrun's 30 s grace before it SIGKILLs a rank that ignores SIGTERM (a stopped one)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "faults.json"))
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or s.name in args.only.split(",")]
    rows, started, library = [], time.time(), library_fingerprint()
    for s in chosen:
        r = run(s, args.limit)
        row = _summary(s, r)
        rows.append(row)
        print(f"{s.name}: {'as expected' if row['as_expected'] else 'NOT AS EXPECTED'}; "
              f"exit {row['launcher_exit_code']}, {row['seconds_fault_to_all_exited']} s fault -> exit, "
              f"{row['seconds_total']} s in all; {row['observed'][:200]}", flush=True)
    total = time.time() - started
    print()
    print(table(rows))
    print(f"\n{sum(r['as_expected'] for r in rows)}/{len(rows)} as expected; "
          f"hangs {sum('HANG' in r['observed'] for r in rows)}, "
          f"SIGABRT {sum(r['sigabrt'] for r in rows)}, silent divergences {sum(r['silent_divergence'] for r in rows)}; "
          f"{total:.0f} s in all")
    if library_fingerprint() != library:
        print("WARNING: the library's sources changed while the table ran: run it again")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"limit_s": args.limit, "total_s": round(total, 1), "library_sha256": library,
                   "library_changed_during_run": library_fingerprint() != library, "rows": rows}, f, indent=1)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")


if __name__ == "__main__":
    main()
