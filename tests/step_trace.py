"""Trace one compression-stage step: the package functions it enters, in the order first entered.

On 2 Gloo ranks, each optimizer trains a small model (defaults, ``overlap=False``, so the whole
exchange happens inside ``step()``) past its freeze; the next step (backward and ``step()``) runs
under ``sys.setprofile``. Every call of a function defined in the installed package
(``compressed_opt``, ``compressed_opt.comm``, ``compressed_opt.cuda``) is recorded as
``module:qualname``. tests/test_structure.py compares rank 0's list with the one documented in
docs/design.md ("The path of a compression step").

    python -P tests/step_trace.py OnebitAdam     # prints the list as docs/design.md writes it, and its size
    python -P tests/step_trace.py --write-doc    # writes the three lists into docs/design.md
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: each optimizer's arguments: a freeze early enough that step 5 compresses
FREEZES = {"OnebitAdam": dict(freeze_step=3), "OnebitLamb": dict(freeze_step=3),
           "ZeroOneAdam": dict(var_freeze_step=3)}


def _module(path: str, roots: dict[str, str]) -> str | None:
    for package, root in roots.items():
        if path.startswith(root + os.sep):
            rest = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            return package if rest == "__init__" else f"{package}.{rest}"
    return None


def trace_step(rank: int, world: int, name: str) -> list[str]:
    """The package functions one compression step enters on this rank (first entry order)."""
    import torch
    from torch import nn

    import compressed_opt
    import compressed_opt.comm
    import compressed_opt.cuda

    roots = {p.__name__: os.path.dirname(os.path.abspath(p.__file__))
             for p in (compressed_opt.comm, compressed_opt.cuda, compressed_opt)}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, overlap=False, **FREEZES[name])
    g = torch.Generator().manual_seed(rank)

    def step():
        opt.zero_grad()
        (model(torch.randn(8, 16, generator=g)) - torch.randn(8, 4, generator=g)).square().mean().backward()
        opt.step()

    for _ in range(5):
        step()
    assert opt.compressing
    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call":
            module = _module(frame.f_code.co_filename, roots)
            qualname = frame.f_code.co_qualname
            if module is not None and "<locals>.<" not in qualname:  # (a comprehension is its function's)
                seen.setdefault(f"{module}:{qualname}")

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    opt.close()
    return list(seen)


def by_module(functions: list[str]) -> dict[str, list[str]]:
    """``module -> [qualname, ...]`` in first-entry order: the form docs/design.md lists them in."""
    out: dict[str, list[str]] = {}
    for f in functions:
        module, qualname = f.split(":")
        out.setdefault(module, []).append(qualname)
    return out


def traced(name: str) -> list[str]:
    from distributed import spawn_ranks

    outcomes = spawn_ranks(trace_step, 2, name, timeout=120)
    for status, value in outcomes:
        assert status == "ok", value
    return outcomes[0][1]


def _block(functions: list[str]) -> str:
    return "\n".join(f"{module}: {', '.join(names)}" for module, names in by_module(functions).items())


def write_doc(path: str) -> None:
    """Replace each optimizer's list (and its count) in ``path`` with the one traced now."""
    import re

    with open(path) as f:
        text = f.read()
    for name in FREEZES:
        functions = traced(name)
        count = f"enters {len(functions)} functions in {len(by_module(functions))} modules"
        text = re.sub(rf"(<!-- step path: {name} -->\n```text\n).*?(\n```)",
                      lambda m: m.group(1) + _block(functions) + m.group(2), text, flags=re.S)
        text = re.sub(rf"(One compression step of `{name}` )enters \d+ functions in \d+ modules",
                      lambda m: m.group(1) + count, text)
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-doc"]:
        write_doc(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "design.md"))
        sys.exit(0)
    functions = traced(sys.argv[1] if len(sys.argv) > 1 else "OnebitAdam")
    print(_block(functions))
    print(f"{len(functions)} functions in {len(by_module(functions))} modules")
