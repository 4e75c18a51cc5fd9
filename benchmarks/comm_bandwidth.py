"""Collective bandwidth: fp32 allreduce, bf16 allreduce and the 1-bit compressed allreduce.

For each buffer size (``--sizes-mb``, in MiB of fp32: 64 means 16 Mi fp32 elements) the three
operations run on the same buffers in the same run, through the library's backend interface
(``compressed_opt.comm``), so the numbers are comparable and the MPI backend is measured the same
way as ``torch.distributed``.

What is reported, per size and operation (conventions of nccl-tests, docs/design.md section 4):

* ``time_s``: time per call. Every call starts with a barrier; each rank times its own call;
  an iteration's time is the **maximum over ranks** (the slowest rank finishes the collective);
  the reported time is the **median over iterations** (min and mean are kept in the JSON too).
  By default the operations are interleaved (each iteration runs fp32, bf16, compressed once),
  so that a change of the machine's load during the run hits all of them alike
  (``--order sequential`` runs all iterations of one operation, then the next).
* ``algbw_GBps`` = data bytes / time, where data bytes are the tensor's bytes in its own dtype
  (fp32: ``4 n``, bf16: ``2 n``). For the compressed allreduce the data bytes are the fp32 bytes
  it averages, so its ``algbw`` is the *effective* bandwidth that can be compared with fp32's
  directly. ``busbw_GBps`` = algbw * 2 (N-1) / N. GB = 1e9 bytes.
* ``speedup_vs_fp32`` = fp32 allreduce time / the operation's time.
* ``bytes_sent_per_rank``: per call, from the backend's byte accounting (``backend.stats``:
  ring-allreduce volume for allreduce, all-to-all and all-gather volumes for the compressed
  exchange); for the compressed allreduce also ``model_wire_bytes`` (``comm.wire_bytes``).
  These are what the algorithm sends; ``benchmarks/wire_bytes.py`` counts the bytes on a wire.
  The table prints them in SI units (kB, MB, GB), as every benchmark here does.
* ``--breakdown`` adds, for the compressed allreduce, each of its phases timed alone with the
  same buffer sizes (compress, header all-gather, bit all-to-all, server average+compress, row
  all-gather, decompress), to show where its time goes.

Launching (one process per rank):

* ``python benchmarks/comm_bandwidth.py --launch 2``: spawns 2 local Gloo ranks itself (file
  store in a temporary folder; all ranks are killed after ``--timeout`` seconds).
* ``torchrun --nproc-per-node 2 benchmarks/comm_bandwidth.py``: ``torch.distributed`` from the
  environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), Gloo, or NCCL with ``--device cuda``.
* ``mpiexec -n 2 python benchmarks/comm_bandwidth.py --backend mpi``: the mpi4py backend.

Rank 0 prints a table and, with ``--json PATH``, writes every number. Run Python with ``-P`` (or
from this folder) when the repository root would otherwise land on ``sys.path``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # common, also under python -P

import torch  # noqa: E402

from common import fmt_bytes, sync  # noqa: E402
from compressed_opt import comm  # noqa: E402
from compressed_opt import cuda as kernels  # noqa: E402

MiB = 1 << 20
OPS = ("fp32", "bf16", "compressed")


# --- arguments -------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="1,4,16,64,256",
                   help="comma-separated buffer sizes in MiB of fp32 (default 1,4,16,64,256)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and operation (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls before them (default 3)")
    p.add_argument("--ops", default=",".join(OPS), help=f"operations to run, of {','.join(OPS)} (default all)")
    p.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved (default): every iteration runs each operation once; "
                        "sequential: all iterations of one operation, then the next")
    p.add_argument("--backend", choices=("auto", "torch", "mpi"), default="auto",
                   help="auto: torch.distributed when launched by torchrun or --launch, MPI under mpiexec")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the buffers live (cuda: NCCL under torch.distributed)")
    p.add_argument("--dist-backend", default=None,
                   help="torch.distributed backend to initialise (default: gloo for cpu, nccl for cuda)")
    p.add_argument("--launch", type=int, default=0, metavar="N",
                   help="spawn N local ranks (Gloo, file store) instead of being launched")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="with --launch: kill every rank after this many seconds (default 900)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time each phase of the compressed allreduce on its own")
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no table")
    args = p.parse_args(argv)
    try:
        args.sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        p.error(f"--sizes-mb must be comma-separated numbers, got {args.sizes_mb!r}")
    if not args.sizes or any(s <= 0 for s in args.sizes):
        p.error("--sizes-mb needs positive sizes")
    args.op_list = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = set(args.op_list) - set(OPS)
    if unknown or not args.op_list:
        p.error(f"--ops takes some of {','.join(OPS)}, got {args.ops!r}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.launch and args.backend == "mpi":
        p.error("--launch spawns Gloo ranks; use mpiexec for --backend mpi")
    if args.launch and args.device == "cuda" and torch.cuda.device_count() < args.launch:
        p.error(f"--launch {args.launch} --device cuda needs {args.launch} GPUs")
    return args


# --- backend setup ---------------------------------------------------------------------------------
def _torch_launched() -> bool:
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def _init_torch(args, init_method: str = "env://", rank: int | None = None, world_size: int | None = None):
    import torch.distributed as dist

    dist_backend = args.dist_backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    kwargs = {} if rank is None else dict(rank=rank, world_size=world_size)
    dist.init_process_group(dist_backend, init_method=init_method, **kwargs)
    return comm.get_backend("torch")


def make_backend(args):
    """The backend this process was launched for, and a function that shuts it down."""
    if args.backend == "mpi":
        return comm.get_backend("mpi"), lambda: None
    if args.backend == "torch" or _torch_launched():
        if not _torch_launched():
            raise SystemExit("--backend torch needs torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                             "MASTER_PORT), or use --launch N")
        backend = _init_torch(args)
        return backend, _destroy_torch
    return comm.get_backend("auto"), lambda: None  # MPI under mpiexec, else a single process


def _destroy_torch():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _device(args) -> torch.device:
    if args.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- timing ----------------------------------------------------------------------------------------
def timed_call(backend, call, prepare, device: torch.device) -> float:
    """Seconds of one ``call()`` on this rank: ``prepare()`` first (untimed: e.g. refill the
    input), then a barrier, so that every rank starts the call together."""
    prepare()
    sync(device)
    backend.barrier()
    t0 = time.perf_counter()
    call()
    sync(device)
    return time.perf_counter() - t0


def time_calls(backend, call, prepare, iters: int, warmup: int, device: torch.device) -> list[float]:
    """This rank's seconds for each of ``iters`` calls (after ``warmup`` untimed ones)."""
    times = [timed_call(backend, call, prepare, device) for _ in range(warmup + iters)]
    return times[warmup:]


