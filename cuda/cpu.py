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
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("onebit_cpu.c")
_FLAG_SETS = (["-O3", "-march=native"], ["-O3"])
MAX_WORLD = 1024


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
    lib.co_compensate_pack.argtypes = [p, p, p, i64, i64]
    lib.co_compensate_pack.restype = ctypes.c_double
    lib.co_subtract_decompressed.argtypes = [p, f32, i64]
    lib.co_subtract_decompressed.restype = None
    lib.co_average_compensate_pack.argtypes = [p, p, i64, i64, p, p, i64]
    lib.co_average_compensate_pack.restype = ctypes.c_double
    lib.co_decompress.argtypes = [p, p, i64, i64, i64, p, i64]
    lib.co_decompress.restype = None
    lib.co_has_avx2.restype = ctypes.c_int
    lib.co_segment_sumsq.argtypes = [p, p, i64, p]
    lib.co_segment_sumsq.restype = None
    lib.co_lerp_scale_clamp.argtypes = [p, p, f32, p, p, p, i64]
    lib.co_lerp_scale_clamp.restype = None
    lib.co_scale_clamp.argtypes = [p, p, p, p, i64]
    lib.co_scale_clamp.restype = None
    lib.co_gather.argtypes = [p, p, p, i64, f32, ctypes.c_int, p]
    lib.co_gather.restype = None
    lib.co_divide_where_nonzero.argtypes = [p, p, p, i64]
    lib.co_divide_where_nonzero.restype = None
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


def _scale(sumsq: float, n: int, scale_out: torch.Tensor) -> None:
    scale_out.fill_(math.sqrt(sumsq / n) if n else 0.0)


def finish_(error, scale_out):
    # pass 2 uses the fp32 scale that is sent, so that error == u - C(u) exactly
    library().co_subtract_decompressed(error.data_ptr(), ctypes.c_float(scale_out.item()), error.numel())


def compress_(x, error, packed, scale_out, finish=True):
    lib = library()
    n = error.numel()
    sumsq = lib.co_compensate_pack(
        None if x is None else x.data_ptr(), error.data_ptr(), packed.data_ptr(), n, packed.numel()
    )
    _scale(sumsq, n, scale_out)
    if finish:
        finish_(error, scale_out)


def average_compress_(chunks, scales, error, packed, scale_out, finish=True):
    lib = library()
    world, row_bytes = chunks.shape
    n = error.numel()
    sumsq = lib.co_average_compensate_pack(
        chunks.data_ptr(), scales.data_ptr(), world, row_bytes, error.data_ptr(), packed.data_ptr(), n
    )
    _scale(sumsq, n, scale_out)
    if finish:
        finish_(error, scale_out)


def decompress_(packed, scales, out):
    rows, row_bytes = packed.shape
    library().co_decompress(
        packed.data_ptr(), scales.data_ptr(), rows, row_bytes, packed.stride(0), out.data_ptr(), out.numel()
    )
