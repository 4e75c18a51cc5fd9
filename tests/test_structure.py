"""The installed package stays easy to read, checked from its source and its objects:

* each optimizer is one class over :class:`~compressed_opt.optimizer.CompressedOptimizer` (at
  most 2 classes of the package in its MRO), and no class of the package mixes in two of ours;
* its public surface is AdamW's plus the few names docs/design.md lists (at most 12);
* the path of one compression step is the one docs/design.md documents (traced, tests/step_trace.py);
* a step's ``STEP`` buffers are dropped when it ends;
* no module reaches into an optimizer's private names, and none branches on the exchange
  variant's name;
* a module over :data:`MAX_LINES` lines is one of the few listed in :data:`LONG_MODULES`, with the
  reason it stays whole: a smell detector, not a reason to cut a class into pieces.

    python -P tests/test_structure.py      # prints every module's line count
"""
from __future__ import annotations

import ast
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402
import torch  # noqa: E402
from test_layering import ROOT, modules  # noqa: E402

import compressed_opt  # noqa: E402
from compressed_opt import state  # noqa: E402

OPTIMIZERS = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")
DESIGN = os.path.join(ROOT, "docs", "design.md")

MAX_LINES = 500
#: the modules over MAX_LINES lines, and why each stays one module (one idea, one object)
LONG_MODULES = {
    "compressed_opt.engine": "the gradient-sync engine: one object and its life cycle (hooks, launch, agreement)",
    "compressed_opt.checkpoint": "the state dict's schema and its checks, save and load in one place",
    "compressed_opt.zero_one_adam": "0/1 Adam's schedule, exchanges, algorithm and optimizer: one paper",
    "compressed_opt.adam": "1-bit Adam's formulas, state, exchanges and algorithm: one paper's transforms",
    "compressed_opt.onebit_lamb": "1-bit LAMB's trust ratios, algorithm and optimizer: one paper",
    "compressed_opt.optimizer": "the one base class: torch.optim's contract over the engine",
    "compressed_opt.zero": "ZeRO's shards for 1-bit Adam: layout, momentum and updates of one shard",
    "compressed_opt.cuda.cpu": "the C implementation of the passes: one ctypes library and its checks",
    "compressed_opt.diloco": "DiLoCo: one optimizer, its warmup, rounds, exchange and each rank's checkpoint record",
}
#: the names an optimizer goes by in the package's modules
OPTIMIZER_NAMES = {"opt", "optimizer", "owner"}


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def test_long_modules_are_the_listed_ones():
    """A new long module is looked at (listed with a reason, or split where it holds two ideas);
    a listed one that shrank leaves the list."""
    long = {m: n for m, p in modules().items() if (n := _lines(p)) > MAX_LINES}
    assert set(long) == set(LONG_MODULES), f"modules over {MAX_LINES} lines: {long}"


def _defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: its functions, classes, methods and the attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _is_optimizer(node: ast.AST) -> bool:
    """``opt``, ``optimizer``, ``owner``, or an attribute of ``self`` by one of those names
    (``self._opt``), or a call of one (``self._ref()``)."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Name):
        return node.id in OPTIMIZER_NAMES
    return isinstance(node, ast.Attribute) and node.attr.strip("_") in OPTIMIZER_NAMES | {"ref"}


def reach_ins() -> list[str]:
    found = []
    for module, path in modules().items():
        with open(path) as f:
            tree = ast.parse(f.read())
        own = _defined_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and _is_optimizer(node.value) and node.attr not in own):
                found.append(f"{module}:{node.lineno}: .{node.attr}")
    return found


def test_no_module_reaches_into_an_optimizers_private_names():
    found = reach_ins()
    assert not found, "private names of an optimizer used from another module:\n" + "\n".join(found)


#: the exchange variants' names: compared with ``==`` / ``!=`` / ``in`` nowhere in the package
VARIANT_NAMES = {"preconditioned", "momentum"}


def _variant_branches(tree: ast.AST) -> list[int]:
    """Lines that compare something with an exchange variant's name."""
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and any(isinstance(x, ast.Constant) and x.value in VARIANT_NAMES
                    for x in [node.left, *node.comparators])]


def branches_on_the_exchange() -> list[str]:
    found = []
    for module, path in modules().items():
        with open(path) as f:
            tree = ast.parse(f.read())
        found += [f"{module}:{line}" for line in _variant_branches(tree)]
    return found


