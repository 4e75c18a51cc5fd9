"""The installed package's layers, read from the source: ``compressed_opt -> comm -> cuda``, arrows
only pointing down, no import cycle (function-level imports included), nothing imported from
``benchmarks/`` or ``tests/``; and no reading of stack frames (a caller recognised by its frames
stops being recognised, silently, when a framework renames an internal: integrate through public
hooks instead, compressed_opt.integrations).

    python -P tests/test_layering.py      # prints the import graph and any cycle
"""
from __future__ import annotations

import ast
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the installed packages and the folders they come from (pyproject.toml's package-dir)
PACKAGES = {"compressed_opt": "compressed_opt", "compressed_opt.comm": "comm", "compressed_opt.cuda": "cuda"}
#: what each layer may import of ours: only layers below it
LAYER = {"compressed_opt": 2, "compressed_opt.comm": 1, "compressed_opt.cuda": 0}
#: subpackages inside a package's folder (part of that package's layer)
SUBPACKAGES = {"compressed_opt.integrations": "compressed_opt/integrations"}


def modules() -> dict[str, str]:
    """Module name -> source path, for every module of the installed package."""
    out = {}
    for package, folder in {**PACKAGES, **SUBPACKAGES}.items():
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                out[package if name == "__init__.py" else f"{package}.{name[:-3]}"] = os.path.join(ROOT, folder, name)
    return out


def _targets(module: str, path: str, node, known) -> list[str]:
    """The modules of ours an import statement needs: ``from pkg import submodule`` needs the
    submodule; ``from pkg import name`` (a name the package's ``__init__`` defines or re-exports)
    needs the package itself, from a module inside it too: a submodule that takes a name from its
    own package's ``__init__``, which imports that submodule back, is a cycle."""
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
    return subs + ([] if len(subs) == len(node.names) else [target])


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


def test_a_name_from_the_own_package_is_an_edge():
    """``from . import Name`` inside a package counts as an import of the package's ``__init__``
    (the cycle the kernels once had: cuda/x.py took a name from cuda/__init__.py, which imported
    x.py), and ``from . import submodule`` as an import of the submodule only."""
    known = {"pkg": "pkg/__init__.py", "pkg.a": "pkg/a.py", "pkg.b": "pkg/b.py"}
    name, sub = ast.parse("from . import Thing").body[0], ast.parse("from . import b").body[0]
    assert _targets("pkg.a", "pkg/a.py", name, known) == ["pkg"]
    assert _targets("pkg.a", "pkg/a.py", sub, known) == ["pkg.b"]
    assert cycles({"pkg": {"pkg.a"}, "pkg.a": {"pkg"}}) == [["pkg", "pkg.a", "pkg"]]


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


#: what reaches a stack frame: sys._getframe, sys._current_frames, inspect.currentframe / stack /
#: trace / getouterframes / getinnerframes, a frame's or traceback's attributes (f_back, f_locals,
#: f_globals, f_code, tb_frame). Matched anywhere in the source, strings and comments included (a
#: getattr by name is a frame read too), as whole words.
FRAME_NAMES = ("_getframe", "_current_frames", "currentframe", "getouterframes", "getinnerframes",
               "f_back", "f_locals", "f_globals", "f_code", "tb_frame")
_FRAME_WORDS = re.compile(r"\b(" + "|".join(FRAME_NAMES) + r")\b|\binspect\s*\.\s*(stack|trace)\b")


def frame_reads(path: str) -> list[str]:
    """``"line: text"`` of every line of ``path`` that names a way to a stack frame, and of every
    ``from inspect import`` of ``stack``/``trace`` (used then without the ``inspect.`` prefix)."""
    with open(path) as f:
        source = f.read()
    found = [f"{n}: {line.strip()}" for n, line in enumerate(source.splitlines(), 1) if _FRAME_WORDS.search(line)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "inspect":
            found += [f"{node.lineno}: from inspect import {a.name}" for a in node.names
                      if a.name in ("stack", "trace")]
    return found


def test_no_stack_frame_reading():
    """No module of the installed package reads the caller's stack frames: integrations use
    public API only (compressed_opt.integrations; GradScaler: compressed_opt.engine)."""
    reads = {m: frame_reads(p) for m, p in modules().items()}
    assert {m: r for m, r in reads.items() if r} == {}


def test_the_frame_check_can_fail(tmp_path):
    """The check sees the reads that frameworks.py used to make (and none in plain code)."""
    reads = tmp_path / "reads.py"
    reads.write_text("import sys\nfrom inspect import stack\nframe = sys._getframe(1)\n"
                     "owner = frame.f_back.f_locals.get('self')\nname = getattr(frame, 'f_code')\n"
                     "import inspect\nouter = inspect . stack()\n")
    assert [line.split(":")[0] for line in frame_reads(str(reads))] == ["3", "4", "5", "7", "2"]
    plain = tmp_path / "plain.py"
    plain.write_text("import torch\nx = torch.stack([torch.ones(1)])\nf_backward = 1\nstack = []\n")
    assert frame_reads(str(plain)) == []


if __name__ == "__main__":
    graph, _ = import_graph()
    for module in sorted(graph):
        print(f"{module} -> {', '.join(sorted(graph[module])) or '-'}")
    found = cycles(graph)
    print("cycles:", *(" -> ".join(c) for c in found) if found else ["none"], sep="\n  ")
    sys.exit(1 if found else 0)
