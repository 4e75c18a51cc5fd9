"""Building and loading the C library of the CPU passes: ``onebit_cpu.c``, ``segmented_cpu.c``,
``lamb_cpu.c``, ``zero_one_cpu.c`` and ``zero_cpu.c`` (``onebit_cpu.h``: what they share), compiled
into one library at first use (:func:`load`, which :func:`compressed_opt.cuda.cpu.library` calls once).

The C sources are compiled with the system C compiler (``$CC``, else ``cc``), keyed by the sources,
the flags and the CPU, and loaded with ctypes. ``-march=native`` is tried first (AVX2 for the
packing), then plain ``-O3``. Loading never breaks training; :func:`load` looks, in order:

1. in the cache dir (:func:`cache_dir`: ``$COMPRESSED_OPT_CACHE_DIR``, else
   ``$XDG_CACHE_HOME/compressed_opt``, else ``~/.cache/compressed_opt``) for a library compiled
   earlier, for each flag set in turn: it loads without a compiler, and from a read-only folder;
2. for the compiler, and compiles into the cache dir (created if missing);
3. if the cache dir cannot be created or written: in a per-user temporary dir
   (``<tempdir>/compressed_opt-<uid>``, mode 0700, refused if another user owns it or others may
   write to it), for a library compiled there earlier, else compiles into it;
4. else returns ``None``: the passes then run their PyTorch reference.

Steps 3 and 4 emit one ``RuntimeWarning`` per process saying what happened and what to set. No
``OSError`` escapes :func:`load`.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

#: the library's sources, compiled together (onebit_cpu.h: what they share)
SOURCES = tuple(Path(__file__).with_name(name) for name in
                ("onebit_cpu.c", "segmented_cpu.c", "lamb_cpu.c", "zero_one_cpu.c", "zero_cpu.c"))
HEADER = Path(__file__).with_name("onebit_cpu.h")
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])

_warn_lock = threading.Lock()
_warned = False  # the one fallback warning of this process is out (load() may run twice at once)


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + platform.processor() + flags


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$COMPRESSED_OPT_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/compressed_opt``, else ``~/.cache/compressed_opt``. Empty variables count as
    unset, and a relative ``XDG_CACHE_HOME`` is ignored (the XDG Base Directory spec). Raises
    ``RuntimeError`` when the home directory is needed and unknown."""
    root = os.environ.get("COMPRESSED_OPT_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and os.path.isabs(xdg):
        return Path(xdg) / "compressed_opt"
    home = Path.home()  # RuntimeError on Python >= 3.12 when unknown; "~" unexpanded before
    if not home.is_absolute():
        raise RuntimeError("the home directory is unknown")
    return home / ".cache" / "compressed_opt"


def _describe(error: BaseException) -> str:
    """``error`` for a warning: its type and message."""
    return f"{type(error).__name__}: {error}"


def _library_name(flags: list[str]) -> str:
    """The file name of the library built from these sources with ``flags`` on this CPU."""
    text = b"".join(path.read_bytes() for path in (*SOURCES, HEADER))
    key = hashlib.sha256(text + " ".join(flags).encode() + _cpu_signature().encode())
    return f"onebit_cpu_{key.hexdigest()[:16]}.so"


def _load(path: Path, declare) -> ctypes.CDLL | None:
    """The library at ``path`` with its functions declared (``declare(lib)``), or ``None`` if it is
    absent or does not load."""
    try:
        if not path.is_file():
            return None
        return declare(ctypes.CDLL(str(path)))
    except (OSError, AttributeError):  # AttributeError: a library without our functions
        return None


def _load_cached(folder: Path, declare) -> ctypes.CDLL | None:
    """A library compiled earlier into ``folder``, trying the flag sets in order, or ``None``."""
    for flags in _FLAG_SETS:
        lib = _load(folder / _library_name(flags), declare)
        if lib is not None:
            return lib
    return None


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` (created if missing) cannot hold compiled kernels, or ``None`` when it can."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return _describe(e)
    return None


def _temp_dir() -> tuple[Path | None, str]:
    """``(the per-user temporary dir, "")``, created with mode 0700, or ``(None, why not)`` when it
    cannot be made, another user owns it or others may write to it."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    try:
        folder = Path(tempfile.gettempdir()) / f"compressed_opt-{uid if uid is not None else 'user'}"
        folder.mkdir(mode=0o700, exist_ok=True)
        info = folder.lstat()
    except OSError as e:
        return None, f"the temporary dir cannot be made ({_describe(e)})"
    if not stat.S_ISDIR(info.st_mode):
        return None, f"the temporary dir {folder} is not a directory"
    if uid is not None and info.st_uid != uid:
        return None, f"the temporary dir {folder} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None, f"the temporary dir {folder} is writable by others (mode {stat.S_IMODE(info.st_mode):o})"
    problem = _unwritable(folder)
    if problem is not None:
        return None, f"the temporary dir {folder} is not writable either ({problem})"
    return folder, ""


def _compile(compiler: str, flags: list[str], target: Path, sources=SOURCES) -> str | None:
    """Compile ``sources`` (the kernels') with ``flags`` into ``target``; ``None`` on success, else why not."""
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
        os.close(fd)
    except OSError as e:
        return _describe(e)
    cmd = [compiler, *flags, "-shared", "-fPIC", "-o", tmp, *(str(path) for path in sources)]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=120)
        if done.returncode != 0:
            lines = done.stderr.decode(errors="replace").strip().splitlines()
            return f"exit status {done.returncode}: {lines[-1][:200] if lines else 'no message'}"
        os.replace(tmp, target)  # atomic: ranks compiling at once all end with a whole file
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return _describe(e)
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # moved to target, or never made


def _build(compiler: str, folder: Path, declare) -> tuple[ctypes.CDLL | None, str]:
    """``(the library compiled into folder, "")``, trying the flag sets in order, or ``(None, why not)``."""
    why = ""
    for flags in _FLAG_SETS:
        target = folder / _library_name(flags)
        failure = _compile(compiler, flags, target)
        if failure is None:
            lib = _load(target, declare)
            if lib is not None:
                return lib, ""
            failure = f"{target} does not load"
        why = f"{compiler} {' '.join(flags)} failed ({failure})"
    return None, why


def compile_like_kernels(sources, target: Path) -> str | None:
    """Compile other C ``sources`` into the shared library ``target`` as the kernels are compiled:
    the system compiler (``$CC``, else ``cc``), the first of their flag sets it takes. ``None`` on
    success, else why not (the benchmarks' own C loops, ``benchmarks/stream_floor.py``)."""
    name = os.environ.get("CC") or "cc"
    compiler = shutil.which(name)
    if compiler is None:
        return f"no C compiler ({name!r} is not on PATH)"
    why = ""
    for flags in _FLAG_SETS:
        failure = _compile(compiler, flags, Path(target), sources)
        if failure is None:
            return None
        why = f"{compiler} {' '.join(flags)} failed ({failure})"
    return why


def _warn_once(message: str) -> None:
    """Emit ``message`` as this process's one RuntimeWarning about loading the kernels."""
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(f"compressed_opt: {message}", RuntimeWarning, stacklevel=3)


def load(declare) -> ctypes.CDLL | None:
    """The compiled library with its functions declared (``declare(lib)``, which returns it), or
    ``None`` when none can be loaded or built here (the module docstring: the lookup order). Warns
    once per process on a fallback; never raises ``OSError``."""
    notes = []  # what went wrong, in order, for the warning
    try:
        cache = cache_dir()
    except RuntimeError as e:
        cache, problem = None, f"no cache dir ({e})"
    else:
        lib = _load_cached(cache, declare)
        if lib is not None:
            return lib
        problem = _unwritable(cache)
        if problem is not None:
            problem = f"the cache dir {cache} is not writable ({problem})"
    folder = cache
    if problem is not None:
        notes.append(problem)
        folder, why = _temp_dir()
        if folder is None:
            notes.append(why)
    name = os.environ.get("CC") or "cc"
    compiler = shutil.which(name)
    lib = None
    if folder is not None:
        lib = _load_cached(folder, declare)
        if lib is None and compiler is not None:
            lib, why = _build(compiler, folder, declare)
            if lib is None:
                notes.append(why)
    if compiler is None and lib is None:
        notes.append(f"no C compiler ({name!r} is not on PATH)")
    if lib is not None:
        if folder != cache:
            _warn_once(f"{'; '.join(notes)}; using the CPU kernels compiled into {folder}, which the system may "
                       "clear. Set COMPRESSED_OPT_CACHE_DIR to a writable folder to keep them.")
        return lib
    advice = []
    if problem is not None:
        advice.append("COMPRESSED_OPT_CACHE_DIR to a writable folder")
    if compiler is None or folder is not None:
        advice.append("CC to a working C compiler")
    _warn_once(f"{'; '.join(notes)}; using the slower PyTorch reference implementation of the CPU "
               f"compression kernels. Set {' and '.join(advice)}.")
    return None
