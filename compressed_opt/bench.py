"""End-to-end training benchmark: compressed optimizers against the data-parallel peers a user
would pick instead, on the same model, data and seeds (docs/design.md section 4).

A small GPT-style causal language model (byte-level, vocabulary 256; presets ``tiny`` ~1M and
``small`` ~9M parameters, or any ``--layers/--width/--heads/--context``) is trained on a corpus
that ships with Python: the help texts of ``pydoc_data.topics`` (~0.5 MB of English prose and
code; ``--corpus PATH`` takes any text file instead). Nothing is downloaded.

Methods (``--methods``, comma-separated):

* ``ddp_adamw``: ``DistributedDataParallel`` + ``torch.optim.AdamW``, gradients averaged by an
  fp32 allreduce hook equivalent to DDP's default (torch's ``allreduce_hook``);
* ``ddp_fp16``: the same with ``fp16_compress_hook`` (``ddp_bf16``: ``bf16_compress_hook``, NCCL only);
* ``ddp_powersgd``: the same with torch's PowerSGD hook (``--powersgd-rank``; PowerSGD starts
  after the same warmup as ours, ``start_powerSGD_iter = --freeze-step``). On Gloo it can abort
  with a size mismatch or hang when its compression starts (its allreduces are launched from
  future callbacks, in an order that can differ between ranks when several DDP buckets are in
  flight); ``ddp_powersgd+serial`` runs one bucket's hook at a time, which keeps the order;
* ``onebit_adam``, ``onebit_lamb``, ``zero_one_adam``: this library's optimizers on the plain model
  (standalone mode), warmup of ``--freeze-step`` steps (1-bit LAMB at ``--lamb-lr``: LAMB's trust
  ratio takes a larger lr than Adam). ``--no-overlap`` communicates in ``step()`` instead of
  during backward; ``--ddp-hook`` runs them under DDP with
  :func:`compressed_opt.register_ddp_comm_hook`. A method may carry its own options:
  ``onebit_adam+ddp``, ``onebit_adam+nooverlap``, ``onebit_adam+overlap``.

Every method runs in processes of its own (a hang or crash of one cannot take the others along):
a rank that completes no step for ``--stall-timeout`` seconds reports a hang and exits, and all
ranks are killed after ``--method-timeout``; a method whose ranks crash, hang or diverge (NaN
loss) is reported as *failed*, with the reason, never as slow. Every method starts from the same
initial model (same seed) and sees the same batches: global batch ``--batch * world_size``
sequences of ``--seq-len`` bytes drawn by step number, rank ``r`` takes its ``r``-th shard.
The learning rate warms up linearly over ``--lr-warmup`` steps, then decays (cosine) to 10%.

Where the ranks run:

* ``--launch N`` (default 2): N local processes, Gloo (NCCL with ``--device cuda``), file store;
* ``--link 1gbit|10gbit|RATE|none``: 2 ranks in network namespaces joined by a veth pair limited
  to that rate (``benchmarks/slowlink.py``; needs root); the wire bytes are counted on the veth;
* under ``torchrun`` (``torchrun --nproc-per-node N -m compressed_opt.bench``, started outside
  the repository root, as torchrun does not pass ``-P``): the methods run one after the other in
  the launched processes (no isolation between methods; peak memory is then cumulative).

What is reported per method (JSON ``--out-dir/NAME.json``, plots ``NAME.png``, a table):

* step time: median over the steps of the warmup stage and of the compression stage (the first
  2 steps of each stage are left out); a step's time is the maximum over the ranks of
  forward + backward + ``optimizer.step()`` + ``zero_grad``;
* samples/s in the method's steady stage (compression stage when it has one);
* bytes sent per step per rank: ours from ``backend.stats``, DDP methods counted in their comm
  hook (every ``all_reduce`` the hook issues, ring volume ``2 (N-1)/N * bytes``); on the slow link
  also the bytes counted on the veth (``tx_bytes``, Ethernet frames with headers and ACKs);
* loss at equal steps: the mean training loss of the last 10% of steps (every method the same
  steps), and the held-out loss at the end; time to a target loss (``--target-loss``, default
  1.05 x ``ddp_adamw``'s final loss) in training wall time;
* peak memory per rank (CPU: ``ru_maxrss``; CUDA: ``max_memory_allocated``);
* with ``--breakdown``: the steady step split into *compute* (forward + backward with no
  communication, timed separately at the end), *communication paid* (forward + backward beyond
  that compute, plus the time ``step()`` waits for or runs communication) and *update*
  (the rest of ``step()``), and, beside it, the time spent in compression kernels and in
  collectives (ours: around each kernel call and each collective; DDP: inside the comm hook, and
  the time an allreduce is in flight). With ``overlap`` the kernels and collectives run during
  backward, so they are not a part of the step's sum: the comparison of *communication paid* with
  them shows what the overlap hid.

Run ``python -P -m compressed_opt.bench --help``; ``benchmarks/train.py`` is the same entry point.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

METHODS = {
    "ddp_adamw": "DDP + AdamW (fp32 allreduce hook)",
    "ddp_fp16": "DDP + AdamW + fp16 compression hook",
    "ddp_bf16": "DDP + AdamW + bf16 compression hook (NCCL)",
    "ddp_powersgd": "DDP + AdamW + PowerSGD hook",
    "onebit_adam": "1-bit Adam",
    "onebit_lamb": "1-bit LAMB",
    "zero_one_adam": "0/1 Adam",
}
OURS = ("onebit_adam", "onebit_lamb", "zero_one_adam")
DEFAULT_METHODS = ("ddp_adamw", "ddp_fp16", "ddp_powersgd", "ddp_powersgd+serial", "onebit_adam", "onebit_lamb",
                   "zero_one_adam")
BASELINE = "ddp_adamw"
SKIP_FIRST = 2  # steps left out at the start of each stage (allocation, first-call costs)
MODIFIERS = ("ddp", "overlap", "nooverlap", "serial")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    n_layers: int
    d_model: int
    n_heads: int
    context: int
    vocab: int = 256


PRESETS = {
    "tiny": ModelConfig(n_layers=4, d_model=128, n_heads=4, context=64),  # ~0.9M parameters
    "small": ModelConfig(n_layers=5, d_model=384, n_heads=6, context=64),  # ~9.1M parameters
}


# --- the model -------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style byte-level causal language model (learned positions, untied head)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"--width {cfg.d_model} must be a multiple of --heads {cfg.n_heads}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def count_params(cfg: ModelConfig) -> int:
    d, L = cfg.d_model, cfg.n_layers
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return cfg.vocab * d * 2 + cfg.context * d + L * per_block + 2 * d


# --- the data ------------------------------------------------------------------------------------
def load_corpus(path: str | None = None) -> bytes:
    """The training text: ``path``'s bytes, or Python's own help texts (``pydoc_data.topics``)."""
    if path:
        with open(path, "rb") as f:
            return f.read()
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")


class Batches:
    """Global batches drawn by step number: every method and rank draws the same sequences;
    rank ``r`` takes rows ``[r*b, (r+1)*b)``. The last 5% of the corpus is held out."""

    def __init__(self, corpus: bytes, seq_len: int, batch: int, rank: int, world: int, seed: int):
        data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8).long()
        split = int(len(data) * 0.95)
        self.train, self.val = data[:split], data[split:]
        if len(self.val) < seq_len + 2 or len(self.train) < seq_len + 2:
            raise ValueError(f"the corpus ({len(data)} bytes) is too short for --seq-len {seq_len}")
        self.seq_len, self.batch, self.rank, self.world, self.seed = seq_len, batch, rank, world, seed

    def _rows(self, data: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        seqs = data[idx]
        return seqs[:, :-1], seqs[:, 1:]

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.train) - self.seq_len - 1, (self.batch * self.world,), generator=g)
        mine = starts[self.rank * self.batch:(self.rank + 1) * self.batch]
        return self._rows(self.train, mine)

    def val_batches(self, sequences: int, per_batch: int):
        """This rank's share of ``sequences`` fixed held-out sequences, in batches."""
        g = torch.Generator().manual_seed(self.seed + 7)
        starts = torch.randint(0, len(self.val) - self.seq_len - 1, (sequences,), generator=g)
        mine = starts[self.rank::self.world]
        for i in range(0, len(mine), per_batch):
            yield self._rows(self.val, mine[i:i + per_batch])


