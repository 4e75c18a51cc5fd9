"""The installed package's layers, read from the source: ``compressed_opt -> comm -> cuda``, arrows
only pointing down, no import cycle (function-level imports included), nothing imported from
``benchmarks/`` or ``tests/``.

    python -P tests/test_layering.py      # prints the import graph and any cycle
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the installed packages and the folders they come from (pyproject.toml's package-dir)
PACKAGES = {"compressed_opt": "compressed_opt", "compressed_opt.comm": "comm", "compressed_opt.cuda": "cuda"}
#: what each layer may import of ours: only layers below it
LAYER = {"compressed_opt": 2, "compressed_opt.comm": 1, "compressed_opt.cuda": 0}


def modules() -> dict[str, str]:
    """Module name -> source path, for every module of the installed package."""
    out = {}
    for package, folder in PACKAGES.items():
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                out[package if name == "__init__.py" else f"{package}.{name[:-3]}"] = os.path.join(ROOT, folder, name)
    return out


def _targets(module: str, path: str, node, known) -> list[str]:
    """The modules of ours an import statement needs (``from pkg import submodule`` needs the
    submodule; a package is initialised before its submodules anyway, so no edge to it from inside)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        parts = base.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
    inside = module.startswith(target + ".")
    return subs + ([] if inside or len(subs) == len(node.names) else [target])


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between our modules, every other top-level module each imports), from every import
    statement in the source, at any depth (function-level imports too)."""
    known = modules()
    graph, foreign = {}, {}
    for module, path in known.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        graph[module], foreign[module] = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, path, node, known):
                    if target in known:
                        if target != module:
                            graph[module].add(target)
                    else:
                        foreign[module].add(target.split(".")[0])
    return graph, foreign


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(u, stack):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v, stack)
        stack.pop()
        state[u] = "done"

    for u in sorted(graph):
        if u not in state:
            visit(u, [])
    return found


def _package(module: str) -> str:
    return max((p for p in PACKAGES if module == p or module.startswith(p + ".")), key=len)


def test_no_import_cycle():
    graph, _ = import_graph()
    assert cycles(graph) == []


def test_arrows_only_point_down():
    graph, _ = import_graph()
    upward = [(m, t) for m, targets in graph.items() for t in targets
              if _package(m) != _package(t) and LAYER[_package(t)] >= LAYER[_package(m)]]
    assert upward == []


def test_nothing_imported_from_benchmarks_or_tests():
    _, foreign = import_graph()
    assert {m: sorted(f & {"benchmarks", "tests", "conftest", "examples"}) for m, f in foreign.items()
            if f & {"benchmarks", "tests", "conftest", "examples"}} == {}


def test_no_file_loaded_by_path():
    for module, path in modules().items():
        with open(path) as f:
            source = f.read()
        assert "spec_from_file_location" not in source, module


if __name__ == "__main__":
    graph, _ = import_graph()
    for module in sorted(graph):
        print(f"{module} -> {', '.join(sorted(graph[module])) or '-'}")
    found = cycles(graph)
    print("cycles:", *(" -> ".join(c) for c in found) if found else ["none"], sep="\n  ")
    sys.exit(1 if found else 0)
