"""What the three framework examples share that is *not* part of the recipe: the tiny GPT-2, the
byte corpus, the command line, and the measurements (parameter hash, loss curve, held-out loss,
bytes per step) written to the ``--out`` JSON.

The recipes themselves are in ``hf_trainer.py``, ``lightning_ddp.py`` and ``accelerate_loop.py``;
``tests/test_integrations.py`` and ``benchmarks/integrations.py`` run them.

Bytes per step, three ways (all per rank):

* ``bytes.ours``: what the library's collectives sent, from ``optimizer.backend.stats`` (its DDP
  hook records its warmup all-reduce there too). For the AdamW baseline, which has no backend,
  a counting DDP comm hook records ``2 (N-1)/N * bucket bytes`` (the ring convention the library
  uses) and then runs torch's default ``allreduce_hook``.
* ``bytes.ddp_unhooked``: for the compressed optimizers, a step whose backward ran while the DDP
  module had no communication hook of ``compressed_opt`` means DDP all-reduced every gradient at
  full precision on its own, *besides* whatever the optimizer sent; it is counted here as
  ``2 (N-1)/N * gradient bytes`` (inferred from the hook's absence, not measured) and added to
  ``bytes.total``.
* ``wire``: measured, when the job runs in a private network namespace (``CO_WIRE_IFACE=lo``, set
  by the harness that launched it in ``unshare --net``): the loopback interface's transmitted
  bytes (``/proc/net/dev``: payload, TCP/IP headers, ACKs, the frameworks' own small collectives
  such as the Trainer's loss gather) read by rank 0 at the end of every step, divided by the
  world size (both ranks share the one interface).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

SEQ_LEN = 64
BATCH = 8  # sequences per rank and step
EVAL_WINDOWS = 128
DEFAULT_LR = {"onebitadam": 2e-3, "onebitlamb": 1e-2, "zerooneadam": 2e-3, "adamw": 2e-3}
OPTIMIZERS = ("onebitadam", "onebitlamb", "zerooneadam", "adamw")
# bytes per step: warmup = steps 2..freeze (step 1 carries one-off checks), compression = freeze+1..end
WARMUP_FROM = 2


# --- the model and the data -------------------------------------------------------------------------
def gpt2_config():
    """A tiny byte-level GPT-2 (120,576 parameters): nothing is downloaded. No dropout: a resumed
    run's arithmetic must not depend on whether a framework restores the random number state
    (Lightning does not; the checkpoint tests compare resumed runs bit for bit)."""
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2,
                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def corpus() -> tuple[torch.Tensor, torch.Tensor]:
    """Python's own help texts (``pydoc_data.topics``, ~0.5 MB; the corpus of
    ``benchmarks/train.py``) as bytes: the first 95% to train on, the last 5% held out."""
    from pydoc_data.topics import topics

    data = torch.frombuffer(bytearray("\n\n".join(topics[k] for k in sorted(topics)).encode()), dtype=torch.uint8)
    data = data.long()
    split = int(len(data) * 0.95)
    return data[:split], data[split:]


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping ``SEQ_LEN``-byte windows of the training bytes (GPT-2 shifts the labels
    itself). ``as_dict``: items ``{"input_ids", "labels"}`` (what the HF Trainer feeds the model)."""

    def __init__(self, as_dict: bool = False):
        train, _ = corpus()
        n = len(train) // SEQ_LEN
        self.windows = train[: n * SEQ_LEN].view(n, SEQ_LEN)
        self.as_dict = as_dict

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        x = self.windows[i]
        return {"input_ids": x, "labels": x} if self.as_dict else x


@torch.no_grad()
def eval_loss(model) -> float:
    """Mean loss on the first ``EVAL_WINDOWS`` held-out windows (eval mode, this rank alone)."""
    _, held = corpus()
    x = held[: EVAL_WINDOWS * SEQ_LEN].view(EVAL_WINDOWS, SEQ_LEN)
    was_training = model.training
    model.eval()
    losses = [model(input_ids=b, labels=b).loss.item() for b in x.split(32)]
    model.train(was_training)
    return sum(losses) / len(losses)