# --- counting what DDP hooks send ---------------------------------------------------------------------
class _CommRecorder:
    """Bytes the DDP hooks send (ring volume), and, when ``timing``, the in-flight intervals of
    their allreduces and the time spent inside the hook calls."""

    def __init__(self):
        self.bytes = 0
        self.timing = False
        self.intervals: list[tuple[float, float]] = []
        self.hook_s = 0.0
        self.lock = threading.Lock()


RECORDER = _CommRecorder()


class _CountingDist:
    """Stands in for ``torch.distributed`` inside torch's DDP hook modules: ``all_reduce`` is
    counted (and timed), everything else is ``torch.distributed``'s own."""

    def __init__(self, dist_module):
        self._dist = dist_module

    def __getattr__(self, name):
        return getattr(self._dist, name)

    def all_reduce(self, tensor, *args, **kwargs):
        world = self._dist.get_world_size(kwargs.get("group"))
        with RECORDER.lock:
            RECORDER.bytes += int(2 * (world - 1) / world * tensor.numel() * tensor.element_size())
        start = time.perf_counter()
        work = self._dist.all_reduce(tensor, *args, **kwargs)
        if RECORDER.timing and work is not None:
            fut = work.get_future()

            def done(f, start=start):
                with RECORDER.lock:
                    RECORDER.intervals.append((start, time.perf_counter()))
                return f.value()

            return _WorkWithFuture(work, fut.then(done))
        return work