def slowest_rank_times(backend, times: list[float], device: torch.device) -> list[float]:
    """Per iteration, the maximum over ranks of the rank's time (an all-gather of the times)."""
    mine = torch.tensor(times, dtype=torch.float64, device=device)
    everyone = torch.empty(backend.world_size * len(times), dtype=torch.float64, device=device)
    backend.all_gather(everyone, mine)
    return everyone.view(backend.world_size, len(times)).max(dim=0).values.tolist()


def summarise(per_iter: list[float], data_bytes: int, world: int, bytes_sent: dict, coll_calls: dict,
              calls: int) -> dict:
    median = statistics.median(per_iter)
    algbw = data_bytes / median / 1e9
    return {
        "time_s": median,
        "time_min_s": min(per_iter),
        "time_mean_s": statistics.fmean(per_iter),
        "times_s": per_iter,
        "data_bytes": data_bytes,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (world - 1) / world,
        "bytes_sent_per_rank": sum(bytes_sent.values()) / calls,
        "bytes_sent_by_collective": {k: v / calls for k, v in bytes_sent.items()},
        "collective_calls_per_call": {k: v / calls for k, v in coll_calls.items()},
    }


class Case:
    """One operation on one size: its buffers (allocated once), ``prepare`` (refill the input),
    ``call``, its data bytes, and the bytes and collective calls it made (``backend.stats``)."""

    def __init__(self, backend, op: str, numel: int, src: torch.Tensor, device: torch.device):
        self.op, self.numel, self.backend = op, numel, backend
        self.times: list[float] = []
        self.bytes_sent: collections.Counter = collections.Counter()
        self.coll_calls: collections.Counter = collections.Counter()
        self.calls = 0
        if op == "bf16":
            self.src = src.to(torch.bfloat16)
            self.data_bytes = 2 * numel
        else:
            self.src = src
            self.data_bytes = 4 * numel
        self.buf = torch.empty_like(self.src)
        if op == "compressed":
            worker_numel, server_numel = comm.error_buffer_sizes(numel, backend.world_size)
            self.worker_error = torch.zeros(worker_numel, dtype=torch.float32, device=device)
            self.server_error = torch.zeros(server_numel, dtype=torch.float32, device=device)

    def prepare(self) -> None:
        self.buf.copy_(self.src)

    def call(self) -> None:
        if self.op == "compressed":
            comm.compressed_allreduce(self.buf, self.worker_error, self.server_error, self.backend)
        else:
            self.backend.all_reduce(self.buf, op="sum")

    def run_once(self, device: torch.device, timed: bool) -> None:
        stats = self.backend.stats
        stats.reset()
        elapsed = timed_call(self.backend, self.call, self.prepare, device)
        self.bytes_sent.update(stats.bytes_sent)
        self.coll_calls.update(stats.calls)
        self.calls += 1
        if timed:
            self.times.append(elapsed)

    def result(self, device: torch.device) -> dict:
        world = self.backend.world_size
        per_iter = slowest_rank_times(self.backend, self.times, device)
        out = summarise(per_iter, self.data_bytes, world, self.bytes_sent, self.coll_calls, self.calls)
        if self.op == "compressed":
            out["model_wire_bytes"] = comm.wire_bytes(self.numel, world)
        return out


