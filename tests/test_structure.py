"""The installed package stays easy to read, checked from its source:

* no module over :data:`MAX_LINES` lines;
* no module reaches into an optimizer's private names (``opt._x``, ``optimizer._x``,
  ``self._opt._x``): the layouts, the DDP hook, checkpoints and consolidation use the optimizer's
  public protocol; a module may call a private name only where that module defines it (the
  launcher callbacks of ``stepping.py`` call the step's own private methods);
* no module branches on the exchange variant's name: the choice is an object, made once
  (:mod:`compressed_opt.exchange_variant`), and the algorithms call it where the variants differ.

    python -P tests/test_structure.py      # prints every module's line count
"""
from __future__ import annotations

import ast
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_layering import modules  # noqa: E402

MAX_LINES = 500
#: the names an optimizer goes by in the package's modules
OPTIMIZER_NAMES = {"opt", "optimizer", "owner"}


def _lines(path: str) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def test_no_module_is_longer_than_500_lines():
    long = {m: n for m, p in modules().items() if (n := _lines(p)) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


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


if __name__ == "__main__":
    for name, path in sorted(modules().items(), key=lambda kv: -_lines(kv[1])):
        print(f"{_lines(path):5d}  {name}")
    for line in reach_ins():
        print("reach-in:", line)