class _WorkWithFuture:
    def __init__(self, work, fut):
        self._work, self._fut = work, fut

    def get_future(self):
        return self._fut

    def wait(self, *a, **k):
        return self._work.wait(*a, **k)


def _install_counting_dist() -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    for module in (default_hooks, powerSGD_hook):
        if not isinstance(module.dist, _CountingDist):
            module.dist = _CountingDist(dist)


def _timed_hook(hook):
    def wrapper(state, bucket):
        if not RECORDER.timing:
            return hook(state, bucket)
        start = time.perf_counter()
        try:
            return hook(state, bucket)
        finally:
            with RECORDER.lock:
                RECORDER.hook_s += time.perf_counter() - start

    wrapper.__name__ = getattr(hook, "__name__", "hook")
    return wrapper


def _one_bucket_at_a_time(hook):
    """``ddp_powersgd+serial``: start a bucket's hook only once the previous bucket's exchange
    has finished. PowerSGD launches allreduces from future callbacks; with several buckets in
    flight the ranks can issue them in different orders, which Gloo (no tags) turns into a size
    mismatch abort or a hang. Serialising the buckets fixes the order and costs overlap."""
    previous = {}

    def serial(state, bucket):
        if bucket.index() > 0 and "fut" in previous:
            previous.pop("fut").wait()
        fut = hook(state, bucket)
        previous["fut"] = fut
        if bucket.is_last():
            previous.clear()
        return fut

    serial.__name__ = getattr(hook, "__name__", "hook") + "_serial"
    return serial


def _union_length(intervals) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


# --- timing our communication (--breakdown) ----------------------------------------------------------
class _PerThreadTimer:
    """Accumulates seconds spent in wrapped calls; nested calls on one thread count once.
    ``when()``, if given, must be true for a call to count."""

    def __init__(self, when=None):
        self.total = 0.0
        self.local = threading.local()
        self.lock = threading.Lock()
        self.when = when

    def wrap(self, fn):
        def timed(*args, **kwargs):
            depth = getattr(self.local, "depth", 0)
            if depth or (self.when is not None and not self.when()):
                return fn(*args, **kwargs)
            self.local.depth = 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.depth = 0
                with self.lock:
                    self.total += time.perf_counter() - start

        return timed

    def take(self) -> float:
        with self.lock:
            value, self.total = self.total, 0.0
        return value


class _TimedWork:
    """A backend ``Work`` whose ``wait()`` is timed."""

    def __init__(self, work, timed_wait):
        self._work, self.wait = work, timed_wait

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