def test_no_module_branches_on_the_exchange_variants_name():
    found = branches_on_the_exchange()
    assert not found, "comparisons with an exchange variant's name (call the variant instead):\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path):
    """The reach-in check flags ``opt._x`` from a module that does not define ``_x`` and lets a
    module's own names pass. (No stack-frame reading: tests/test_layering.py.)"""
    code = "def f(opt, self):\n    opt._hidden()\n    self._opt._inner = 1\n    opt.public()\n"
    tree = ast.parse(code)
    own = _defined_names(tree)
    hits = [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")
            and _is_optimizer(n.value) and n.attr not in own]
    assert hits == ["_hidden"]  # (_inner is assigned here: a name of this module)
    branching = ast.parse("if self.exchange_mode == 'preconditioned':\n    pass\nx = 'momentum' in modes\n"
                          "name = 'momentum'\n")
    assert _variant_branches(branching) == [1, 3]  # (an assignment is not a branch)


def _package_classes(cls) -> list[type]:
    return [k for k in cls.__mro__ if k.__module__.split(".")[0] == "compressed_opt"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_an_optimizer_is_one_class_over_the_base(name):
    cls = getattr(compressed_opt, name)
    assert [k.__name__ for k in _package_classes(cls)] == [name, "CompressedOptimizer"]
    assert issubclass(cls, torch.optim.Optimizer)


def test_no_class_mixes_in_two_of_ours():
    """No class of the package has two bases of the package: parts are composed (held as
    attributes), not mixed in."""
    import importlib

    mixed = []
    for module in modules():
        for obj in vars(importlib.import_module(module)).values():
            if isinstance(obj, type) and obj.__module__ == module:
                ours = [b for b in obj.__bases__ if b.__module__.split(".")[0] == "compressed_opt"]
                if len(ours) > 1:
                    mixed.append(f"{module}.{obj.__qualname__}({', '.join(b.__name__ for b in ours)})")
    assert mixed == []


def _documented_surface() -> dict[str, set[str]]:
    """docs/design.md's list of the names beyond AdamW's: the lines ``<!-- surface: Name -->``
    followed by a line of backquoted names."""
    with open(DESIGN) as f:
        lines = f.read().splitlines()
    out = {}
    for i, line in enumerate(lines):
        if line.startswith("<!-- surface: "):
            out[line.split()[2]] = set(re.findall(r"``?([A-Za-z_]+)`", lines[i + 1]))
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_public_surface_is_adamws_and_the_documented_few(name):
    model = torch.nn.Linear(3, 2)
    adamw = torch.optim.AdamW(model.parameters())
    opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-3)
    try:
        beyond = {n for n in dir(opt) if not n.startswith("_")} - set(dir(adamw))
    finally:
        opt.close()
    assert beyond == _documented_surface()[name]
    assert len(beyond) <= 12


def _documented_path(name: str) -> list[str]:
    """docs/design.md's path of one compression step of ``name``: the fenced block after
    ``<!-- step path: name -->``, one ``module: qualname, qualname`` line per module."""
    with open(DESIGN) as f:
        text = f.read()
    block = text.split(f"<!-- step path: {name} -->", 1)[1].split("```", 2)[1]
    out = []
    for line in block.splitlines()[1:]:
        if line.strip():
            module, names = line.split(": ", 1)
            out += [f"{module}:{q.strip()}" for q in names.split(",")]
    return out


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_path_of_a_compression_step_is_the_documented_one(name):
    """The package functions one compression step enters (2 Gloo ranks, defaults, ``overlap=False``)
    are those docs/design.md lists: the document cannot drift from the code."""
    from step_trace import traced

    documented, found = _documented_path(name), traced(name)
    assert sorted(found) == sorted(documented), (
        f"not documented: {sorted(set(found) - set(documented))}; documented, not run: "
        f"{sorted(set(documented) - set(found))} (python -P tests/step_trace.py {name} prints the list)")


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_steps_buffers_are_dropped_when_it_ends(name):
    """After a compression step (and a full-precision one), every ``STEP`` field of every bucket's
    parts is ``None``: no gradient or result rows stay referenced between steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    freeze = dict(var_freeze_step=2) if name == "ZeroOneAdam" else dict(freeze_step=2)
    opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-3, **freeze)
    try:
        for step in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            opt.step()
            kept = {(type(p).__name__, n) for b in opt.engine.buckets for part in (b.sync, b.feedback, b.state)
                    for p in state.parts(part) for n in state.names(p, state.STEP) if getattr(p, n) is not None}
            assert kept == set(), f"step {step + 1}: {kept}"
        assert opt.compressing
        assert any(state.names(p, state.STEP) for b in opt.engine.buckets for part in (b.sync, b.state)
                   for p in state.parts(part))  # (the check sees STEP fields: there are some)
    finally:
        opt.close()


if __name__ == "__main__":
    for name, path in sorted(modules().items(), key=lambda kv: -_lines(kv[1])):
        print(f"{_lines(path):5d}  {name}")
    for line in reach_ins():
        print("reach-in:", line)
