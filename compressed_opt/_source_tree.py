"""Why ``import compressed_opt`` fails when the source folder shadows the installed package.

``compressed_opt/`` is only part of the package: ``compressed_opt.comm`` and
``compressed_opt.cuda`` come from the folders ``comm/`` and ``cuda/`` beside it, mapped in by an
install (pyproject.toml, package-dir). Python started in the repository root (``python -c``, an
interactive session) puts the root first on ``sys.path`` and finds the bare source folder before a
regular (non-editable) install, whose subpackages are then missing. This module imports nothing of
the package: it must work while the package fails to import.
"""
from __future__ import annotations

import os

#: the subpackages that live outside ``compressed_opt/`` in a checkout
SUBPACKAGES = ("comm", "cuda")


def is_source_tree(package_dir: str) -> bool:
    """Whether ``package_dir`` is the ``compressed_opt/`` folder of a source checkout: ``comm/`` and
    ``cuda/`` lie beside it rather than inside it."""
    root = os.path.dirname(os.path.abspath(package_dir))
    return (os.path.isfile(os.path.join(root, "comm", "compressed.py"))
            and os.path.isfile(os.path.join(root, "cuda", "__init__.py"))
            and not os.path.isdir(os.path.join(package_dir, "comm")))


def shadowing_error(error: ImportError, package_dir: str) -> ImportError | None:
    """The ImportError to raise instead of ``error`` when ``error`` is a subpackage missing because
    the package was imported from the source tree at ``package_dir``; ``None`` for any other cause."""
    missing = {"compressed_opt"} | {f"compressed_opt.{name}" for name in SUBPACKAGES}
    if error.name not in missing or not is_source_tree(package_dir):
        return None
    return ImportError(
        f"compressed_opt was imported from the source folder {os.path.abspath(package_dir)}, which "
        "lacks compressed_opt.comm and compressed_opt.cuda (they live in comm/ and cuda/ beside it and "
        "only an install maps them in): the compressed-opt source folder is shadowing the installed "
        "package. Run Python with -P, or from another folder, or install in editable mode "
        "(pip install -e .).",
        name=error.name,
    )
