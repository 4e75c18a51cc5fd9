"""Kernel throughput: the compression kernels against a plain copy of the same bytes (docs/design.md 4).

For each size (``--sizes-mb``, in MiB of fp32: 64 means n = 16 Mi fp32 elements) and in the same
run, through the public dispatch functions of ``compressed_opt.cuda`` (the CuPy kernels for
``--device cuda``, the native C kernels, or the PyTorch reference where those are missing, for
``--device cpu``):

* ``copy``: ``dst.copy_(src)`` of the n fp32 elements (a memcpy on the CPU, a device-to-device
  copy on the GPU): 4n bytes read and 4n written, the yardstick;
* ``compress``: the worker's ``compress_rows_(x, error, rows, chunk, block)`` on n elements in 2
  chunks (u = x + e; per block of ``--block`` elements s = ||u|| / sqrt(len); bits of u;
  e <- u - s (2b - 1)), into 2 rows of [block scales | bits];
* ``average_compress_wN``: the server's ``average_compress_rows_`` of N = 2 and 4 rows of a chunk
  of n elements (z = e + (1/N) sum_i s_ib (2 b_i - 1), then the compression of z), n elements of
  error;
* ``decompress``: ``decompress_rows_`` of 4 rows of n / 4 elements into n fp32 elements.

Reported per kernel: ``time_s``, the median time of one call; ``GBps`` = 4n / time (the fp32
payload per second, 1 GB = 1e9 bytes); ``ratio_to_copy`` = copy time / kernel time, so 1.0 means
as fast as copying the fp32 buffer once (a compression touches more bytes than a copy: about
20n against 8n, so ~0.4 is the bandwidth bound of compress with x). CPU times are wall-clock
(``time.perf_counter``) per call; GPU times come from CUDA events around ``--inner`` back-to-back
calls, divided by ``--inner`` (the calls go through Python, so at the smallest sizes a GPU time
can be bounded by the launch overhead, some tens of microseconds, rather than by memory).

Run ``python benchmarks/kernels.py --device cpu --sizes-mb 16,64`` (Python with ``-P``, or from
this folder, when the repository root would otherwise land on ``sys.path``); ``--json PATH``
writes every number.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common, also under python -P

import torch  # noqa: E402

from common import sync  # noqa: E402
from compressed_opt import cuda as kernels  # noqa: E402
from compressed_opt.comm import DEFAULT_BLOCK  # noqa: E402

MiB = 1 << 20
WORLDS = (2, 4)
DECOMPRESS_ROWS = 4


def _timer(device: torch.device, repeat: int, inner: int):
    """Return ``measure(fn) -> list of seconds per call``, for ``device``."""
    if device.type == "cuda":

        def measure(fn):
            times = []
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / inner)
            return times

    else:

        def measure(fn):
            times = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return times

    return measure


def _rows(count: int, chunk: int, block: int, device, g: torch.Generator) -> torch.Tensor:
    """``count`` rows of random bits with scales in [0.5, 1.5)."""
    nb, row_len = kernels.rows_layout(chunk, block)
    rows = torch.randint(0, 256, (count, row_len), dtype=torch.uint8, generator=g)
    rows[:, : 4 * nb] = (torch.rand(count, nb, generator=g) + 0.5).view(torch.uint8).view(count, 4 * nb)
    return rows.to(device)


def _buffers(n: int, block: int, device: torch.device, g: torch.Generator) -> dict:
    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device)

    return {
        "src": rand(n),
        "dst": torch.empty(n, device=device),
        "x": rand(n),
        "error": rand(n) * 0.1,
        "worker_rows": _rows(2, n // 2, block, device, g),
        "server_rows": {w: _rows(w, n, block, device, g) for w in WORLDS},
        "server_row": torch.empty(kernels.rows_layout(n, block)[1], dtype=torch.uint8, device=device),
        "server_error": rand(n) * 0.1,
        "rows": _rows(DECOMPRESS_ROWS, n // DECOMPRESS_ROWS, block, device, g),
        "out": torch.empty(n, device=device),
    }


def _operations(b: dict, n: int, block: int) -> dict:
    ops = {
        "copy": lambda: b["dst"].copy_(b["src"]),
        "compress": lambda: kernels.compress_rows_(b["x"], b["error"], b["worker_rows"], n // 2, block),
    }
    for w in WORLDS:
        ops[f"average_compress_w{w}"] = (
            lambda w=w: kernels.average_compress_rows_(b["server_rows"][w], b["server_error"], b["server_row"], n,
                                                       block)
        )
    ops["decompress"] = lambda: kernels.decompress_rows_(b["rows"], b["out"], n // DECOMPRESS_ROWS, block)
    return ops


def run(device: torch.device, sizes_mb: list[float], repeat: int, inner: int, warmup: int,
        block: int = DEFAULT_BLOCK) -> dict:
    measure = _timer(device, repeat, inner)
    g = torch.Generator().manual_seed(0)
    results = []
    for size_mb in sizes_mb:
        n = int(size_mb * MiB) // 4
        n -= n % (32 * DECOMPRESS_ROWS)  # chunks of a multiple of 32 elements in every row
        b = _buffers(n, block, device, g)
        entry = {"size_mb": size_mb, "numel": n, "fp32_bytes": 4 * n, "block": block, "ops": {}}
        for name, fn in _operations(b, n, block).items():
            for _ in range(warmup):
                fn()
            sync(device)
            times = measure(fn)
            t = statistics.median(times)
            entry["ops"][name] = {"time_s": t, "time_min_s": min(times), "GBps": 4 * n / t / 1e9, "times_s": times}
        copy_t = entry["ops"]["copy"]["time_s"]
        for r in entry["ops"].values():
            r["ratio_to_copy"] = copy_t / r["time_s"]
        results.append(entry)
        del b
    return {"results": results}


def _print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"# kernels on {cfg['device']} ({cfg['device_name']}), path {cfg['kernel_path']!r}, "
          f"median of {cfg['repeat']}" + (f" x {cfg['inner']} calls" if cfg["device"].startswith("cuda") else ""))
    print(f"{'size MiB':>9} {'kernel':<22} {'time ms':>10} {'GB/s':>9} {'x copy':>8}")
    for entry in report["results"]:
        for name, r in entry["ops"].items():
            print(f"{entry['size_mb']:>9g} {name:<22} {r['time_s'] * 1e3:>10.3f} {r['GBps']:>9.2f} "
                  f"{r['ratio_to_copy']:>8.3f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto")
    parser.add_argument("--sizes-mb", default="4,16,64,256", help="comma-separated MiB of fp32")
    parser.add_argument("--repeat", type=int, default=10, help="timed samples per kernel and size")
    parser.add_argument("--inner", type=int, default=10, help="GPU: back-to-back calls per sample")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--block", type=int, default=DEFAULT_BLOCK, help="elements per 1-bit scale")
    parser.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    args = parser.parse_args(argv)

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]

    path = kernels.kernel_path(device)
    report = run(device, sizes, args.repeat, args.inner, args.warmup, args.block)
    report["config"] = {
        "device": str(device),
        "device_name": (
            torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
        ),
        "kernel_path": path,
        "repeat": args.repeat,
        "inner": args.inner,
        "warmup": args.warmup,
        "block": args.block,
        "torch": torch.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "torch_threads": torch.get_num_threads(),
    }
    _print_table(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
