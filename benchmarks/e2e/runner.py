"""Where a method's ranks run, each method in processes of its own (a hang or a crash of one cannot
take the others along): N local processes, 2 ranks over the slow link, or, under torchrun, the
launched processes themselves; and the worker, one rank of one method. A method whose ranks
crash, hang or time out is reported as failed, with the rank that failed by itself and why."""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import threading
import time
import traceback

import torch

from common import HERE, child_env, run_on_link, slowlink

from .loop import train_method
from .methods import parse_spec
from .report import write_json

#: what a rank runs (``--worker``): the benchmark's entry point in this folder
ENTRY = os.path.join(HERE, "train.py")


# --- a worker process: one method, this rank ---------------------------------------------------------------
def _init_dist(cfg: dict, init_method: str | None, rank: int | None = None, world: int | None = None) -> torch.device:
    import torch.distributed as dist

    if cfg["device"] == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank or 0))
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    kwargs = {} if rank is None else dict(rank=rank, world_size=world)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method,
                            timeout=datetime.timedelta(seconds=max(60, cfg["method_timeout"])), **kwargs)
    return device


def worker_main(args) -> int:
    import torch.distributed as dist

    with open(args.config) as f:
        cfg = json.load(f)
    torch.set_num_threads(cfg["threads"])
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    init = args.init_method or "env://"
    try:
        device = _init_dist(cfg, init, rank, world)
        method = parse_spec(args.worker, cfg["overlap"], cfg["ddp_hook"])
        result = train_method(method, cfg, device, args.progress)
        if result is not None:
            write_json(args.out, result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # no atexit/destructor that could wait on a dead peer
    return 0


# --- the launcher: every method in processes of its own ----------------------------------------------------
def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _reason_from_output(text: str) -> str:
    """The last exception line of a rank's output (what went wrong, in one line)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(m in ln for m in ("Error", "Exception", "error", "what():", "Killed", "watchdog")) \
                and not ln.startswith("File "):
            return ln[:300]
    return lines[-1][:300] if lines else "(no output)"


class Display:
    """The one updating status line on stderr (a plain line every 15 s when not a terminal)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.last_plain = 0.0
        self.width = 0

    def show(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            pad = max(0, self.width - len(text))
            sys.stderr.write("\r" + text + " " * pad)
            self.width = len(text)
        else:
            now = time.monotonic()
            if now - self.last_plain < 15:
                return
            self.last_plain = now
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self, text: str) -> None:
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r" + text + " " * max(0, self.width - len(text)) + "\n")
            self.width = 0
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


def _progress_text(index: int, total: int, spec: str, path: str, started: float) -> str:
    head = f"[{index}/{total}] {spec}"
    try:
        with open(path) as f:
            p = json.load(f)
    except (OSError, ValueError):
        return f"{head}: starting ({time.monotonic() - started:.0f} s)"
    return (f"{head}: step {p['step']}/{p['steps']} loss {p['loss']:.3f} {p['step_s'] * 1e3:.0f} ms/step "
            f"({p['stage']}) {time.monotonic() - started:.0f} s")


def _worker_cmd(spec: str, config: str, out: str, progress: str, init_method: str | None = None) -> list[str]:
    """One rank of one method: ``benchmarks/train.py --worker SPEC`` (a fresh interpreter)."""
    cmd = [sys.executable, "-P", ENTRY, "--worker", spec, "--config", config, "--out", out, "--progress", progress]
    if init_method:
        cmd += ["--init-method", init_method]
    return cmd


def run_local(spec: str, cfg: dict, tmp: str, display: Display, index: int, total: int) -> dict:
    """Run one method as ``cfg['launch']`` local processes; a dict with ``status`` and either
    ``result`` or ``error``."""
    n = cfg["launch"]
    store = os.path.join(tmp, "store")
    config, out, prog = (os.path.join(tmp, f) for f in ("config.json", "result.json", "progress.json"))
    write_json(config, cfg)
    procs, logs = [], []
    started = time.monotonic()
    first_failed, timed_out = None, False
    try:
        for r in range(n):
            env = dict(child_env(), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
            log = open(os.path.join(tmp, f"rank{r}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen(_worker_cmd(spec, config, out, prog, f"file://{store}"), env=env,
                                          stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        deadline = started + cfg["method_timeout"]
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            now = time.monotonic()
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now  # a rank failed: give the others a moment to fail by themselves
                first_failed = next(r for r, c in enumerate(codes) if c not in (None, 0))
            if failed_at is not None and now - failed_at > cfg["grace"]:
                break
            if now > deadline:
                timed_out = True
                break
            display.show(_progress_text(index, total, spec, prog, started))
            time.sleep(0.2)
    finally:
        own = [p.poll() for p in procs]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, 9)
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    return _collect(spec, out, prog, own, timed_out, outputs, time.monotonic() - started, cfg,
                    {"first_failed": first_failed})


def _collect(spec, out, prog, codes, timed_out, outputs, elapsed, cfg, extra=None) -> dict:
    entry = {"spec": spec, "elapsed_s": elapsed, "exit_codes": codes, **(extra or {})}
    last = None
    with contextlib.suppress(OSError, ValueError):
        with open(prog) as f:
            last = json.load(f)
    if timed_out:
        where = f" (last progress: step {last['step']} of {last['steps']})" if last else " (before the first step)"
        entry.update(status="failed", error=f"timed out after {cfg['method_timeout']:g} s: a rank hung or stopped "
                     f"responding{where}; exit codes {codes} (None: killed)")
    elif any(c not in (None, 0) for c in codes) or not os.path.exists(out):
        bad = _culprit(codes, outputs, (extra or {}).get("first_failed"))
        if bad is None:
            entry.update(status="failed", error=f"no result written; exit codes {codes}")
        else:
            how = f"exited with code {codes[bad]}" if codes[bad] > 0 else f"died of signal {-codes[bad]}"
            entry.update(status="failed", error=f"rank {bad} {how}: {_reason_from_output(outputs[bad])}")
    else:
        with open(out) as f:
            entry.update(status="ok", result=json.load(f))
    if entry["status"] != "ok":
        entry["last_progress"] = last
        entry["output_tail"] = [_tail(o) for o in outputs]
    return entry


_PEER_LOST = ("Connection closed by peer", "Connection reset", "Broken pipe", "ECONNRESET", "EPIPE",
              "Connection refused", "Socket Timeout", "NCCL communicator was aborted")


def _culprit(codes, outputs, first_failed=None) -> int | None:
    """The rank that failed by itself: the first seen failing, else one that died of a signal of
    its own (an abort) or exited with an error that is not the loss of its peer."""
    if first_failed is not None:
        return first_failed
    failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
    if not failed:
        return None
    by_itself = [r for r in failed if codes[r] > 0 or codes[r] != -9]  # -9: killed by the launcher
    own = [r for r in by_itself if codes[r] < 0 or not any(m in outputs[r] for m in _PEER_LOST)]
    return (own or by_itself or failed)[0]


def run_link(spec: str, cfg: dict, tmp: str, display: Display, index: int, total: int) -> dict:
    """Run one method as 2 nodes of ``cfg['ranks_per_node']`` ranks over the slow link
    (``common.run_on_link``; more than one rank per node: torchrun per node); as :func:`run_local`."""
    config, out, prog = (os.path.join(tmp, f) for f in ("config.json", "result.json", "progress.json"))
    write_json(config, cfg)
    started = time.monotonic()
    stop = threading.Event()

    def show():  # the ranks run on the main thread, so that Ctrl-C/SIGTERM reach slowlink's cleanup
        while not stop.wait(0.2):
            display.show(_progress_text(index, total, spec, prog, started) + f" [link {cfg['link']}]")

    shower = threading.Thread(target=show, daemon=True)
    shower.start()
    res = error = None
    try:
        for attempt in range(2):  # a link that could not be set up is tried once more
            try:
                res = run_on_link(_worker_cmd(spec, config, out, prog), cfg["link"], threads=cfg["threads"],
                                  timeout=cfg["method_timeout"], grace=cfg["grace"], port=29500 + index,
                                  ranks_per_node=cfg.get("ranks_per_node", 1),
                                  isolation=cfg.get("link_emulation") or "auto")
                break
            except slowlink().SlowLinkError as e:
                error = e
                if attempt == 0:
                    display.done(f"[{index}/{total}] {spec}: the slow link failed ({e}); trying once more")
    finally:
        stop.set()
        shower.join()
    if res is None:
        return {"spec": spec, "status": "failed", "error": f"slow link: {error}",
                "elapsed_s": time.monotonic() - started}
    link = {k: res.get(k) for k in ("rate", "tbf", "tx_bytes", "rx_bytes", "tx_packets", "elapsed_s", "gso",
                                    "isolation")}
    codes = res["returncodes"]
    return _collect(spec, out, prog, codes if not res["timed_out"] else [c if c == 0 else None for c in codes],
                    res["timed_out"], res["outputs"], time.monotonic() - started, cfg, {"link": link})


#: wire bytes per payload byte of TCP over Ethernet with a 1500-byte MTU: a 1448-byte segment (with
#: TCP timestamps) travels in a 1514-byte frame
FRAME_OVERHEAD = 1514 / 1448


def model_link(result: dict, rate) -> dict:
    """The modelled link (``--link-emulation model``): each step of ``result`` (measured on local
    ranks over loopback) takes its time plus the time its bytes take on a link of ``rate`` in each
    direction, ``bytes sent per rank x FRAME_OVERHEAD x 8 / rate``, with no overlap with compute
    and no propagation delay (none on the emulated veth either). The curve keeps
    ``measured_step_s`` and gets ``link_s``; ``step_s`` becomes the modelled step. Returns the model."""
    bps = slowlink().parse_rate(rate)
    curve = result["curve"]
    link_s = [b * FRAME_OVERHEAD * 8 / bps for b in curve["bytes"]]
    curve["measured_step_s"] = curve["step_s"]
    curve["link_s"] = link_s
    curve["step_s"] = [t + x for t, x in zip(curve["step_s"], link_s)]
    return {"isolation": "model", "rate": str(rate), "rate_bps": bps, "frame_overhead": FRAME_OVERHEAD,
            "step": "measured loopback step + bytes sent per rank x frame_overhead x 8 / rate_bps"}


def run_modelled(spec: str, cfg: dict, tmp: str, display: Display, index: int, total: int) -> dict:
    """Run one method on 2 local ranks (:func:`run_local`), then put its steps on the modelled link."""
    entry = run_local(spec, cfg, tmp, display, index, total)
    if entry["status"] == "ok":
        entry["link"] = model_link(entry["result"], cfg["link"])
    return entry


def run_in_process(specs: list[str], cfg: dict, display: Display) -> list[dict]:
    """Under torchrun: every method in turn in these processes (no isolation)."""
    import torch.distributed as dist

    device = _init_dist(cfg, "env://")
    entries = []
    try:
        for i, spec in enumerate(specs, 1):
            method = parse_spec(spec, cfg["overlap"], cfg["ddp_hook"])
            started = time.monotonic()
            result = train_method(method, cfg, device, None)
            display.done(f"[{i}/{len(specs)}] {spec}: done in {time.monotonic() - started:.0f} s")
            entries.append({"spec": spec, "status": "ok", "result": result, "elapsed_s": time.monotonic() - started})
            dist.barrier()
    finally:
        dist.destroy_process_group()
    return entries if int(os.environ["RANK"]) == 0 else []

