"""When to freeze the variance: a fixed step, or ``"auto"`` when it has stabilised.

The auto rule watches ``S_t``, the mean of the bias-corrected second moment ``v_hat`` over all
parameters, after every warmup step. It freezes at the first step ``t >= min_step`` at which
``S`` moved by less than ``rtol`` (relative) over each of the last ``window`` steps:
``max_{t-window < k <= t} |S_k / S_{k-1} - 1| < rtol``, or at ``max_step`` at the latest.
Rank 0 decides and broadcasts the decision, so every rank freezes at the same step even if the
ranks' variances differ in the last bit. The step chosen is logged and kept in checkpoints.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field


@dataclass
class VarianceStabilityRule:
    window: int = 20
    rtol: float = 0.02
    min_step: int = 20
    max_step: int = 10_000
    _history: collections.deque = field(default_factory=collections.deque, repr=False)

    def __post_init__(self):
        if self.window < 1 or self.min_step < 1 or self.max_step < self.min_step:
            raise ValueError("VarianceStabilityRule needs window >= 1 and 1 <= min_step <= max_step")
        if not 0 < self.rtol < 1:
            raise ValueError(f"VarianceStabilityRule rtol must be in (0, 1), got {self.rtol}")

    def observe(self, step: int, mean_variance: float) -> bool:
        """Record ``S_step``; whether to freeze at the end of this step."""
        self._history.append(mean_variance)
        while len(self._history) > self.window + 1:
            self._history.popleft()
        if step >= self.max_step:
            return True
        if step < self.min_step or len(self._history) < self.window + 1:
            return False
        h = list(self._history)
        changes = [abs(b / a - 1.0) if a > 0 else math.inf for a, b in zip(h, h[1:])]
        return max(changes) < self.rtol

    def state_dict(self) -> dict:
        return {"window": self.window, "rtol": self.rtol, "min_step": self.min_step,
                "max_step": self.max_step, "history": list(self._history)}

    def load_state_dict(self, state: dict) -> None:
        self.window, self.rtol = int(state["window"]), float(state["rtol"])
        self.min_step, self.max_step = int(state["min_step"]), int(state["max_step"])
        self._history = collections.deque(float(v) for v in state["history"])


def resolve_rule(value):
    """The rule a freeze argument asks for: ``value`` itself if it is a rule, a default rule for
    ``"auto"``, ``None`` for a fixed step."""
    if isinstance(value, VarianceStabilityRule):
        return value
    if value == "auto":
        return VarianceStabilityRule()
    return None


def restore_rule(rule: VarianceStabilityRule | None, state: dict | None) -> VarianceStabilityRule | None:
    """The rule a checkpoint describes (``state`` from ``state_dict()``), reusing ``rule``."""
    if state is None:
        return rule
    rule = rule if rule is not None else VarianceStabilityRule()
    rule.load_state_dict(state)
    return rule
