"""Up-front checks of optimizer arguments: each error names the argument and what to change."""
from __future__ import annotations

import math
import numbers


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


def check_betas(betas) -> tuple[float, float]:
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}") from None
    for i, b in enumerate((b1, b2)):
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not 0.0 <= float(b) < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b!r} (betas must be in [0, 1))")
    return float(b1), float(b2)


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
    """AdamW's hyperparameters of a param group (``betas`` normalised to a float pair)."""
    check_nonneg_float("lr", group["lr"])
    check_nonneg_float("eps", group["eps"])
    check_nonneg_float("weight_decay", group["weight_decay"])
    group["betas"] = check_betas(group["betas"])