class _OurInstrumentation:
    """Wraps the compression kernels (module attributes of ``compressed_opt.cuda``, looked up
    at each call by the compressed allreduce) and this backend's collectives (time on any
    thread), and measures how long ``optimizer.step()`` waits for or runs communication: the
    wait for backward-launched buckets, the inline exchanges, and kernels and collectives that
    ``step()`` runs itself (e.g. 0/1 Adam's synchronisations). Only installed with ``--breakdown``."""

    KERNELS = ("compress_", "average_compress_", "finish_", "decompress_")
    COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "broadcast")

    def __init__(self, optimizer):
        from compressed_opt import cuda as kernels

        main = threading.main_thread()
        self.in_step = False
        self.kernels = _PerThreadTimer()
        self.collectives = _PerThreadTimer()
        self.waits = _PerThreadTimer(when=lambda: self.in_step and threading.current_thread() is main)
        self._kernel_module = kernels
        self._saved = {name: getattr(kernels, name) for name in self.KERNELS if hasattr(kernels, name)}
        for name, fn in self._saved.items():
            setattr(kernels, name, self.waits.wrap(self.kernels.wrap(fn)))
        backend = optimizer.backend
        for name in self.COLLECTIVES:
            setattr(backend, name, self._timed_collective(getattr(backend, name)))
        launcher = optimizer._launcher
        launcher.wait = self.waits.wrap(launcher.wait)
        launcher.run_inline = self.waits.wrap(launcher.run_inline)
        step = optimizer.step

        def timed_step(*args, **kwargs):
            self.in_step = True
            try:
                return step(*args, **kwargs)
            finally:
                self.in_step = False

        optimizer.step = timed_step

    def _timed_collective(self, fn):
        """Time the call and, for ``async_op=True``, the ``wait()`` of its handle: the time a
        thread is held up by the collective."""
        timed = self.waits.wrap(self.collectives.wrap(fn))

        def call(*args, **kwargs):
            work = timed(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                return _TimedWork(work, self.waits.wrap(self.collectives.wrap(work.wait)))
            return work

        return call

    def take(self) -> tuple[float, float, float]:
        return self.kernels.take(), self.collectives.take(), self.waits.take()

    def remove(self) -> None:
        for name, fn in self._saved.items():
            setattr(self._kernel_module, name, fn)


# --- one method on the ranks of an initialised process group ----------------------------------------------
def parse_spec(spec: str, overlap: bool, ddp_hook: bool) -> dict:
    name, *mods = spec.split("+")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(METHODS)}")
    for m in mods:
        if m not in MODIFIERS:
            raise ValueError(f"unknown option +{m} in {spec!r}; options: +{', +'.join(MODIFIERS)}")
        if m == "serial" and name != "ddp_powersgd":
            raise ValueError(f"+serial applies to ddp_powersgd only, not to {name}")
        if m != "serial" and name not in OURS:
            raise ValueError(f"+{m} applies to {', '.join(OURS)} only, not to {name}")
    if "overlap" in mods:
        overlap = True
    if "nooverlap" in mods:
        overlap = False
    return {"spec": spec, "name": name, "overlap": overlap, "ddp_hook": ddp_hook or "ddp" in mods,
            "serial": "serial" in mods}