def measure_size(backend, numel: int, src: torch.Tensor, args, device) -> dict:
    """Every operation of ``args.op_list`` on ``numel`` elements. ``interleaved`` (default): each
    iteration runs every operation once, so slow changes of the machine's load hit all of them
    alike; ``sequential``: all iterations of one operation, then the next (nccl-tests' way)."""
    cases = [Case(backend, op, numel, src, device) for op in args.op_list]
    if args.order == "interleaved":
        for i in range(args.warmup + args.iters):
            for case in cases:
                case.run_once(device, timed=i >= args.warmup)
    else:
        for case in cases:
            for i in range(args.warmup + args.iters):
                case.run_once(device, timed=i >= args.warmup)
    return {case.op: case.result(device) for case in cases}


def breakdown(backend, numel: int, src: torch.Tensor, args, device) -> dict:
    """Each phase of one compressed allreduce timed alone (median over iterations of the slowest
    rank), with buffers of the sizes the real call uses. Phases: worker ``compress``, the 16-byte
    ``header_allgather``, the ``all_to_all`` of the rows, the server ``average_compress``, the
    ``row_allgather`` of ``[block scales | bits]`` and the final ``decompress``.

    Each phase starts after a barrier, so the sum leaves out what the real call adds: the
    Python around the kernels, the agreement check of the headers, and each rank waiting in a
    collective for the other ranks to finish the previous phase."""
    world = backend.world_size
    block = comm.DEFAULT_BLOCK
    chunk = comm.chunk_numel(numel, world)
    row = comm.row_bytes(numel, world, block)
    server_numel = comm.server_valid_numel(numel, world, backend.rank)
    u8 = dict(dtype=torch.uint8, device=device)
    x = torch.empty_like(src)
    worker_error = torch.zeros(numel, dtype=torch.float32, device=device)
    server_error = torch.zeros(chunk, dtype=torch.float32, device=device)
    rows = torch.zeros(world * row, **u8)
    rows_in = torch.zeros(world * row, **u8)
    header = torch.zeros(4, dtype=torch.int32, device=device)
    headers = torch.zeros(4 * world, dtype=torch.int32, device=device)
    server_row = torch.zeros(row, **u8)
    gathered = torch.zeros(world * row, **u8)
    refill = lambda: x.copy_(src)  # noqa: E731
    nothing = lambda: None  # noqa: E731
    phases = {
        "compress": (lambda: kernels.compress_rows_(x, worker_error, rows.view(world, row), chunk, block), refill),
        "header_allgather": (lambda: backend.all_gather(headers, header), nothing),
        "all_to_all": (lambda: backend.all_to_all(rows_in, rows), nothing),
        "average_compress": (lambda: kernels.average_compress_rows_(
            rows_in.view(world, row), server_error[:server_numel], server_row, chunk, block), nothing),
        "row_allgather": (lambda: backend.all_gather(gathered, server_row), nothing),
        "decompress": (lambda: kernels.decompress_rows_(gathered.view(world, row), x, chunk, block), nothing),
    }
    out = {}
    for name, (call, prepare) in phases.items():
        times = time_calls(backend, call, prepare, args.iters, args.warmup, device)
        out[name] = statistics.median(slowest_rank_times(backend, times, device))
    out["sum_of_phases"] = sum(out.values())
    return out


