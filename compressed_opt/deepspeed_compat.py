"""Build an optimizer from a DeepSpeed JSON ``"optimizer"`` section (migration from DeepSpeed).

DeepSpeed's ``OneBitAdam``, ``OneBitLamb`` and ``ZeroOneAdam`` sections map onto
:class:`OnebitAdam`, :class:`OnebitLamb` and :class:`ZeroOneAdam` with the same parameter names.
``comm_backend_name`` picks the backend (``"nccl"``/``"gloo"``: ``torch.distributed``; ``"mpi"``:
mpi4py, with ``cuda_aware``). What differs from DeepSpeed is documented in the README's migration
section: bias correction is on by default (``bias_correction=False`` in the section, or
``deepspeed_numerics=True``, restores DeepSpeed's update) and no step is spent on initialisation.
A section without ``weight_decay`` gets DeepSpeed's default, 0 (the classes' own default is
AdamW's, 1e-2).
"""
from __future__ import annotations

from typing import Any

from compressed_opt.comm import get_backend

_COMMON = {"lr", "betas", "eps", "weight_decay", "bias_correction", "cuda_aware", "comm_backend_name"}
_KEYS = {
    "onebitadam": _COMMON | {"freeze_step"},
    "onebitlamb": _COMMON | {"freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                             "factor_threshold"},
    "zerooneadam": _COMMON | {"var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper"},
}


def _optimizer_class(kind: str):
    from .onebit_adam import OnebitAdam
    from .onebit_lamb import OnebitLamb
    from .zero_one_adam import ZeroOneAdam

    return {"onebitadam": OnebitAdam, "onebitlamb": OnebitLamb, "zerooneadam": ZeroOneAdam}[kind]


_OPTIONS = {"zero_stage", "master_resync_interval", "overlap", "bucket_cap_mb", "accumulation_steps", "hierarchy",
            "path"}


def from_deepspeed_config(params, optimizer_section: dict[str, Any], *, backend=None, deepspeed_numerics: bool = False,
                          **options):
    """The optimizer a DeepSpeed ``"optimizer"`` section describes, over ``params``.

    ``optimizer_section`` is the dict under ``"optimizer"`` (``{"type": ..., "params": {...}}``);
    the whole DeepSpeed config is accepted too, and then its ``"zero_optimization"`` stage 1 or 2
    becomes ``zero_stage`` (DeepSpeed refused ZeRO with these optimizers; OnebitAdam and
    OnebitLamb shard by it, ZeroOneAdam says why it does not; stage 3 is refused). ``backend``
    overrides ``comm_backend_name``. ``deepspeed_numerics=True`` turns bias correction off, as
    DeepSpeed's optimizers had it. ``options``: this library's own arguments (``zero_stage``,
    ``master_resync_interval``, ``overlap``, ``bucket_cap_mb``, ``accumulation_steps``,
    ``hierarchy``, ``path``), over the config. Unknown parameters raise ``ValueError`` naming
    them (a typo must not fall back silently).
    """
    if not isinstance(optimizer_section, dict):
        raise TypeError(f"optimizer_section must be a dict, got {type(optimizer_section).__name__}")
    section = optimizer_section.get("optimizer", optimizer_section)
    kind = str(section.get("type", "")).replace("_", "").lower()
    if kind not in _KEYS:
        raise ValueError(
            f"optimizer type {section.get('type')!r} is not one of DeepSpeed's compressed optimizers "
            "(OneBitAdam, OneBitLamb, ZeroOneAdam)"
        )
    args = dict(section.get("params", {}))
    unknown = sorted(set(args) - _KEYS[kind])
    if unknown:
        raise ValueError(f"unknown {section['type']} parameter(s) {unknown}; supported: {sorted(_KEYS[kind])}")
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown}; this library's options: {sorted(_OPTIONS)}")
    if "optimizer" in optimizer_section and "zero_stage" not in options:
        stage = (optimizer_section.get("zero_optimization") or {}).get("stage", 0)
        if stage not in (0, 1, 2):
            raise ValueError(
                f"zero_optimization stage {stage!r}: the optimizer state can be sharded with stage 1 or 2 "
                "(zero_stage); stage 3 (sharded parameters) is not supported"
            )
        if stage:
            options["zero_stage"] = stage
    backend_name = str(args.pop("comm_backend_name", "auto")).lower()
    cuda_aware = args.pop("cuda_aware", None)
    if backend is None:
        if backend_name == "mpi":
            backend = get_backend("mpi", cuda_aware=cuda_aware)
        elif backend_name in ("nccl", "gloo", "torch"):
            backend = get_backend("torch")
        elif backend_name in ("auto", "compressed"):
            backend = get_backend("auto")
        else:
            raise ValueError(f"comm_backend_name must be 'nccl', 'gloo' or 'mpi', got {backend_name!r}")
    if "betas" in args:
        # JSON writes 0.0 as 0; the optimizers take float betas (as AdamW)
        args["betas"] = tuple(float(b) if isinstance(b, int) and not isinstance(b, bool) else b for b in args["betas"])
    # DeepSpeed's default weight decay was 0; ours is AdamW's 1e-2: a section without one keeps DeepSpeed's
    args.setdefault("weight_decay", 0.0)
    if deepspeed_numerics:
        args["bias_correction"] = False
    return _optimizer_class(kind)(params, backend=backend, **args, **options)
