"""Native CPU path of the compression kernels: ``onebit_cpu.c``, compiled at first use.

The C source is compiled with the system C compiler (``$CC``, else ``cc``) into a per-user cache
(``$COMPRESSED_OPT_CACHE_DIR``, else ``~/.cache/compressed_opt``), keyed by the source, the flags
and the CPU, and loaded with ctypes. ``-march=native`` is tried first (AVX2 for the packing), then
plain ``-O3``. :func:`library` returns ``None`` when nothing compiles; the dispatcher then falls
back to the PyTorch reference and says so once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("onebit_cpu.c")
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])


def _cpu_signature() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return platform.machine() + platform.processor() + flags


def cache_dir() -> Path:
    root = os.environ.get("COMPRESSED_OPT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "compressed_opt"


def _compile(compiler: str, flags: list[str], target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    cmd = [compiler, *flags, "-shared", "-fPIC", "-o", tmp, str(SOURCE)]
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=120)
        if done.returncode != 0:
            return False
        os.replace(tmp, target)  # atomic: ranks compiling at once all end with a whole file
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.co_compress_rows.argtypes = [p, p, p, i64, i64, i64, i64, i64]
    lib.co_compress_rows.restype = None
    lib.co_average_compress_rows.argtypes = [p, i64, i64, i64, i64, p, p, i64]
    lib.co_average_compress_rows.restype = ctypes.c_int
    lib.co_decompress_rows.argtypes = [p, i64, i64, i64, i64, p, i64]
    lib.co_decompress_rows.restype = None
    lib.co_has_avx2.restype = ctypes.c_int
    lib.co_segment_sumsq.argtypes = [p, p, i64, p]
    lib.co_segment_sumsq.restype = None
    lib.co_lerp_scale_clamp.argtypes = [p, p, f32, p, p, p, p, i64]
    lib.co_lerp_scale_clamp.restype = None
    lib.co_scale_clamp.argtypes = [p, p, p, p, i64]
    lib.co_scale_clamp.restype = None
    lib.co_gather.argtypes = [p, p, p, i64, f32, ctypes.c_int, p]
    lib.co_gather.restype = None
    lib.co_divide_where_nonzero.argtypes = [p, p, p, i64]
    lib.co_divide_where_nonzero.restype = None
    lib.co_divide_where_nonzero_segments.argtypes = [p, p, p, p, p, i64]
    lib.co_divide_where_nonzero_segments.restype = None
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel library, or ``None`` if no compiler could build it."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return None
    source = SOURCE.read_bytes()
    for flags in _FLAG_SETS:
        key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode())
        target = cache_dir() / f"onebit_cpu_{key.hexdigest()[:16]}.so"
        if target.exists() or _compile(compiler, flags, target):
            try:
                return _declare(ctypes.CDLL(str(target)))
            except OSError:
                continue
    return None


def compress_rows_(x, error, rows, chunk, block):
    library().co_compress_rows(None if x is None else x.data_ptr(), error.data_ptr(), rows.data_ptr(), rows.stride(0),
                               rows.shape[0], chunk, block, error.numel())


def average_compress_rows_(rows, error, out_row, chunk, block):
    if library().co_average_compress_rows(rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block,
                                          error.data_ptr(), out_row.data_ptr(), error.numel()):
        raise ValueError(f"{rows.shape[0]} rows: more than the kernel's weights")  # (checked before the call)


def decompress_rows_(rows, out, chunk, block):
    library().co_decompress_rows(rows.data_ptr(), rows.stride(0), rows.shape[0], chunk, block, out.data_ptr(),
                                 out.numel())
