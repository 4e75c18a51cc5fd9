"""One method trained on the ranks of an initialised process group: the timed steps, the
compute calibration, the held-out loss, and what keeps a rank from hanging unseen (the watchdog)."""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import statistics
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import sync

from .data import Batches, load_corpus
from .instrument import RECORDER, OurTiming, union_length
from .methods import METHODS, OURS, build, lr_at
from .model import ARCHS, ModelConfig


class _WireCounter:
    """This rank's veth ``tx_bytes`` (on the slow link), or ``None``."""

    def __init__(self):
        ifname = os.environ.get("SLOWLINK_IFNAME")
        self.path = f"/sys/class/net/{ifname}/statistics/tx_bytes" if ifname else None
        if self.path and not os.path.exists(self.path):
            self.path = None

    def read(self) -> int | None:
        if self.path is None:
            return None
        with open(self.path) as f:
            return int(f.read())


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


class _Progress:
    """Rank 0 writes its progress to a small JSON file that the launcher shows."""

    def __init__(self, path: str | None, method: str, steps: int):
        self.path, self.method, self.steps, self.last = path, method, steps, 0.0

    def update(self, step: int, loss: float, step_s: float, stage: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and now - self.last < 0.25):
            return
        self.last = now
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"method": self.method, "step": step, "steps": self.steps, "loss": loss,
                       "step_s": step_s, "stage": stage}, f)
        os.replace(tmp, self.path)


class _Watchdog:
    """Ends this rank (exit code 124) when no step has completed for ``stall_s`` seconds: a hang
    (e.g. ranks waiting in mismatched collectives) is reported as a failure, not as a slow run."""

    def __init__(self, stall_s: float, rank: int):
        self.stall_s, self.rank = stall_s, rank
        self.last, self.what = time.monotonic(), "the start"
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def beat(self, what: str) -> None:
        self.last, self.what = time.monotonic(), what

    def _watch(self) -> None:
        while not self.stop.wait(1.0):
            if time.monotonic() - self.last > self.stall_s:
                sys.stderr.write(f"[rank {self.rank}] watchdog: hung, no progress for {self.stall_s:g} s after "
                                 f"{self.what} (--stall-timeout); exiting\n")
                sys.stderr.flush()
                os._exit(124)

    def close(self) -> None:
        self.stop.set()


def _inject(cfg: dict, method: dict, rank: int, world: int, step: int) -> None:
    """Testing (``--inject-failure``): the last rank crashes or hangs at the given step."""
    spec = next((f for f in cfg.get("inject_failure") or () if f["method"] in (method["spec"], method["name"])), None)
    if spec is None or rank != world - 1 or step != spec["step"]:
        return
    if spec["mode"] == "crash":
        raise RuntimeError(f"injected failure (--inject-failure) on rank {rank} at step {step}")
    sys.stderr.write(f"[rank {rank}] injected hang (--inject-failure) at step {step}\n")
    sys.stderr.flush()
    while True:
        time.sleep(3600)


