"""Up-front checks of optimizer arguments: each error names the argument and what to change.

The hyperparameters shared with ``torch.optim.AdamW`` (``lr``, ``betas``, ``eps``,
``weight_decay``) are checked as AdamW checks them, with its exception types and messages for
every value AdamW rejects (``ValueError: Invalid learning rate: -1``, ``Tensor lr must be
1-element``, ``betas must be either both floats or both Tensors``, ...), so code that handles
AdamW's errors handles ours. Where AdamW's error is an accident of its implementation (a
``TypeError`` from comparing a string with 0.0, an ``IndexError`` for a 1-tuple of betas, the
ambiguous truth value of a many-element tensor) ours says what is wrong instead. Beyond AdamW,
non-finite values (``inf``) and booleans are rejected. Tensor betas (1-element, both) are
accepted and kept as floats.
"""
from __future__ import annotations

import math
import numbers

import torch

from compressed_opt import cuda as kernels


def check_nonneg_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:  # a 0-dim tensor lr
            value = value.item()
        else:
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0.0:
        raise ValueError(f"Invalid {name}: {value} (must be a finite number >= 0)")
    return value


def _real(name: str, value) -> float:
    """``value`` as a float: a real number (not a bool) or a 1-element tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Tensor {name} must be 1-element")
        if value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{name} must be a real number, got a {value.dtype} tensor")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _check_adamw_scalar(name: str, value, invalid: str) -> float:
    """AdamW's ``0.0 <= value`` check and message (``invalid``: its wording, e.g. "Invalid
    learning rate"), plus finiteness."""
    x = _real(name, value)
    if not x >= 0.0:  # also NaN, as AdamW
        raise ValueError(f"{invalid}: {value}")
    if math.isinf(x):
        raise ValueError(f"{invalid}: {value} (must be finite)")
    return x


def check_betas(betas) -> tuple[float, float]:
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    values = []
    for i, b in enumerate((b1, b2)):
        x = _real(f"betas[{i}]", b)
        if not 0.0 <= x < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b}")
        values.append(x)
    if not (isinstance(b1, float) and isinstance(b2, float)) and not (
        isinstance(b1, torch.Tensor) and isinstance(b2, torch.Tensor)
    ):
        raise ValueError("betas must be either both floats or both Tensors")  # AdamW's rule
    return values[0], values[1]


def check_choice(name: str, value, choices: tuple) -> None:
    """``value`` must be one of ``choices`` (compared with ``==``)."""
    if value not in choices:
        raise ValueError(f"Invalid {name}: {value!r} (must be one of {', '.join(map(repr, choices))})")


def check_scale_block(value) -> int:
    """``scale_block``: elements per 1-bit scale, a positive multiple of 256 (the kernels' tile)."""
    return kernels.check_block(value, "scale_block")


def check_step_count(name: str, value, allow_auto: bool = False, minimum: int = 0):
    if allow_auto and value == "auto":
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        extra = " or 'auto'" if allow_auto else ""
        raise TypeError(f"{name} must be an int{extra}, got {value!r}")
    if value < minimum:
        raise ValueError(f"Invalid {name}: {value} (must be >= {minimum})")
    return int(value)


def check_adam_group(group: dict) -> None:
    """AdamW's hyperparameters of a param group, in AdamW's order (lr, eps, betas, weight decay)
    and with its messages. ``betas``, ``eps`` and ``weight_decay`` are normalised to floats;
    ``lr`` keeps its type: a tensor lr stays the tensor the caller gave, so updating it in place
    (as LR schedulers do with a tensor lr) takes effect; the steps read it as a float."""
    _check_adamw_scalar("lr", group["lr"], "Invalid learning rate")
    group["eps"] = _check_adamw_scalar("eps", group["eps"], "Invalid epsilon value")
    group["betas"] = check_betas(group["betas"])
    group["weight_decay"] = _check_adamw_scalar("weight_decay", group["weight_decay"], "Invalid weight_decay value")


#: torch.optim.AdamW's group keys for how it runs, which mean nothing here (ignored, with a warning
#: where set to ask for something): these optimizers run their own passes
IGNORED_GROUP_KEYS = ("foreach", "fused", "capturable", "differentiable")
#: AdamW's group keys that change the algorithm, which these optimizers do not implement (refused when set)
REFUSED_GROUP_KEYS = ("amsgrad", "maximize")


def check_group_keys(name: str, group: dict) -> list[str]:
    """Refuse a param group that sets one of :data:`REFUSED_GROUP_KEYS`; return the
    :data:`IGNORED_GROUP_KEYS` it sets to something (truthy), for the caller to warn about once."""
    for key in REFUSED_GROUP_KEYS:
        if group.get(key):
            raise ValueError(f"{name} does not implement AdamW's {key}=True (a param group sets it): "
                             f"the step would silently differ from what was asked; remove the key")
    return [key for key in IGNORED_GROUP_KEYS if group.get(key)]

