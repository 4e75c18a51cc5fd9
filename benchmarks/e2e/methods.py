"""The methods compared: their names and options, and what each builds (the module to call, the
optimizer, its stage, its byte count) on the ranks of an initialised process group."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .instrument import RECORDER, OurTiming, install_counting_dist, timed_hook
from .plain_diloco import PlainDiLoCo

#: every AdamW baseline is torch's fused AdamW where torch has it for the device (what users and the
#: frameworks pick: transformers' Trainer defaults to it), else its default; the result says which
METHODS = {
    "ddp_adamw": "DDP + AdamW (fp32 allreduce hook)",
    "ddp_fp16": "DDP + AdamW + fp16 compression hook",
    "ddp_bf16": "DDP + AdamW + bf16 compression hook (NCCL)",
    "ddp_powersgd": "DDP + AdamW + PowerSGD hook",
    "onebit_adam": "1-bit Adam",
    "onebit_lamb": "1-bit LAMB",
    "zero_one_adam": "0/1 Adam",
    "local_adamw": "AdamW, no communication (each rank alone: the compute floor, not data parallel)",
    "diloco_fp32": "DiLoCo around fused AdamW, fp32 pseudo-gradients every --sync-every steps",
    "diloco_4bit": "DiLoCo around fused AdamW, 4-bit pseudo-gradients with error feedback every --sync-every steps",
    "diloco_1bit": ("DiLoCo around fused AdamW, 1-bit pseudo-gradients (rotated, no error feedback: the default) every "
                    "--sync-every steps"),
    "diloco_reference": "DiLoCo written plainly (fp32 all_reduce, Nesterov SGD; benchmarks/e2e/plain_diloco.py)",
}
OURS = ("onebit_adam", "onebit_lamb", "zero_one_adam")
DEFAULT_METHODS = ("ddp_adamw", "ddp_fp16", "ddp_powersgd", "ddp_powersgd+serial", "onebit_adam", "onebit_lamb",
                   "zero_one_adam")
BASELINE = "ddp_adamw"
# ours: flat / node pick the hierarchy; measure: path="measure" (the library's default; else "1bit")
MODIFIERS = ("ddp", "overlap", "nooverlap", "serial", "flat", "node", "measure")


def adamw(params, hp: dict) -> tuple[torch.optim.Optimizer, bool]:
    """``torch.optim.AdamW`` with ``fused=True`` where torch supports it for these parameters,
    else its default implementation; and whether it is the fused one."""
    params = list(params)
    try:
        return torch.optim.AdamW(params, **hp, fused=True), True
    except (RuntimeError, ValueError, TypeError):  # (no fused kernel for this device or dtype)
        return torch.optim.AdamW(params, **hp), False


def parse_spec(spec: str, overlap: bool, ddp_hook: bool) -> dict:
    """``spec`` (``name[+option...]``) as a dict; ``ValueError`` names what is wrong."""
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
    if "flat" in mods and "node" in mods:
        raise ValueError(f"+flat and +node in {spec!r}: choose one")
    hierarchy = "flat" if "flat" in mods else "node" if "node" in mods else "auto"
    return {"spec": spec, "name": name, "overlap": overlap, "ddp_hook": ddp_hook or "ddp" in mods,
            "serial": "serial" in mods, "hierarchy": hierarchy, "path": "measure" if "measure" in mods else "1bit"}


def lr_at(step: int, cfg: dict) -> float:
    """Linear warmup over ``lr_warmup`` steps, then cosine decay to 10% at the last step."""
    base, warm, total = cfg["lr"], cfg["lr_warmup"], cfg["steps"]
    if step <= warm:
        return base * step / max(1, warm)
    frac = (step - warm) / max(1, total - warm)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def one_bucket_at_a_time(hook):
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


def build(method: dict, model: nn.Module, cfg: dict, device: torch.device, timing: OurTiming | None = None):
    """``(module to call, optimizer, stage(), bytes_sent(), extra)`` for ``method``. With
    ``timing`` (ours, ``--breakdown``) the optimizer's backend and steps are timed by it."""
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

        install_counting_dist()
        module = DDP(model, **ddp_kwargs)
        stage = lambda: "full"  # noqa: E731
        if name == "ddp_adamw":
            module.register_comm_hook(None, timed_hook(default_hooks.allreduce_hook))
        elif name == "ddp_fp16":
            module.register_comm_hook(None, timed_hook(default_hooks.fp16_compress_hook))
        elif name == "ddp_bf16":
            if dist.get_backend() != "nccl":
                raise RuntimeError("ddp_bf16 needs NCCL (bf16 allreduce is not supported by Gloo); use ddp_fp16")
            module.register_comm_hook(None, timed_hook(default_hooks.bf16_compress_hook))
        else:
            start = max(2, cfg["freeze_step"])
            state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=cfg["powersgd_rank"], start_powerSGD_iter=start,
                min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=cfg["seed"])
            hook = powerSGD_hook.powerSGD_hook
            if method["serial"]:
                hook = one_bucket_at_a_time(hook)
            module.register_comm_hook(state, timed_hook(hook))
            stage = lambda: "compression" if state.iter >= state.start_powerSGD_iter else "warmup"  # noqa: E731
        opt, fused = adamw(model.parameters(), hp)
        return module, opt, stage, lambda: RECORDER.bytes, {"ddp": True, "adamw_fused": fused}
    if name == "local_adamw":  # the floor of any method's step: the same work with nothing exchanged
        opt, fused = adamw(model.parameters(), hp)
        return model, opt, lambda: "full", lambda: 0, {"ddp": False, "adamw_fused": fused}
    if name == "diloco_reference":  # the plain reference, beside ours
        inner, fused = adamw(model.parameters(), hp)
        opt = PlainDiLoCo(model.parameters(), inner, cfg["sync_every"], cfg["outer_lr"], cfg["outer_momentum"])
        return model, opt, lambda: "full", lambda: opt.bytes_sent, {"ddp": False, "adamw_fused": fused}
    if name.startswith("diloco_"):  # rounds of sync_every inner steps; the loop's lr schedule drives the inner AdamW
        backend = compressed_opt.get_backend("torch")
        inner, fused = adamw(model.parameters(), hp)
        opt = compressed_opt.DiLoCo(model.parameters(), inner, sync_every=cfg["sync_every"],
                                    compression=name.split("_")[1], backend=backend, fragments=cfg["fragments"],
                                    delay=cfg["delay"], outer_lr=cfg["outer_lr"], outer_momentum=cfg["outer_momentum"],
                                    error_feedback=cfg.get("error_feedback"), warmup_steps=cfg.get("diloco_warmup", 0))
        # (opt.backend: with a delay, DiLoCo's duplicate of the backend given, a communicator of its own)
        stage = lambda: "warmup" if opt.inner_step < opt.warmup_steps else "full"  # noqa: E731 (before the step)
        return model, opt, stage, lambda: opt.backend.stats.total_bytes, {"ddp": False, "adamw_fused": fused}
    backend = compressed_opt.get_backend("torch")
    if timing is not None:
        backend = timing.wrap(backend)  # counts bytes in the wrapped backend's stats
    # path: the 1-bit exchange unless +measure (the default, which may take fp32 where it is faster)
    kwargs = dict(hp, backend=backend, bucket_cap_mb=cfg["bucket_mb"], overlap=method["overlap"],
                  hierarchy=method["hierarchy"], path=method["path"])
    if name == "onebit_adam":
        opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=cfg["freeze_step"], **kwargs)
    elif name == "onebit_lamb":
        kwargs["lr"] = cfg["lamb_lr"]  # LAMB scales each layer's step by ||p|| / ||update||
        opt = compressed_opt.OnebitLamb(model.parameters(), freeze_step=cfg["freeze_step"], **kwargs)
    else:
        opt = compressed_opt.ZeroOneAdam(model.parameters(), var_freeze_step=cfg["freeze_step"], **kwargs)
    module = model
    if method["ddp_hook"]:
        module = DDP(model, **ddp_kwargs)
        compressed_opt.register_ddp_comm_hook(module, opt)
    if timing is not None:
        timing.attach(opt)
    stage = lambda: "compression" if opt.compressing else "warmup"  # noqa: E731
    return module, opt, stage, lambda: backend.stats.total_bytes, {"ddp": method["ddp_hook"]}