def train_method(method: dict, cfg: dict, device: torch.device, progress_path: str | None = None) -> dict | None:
    """Train ``method`` on the ranks of the initialised default process group; rank 0 gets the
    raw results (curves per step, per-rank breakdown), the other ranks ``None``."""
    import torch.distributed as dist

    from compressed_opt.comm import TorchBackend

    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = ModelConfig(**cfg["model"])
    torch.manual_seed(cfg["seed"])
    model = ARCHS[cfg.get("arch", "gpt")](mcfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    data = Batches(load_corpus(cfg.get("corpus")), cfg["seq_len"], cfg["batch"], rank, world, cfg["seed"])
    breakdown = cfg["breakdown"]
    ours = method["name"] in OURS
    timing = OurTiming() if (breakdown and ours) else None
    module, opt, stage_of, sent, extra = build(method, model, cfg, device, timing)
    RECORDER.timing = breakdown and not ours
    wire = _WireCounter()
    progress = _Progress(progress_path if rank == 0 else None, method["spec"], cfg["steps"])
    rec = {k: [] for k in ("loss", "step_s", "fwd_s", "bwd_s", "opt_s", "bytes", "wire", "stage",
                           "kernels_s", "collectives_s", "wait_s")}
    steps = cfg["steps"]
    watchdog = _Watchdog(cfg["stall_timeout"], rank)
    dist.barrier()
    for step in range(1, steps + 1):
        lr = lr_at(step, cfg) * (cfg["lamb_lr"] / cfg["lr"] if method["name"] == "onebit_lamb" else 1.0)
        for group in getattr(opt, "inner", opt).param_groups:  # (DiLoCo: its inner optimizer's)
            group["lr"] = lr
        x, y = data.train_batch(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        stage = stage_of()
        bytes_before, wire_before = sent(), wire.read()
        if RECORDER.timing:
            RECORDER.intervals.clear()
            RECORDER.hook_s = 0.0
        _inject(cfg, method, rank, world, step)
        sync(device)
        t0 = time.perf_counter()
        logits = module(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        sync(device)
        t1 = time.perf_counter()
        loss.backward()
        sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        t3 = time.perf_counter()
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"{method['spec']}: loss is {loss_value} at step {step}")
        w = wire.read()
        rec["loss"].append(loss_value)
        rec["step_s"].append(t3 - t0)
        rec["fwd_s"].append(t1 - t0)
        rec["bwd_s"].append(t2 - t1)
        rec["opt_s"].append(t3 - t2)
        rec["bytes"].append(sent() - bytes_before)
        rec["wire"].append(None if w is None else w - wire_before)
        rec["stage"].append(stage)
        if timing is not None:
            k, c, wt = timing.take()
            rec["kernels_s"].append(k)
            rec["collectives_s"].append(c)
            rec["wait_s"].append(wt)
        elif RECORDER.timing:
            with RECORDER.lock:
                rec["kernels_s"].append(RECORDER.hook_s)
                rec["collectives_s"].append(union_length(RECORDER.intervals))
            rec["wait_s"].append(0.0)  # DDP waits for its communication inside backward
        progress.update(step, loss_value, t3 - t0, stage, force=step == steps)
        watchdog.beat(f"step {step}")
    if timing is not None:
        timing.remove()
    RECORDER.timing = False
    compute = _calibrate_compute(module, opt, data, device, extra["ddp"], steps) if breakdown else None
    watchdog.beat("the compute calibration")
    eval_loss = _evaluate(model, data, cfg, device)
    watchdog.beat("the evaluation")
    local = {"rec": rec, "compute_s": compute, "peak_memory_bytes": _peak_memory(device)}
    everyone = TorchBackend().all_gather_object(local)  # (torch's own can abort the exit that follows)
    watchdog.close()
    if rank != 0:
        return None
    per_step = lambda key, how: [how(v) for v in zip(*(e["rec"][key] for e in everyone))]  # noqa: E731
    wires = per_step("wire", lambda v: None if v[0] is None else statistics.fmean(v))
    result = {
        "spec": method["spec"],
        "method": method["name"],
        "label": METHODS[method["name"]] + (" [fused AdamW]" if extra.get("adamw_fused") else ""),
        "adamw_fused": extra.get("adamw_fused"),
        "overlap": method["overlap"] if ours else None,
        "ddp_hook": method["ddp_hook"] if ours else None,
        "params": n_params,
        "world_size": world,
        "curve": {
            "loss": per_step("loss", statistics.fmean),
            "step_s": per_step("step_s", max),
            "bytes": per_step("bytes", statistics.fmean),
            "wire_bytes": wires if any(v is not None for v in wires) else None,
            "stage": rec["stage"],
        },
        "eval_loss": eval_loss,
        "peak_memory_bytes": [e["peak_memory_bytes"] for e in everyone],
        "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "ru_maxrss",
    }
    if breakdown:
        result["breakdown_per_rank"] = [
            {"compute_s": e["compute_s"], **{k: e["rec"][k] for k in ("fwd_s", "bwd_s", "opt_s", "kernels_s",
                                                                       "collectives_s", "wait_s")}}
            for e in everyone]
    return result


def _calibrate_compute(module, opt, data, device, under_ddp: bool, steps: int, iters: int = 5) -> float:
    """Median seconds of forward + backward with no communication at all, on the trained model
    (every rank at once, as in training)."""
    import torch.distributed as dist

    contexts = []
    if under_ddp:
        contexts.append(module.no_sync)
    if hasattr(opt, "no_sync"):
        contexts.append(opt.no_sync)
    times = []
    dist.barrier()
    for i in range(iters + 1):
        x, y = data.train_batch(steps + 1 + i)
        x, y = x.to(device), y.to(device)
        with contextlib.ExitStack() as stack:
            for ctx in contexts:
                stack.enter_context(ctx())
            sync(device)
            t0 = time.perf_counter()
            logits = module(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    return statistics.median(times)


@torch.no_grad()
def _evaluate(model: nn.Module, data: Batches, cfg: dict, device: torch.device) -> float:
    import torch.distributed as dist

    from compressed_opt.comm.torch_backend import hold

    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in data.val_batches(cfg["eval_sequences"], per_batch=16):
        logits = model(x.to(device))
        total[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1),
                                    reduction="sum").double()
        total[1] += y.numel()
    model.train()
    hold(total)  # the exit waits until torch lets go of it (docs/comm.md)
    dist.all_reduce(total)
    return float(total[0] / total[1])