def params_sha256(model) -> str:
    """sha256 of every parameter's bytes, in ``named_parameters()`` order."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# --- the command line and the optimizer ---------------------------------------------------------------
def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="onebitadam")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--freeze-step", type=int, default=50,
                   help="freeze_step (OnebitAdam, OnebitLamb) / var_freeze_step (ZeroOneAdam)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=None, help="default: 2e-3 (1e-2 for onebitlamb)")
    p.add_argument("--out", default=None, help="JSON results (written by rank 0)")
    p.add_argument("--compat", choices=("none", "manual-hook", "no-overlap"), default="none",
                   help="none: the optimizer with default arguments (the recipe). Before automatic DDP "
                        "detection: manual-hook registers compressed_opt.register_ddp_comm_hook on the "
                        "framework's DDP module; no-overlap passes overlap=False (DDP still all-reduces)")
    p.add_argument("--path", choices=("auto", "1bit", "fp32", "measure"), default=None,
                   help="the optimizer's path per bucket (default: the library's, 'auto': measured on the link)")
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step (the framework's "
                   "gradient accumulation)")
    p.add_argument("--param-groups", choices=("one", "decay"), default="one",
                   help="the optimizer's param groups: one, or weight decay on matrices and none on biases and "
                        "norms (the transformers Trainer's split)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (the framework's mixed precision)")
    p.add_argument("--save-at", type=int, default=0, help="save a checkpoint (the framework's own) after this "
                   "optimizer step, into --checkpoint, and train on")
    p.add_argument("--checkpoint", default=None, help="the checkpoint folder of --save-at and --resume")
    p.add_argument("--resume", action="store_true", help="resume from the checkpoint of --save-at in --checkpoint "
                   "and train the remaining steps")
    args = p.parse_args()
    if (args.save_at or args.resume) and not (args.checkpoint and 0 < args.save_at < args.steps):
        p.error("--save-at and --resume need --checkpoint and 0 < --save-at < --steps")
    if args.accumulation < 1:
        p.error("--accumulation must be >= 1")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if not 1 <= args.freeze_step:
        p.error("--freeze-step must be >= 1")
    return args


def make_optimizer(args, params, **recipe):
    """The optimizer of ``--optimizer``: default arguments except ``lr`` and the freeze step,
    e.g. ``compressed_opt.OnebitAdam(model.parameters(), lr=2e-3, freeze_step=50)``; ``recipe``:
    more arguments of the compressed optimizers that a recipe needs (``backend=``...)."""
    import compressed_opt

    if args.param_groups == "decay":  # the transformers Trainer's split: no decay on biases and norms
        params = list(params)
        params = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    extra = {"overlap": False} if args.compat == "no-overlap" and args.optimizer != "adamw" else {}
    if args.path is not None and args.optimizer != "adamw":
        extra["path"] = args.path
    extra.update(recipe)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr)
    if args.optimizer == "onebitadam":
        return compressed_opt.OnebitAdam(params, lr=args.lr, freeze_step=args.freeze_step, **extra)
    if args.optimizer == "onebitlamb":
        return compressed_opt.OnebitLamb(params, lr=args.lr, freeze_step=args.freeze_step, **extra)
    return compressed_opt.ZeroOneAdam(params, lr=args.lr, var_freeze_step=args.freeze_step, **extra)


# --- measurements ---------------------------------------------------------------------------------------
def _lo_tx_bytes(iface: str) -> int | None:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if rest and name.strip() == iface:
                return int(rest.split()[8])
    return None


def _hook_name(ddp) -> str | None:
    hooks = getattr(ddp, "_comm_hooks", None) or []
    if not hooks:
        return None
    hook = hooks[-1][0]
    return f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', type(hook).__name__)}"


def _ours(ddp) -> bool:
    name = _hook_name(ddp)
    return name is not None and name.startswith("compressed_opt")


class _CountingState:
    def __init__(self, process_group, world):
        self.process_group, self.world, self.bytes = process_group, world, 0


def _counting_allreduce_hook(state: _CountingState, bucket):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    buf = bucket.buffer()
    state.bytes += int(2 * (state.world - 1) / state.world * buf.numel() * buf.element_size())
    return default_hooks.allreduce_hook(state.process_group, bucket)


class Meter:
    """Per-step measurements of one rank. The framework glue calls :meth:`attach` once the model is
    wrapped in DDP (before the first forward), :meth:`after_backward` between each step's backward
    and its ``optimizer.step()``, and :meth:`step_end` after each optimizer step."""

    def __init__(self, args, framework: str, optimizer):
        import torch.distributed as dist

        self.args, self.framework = args, framework
        self.optimizer = optimizer  # the raw one (frameworks wrap it)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ddp = None
        self.counting = None
        self.iface = os.environ.get("CO_WIRE_IFACE") or None
        self.ours, self.unhooked, self.wire, self.losses, self.calls = [], [], [], [], []
        self.hooks_seen = []
        self._base_ours = self._base_wire = None
        self._pending_unhooked = False
        self._checkpoint_ours = self._checkpoint_wire = 0  # bytes of saving, not of training steps
        self.t0 = time.perf_counter()
        self.hook_at_attach = None

    # the DDP module ------------------------------------------------------------------------------------
    def attach(self, ddp) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"{self.framework}: expected the DDP-wrapped model, got {type(ddp).__name__}")
        self.ddp = ddp
        self.grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)
        if self.args.optimizer == "adamw":
            self.counting = _CountingState(None, self.world)
            ddp.register_comm_hook(self.counting, _counting_allreduce_hook)
        elif self.args.compat == "manual-hook" and not _ours(ddp):
            import compressed_opt

            compressed_opt.register_ddp_comm_hook(ddp, self.optimizer)
        self.hook_at_attach = _hook_name(ddp)
        self._base_ours = self._ours_total()
        self._base_wire = self._wire_total()

    def _ours_total(self) -> int:
        if self.counting is not None:
            return self.counting.bytes
        if self.args.optimizer == "adamw":
            return 0
        return self.optimizer.backend.stats.total_bytes

    def _wire_total(self):
        return None if self.iface is None else _lo_tx_bytes(self.iface)

    # per step -------------------------------------------------------------------------------------------
    def after_backward(self) -> None:
        """After the step's backward, before ``optimizer.step()``: did backward run through a
        compressed_opt hook? (Without one, DDP all-reduced every gradient itself.)"""
        if self.ddp is None:
            raise RuntimeError(f"{self.framework}: Meter.attach was not called before the first step")
        self._pending_unhooked = self.args.optimizer != "adamw" and not _ours(self.ddp)

    def checkpoint_done(self) -> None:
        """After a checkpoint was saved between two steps: what was sent since the last step
        (consolidating the optimizer's per-rank state onto the saving rank) belongs to saving,
        not to the next step."""
        last_ours = self.ours[-1] if self.ours else self._base_ours
        self._checkpoint_ours = self._ours_total() - last_ours  # (cumulative: the steps' are net of it)
        if self.iface is not None:
            last_wire = self.wire[-1] if self.wire else self._base_wire
            self._checkpoint_wire = self._wire_total() - last_wire

    def step_end(self, loss=None) -> None:
        self.ours.append(self._ours_total() - self._checkpoint_ours)
        self.unhooked.append(self._pending_unhooked)
        self.wire.append(None if self.iface is None else self._wire_total() - self._checkpoint_wire)
        self.hooks_seen.append(_hook_name(self.ddp))
        if self.args.optimizer != "adamw":
            self.calls.append(dict(self.optimizer.backend.stats.calls))
        if loss is not None:
            self.losses.append(float(loss))

    # the result ----------------------------------------------------------------------------------------
    def finish(self, model, losses=None) -> dict | None:
        """Gather every rank's figures; rank 0 writes ``--out`` and returns the result."""
        mine = {
            "rank": self.rank,
            "params_sha256": params_sha256(model),
            "eval_loss": eval_loss(model),
            "losses": self.losses,
            "ours": self.ours, "unhooked": self.unhooked, "wire": self.wire,
        }
        # (torch's all_gather_object as the job's last collective can abort the exit, or hang
        # when the DDP module is dropped right after: see compressed_opt.comm.torch_backend)
        from compressed_opt.comm import TorchBackend

        everyone = TorchBackend().all_gather_object(mine)
        if self.rank != 0:
            return None
        r0 = everyone[0]
        if losses is None:  # the mean over ranks of each rank's own step loss
            per_rank = [r["losses"] for r in everyone]
            losses = [sum(v) / len(v) for v in zip(*per_rank)] if all(per_rank) else []
        steps = len(self.ours)
        # (a resumed run measures its own steps only: the stages counted from where it began)
        freeze = max(0, self.args.freeze_step - (self.args.save_at if self.args.resume else 0))
        per_step = _diffs(self._base_ours, r0["ours"])
        unhooked = [self.grad_bytes * 2 * (self.world - 1) / self.world if u else 0 for u in r0["unhooked"]]
        total = [a + b for a, b in zip(per_step, unhooked)]
        wire = None
        if self.iface is not None and all(w is not None for w in r0["wire"]):
            wire_steps = [w / self.world for w in _diffs(self._base_wire, r0["wire"])]
            wire = {"interface": self.iface, "per_step": wire_steps, **_stages(wire_steps, freeze)}
        result = {
            "framework": self.framework,
            "optimizer": self.args.optimizer,
            "compat": self.args.compat,
            "accumulation": self.args.accumulation,
            "bf16": self.args.bf16,
            "resumed_at": self.args.save_at if self.args.resume else 0,
            "steps": steps,
            "freeze_step": self.args.freeze_step,
            "seed": self.args.seed,
            "lr": self.args.lr,
            "world_size": self.world,
            "torch": torch.__version__,
            "ranks": [{"rank": r["rank"], "params_sha256": r["params_sha256"], "eval_loss": r["eval_loss"]}
                      for r in everyone],
            "params_identical": len({r["params_sha256"] for r in everyone}) == 1,
            "params_sha256": r0["params_sha256"],
            "eval_loss": r0["eval_loss"],
            "loss": losses,
            "losses_finite": bool(losses) and all(math.isfinite(v) for v in losses),
            "ddp_comm_hook": {"at_attach": self.hook_at_attach, "per_step": self.hooks_seen},
            "backend_calls_cumulative": self.calls,  # rank 0, per step (compressed optimizers)
            "bytes": {
                "ours_source": "DDP counting hook (ring 2(N-1)/N)" if self.args.optimizer == "adamw"
                else "optimizer.backend.stats",
                "gradient_bytes": self.grad_bytes,
                "ours_per_step": per_step,
                "ddp_unhooked_per_step": unhooked,
                "unhooked_steps": [i + 1 for i, u in enumerate(r0["unhooked"]) if u],
                "total_per_step": total,
                "ours": _stages(per_step, freeze),
                **_stages(total, freeze),
            },
            "wire": wire,
            "checkpoint_bytes": {"ours": self._checkpoint_ours, "wire": self._checkpoint_wire},
            "wall_s": time.perf_counter() - self.t0,
        }
        if self.args.out:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            with open(self.args.out, "w") as f:
                json.dump(result, f, indent=1)
        b = result["bytes"]
        print(f"[{self.framework}/{self.args.optimizer}] steps {steps}, final loss "
              f"{losses[-1] if losses else float('nan'):.4f}, eval {r0['eval_loss']:.4f}, ranks identical "
              f"{result['params_identical']}, bytes/step/rank warmup {b['warmup']} compression {b['compression']}"
              + (f", wire warmup {wire['warmup']} compression {wire['compression']}" if wire else ""), flush=True)
        return result


def _diffs(base, cumulative):
    out, prev = [], base or 0
    for c in cumulative:
        out.append(c - prev)
        prev = c
    return out


def _mean(v):
    return sum(v) / len(v) if v else None


def _stages(per_step, freeze) -> dict:
    return {"step1": per_step[0] if per_step else None, "warmup": _mean(per_step[WARMUP_FROM - 1:freeze]),
            "compression": _mean(per_step[freeze:])}


# --- the sharded recipes (accelerate_fsdp2.py, lightning_model_parallel.py) ------------------------------
def accelerate_fsdp_on_cpu():
    """Not part of the recipe: lets accelerate's FSDP2 plugin run on CPU ranks (Gloo), for the tests.
    accelerate 1.15 turns its FSDP plugin on only for accelerator devices (``AcceleratorState``
    switches to ``DistributedType.FSDP`` from ``MULTI_GPU``, ``MULTI_XPU``..., never from
    ``MULTI_CPU``; ``ParallelismConfig`` then refuses the run). This starts accelerate's
    ``PartialState`` on CPU and shows it as ``MULTI_GPU`` to the ``Accelerator(...)`` made inside the
    returned context, which then records ``FSDP`` for both states (as on GPUs); the device stays the
    CPU. On GPUs, make the ``Accelerator`` without it."""
    import contextlib

    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    @contextlib.contextmanager
    def shown_as_multi_gpu():
        state = PartialState(cpu=True)
        if state.distributed_type != DistributedType.MULTI_CPU:
            yield
            return
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        try:
            yield  # (AcceleratorState ends by copying its FSDP type to PartialState)
        except BaseException:
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_CPU
            raise
        if PartialState._shared_state["distributed_type"] != DistributedType.FSDP:
            raise RuntimeError("accelerate_fsdp_on_cpu: make Accelerator(fsdp_plugin=...) inside the context")

    return shown_as_multi_gpu()


def local_sha256(params) -> str:
    """sha256 of this rank's local tensors of ``params`` (DTensors: their local shard), in order."""
    h = hashlib.sha256()
    for p in params:
        t = p.to_local() if hasattr(p, "to_local") else p
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def sharded_result(args, framework: str, losses: list[float], params, place: int, replicas: int,
                   optimizer=None) -> dict | None:
    """The ``--out`` JSON of a sharded recipe, gathered from every rank; rank 0 writes it.
    ``place``: this rank's coordinate in the dimensions that split the model (its shard or tp
    rank): ranks of one place are replicas of each other and must hold the same bits.
    ``losses``: this rank's own loss per step (the JSON has their mean over ranks);
    ``optimizer``: the compressed one (``comm_stats()``), ``None`` for the AdamW baseline."""
    import torch.distributed as dist

    stats = optimizer.comm_stats().as_dict() if optimizer is not None else None
    mine = {"rank": dist.get_rank(), "place": place, "sha": local_sha256(params), "losses": losses, "stats": stats}
    from compressed_opt.comm import TorchBackend  # (as Meter.finish: torch's own can abort the exit)

    everyone = TorchBackend().all_gather_object(mine)
    if dist.get_rank() != 0:
        return None
    by_place: dict[int, set] = {}
    for r in everyone:
        by_place.setdefault(r["place"], set()).add(r["sha"])
    mean = [sum(v) / len(v) for v in zip(*(r["losses"] for r in everyone))]
    result = {
        "framework": framework, "optimizer": args.optimizer, "steps": len(mean), "freeze_step": args.freeze_step,
        "resumed_at": args.save_at if args.resume else 0, "world_size": len(everyone), "replicas": replicas,
        "loss": mean, "losses_finite": bool(mean) and all(math.isfinite(v) for v in mean),
        "ranks": [{k: r[k] for k in ("rank", "place", "sha")} for r in everyone],
        "replicas_identical": all(len(s) == 1 for s in by_place.values()) and len(by_place) * replicas == len(everyone),
        "comm_stats": [r["stats"] for r in everyone],
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    ratio = stats["compression_ratio"] if stats else None
    print(f"[{framework}/{args.optimizer}] steps {len(mean)}, final loss {mean[-1] if mean else float('nan'):.4f}, "
          f"replicas identical {result['replicas_identical']}, compression ratio vs fp32 {ratio}", flush=True)
    return result


# --- launching an example (tests/test_integrations.py, benchmarks/integrations.py) --------------------
EXAMPLES_DIR = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ("hf_trainer", "lightning_ddp", "accelerate_loop")
_TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
#: how users launch each example on 2 CPU ranks
LAUNCHERS = {
    "hf_trainer": _TORCHRUN,
    "accelerate_loop": _TORCHRUN,
    "lightning_ddp": [sys.executable],  # pl.Trainer(devices=2) starts the second rank itself
    # the sharded recipes, on 4 ranks: 2 replicas x 2 shards (accelerate), 2 replicas x tp 2 (Lightning)
    "accelerate_fsdp2": _TORCHRUN[:-1] + ["4"],
    "lightning_model_parallel": [sys.executable],  # pl.Trainer(devices=4) starts the other ranks itself
}
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID", "NODE_RANK", "CO_WIRE_IFACE")


def private_netns() -> list[str] | None:
    """A command prefix running a job in a network namespace of its own (loopback only, so its
    traffic is all the interface carries), or ``None`` where that cannot be made (not root, no
    ``unshare``/``ip``)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("ip")):
        return None
    prefix = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]
    try:
        probe = subprocess.run(prefix + ["true"], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return prefix if probe.returncode == 0 else None


def launch(script: str, optimizer: str, *, steps: int, freeze: int, seed: int, out: str, compat: str = "none",
           timeout: float = 240, netns: list[str] | None = None, env: dict | None = None,
           cwd: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    """Run ``examples/<script>.py`` as users launch it (:data:`LAUNCHERS`: 2 ranks, 4 for the sharded
    recipes), in its own session (a job past ``timeout`` is killed whole); ``extra``: more of its
    arguments (``--bf16``, ``--save-at``...).
    ``{"returncode", "timed_out", "output", "seconds", "result"}``; ``result`` is the ``--out``
    JSON (``None`` if it was not written)."""
    cmd = LAUNCHERS[script] + [
        os.path.join(EXAMPLES_DIR, f"{script}.py"), "--optimizer", optimizer, "--steps", str(steps),
        "--freeze-step", str(freeze), "--seed", str(seed), "--out", out, "--compat", compat, *extra,
    ]
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1")
    for var in _LAUNCHER_VARS:
        env.pop(var, None)
    if netns:
        cmd = list(netns) + cmd
        env["CO_WIRE_IFACE"] = "lo"
    if os.path.exists(out):
        os.remove(out)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd or os.path.dirname(os.path.abspath(out)), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc)
        output, _ = proc.communicate()
    result = None
    if os.path.exists(out):
        with open(out) as f:
            result = json.load(f)
    return {"returncode": proc.returncode, "timed_out": timed_out, "output": output,
            "seconds": time.perf_counter() - t0, "result": result}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun starts its workers in sessions of their own, so
    killing the launcher's process group would leave them behind)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGTERM (torchrun then stops its workers), a grace period, then SIGKILL to whatever is left
    of the job: the launcher's process group and every descendant."""
    tree = _descendants(proc.pid) if os.path.isdir("/proc") else []
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    tree += _descendants(proc.pid) if os.path.isdir("/proc") and proc.poll() is None else []
    for pid in [proc.pid, *tree]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