def lr_at(step: int, cfg: dict) -> float:
    """Linear warmup over ``lr_warmup`` steps, then cosine decay to 10% at the last step."""
    base, warm, total = cfg["lr"], cfg["lr_warmup"], cfg["steps"]
    if step <= warm:
        return base * step / max(1, warm)
    frac = (step - warm) / max(1, total - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def _build(method: dict, model: nn.Module, cfg: dict, device: torch.device):
    """``(module to call, optimizer, stage(), bytes_sent(), extra)`` for ``method``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import compressed_opt

    name = method["name"]
    hp = dict(lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"], weight_decay=cfg["weight_decay"])
    ddp_kwargs = dict(bucket_cap_mb=cfg["ddp_bucket_mb"])
    if device.type == "cuda":
        ddp_kwargs["device_ids"] = [device.index]
    if name.startswith("ddp_"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        _install_counting_dist()
        module = DDP(model, **ddp_kwargs)
        stage = lambda: "full"  # noqa: E731
        if name == "ddp_adamw":
            module.register_comm_hook(None, _timed_hook(default_hooks.allreduce_hook))
        elif name == "ddp_fp16":
            module.register_comm_hook(None, _timed_hook(default_hooks.fp16_compress_hook))
        elif name == "ddp_bf16":
            if dist.get_backend() != "nccl":
                raise RuntimeError("ddp_bf16 needs NCCL (bf16 allreduce is not supported by Gloo); use ddp_fp16")
            module.register_comm_hook(None, _timed_hook(default_hooks.bf16_compress_hook))
        else:
            start = max(2, cfg["freeze_step"])
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=cfg["powersgd_rank"], start_powerSGD_iter=start,
                min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=cfg["seed"])
            hook = powerSGD_hook.powerSGD_hook
            if method["serial"]:
                hook = _one_bucket_at_a_time(hook)
            module.register_comm_hook(state, _timed_hook(hook))
            stage = lambda: "compression" if state.iter >= state.start_powerSGD_iter else "warmup"  # noqa: E731
        opt = torch.optim.AdamW(model.parameters(), **hp)
        return module, opt, stage, lambda: RECORDER.bytes, {"ddp": True}
    backend = compressed_opt.get_backend("torch")
    common = dict(hp, backend=backend, bucket_cap_mb=cfg["bucket_mb"], overlap=method["overlap"])
    if name == "onebit_adam":
        opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=cfg["freeze_step"], **common)
    elif name == "onebit_lamb":
        common["lr"] = cfg["lamb_lr"]  # LAMB scales each layer's step by ||p|| / ||update||
        opt = compressed_opt.OnebitLamb(model.parameters(), freeze_step=cfg["freeze_step"], **common)
    else:
        opt = compressed_opt.ZeroOneAdam(model.parameters(), var_freeze_step=cfg["freeze_step"], **common)
    module = model
    if method["ddp_hook"]:
        module = DDP(model, **ddp_kwargs)
        compressed_opt.register_ddp_comm_hook(module, opt)
    stage = lambda: "compression" if opt.compressing else "warmup"  # noqa: E731
    return module, opt, stage, lambda: backend.stats.total_bytes, {"ddp": method["ddp_hook"]}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    rank, world = dist.get_rank(), dist.get_world_size()
    mcfg = ModelConfig(**cfg["model"])
    torch.manual_seed(cfg["seed"])
    model = TinyGPT(mcfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    data = Batches(load_corpus(cfg.get("corpus")), cfg["seq_len"], cfg["batch"], rank, world, cfg["seed"])
    module, opt, stage_of, sent, extra = _build(method, model, cfg, device)
    breakdown = cfg["breakdown"]
    ours = method["name"] in OURS
    instr = _OurInstrumentation(opt) if (breakdown and ours) else None
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
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = data.train_batch(step)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        stage = stage_of()
        bytes_before, wire_before = sent(), wire.read()
        if RECORDER.timing:
            RECORDER.intervals.clear()
            RECORDER.hook_s = 0.0
        _inject(cfg, method, rank, world, step)
        _sync(device)
        t0 = time.perf_counter()
        logits = module(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
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
        if instr is not None:
            k, c, wt = instr.take()
            rec["kernels_s"].append(k)
            rec["collectives_s"].append(c)
            rec["wait_s"].append(wt)
        elif RECORDER.timing:
            with RECORDER.lock:
                rec["kernels_s"].append(RECORDER.hook_s)
                rec["collectives_s"].append(_union_length(RECORDER.intervals))
            rec["wait_s"].append(0.0)  # DDP waits for its communication inside backward
        progress.update(step, loss_value, t3 - t0, stage, force=step == steps)
        watchdog.beat(f"step {step}")
    if instr is not None:
        instr.remove()
    RECORDER.timing = False
    compute = _calibrate_compute(module, opt, data, device, extra["ddp"], steps) if breakdown else None
    watchdog.beat("the compute calibration")
    eval_loss = _evaluate(model, data, cfg, device)
    watchdog.beat("the evaluation")
    local = {"rec": rec, "compute_s": compute, "peak_memory_bytes": _peak_memory(device)}
    everyone = [None] * world
    dist.all_gather_object(everyone, local)
    watchdog.close()
    if rank != 0:
        return None
    per_step = lambda key, how: [how(v) for v in zip(*(e["rec"][key] for e in everyone))]  # noqa: E731
    wires = per_step("wire", lambda v: None if v[0] is None else statistics.fmean(v))
    result = {
        "spec": method["spec"],
        "method": method["name"],
        "label": METHODS[method["name"]],
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
            _sync(device)
            t0 = time.perf_counter()
            logits = module(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    return statistics.median(times)


@torch.no_grad()
def _evaluate(model: nn.Module, data: Batches, cfg: dict, device: torch.device) -> float:
    import torch.distributed as dist

    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in data.val_batches(cfg["eval_sequences"], per_batch=16):
        logits = model(x.to(device))
        total[0] += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1),
                                    reduction="sum").double()
        total[1] += y.numel()
    model.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


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
            _write_json(args.out, result)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)  # no atexit/destructor that could wait on a dead peer
    return 0


def _rounded(obj, digits: int = 6):
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


def _write_json(path: str, obj) -> None:
    """Indented JSON with floats to 6 significant digits and lists of scalars on one line."""
    text = json.dumps(_rounded(obj), indent=1)
    text = re.sub(r"\[[^\[\]{}]*\]", lambda m: re.sub(r"\n\s*", "", m.group(0)), text)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


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


class _Display:
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
    cmd = [sys.executable, "-P", "-m", "compressed_opt.bench", "--worker", spec, "--config", config,
           "--out", out, "--progress", progress]
    if init_method:
        cmd += ["--init-method", init_method]
    return cmd


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    return env


def run_local(spec: str, cfg: dict, tmp: str, display: _Display, index: int, total: int) -> dict:
    """Run one method as ``cfg['launch']`` local processes; a dict with ``status`` and either
    ``result`` or ``error``."""
    n = cfg["launch"]
    store = os.path.join(tmp, "store")
    config, out, prog = (os.path.join(tmp, f) for f in ("config.json", "result.json", "progress.json"))
    _write_json(config, cfg)
    procs, logs = [], []
    started = time.monotonic()
    first_failed, timed_out = None, False
    try:
        for r in range(n):
            env = dict(_child_env(), RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
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


def load_slowlink():
    """``benchmarks/slowlink.py`` of the source checkout (or ``$COMPRESSED_OPT_SLOWLINK``)."""
    import importlib.util

    path = os.environ.get("COMPRESSED_OPT_SLOWLINK") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "slowlink.py")
    if not os.path.exists(path):
        raise SystemExit(f"--link needs benchmarks/slowlink.py from the compressed-opt source checkout "
                         f"(not found at {path}; set COMPRESSED_OPT_SLOWLINK to its path)")
    spec = importlib.util.spec_from_file_location("slowlink", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("slowlink", module)
    spec.loader.exec_module(module)
    return module


def check_link_possible(slowlink) -> None:
    if not sys.platform.startswith("linux"):
        raise SystemExit("--link needs Linux network namespaces (ip netns); run without --link")
    if os.geteuid() != 0:
        raise SystemExit("--link creates network namespaces and a rate-limited veth pair, which needs root "
                         "(or CAP_NET_ADMIN and CAP_SYS_ADMIN): run as root, e.g. with sudo, or leave out --link")
    ok, why = slowlink.netns_supported()
    if not ok:
        raise SystemExit(f"--link: network namespaces are not usable here ({why}); leave out --link")


def run_link(spec: str, cfg: dict, tmp: str, display: _Display, index: int, total: int, slowlink) -> dict:
    config, out, prog = (os.path.join(tmp, f) for f in ("config.json", "result.json", "progress.json"))
    _write_json(config, cfg)
    rate = None if cfg["link"] == "none" else cfg["link"]
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
                res = slowlink.run_two_ranks(_worker_cmd(spec, config, out, prog), rate=rate,
                                             timeout=cfg["method_timeout"],
                                             env={"OMP_NUM_THREADS": str(cfg["threads"])},
                                             grace=cfg["grace"], port=29500 + index)
                break
            except slowlink.SlowLinkError as e:
                error = e
                if attempt == 0:
                    display.done(f"[{index}/{total}] {spec}: the slow link failed ({e}); trying once more")
    finally:
        stop.set()
        shower.join()
    if res is None:
        return {"spec": spec, "status": "failed", "error": f"slow link: {error}",
                "elapsed_s": time.monotonic() - started}
    link = {k: res.get(k) for k in ("rate", "tbf", "tx_bytes", "rx_bytes", "tx_packets", "elapsed_s", "gso")}
    codes = res["returncodes"]
    return _collect(spec, out, prog, codes if not res["timed_out"] else [c if c == 0 else None for c in codes],
                    res["timed_out"], res["outputs"], time.monotonic() - started, cfg, {"link": link})


def run_in_process(specs: list[str], cfg: dict, display: _Display) -> list[dict]:
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


# --- summaries -----------------------------------------------------------------------------------------------
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
    """Per-method numbers from the raw curves (see the module docstring)."""
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
def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def format_table(entries: list[dict], comparison: dict, cfg: dict) -> str:
    wire = any(e.get("summary", {}).get("wire_bytes_per_step") is not None for e in entries)
    cols = [("method", 22), ("loss", 6), ("eval", 6), ("warmup ms", 9), ("step ms", 8), ("samples/s", 9),
            ("bytes/step", 10)] + ([("wire/step", 10)] if wire else []) + [
            ("speedup", 7), ("to target", 9), ("peak MB", 7)]
    lines = ["  ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w) in enumerate(cols))]
    for e in entries:
        if e["status"] != "ok":
            lines.append(f"{e['spec']:<22}  FAILED: {e['error']}")
            continue
        s = e["summary"]
        has_warm = s["steady_stage"] == "compression"
        ttt = s.get("time_to_target_s")
        row = [f"{e['spec']:<22}", f"{s['final_loss']:6.3f}", f"{s['eval_loss']:6.3f}",
               f"{_ms(s['step_s_warmup'] if has_warm else None):>9}", f"{_ms(s['step_s']):>8}",
               f"{s['samples_per_s']:9.1f}", f"{_fmt_bytes(s['bytes_per_step']):>10}"]
        if wire:
            row.append(f"{_fmt_bytes(s.get('wire_bytes_per_step')):>10}")
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
                     "communication dominates the step (--link 1gbit, as root; make bench)")
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


# --- command line ----------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -P -m compressed_opt.bench",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="methods: " + ", ".join(METHODS) + " (ours may take +ddp, +overlap, +nooverlap)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated (default: %(default)s)")
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="model preset (default tiny)")
    p.add_argument("--layers", type=int, help="override the preset's layers")
    p.add_argument("--width", type=int, help="override the preset's width (d_model)")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--context", type=int, help="override the preset's context (positions)")
    p.add_argument("--seq-len", type=int, help="training sequence length (default: the context)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--steps", type=int, default=200, help="training steps, the same for every method (default 200)")
    p.add_argument("--freeze-step", type=int, help="warmup steps of ours and PowerSGD's start (default steps/4)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--lamb-lr", type=float, default=1e-2,
                   help="peak learning rate of onebit_lamb (default 1e-2: LAMB's trust ratio scales each layer's "
                        "step by ||p||/||update||, so it takes a larger lr than Adam)")
    p.add_argument("--lr-warmup", type=int, help="linear learning-rate warmup steps (default steps/10)")
    p.add_argument("--betas", default="0.9,0.99", help="Adam betas (default 0.9,0.99)")
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="ours: bucket_cap_mb (one collective and one compression scale per bucket; default 25)")
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default 25)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix approximation rank (default 4)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="ours: communicate during backward (default) or in step()")
    p.add_argument("--ddp-hook", action="store_true", help="ours: run under DDP with register_ddp_comm_hook")
    p.add_argument("--breakdown", action="store_true",
                   help="time compute, compression kernels and collectives per step (small overhead)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", help="a text file to train on instead of Python's help texts")
    p.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences for the final loss (default 64)")
    p.add_argument("--target-loss", type=float, help="loss for time-to-target (default 1.05 x ddp_adamw's final loss)")
    p.add_argument("--launch", type=int, default=None, metavar="N", help="local ranks per method (default 2)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="2 ranks over a rate-limited veth pair: 1gbit, 10gbit, any tc rate, or none (needs root)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1") or 1),
                   help="torch threads per rank (default $OMP_NUM_THREADS or 1)")
    p.add_argument("--method-timeout", type=float, default=900.0,
                   help="seconds before a method's ranks are killed and it is reported failed (default 900)")
    p.add_argument("--stall-timeout", type=float, default=120.0,
                   help="a rank that completes no step for this many seconds reports a hang and exits (default 120)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds the other ranks get after one fails (default 5)")
    p.add_argument("--inject-failure", metavar="METHOD:crash|hang[:STEP]", action="append",
                   help="testing: make the last rank of METHOD crash or hang at STEP (default 3); repeatable")
    p.add_argument("--out-dir", default="results", help="where NAME.json and NAME.png go (default ./results)")
    p.add_argument("--name", help="file name stem (default train-MODEL-LINK)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    # internal: one rank of one method
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--init-method", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_config(args) -> dict:
    base = PRESETS[args.model]
    model = ModelConfig(n_layers=args.layers or base.n_layers, d_model=args.width or base.d_model,
                        n_heads=args.heads or base.n_heads, context=args.context or base.context)
    seq_len = args.seq_len or model.context
    if seq_len > model.context:
        raise SystemExit(f"--seq-len {seq_len} is longer than the context {model.context}")
    if args.steps < 1 or args.batch < 1:
        raise SystemExit("--steps and --batch must be >= 1")
    freeze = args.freeze_step if args.freeze_step is not None else max(2, args.steps // 4)
    if not 1 <= freeze < args.steps:
        raise SystemExit(f"--freeze-step must be in [1, --steps), got {freeze}")
    betas = [float(b) for b in args.betas.split(",")]
    if len(betas) != 2:
        raise SystemExit("--betas takes two numbers, e.g. 0.9,0.99")
    inject = []
    for text in args.inject_failure or ():
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[1] not in ("crash", "hang") or not parts[-1]:
            raise SystemExit("--inject-failure takes METHOD:crash or METHOD:hang, optionally :STEP")
        inject.append({"method": parts[0], "mode": parts[1], "step": int(parts[2]) if len(parts) == 3 else 3})
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and args.launch is None and not args.link
    if args.link:
        if args.launch not in (None, 2):
            raise SystemExit("--link runs exactly 2 ranks; leave out --launch")
        launch = 2
    else:
        launch = args.launch if args.launch is not None else 2
    if launch < 1:
        raise SystemExit("--launch must be >= 1")
    return {
        "model": dataclasses.asdict(model),
        "model_preset": args.model,
        "params": count_params(model),
        "seq_len": seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "freeze_step": freeze,
        "lr": args.lr,
        "lamb_lr": args.lamb_lr,
        "lr_warmup": args.lr_warmup if args.lr_warmup is not None else max(1, args.steps // 10),
        "betas": betas,
        "eps": args.eps,
        "weight_decay": args.weight_decay,
        "bucket_mb": args.bucket_mb,
        "ddp_bucket_mb": args.ddp_bucket_mb,
        "powersgd_rank": args.powersgd_rank,
        "overlap": args.overlap,
        "ddp_hook": args.ddp_hook,
        "breakdown": args.breakdown,
        "seed": args.seed,
        "corpus": os.path.abspath(args.corpus) if args.corpus else None,
        "eval_sequences": args.eval_sequences,
        "target_loss": args.target_loss,
        "launch": launch,
        "link": args.link,
        "device": args.device,
        "threads": args.threads,
        "method_timeout": args.method_timeout,
        "stall_timeout": args.stall_timeout,
        "grace": args.grace,
        "inject_failure": inject,
        "mode": "link" if args.link else ("torchrun" if under_torchrun else "local"),
    }


def _environment() -> dict:
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "argv": " ".join(shlex.quote(a) for a in sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):  # stop the ranks and delete the link, as for Ctrl-C
            signal.signal(sig, _raise_interrupt)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
            signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = make_config(args)
    specs = [s.strip() for s in args.methods.split(",") if s.strip()]
    for s in specs:
        try:
            parse_spec(s, cfg["overlap"], cfg["ddp_hook"])
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if cfg["batch"] * cfg["launch"] > 0 and cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no usable CUDA device")
    slowlink = None
    if cfg["link"]:
        slowlink = load_slowlink()
        check_link_possible(slowlink)
    display = _Display(enabled=not args.quiet)
    where = (f"2 ranks over a {cfg['link']} veth link" if cfg["link"] else
             "torchrun ranks" if cfg["mode"] == "torchrun" else f"{cfg['launch']} local ranks")
    model = cfg["model"]
    header = (f"# compressed_opt.bench: {cfg['params'] / 1e6:.2f}M-parameter GPT ({model['n_layers']} layers, width "
              f"{model['d_model']}, {model['n_heads']} heads), batch {cfg['batch']} x {cfg['seq_len']} bytes per rank, "
              f"{cfg['steps']} steps (warmup {cfg['freeze_step']}), {where}, {cfg['device']}, "
              f"{cfg['threads']} thread(s) per rank")
    leader = cfg["mode"] != "torchrun" or os.environ.get("RANK") == "0"
    if leader:
        print(header, flush=True)
    else:
        display.enabled = False
    started = time.monotonic()
    if cfg["mode"] == "torchrun":
        entries = run_in_process(specs, cfg, display)
        if not entries:
            return 0
    else:
        entries = []
        for i, spec in enumerate(specs, 1):
            load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
            with tempfile.TemporaryDirectory(prefix="co-train-") as tmp:
                if cfg["link"]:
                    entry = run_link(spec, cfg, tmp, display, i, len(specs), slowlink)
                else:
                    entry = run_local(spec, cfg, tmp, display, i, len(specs))
            entry["load_average_before"] = load_before
            entry["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
            status = "ok" if entry["status"] == "ok" else f"FAILED ({entry['error']})"
            display.done(f"[{i}/{len(specs)}] {spec}: {status} in {entry['elapsed_s']:.0f} s")
            entries.append(entry)
    comparison = compare(entries, cfg)
    print(format_table(entries, comparison, cfg), flush=True)
    name = args.name or (f"train-{cfg['model_preset']}-"
                         f"{cfg['link'] or ('torchrun' if cfg['mode'] == 'torchrun' else 'local')}")
    os.makedirs(args.out_dir, exist_ok=True)
    report = {"config": cfg, "environment": _environment(), "comparison": comparison,
              "wall_time_s": time.monotonic() - started, "methods": entries}
    json_path = os.path.join(args.out_dir, name + ".json")
    _write_json(json_path, report)
    print(f"# wrote {json_path}", flush=True)
    if not args.no_plot:
        png = plot(entries, comparison, os.path.join(args.out_dir, name + ".png"), header.lstrip("# "))
        if png:
            print(f"# wrote {png}", flush=True)
    return 0 if all(e["status"] == "ok" for e in entries) else 1


def cli() -> int:
    try:
        return main()
    except KeyboardInterrupt as e:
        print(f"\ncompressed_opt.bench: interrupted ({e or 'Ctrl-C'}); the ranks were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
