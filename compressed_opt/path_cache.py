"""``path="measure"``, reproducible: a measured choice is kept on the machine and reused.

``path="measure"`` times the 1-bit exchange against the fp32 average for each bucket size (and,
on several nodes, the flat against the hierarchical exchange) at the first step, and takes the
faster (:func:`choose_measured`). Two runs of the same seed could then
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

from compressed_opt.cuda.build import cache_dir  # the kernels' per-user cache folder

logger = logging.getLogger("compressed_opt")

_FORMAT = 1
_PATH_CODES = {"1bit": 1, "fp32": 2}
_PATH_REPS = 5


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


def choose(candidates, backend, numels, device, block: int):
    """``(averaging, paths)`` for ``path="measure"``: rank 0's cached choice where it has one,
    else :func:`choose_measured` (collective), kept in rank 0's cache. Collective: every rank calls
    it, at the same point; every rank returns the same choice."""
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
    averaging, paths, times = choose_measured(candidates, backend, numels, device)
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


# --- measuring ------------------------------------------------------------------------------------
def _time_paths(averaging, backend, numel: int, device) -> tuple[float, float]:
    """Median seconds of this rank's 1-bit exchange and fp32 all-reduce of ``numel`` elements
    (scratch buffers; one untimed call of each first)."""
    import time

    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(device)
    we, se = (torch.zeros(k, dtype=torch.float32, device=device) for k in averaging.error_sizes(numel))
    times = {"1bit": [], "fp32": []}
    for rep in range(_PATH_REPS + 1):
        for path in ("1bit", "fp32"):
            y = x.clone()
            start = time.perf_counter()
            if path == "1bit":
                averaging(y, we, se)
            else:
                averaging.average(y)
            if rep:
                times[path].append(time.perf_counter() - start)
    return sorted(times["1bit"])[_PATH_REPS // 2], sorted(times["fp32"])[_PATH_REPS // 2]


def measure_times(averaging, backend, numels, device) -> dict[int, tuple[float, float]]:
    """Per bucket size, the seconds of ``averaging``'s 1-bit exchange and of the fp32 all-reduce
    on this link, as the slowest rank timed them (collective: every rank times both, one
    all-gather shares the times, so every rank holds the same numbers)."""
    sizes = sorted(set(int(n) for n in numels if n > 0))
    mine = torch.tensor([t for n in sizes for t in _time_paths(averaging, backend, n, device)], dtype=torch.float64)
    everyone = torch.empty(backend.world_size * mine.numel(), dtype=torch.float64, device=device)
    backend.all_gather(everyone, mine.to(device))
    slowest = everyone.view(backend.world_size, len(sizes), 2).amax(dim=0).cpu().tolist()
    return {n: (onebit, fp32) for n, (onebit, fp32) in zip(sizes, slowest)}


def faster_paths(times: dict[int, tuple[float, float]]) -> dict[int, str]:
    """Per bucket size, ``"fp32"`` where the fp32 all-reduce took less time, else ``"1bit"``."""
    return {n: ("fp32" if fp32 < onebit else "1bit") for n, (onebit, fp32) in times.items()}


def choose_measured(candidates, backend, numels, device):
    """``(averaging, paths, times)``: of ``candidates`` (flat and hierarchical exchanges), the one
    whose buckets, each on its faster path, take the least time in all on this link, its paths per
    bucket size, and its measured ``(1-bit, fp32)`` seconds per size (collective; every rank
    decides from the same shared times). :func:`compressed_opt.path_cache.choose` keeps the
    choice for a rerun."""
    best = None
    for averaging in candidates:
        times = measure_times(averaging, backend, numels, device)
        total = sum(min(times[int(n)]) for n in numels if n > 0)
        paths = faster_paths(times)
        if backend.rank == 0:
            timings = ", ".join(f"{n}: {a * 1e3:.2f} / {b * 1e3:.2f} -> {paths[n]}" for n, (a, b) in times.items())
            logger.info("compressed_opt: measured the %s exchange per bucket size (elements: 1-bit ms / fp32 ms -> "
                        "path): %s; %.2f ms per step", averaging.key[0], timings, total * 1e3)
        if best is None or total < best[0]:
            best = (total, averaging, paths, times)
    return best[1:]
