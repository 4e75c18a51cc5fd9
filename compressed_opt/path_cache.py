"""``path="measure"``, reproducible: a measured choice is kept on the machine and reused.

``path="measure"`` times the 1-bit exchange against the fp32 average for each bucket size (and,
on several nodes, the flat against the hierarchical exchange) at the first step, and takes the
faster (:func:`compressed_opt.averaging.choose_measured`). Two runs of the same seed could then
choose differently wherever both take about as long, and end up in different places. So the
first run's choice is written to a small JSON file on rank 0's machine, and a later run of the
same job reuses it instead of measuring again:

* the file lives in the per-user cache folder: ``$COMPRESSED_OPT_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/compressed_opt``, else ``~/.cache/compressed_opt``; its name is a hash of
  what the choice depends on (:func:`cache_key`): rank 0's host name, the backend's kind and
  world size, the exchanges chosen between (their node layout), the device type, the 1-bit scale
  block and the bucket sizes. Delete it (the warning names it) to measure again.
* rank 0 reads it and broadcasts the choice (one small broadcast), so every rank takes rank 0's
  choice even where the ranks' caches differ; rank 0 writes it after a measurement.
* a file that cannot be read or does not match (another version's, edited) counts as absent; one
  that cannot be written is skipped with a log line: the cache never stops training.

A checkpoint keeps the choice too (``state_dict()["compressed_opt"]["averaging"/"paths"]``), and
a resume takes it from there before looking here.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path

import torch

from compressed_opt.cuda.cpu import cache_dir  # the kernels' per-user cache folder

logger = logging.getLogger("compressed_opt")

_FORMAT = 1
_PATH_CODES = {"1bit": 1, "fp32": 2}


def cache_key(backend, candidates, sizes: list[int], device: torch.device, block: int) -> str:
    """A hash of everything a measured choice depends on (rank 0's host: called on rank 0)."""
    return hashlib.sha256(json.dumps(_what(backend, candidates, sizes, device, block), sort_keys=True).encode()
                          ).hexdigest()[:20]


def _what(backend, candidates, sizes: list[int], device: torch.device, block: int) -> dict:
    return {
        "format": _FORMAT,
        "host": socket.gethostname(),
        "backend": type(backend).__name__,
        "world_size": backend.world_size,
        "exchanges": [list(a.key) for a in candidates],
        "device": torch.device(device).type,
        "block": block,
        "sizes": sizes,
    }


def cache_file(key: str) -> Path | None:
    """Where the choice of ``key`` is kept (``None``: no cache folder is known, e.g. no home)."""
    try:
        return cache_dir() / f"path_choice_{key}.json"
    except (RuntimeError, OSError):
        return None


def _load(path: Path, what: dict, candidates, sizes: list[int]) -> tuple[int, dict[int, str]] | None:
    """``(index of the chosen exchange, path per size)`` from ``path`` if it was measured for
    ``what``, else ``None``."""
    try:
        entry = json.loads(path.read_text())
        if entry.get("format") != _FORMAT or entry.get("for") != what:
            return None
        keys = [list(a.key) for a in candidates]
        index = keys.index(entry["exchange"])
        paths = {int(n): p for n, p in entry["paths"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if sorted(paths) != sizes or not set(paths.values()) <= set(_PATH_CODES):
        return None
    return index, paths


def _store(path: Path, what: dict, averaging, paths: dict[int, str], times) -> None:
    entry = {"format": _FORMAT, "for": what, "exchange": list(averaging.key),
             "paths": {str(n): p for n, p in paths.items()}, "seconds": {str(n): list(t) for n, t in times.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entry, indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        logger.info("compressed_opt: could not keep the measured path choice in %s (%s)", path, exc)


def choose(candidates, backend, numels, device, block: int, measure):
    """``(averaging, paths)`` for ``path="measure"``: rank 0's cached choice where it has one,
    else ``measure(candidates, backend, numels, device)`` (collective; returns ``(averaging,
    paths, times)``), kept in rank 0's cache. Collective: every rank calls it, at the same point;
    every rank returns the same choice."""
    sizes = sorted(set(int(n) for n in numels if n > 0))
    found = None
    path = None
    if backend.rank == 0:
        what = _what(backend, candidates, sizes, device, block)
        path = cache_file(cache_key(backend, candidates, sizes, device, block))
        found = _load(path, what, candidates, sizes) if path is not None else None
    if backend.world_size > 1:  # rank 0's choice, on every rank: [found, exchange, path code per size]
        codes = torch.zeros(2 + len(sizes), dtype=torch.int64)
        if found is not None:
            codes[0], codes[1] = 1, found[0]
            codes[2:] = torch.tensor([_PATH_CODES[found[1][n]] for n in sizes], dtype=torch.int64)
        codes = codes.to(device)
        backend.broadcast(codes, src=0)
        codes = codes.cpu().tolist()
        names = {code: name for name, code in _PATH_CODES.items()}
        found = (codes[1], {n: names[c] for n, c in zip(sizes, codes[2:])}) if codes[0] else None
    if found is not None:
        averaging, paths = candidates[found[0]], found[1]
        if backend.rank == 0:
            logger.warning("compressed_opt: path='measure' reused the choice measured earlier on this machine "
                           "(%s: the %s exchange, %s); delete the file to measure again", path,
                           averaging.key[0], _summary(paths))
        return averaging, paths
    averaging, paths, times = measure(candidates, backend, numels, device)
    if backend.rank == 0 and path is not None:
        _store(path, what, averaging, paths, times)
        logger.warning("compressed_opt: path='measure' timed the exchanges on this link: the %s exchange, %s; "
                       "kept in %s, so that a rerun of this job takes the same choice", averaging.key[0],
                       _summary(paths), path)
    return averaging, paths


def _summary(paths: dict[int, str]) -> str:
    onebit = sorted(n for n, p in paths.items() if p == "1bit")
    fp32 = sorted(n for n, p in paths.items() if p == "fp32")
    parts = []
    if onebit:
        parts.append(f"1-bit for bucket sizes {onebit}")
    if fp32:
        parts.append(f"fp32 (measured faster) for {fp32}")
    return " and ".join(parts) or "no buckets"
