"""Micro-benchmarks of the kernels and the collectives, with pytest-benchmark (``make bench-micro``).

Not part of ``make test`` (``testpaths = tests``): these measure, they do not check. Run::

    python -P -m pytest benchmarks/test_micro.py -p no:cacheprovider
    python -P -m pytest benchmarks/test_micro.py --benchmark-json benchmarks/results/micro.json

Each benchmark puts its ratios into ``benchmark.extra_info`` (shown in ``--benchmark-json``),
measured in the same run (docs/design.md section 4):

* kernels (``compress_``, ``average_compress_`` of 2 rows, ``decompress_``, on the CPU path):
  ``ratio_to_copy`` = time of a plain copy of the same fp32 bytes / kernel time (1.0: as fast
  as copying the buffer once; a compression touches ~2.5x the bytes of a copy, so ~0.4 is the
  memory-bandwidth bound), and ``GBps`` = fp32 bytes / time;
* collectives on 2 local Gloo ranks (this process is rank 0, a helper process rank 1):
  fp32 allreduce, bf16 allreduce and the 1-bit ``compressed_allreduce`` of the same fp32 buffer,
  with ``speedup_vs_fp32_allreduce`` = fp32 allreduce time / time, ``algbw_GBps`` (fp32 bytes
  / time: the effective bandwidth) and ``bytes_sent_per_rank`` from ``backend.stats``.

Loopback has far more bandwidth than a network: on the CPU the compressed allreduce is bound by
its kernels here, and wins only where the link is slower than them (``benchmarks/train.py --link``).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common, also for the peer under python -P

import pytest  # noqa: E402
import torch  # noqa: E402

from common import child_env  # noqa: E402
from compressed_opt import comm  # noqa: E402
from compressed_opt import cuda as kernels  # noqa: E402

MiB = 1 << 20
BLOCK = comm.DEFAULT_BLOCK
SIZES_MB = (1, 16)
ROUNDS = 15
WARMUP = 2
OPS = {"fp32": 1, "bf16": 2, "compressed": 3}
_FP32_TIMES: dict[int, float] = {}


def _numel(size_mb: float) -> int:
    n = int(size_mb * MiB) // 4
    return n - n % 64


def _median_time(fn, repeat: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median(benchmark) -> float:
    return benchmark.stats.stats.median


def _run(benchmark, fn) -> None:
    benchmark.pedantic(fn, rounds=ROUNDS, iterations=1, warmup_rounds=WARMUP)


# --- kernels ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def buffers():
    g = torch.Generator().manual_seed(0)
    cache = {}

    def make(n):
        if n not in cache:
            def rows(count, chunk):
                nb, row_len = kernels.rows_layout(chunk, BLOCK)
                r = torch.randint(0, 256, (count, row_len), dtype=torch.uint8, generator=g)
                r[:, : 4 * nb] = (torch.rand(count, nb, generator=g) + 0.5).view(torch.uint8).view(count, 4 * nb)
                return r

            cache[n] = {
                "src": torch.randn(n, generator=g), "dst": torch.empty(n),
                "x": torch.randn(n, generator=g), "error": torch.randn(n, generator=g) * 0.1,
                "worker_rows": rows(2, n // 2), "server_rows": rows(2, n),
                "server_row": torch.empty(kernels.rows_layout(n, BLOCK)[1], dtype=torch.uint8),
                "server_error": torch.randn(n, generator=g) * 0.1,
                "rows": rows(2, n // 2), "out": torch.empty(n),
            }
        return cache[n]

    return make


def _kernel_ratio(benchmark, b, n) -> None:
    if getattr(benchmark, "disabled", False):
        return
    copy = _median_time(lambda: b["dst"].copy_(b["src"]))
    t = _median(benchmark)
    benchmark.extra_info.update(kernel_path=kernels.kernel_path(torch.device("cpu")), numel=n, fp32_bytes=4 * n,
                                copy_time_s=copy, ratio_to_copy=copy / t, GBps=4 * n / t / 1e9)


@pytest.mark.parametrize("size_mb", SIZES_MB)
def test_kernel_compress(benchmark, buffers, size_mb):
    n = _numel(size_mb)
    b = buffers(n)
    _run(benchmark, lambda: kernels.compress_rows_(b["x"], b["error"], b["worker_rows"], n // 2, BLOCK))
    _kernel_ratio(benchmark, b, n)


@pytest.mark.parametrize("size_mb", SIZES_MB)
def test_kernel_average_compress_2_ranks(benchmark, buffers, size_mb):
    n = _numel(size_mb)
    b = buffers(n)
    _run(benchmark, lambda: kernels.average_compress_rows_(b["server_rows"], b["server_error"], b["server_row"], n,
                                                           BLOCK))
    _kernel_ratio(benchmark, b, n)


@pytest.mark.parametrize("size_mb", SIZES_MB)
def test_kernel_decompress(benchmark, buffers, size_mb):
    n = _numel(size_mb)
    b = buffers(n)
    _run(benchmark, lambda: kernels.decompress_rows_(b["rows"], b["out"], n // 2, BLOCK))
    _kernel_ratio(benchmark, b, n)


# --- collectives on 2 local ranks --------------------------------------------------------------------------
class _Buffers:
    """The buffers of one op and size, the same on both ranks (each rank its own data)."""

    def __init__(self, op: int, n: int, rank: int):
        g = torch.Generator().manual_seed(1234 + rank)
        self.src = torch.randn(n, generator=g)
        if op == OPS["bf16"]:
            self.src = self.src.to(torch.bfloat16)
        self.buf = torch.empty_like(self.src)
        we, se = comm.error_buffer_sizes(n, 2)
        self.worker_error, self.server_error = torch.zeros(we), torch.zeros(se)

    def call(self, op: int, backend) -> None:
        self.buf.copy_(self.src)
        if op == OPS["compressed"]:
            comm.compressed_allreduce(self.buf, self.worker_error, self.server_error, backend)
        else:
            backend.all_reduce(self.buf, op="sum")


def _peer_main(store: str) -> int:
    """Rank 1: do what rank 0 announces (op, numel, calls), until op 0."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=1, world_size=2)
    backend = comm.get_backend("torch")
    cache = {}
    command = torch.zeros(3, dtype=torch.int64)
    while True:
        backend.broadcast(command, src=0)  # (held: the exit waits until torch lets go, docs/comm.md)
        op, n, calls = command.tolist()
        if op == 0:
            break
        b = cache.setdefault((op, n), _Buffers(op, n, rank=1))
        for _ in range(calls):
            b.call(op, backend)
    dist.destroy_process_group()
    return 0


