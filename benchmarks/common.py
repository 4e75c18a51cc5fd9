"""Helpers shared by the benchmarks of this folder: byte formatting, device synchronisation, the
environment of child processes, and the slow link (``slowlink.py``).

Imported as the top-level module ``common``: a script of this folder puts the folder on
``sys.path`` itself (``python -P`` does not, and the repository root must not be there: its
``cuda/`` folder would shadow NVIDIA's ``cuda`` package)::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

Units: bytes print in SI units (kB, MB, GB: powers of 1000), as bandwidths do (GB/s = 1e9 bytes
per second); a buffer size given in MiB (``--sizes-mb``) keeps its binary label.
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: what a launcher (torchrun, torch.distributed.run) sets for a rank: a child process that
#: inherited them would try to join its parent's job instead of starting its own
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


# --- results -----------------------------------------------------------------------------------------
def write_json(path, data, indent: int = 1) -> None:
    """Write ``data`` as JSON to ``path`` (nothing when ``path`` is ``None``): its folder made if
    needed, written to a temporary file first, so a reader never sees half a result."""
    if path is None:
        return
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=indent)
    os.replace(path + ".tmp", path)


# --- formatting ------------------------------------------------------------------------------------
def fmt_bytes(n) -> str:
    """``n`` bytes in SI units: ``"1.14 MB"``, ``"512 B"``; ``"-"`` for ``None``."""
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


# --- devices ---------------------------------------------------------------------------------------
def sync(device) -> None:
    """Wait for the work queued on ``device`` (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


# --- child processes -------------------------------------------------------------------------------
def child_env(threads: int | str | None = None, drop: tuple[str, ...] = (), **extra: str) -> dict:
    """The environment for a child process that starts work of its own: this process's, without
    the launcher variables (:data:`LAUNCHER_VARIABLES`) and the names in ``drop``, with
    ``OMP_NUM_THREADS`` set to ``threads`` (``None``: as it is here, else 1), plus ``extra``."""
    env = dict(os.environ)
    for var in LAUNCHER_VARIABLES + tuple(drop):
        env.pop(var, None)
    if threads is None:
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra)
    return env


# --- the slow link ---------------------------------------------------------------------------------
def slowlink():
    """The ``slowlink`` module of this folder (network namespaces joined by a rate-limited veth)."""
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    import slowlink as module

    return module


def check_link_possible(flag: str = "--link", isolation: str = "auto") -> str:
    """How 2 ranks run over a slow link here (``slowlink.ISOLATIONS``: ``"netns"`` as root,
    ``"userns"`` in a user namespace of this user's own); exit with a message saying why when
    they cannot."""
    if not sys.platform.startswith("linux"):
        raise SystemExit(f"{flag} needs Linux network namespaces; run without {flag}")
    ok, why = slowlink().netns_supported(isolation)
    if not ok:
        raise SystemExit(f"{flag}: the link's network namespaces cannot be made here ({why}); leave out {flag}")
    return slowlink().check_tools(isolation)


def run_on_link(cmd: list[str], rate, threads: int | str | None = None, **kwargs) -> dict:
    """``cmd`` as 2 ranks over a veth link limited to ``rate`` (a tc rate such as ``"1gbit"``;
    ``"none"`` or ``None``: no limit), each with ``OMP_NUM_THREADS=threads`` (``None``: as here,
    else 1); ``kwargs`` (e.g. ``isolation``) and the result are ``slowlink.run_two_ranks``'s. Raises
    ``slowlink.SlowLinkError`` when the link cannot be made."""
    env = {} if threads is None else {"OMP_NUM_THREADS": str(threads)}
    return slowlink().run_two_ranks(cmd, rate=rate, env=env, **kwargs)