def run(args, backend) -> dict | None:
    """The whole sweep on ``backend``; rank 0 gets the results (other ranks ``None``)."""
    device = _device(args)
    world = backend.world_size
    results = []
    for size_mb in args.sizes:
        numel = max(1, int(size_mb * MiB) // 4)
        gen = torch.Generator().manual_seed(1234 + backend.rank)
        src = torch.randn(numel, generator=gen).to(device)
        entry = {"size_mb": size_mb, "numel": numel, "fp32_bytes": 4 * numel,
                 "ops": measure_size(backend, numel, src, args, device)}
        fp32 = entry["ops"].get("fp32")
        for res in entry["ops"].values():
            res["speedup_vs_fp32"] = fp32["time_s"] / res["time_s"] if fp32 else None
        if args.breakdown:
            entry["compressed_breakdown_s"] = breakdown(backend, numel, src, args, device)
        results.append(entry)
        if backend.rank == 0 and not args.quiet:
            print(format_rows(entry, world), flush=True)
        del src
    if backend.rank != 0:
        return None
    return {
        "config": {
            "backend": getattr(backend, "name", type(backend).__name__),
            "backend_repr": repr(backend),
            "world_size": world,
            "device": str(device),
            "kernel_path": kernels.kernel_path(device),
            "iters": args.iters,
            "warmup": args.warmup,
            "order": args.order,
            "sizes_mb": args.sizes,
            "launch": "spawn" if args.launch else ("torchrun" if _torch_launched() else "mpi/other"),
            "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "cpu_count": os.cpu_count(),
            "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
            "torch": torch.__version__,
            "host": socket.gethostname(),
            "python": platform.python_version(),
            "conventions": "time: median over iterations of the max over ranks; algbw = data bytes/time "
                           "(compressed: fp32 bytes); busbw = algbw*2(N-1)/N; GB = 1e9 bytes; "
                           "bytes_sent_per_rank from backend.stats per call",
        },
        "results": results,
    }


# --- output ----------------------------------------------------------------------------------------
HEADER = (f"{'size':>9} {'op':<11} {'time ms':>9} {'algbw GB/s':>10} {'busbw GB/s':>10} "
          f"{'sent/rank':>11} {'vs fp32':>8}")


def format_rows(entry: dict, world: int) -> str:
    lines = []
    for i, (op, r) in enumerate(entry["ops"].items()):
        size = f"{entry['size_mb']:g} MiB" if i == 0 else ""
        speed = f"{r['speedup_vs_fp32']:.2f}x" if r.get("speedup_vs_fp32") else "-"
        label = op + ("*" if op == "compressed" else "")
        lines.append(f"{size:>9} {label:<11} {r['time_s'] * 1e3:9.3f} {r['algbw_GBps']:10.3f} "
                     f"{r['busbw_GBps']:10.3f} {fmt_bytes(r['bytes_sent_per_rank']):>11} {speed:>8}")
    b = entry.get("compressed_breakdown_s")
    if b:
        parts = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in b.items())
        lines.append(f"{'':>9} phases ms: {parts}")
    return "\n".join(lines)


def print_header(args, backend) -> None:
    load = f", load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs" if hasattr(os, "getloadavg") else ""
    print(f"# comm_bandwidth: {backend!r}, device {args.device}, kernels {kernels.kernel_path(_device(args))}, "
          f"{args.iters} iters (+{args.warmup} warmup), time = median over iters of max over ranks{load}")
    print("# compressed*: algbw/busbw are effective (fp32 bytes / time); sent/rank from backend.stats")
    print(HEADER, flush=True)


def rank_main(args, backend) -> int:
    if backend.rank == 0 and not args.quiet:
        print_header(args, backend)
    report = run(args, backend)
    if report is not None and args.json:
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(report, f, indent=1)
        os.replace(path + ".tmp", path)
        if not args.quiet:
            print(f"# wrote {path}", flush=True)
    backend.barrier()
    return 0


# --- --launch N: local Gloo ranks ---------------------------------------------------------------------
def _spawned_rank(rank: int, world_size: int, store: str, argv: list[str]) -> None:
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = parse_args(argv)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        backend = _init_torch(args, init_method=f"file://{store}", rank=rank, world_size=world_size)
        try:
            rank_main(args, backend)
        finally:
            _destroy_torch()
    except BaseException:
        sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
        sys.stderr.flush()
        os._exit(1)


def launch(args, argv: list[str]) -> int:
    """Spawn ``args.launch`` ranks of this benchmark; kill them all after ``args.timeout``."""
    import torch.multiprocessing as mp

    child_argv = list(argv)  # the ranks run rank_main directly: --launch stays (and labels the run)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="co-bench-") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_spawned_rank, args=(r, args.launch, store, child_argv), daemon=False)
                 for r in range(args.launch)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + args.timeout
        failed = None
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                failed = f"timed out after {args.timeout:g} s"
                break
            dead_bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead_bad:
                failed = f"rank {dead_bad[0]} exited with code {procs[dead_bad[0]].exitcode}"
                # give the others a moment to notice and fail on their own
                time.sleep(2.0)
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        codes = [p.exitcode for p in procs]
        if failed is None and any(c != 0 for c in codes):
            failed = f"ranks exited with codes {codes}"
        if failed:
            print(f"comm_bandwidth --launch {args.launch}: {failed}", file=sys.stderr)
            return 1
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.launch:
        return launch(args, argv)
    backend, shutdown = make_backend(args)
    try:
        return rank_main(args, backend)
    finally:
        shutdown()


if __name__ == "__main__":
    sys.exit(main())