class _Ranks:
    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.tmp = tempfile.TemporaryDirectory(prefix="co-micro-")
        store = os.path.join(self.tmp.name, "store")
        env = child_env(threads=1, drop=("PYTHONPATH",))
        self.peer = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__), "--peer", store], env=env)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=2)
        self.backend = comm.get_backend("torch")
        self.cache = {}

    def announce(self, op: int, n: int, calls: int) -> _Buffers:
        self.backend.broadcast(torch.tensor([op, n, calls], dtype=torch.int64), src=0)
        return self.cache.setdefault((op, n), _Buffers(op, n, rank=0))

    def time_op(self, op: int, n: int, repeat: int = 10) -> float:
        b = self.announce(op, n, repeat + 1)
        return _median_time(lambda: b.call(op, self.backend), repeat)

    def close(self):
        self.announce(0, 0, 0)
        self.dist.destroy_process_group()
        self.peer.wait(timeout=60)
        self.tmp.cleanup()


@pytest.fixture(scope="module")
def ranks():
    r = _Ranks()
    yield r
    r.close()


@pytest.mark.parametrize("size_mb", SIZES_MB)
@pytest.mark.parametrize("op", list(OPS))
def test_collective(benchmark, ranks, op, size_mb):
    code, n = OPS[op], _numel(size_mb)
    disabled = getattr(benchmark, "disabled", False)
    b = ranks.announce(code, n, 1 if disabled else ROUNDS + WARMUP)
    ranks.backend.stats.reset()
    _run(benchmark, lambda: b.call(code, ranks.backend))
    if disabled:
        return
    calls = ranks.backend.stats.calls
    t = _median(benchmark)
    if op == "fp32":
        _FP32_TIMES[n] = t
    fp32 = _FP32_TIMES.get(n) or ranks.time_op(OPS["fp32"], n)
    benchmark.extra_info.update(
        numel=n, fp32_bytes=4 * n, algbw_GBps=4 * n / t / 1e9, speedup_vs_fp32_allreduce=fp32 / t,
        bytes_sent_per_rank=ranks.backend.stats.total_bytes / max(1, ROUNDS + WARMUP),
        collective_calls=dict(calls))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--peer":
        sys.exit(_peer_main(sys.argv[2]))
    sys.exit(pytest.main([__file__, "-p", "no:cacheprovider", *sys.argv[1:]]))
