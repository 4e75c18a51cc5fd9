"""Checks of the MPI backend, run on every rank of an MPI job (not a pytest module).

    mpiexec -n 3 python -P tests/mpi_worker.py [--comm world|self] CASE [CASE ...]

CASE is a name from ``CASES`` or ``all``. Every rank prints ``OK <case> rank <r>/<n>`` for each
case it passed. On a failure a rank prints ``FAIL <case> rank <r>/<n>: ...`` and the traceback
to stderr, then aborts the whole job (``MPI_Abort``), so the other ranks do not hang in a
collective and ``mpiexec`` exits non-zero. ``--comm self`` runs the cases on ``MPI.COMM_SELF``
(world size 1), e.g. as a singleton without ``mpiexec``.

To add a case, write ``def case_<name>(be)`` taking a fresh ``MPIBackend`` and decorate it with
``@case``; check with ``expect``/``expect_equal`` (or any exception).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the tests' reference helpers

import torch  # noqa: E402

from compressed_opt.comm.backend import CompletedWork, Work  # noqa: E402
from compressed_opt.comm.mpi_backend import MPIBackend, MPIWork, _CudaBytes, detect_cuda_aware  # noqa: E402

CASES = {}


def case(fn):
    CASES[fn.__name__[len("case_"):]] = fn
    return fn


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def expect_equal(got, want, what):
    expect(got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want),
           f"{what}: got {got.dtype} {tuple(got.shape)} {got.flatten()[:8].tolist()}..., "
           f"want {want.dtype} {tuple(want.shape)} {want.flatten()[:8].tolist()}...")


def done(work, async_op):
    """Wait on a collective's handle, checking what kind of handle each mode returns."""
    expect(isinstance(work, Work), f"a collective returned {type(work).__name__}, not a Work")
    if async_op:
        work.wait()
        work.wait()  # a second wait is a no-op
        expect(work.is_completed(), "is_completed() is False after wait()")
    else:
        expect(isinstance(work, CompletedWork), "a synchronous call must return a CompletedWork")


FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
INTS = (torch.int32, torch.int64, torch.uint8)


# --- all_reduce ------------------------------------------------------------------------------------
@case
def case_all_reduce(be):
    r, n = be.rank, be.world_size
    base = torch.arange(24).reshape(2, 12) % 7  # small integers: exact in every dtype
    for dtype in FLOATS + INTS:
        for async_op in (False, True):
            t = (base * (r + 1)).to(dtype)
            done(be.all_reduce(t, "sum", async_op=async_op), async_op)
            expect_equal(t, (base * (n * (n + 1) // 2)).to(dtype), f"all_reduce sum {dtype} async={async_op}")
    for dtype in FLOATS:
        for async_op in (False, True):
            t = (base * (r + 1)).to(dtype)
            done(be.all_reduce(t, "avg", async_op=async_op), async_op)
            want = ((base * (n * (n + 1) // 2)).to(torch.float32 if dtype.itemsize < 4 else dtype) / n).to(dtype)
            expect_equal(t, want, f"all_reduce avg {dtype} async={async_op}")
    # bf16 is summed in fp32 and rounded once: 256 + 1 + 1 in bf16 steps would stay 256
    t = torch.tensor([256.0 if r == 0 else 1.0], dtype=torch.bfloat16)
    be.all_reduce(t)
    expect_equal(t, torch.tensor([256.0 + (n - 1)]).to(torch.bfloat16), "bf16 sum rounds once")
    # bool sums as logical or
    t = torch.tensor([r == 0, False, True])
    be.all_reduce(t)
    expect_equal(t, torch.tensor([True, False, True]), "all_reduce bool")
    # a large buffer and an empty one
    t = torch.full((1 << 20,), float(r))
    be.all_reduce(t, "avg")
    expect_equal(t, torch.full((1 << 20,), (n - 1) / 2), "all_reduce 4 MB avg")
    t = torch.empty(0)
    be.all_reduce(t)
    expect(t.numel() == 0, "empty all_reduce")


@case
def case_async_many(be):
    """Several collectives in flight at once, of the same size (staging buffers must not be
    shared), waited on in reverse order."""
    r, n = be.rank, be.world_size
    ts = [torch.full((1000,), float(r + i), dtype=torch.bfloat16) for i in range(4)]
    works = [be.all_reduce(t, "avg", async_op=True) for t in ts]
    out = torch.empty(n * 8, dtype=torch.int64)
    works.append(be.all_gather(out, torch.full((8,), r, dtype=torch.int64), async_op=True))
    for w in reversed(works):
        w.wait()
    for i, t in enumerate(ts):
        want = torch.full((1000,), sum(float(k + i) for k in range(n)) / n).to(torch.bfloat16)
        expect_equal(t, want, f"in-flight bf16 all_reduce {i}")
    expect_equal(out, torch.arange(n).repeat_interleave(8), "in-flight all_gather")
    # is_completed() polls, and completes the post-processing once
    t = torch.full((16,), float(r + 1))
    w = be.all_reduce(t, "avg", async_op=True)
    deadline = time.monotonic() + 30
    while not w.is_completed():
        expect(time.monotonic() < deadline, "is_completed() never became True")
    w.wait()
    expect_equal(t, torch.full((16,), (n + 1) / 2), "avg after is_completed() polling")


# --- all_gather, all_to_all, broadcast -------------------------------------------------------------
@case
def case_all_gather(be):
    r, n = be.rank, be.world_size
    k = 5
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        for async_op in (False, True):
            inp = (torch.arange(k) + 10 * r).to(dtype)
            out = torch.empty(n * k, dtype=dtype)
            done(be.all_gather(out, inp, async_op=async_op), async_op)
            want = (torch.arange(k).repeat(n) + 10 * torch.arange(n).repeat_interleave(k)).to(dtype)
            expect_equal(out, want, f"all_gather {dtype} async={async_op} (rank-major)")
            expect_equal(inp, (torch.arange(k) + 10 * r).to(dtype), "all_gather leaves its input")


@case
def case_all_to_all(be):
    r, n = be.rank, be.world_size
    k = 3
    for dtype in (torch.float32, torch.bfloat16, torch.int32, torch.uint8):
        for async_op in (False, True):
            # element m of chunk j of rank r's input is 100*r + 10*j + m
            j, m = torch.arange(n).repeat_interleave(k), torch.arange(k).repeat(n)
            inp = (100 * r + 10 * j + m).to(dtype)
            out = torch.empty_like(inp)
            done(be.all_to_all(out, inp, async_op=async_op), async_op)
            # chunk i of the output comes from rank i: 100*i + 10*r + m
            want = (100 * j + 10 * r + m).to(dtype)
            expect_equal(out, want, f"all_to_all {dtype} async={async_op}")


@case
def case_broadcast(be):
    r, n = be.rank, be.world_size
    src = n - 1  # a non-zero root where there is one
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
        for async_op in (False, True):
            t = (torch.arange(12).reshape(3, 4) + 100 * r).to(dtype)
            done(be.broadcast(t, src=src, async_op=async_op), async_op)
            expect_equal(t, (torch.arange(12).reshape(3, 4) + 100 * src).to(dtype),
                         f"broadcast {dtype} from {src} async={async_op}")


@case
def case_barrier(be):
    r = be.rank
    be.barrier()
    if r == 0:
        time.sleep(0.3)
    t0 = time.monotonic()
    be.barrier()
    waited = time.monotonic() - t0
    if r != 0:
        expect(waited > 0.2, f"barrier returned after {waited:.3f} s, before rank 0 arrived")


# --- byte accounting, errors, plumbing --------------------------------------------------------------
@case
def case_stats(be):
    n = be.world_size
    be.stats.reset()
    be.all_reduce(torch.ones(1000))  # 4000 bytes
    be.all_reduce(torch.ones(1000, dtype=torch.bfloat16), async_op=True).wait()  # reduced as fp32: 4000 bytes
    be.all_gather(torch.empty(n * 10, dtype=torch.float64), torch.ones(10, dtype=torch.float64))
    be.all_to_all(torch.empty(n * 6), torch.ones(n * 6))
    be.broadcast(torch.ones(7, dtype=torch.int64), src=0)
    want = {
        "all_reduce": 2 * int(2 * (n - 1) / n * 4000),
        "all_gather": (n - 1) * 80,
        "all_to_all": int((n - 1) / n * n * 24),
    }
    if n > 1:
        want["broadcast"] = 56
    got = {k: v for k, v in be.stats.bytes_sent.items() if v or k in want}
    expect(got == want, f"bytes_sent {got}, want {want}")
    calls = dict(be.stats.calls)
    want_calls = {"all_reduce": 2, "all_gather": 1, "all_to_all": 1}
    if n > 1:
        want_calls["broadcast"] = 1
    expect(calls == want_calls, f"calls {calls}, want {want_calls}")
    expect(be.stats.total_bytes == sum(want.values()), "total_bytes")


@case
def case_errors(be):
    def raises(exc, fn, what):
        try:
            fn()
        except exc:
            return
        raise AssertionError(f"{what} did not raise {exc.__name__}")

    n = be.world_size
    raises(ValueError, lambda: be.all_reduce(torch.ones(4, 4).t()), "non-contiguous all_reduce")
    raises(ValueError, lambda: be.all_gather(torch.empty(n * 4), torch.ones(8)[::2]), "non-contiguous all_gather")
    raises(ValueError, lambda: be.all_to_all(torch.empty(2, 2 * n).t(), torch.ones(4 * n)), "non-contiguous all_to_all")
    raises(ValueError, lambda: be.broadcast(torch.ones(4, 4).t()), "non-contiguous broadcast")
    raises(TypeError, lambda: be.all_reduce(torch.ones(4, dtype=torch.int32), "avg"), "integer avg")
    raises(ValueError, lambda: be.all_reduce(torch.ones(4), "max"), "op='max'")
    be.barrier()  # every rank still in step


@case
def case_plumbing(be):
    """What the CUDA path relies on, checked on the host: mpi4py takes a buffer given by
    ``__cuda_array_interface__`` (here over host memory, which an MPI that is not CUDA-aware just
    reads), and the CUDA-aware query answers."""
    r, n = be.rank, be.world_size
    expect(be.name == "mpi" and isinstance(be.cuda_aware, bool), f"name/cuda_aware: {be!r}")
    expect(isinstance(detect_cuda_aware(), bool), "detect_cuda_aware() must give a bool")
    t = torch.full((6,), float(r + 1))
    be.comm.Allreduce(be._mpi.IN_PLACE, [_CudaBytes(t), be._mpi.FLOAT], be._mpi.SUM)
    expect_equal(t, torch.full((6,), n * (n + 1) / 2), "all_reduce through __cuda_array_interface__")
    forced = MPIBackend(be.comm, cuda_aware=True)
    expect(forced.cuda_aware is True, "cuda_aware=True must force it")
    w = forced.all_reduce(torch.ones(3), async_op=True)
    expect(isinstance(w, MPIWork), f"async_op=True returned {type(w).__name__}")
    w.wait()


@case
def case_reduce_scatter(be):
    r, n = be.rank, be.world_size
    for async_op in (False, True):
        for op in ("sum", "avg"):
            x = torch.arange(4 * n, dtype=torch.float32) * (r + 1)
            out = torch.empty(4)
            done(be.reduce_scatter(out, x, op, async_op=async_op), async_op)
            want = torch.arange(4 * n, dtype=torch.float32)[4 * r : 4 * r + 4] * (n * (n + 1) // 2)
            expect_equal(out, want / n if op == "avg" else want, f"reduce_scatter {op} async={async_op}")


@case
def case_compressed_allreduce(be):
    """The compressed allreduce on MPI against the single-process reference (tests/)."""
    from allreduce_reference import mismatches, simulate
    from compressed_opt.comm import chunk_numel, compressed_allreduce, error_buffer_sizes

    n = be.world_size
    for numel in (0, 1, 33, 1000, 65_549):
        we_n, se_n = error_buffer_sizes(numel, n)
        we, se = torch.zeros(we_n), torch.zeros(se_n)
        ref_we = [torch.zeros(numel) for _ in range(n)]
        ref_se = [torch.zeros(chunk_numel(numel, n)) for _ in range(n)]
        for step in range(3):
            inputs = [torch.randn(numel, generator=torch.Generator().manual_seed(97 * step + 13 * k)) + k
                      for k in range(n)]
            got = compressed_allreduce(inputs[be.rank].clone(), we, se, be)
            want = simulate(inputs, ref_we, ref_se)
            bad = mismatches(got, want)
            expect(bad <= numel // 1000, f"numel {numel} step {step}: {bad} values differ from the reference")
            gathered = torch.empty(n * numel)
            be.all_gather(gathered, got)
            expect(all(torch.equal(c, got) for c in gathered.view(n, numel)) if numel else True,
                   "compressed_allreduce results differ between ranks")


@case
def case_hierarchical(be):
    """Node layouts on MPI (shared-memory nodes, the override) and the hierarchical compressed
    allreduce on MPI sub-communicators against the single-process reference (tests/); one rank
    per node on more than one rank is bitwise the flat exchange (one rank alone: the identity)."""
    from compressed_opt.comm import (RANKS_PER_NODE_ENV, compressed_allreduce, discover_layout, error_buffer_sizes,
                                     hierarchical_compressed_allreduce, hierarchical_error_buffer_sizes, node_backends)
    from test_hierarchical import assert_close_to_reference, rank_input, reference

    n = be.world_size
    found = discover_layout(be, env={})  # every rank of this job shares one machine's memory
    expect((found.nodes, found.source) == ((tuple(range(n)),), "MPI shared-memory nodes"), f"found {found}")
    if n % 2:
        expect(discover_layout(be, env={RANKS_PER_NODE_ENV: "2"}) is None, "2 per node must not fit 3 ranks")
    for per_node in sorted({1, n}):
        layout = discover_layout(be, env={RANKS_PER_NODE_ENV: str(per_node)})
        backends = node_backends(be, layout)
        expect((backends.intra.world_size, backends.inter.world_size) == (per_node, n // per_node),
               f"sub-communicators of {layout}")
        for numel in (1, 1000):
            sizes = hierarchical_error_buffer_sizes(numel, per_node, n // per_node)
            we, se = torch.zeros(sizes[0]), torch.zeros(sizes[1])
            flat_we, flat_se = (torch.zeros(k) for k in error_buffer_sizes(numel, n))
            want, _, _ = reference(layout.nodes, numel, 2)
            for step in range(2):
                got = hierarchical_compressed_allreduce(rank_input(be.rank, numel, step), we, se, backends)
                assert_close_to_reference(got, want[step], f"{layout}, numel {numel}, step {step}")
                gathered = torch.empty(n * numel)
                be.all_gather(gathered, got)
                expect(all(torch.equal(c, got) for c in gathered.view(n, numel)), f"{layout}: ranks differ")
                if per_node == 1 and n > 1:
                    flat = compressed_allreduce(rank_input(be.rank, numel, step), flat_we, flat_se, be)
                    expect(torch.equal(got, flat), f"{layout}: not bitwise the flat exchange")


@case
def case_onebit_adam(be):
    """OnebitAdam on the MPI backend: warmup equals AdamW, every rank holds the same parameters."""
    from torch import nn

    from compressed_opt import OnebitAdam
    from test_onebit_adam import HP, gaussian_batches, reference_run
    from optim_tasks import mlp

    steps, freeze = 6, 3
    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=freeze, backend=be, **HP)
    ref = reference_run(be.world_size, steps, freeze)
    for s, (x, y) in enumerate(gaussian_batches(be.rank, be.world_size, steps)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = torch.empty(be.world_size * flat.numel())
        be.all_gather(everyone, flat)
        expect(all(torch.equal(c, flat) for c in everyone.view(be.world_size, -1)), f"ranks differ after step {s + 1}")
        want = torch.cat([p.reshape(-1) for p in ref[s]])
        tol = 1e-5 if s < freeze else 1e-4
        err = ((flat - want).abs() / (want.abs() + 1e-3)).max().item()
        expect(err < tol, f"step {s + 1}: differs from the reference by {err}")


@case
def case_diloco(be):
    """DiLoCo on the MPI backend: with the 1-bit and the 4-bit exchanges the replicas are equal after
    every synchronisation; streamed (fragments 2, delay 1: the exchange on its thread) the anchors
    are equal on every rank and the loss falls."""
    from torch import nn

    from compressed_opt import DiLoCo
    from optim_tasks import mlp
    from test_onebit_adam import gaussian_batches

    def gathered(flat):
        everyone = torch.empty(be.world_size * flat.numel())
        be.all_gather(everyone, flat)
        return everyone.view(be.world_size, -1)

    for fragments, delay, compression in ((1, 0, "1bit"), (2, 1, "1bit"), (1, 0, "4bit")):
        torch.manual_seed(be.rank)  # (DiLoCo starts every replica from rank 0's parameters)
        model = mlp()
        opt = DiLoCo(model.parameters(), torch.optim.AdamW(model.parameters(), lr=1e-2), sync_every=4,
                     fragments=fragments, delay=delay, backend=be, compression=compression)
        losses = []
        for s, (x, y) in enumerate(gaussian_batches(be.rank, be.world_size, 16)):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if delay == 0 and (s + 1) % 4 == 0:
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                expect(all(torch.equal(c, flat) for c in gathered(flat)),
                       f"{compression}: replicas differ after step {s + 1}")
        opt.synchronize()
        anchors = torch.cat([f.anchor for f in opt.fragments])
        expect(all(torch.equal(c, anchors) for c in gathered(anchors)), f"anchors differ ({fragments}, {delay})")
        expect(sum(losses[-4:]) < sum(losses[:4]), f"the loss did not fall: {losses}")
        expect(opt.comm_stats()["syncs"] == 4 * fragments, f"{opt.comm_stats()['syncs']} synchronisations landed")
        opt.close()


@case
def case_consolidate(be):
    """consolidate_state_dict on MPI: rank 0's one state dict resumes every rank bit-exactly."""
    import copy
    import io

    from torch import nn

    from compressed_opt import OnebitAdam
    from optim_tasks import mlp
    from test_onebit_adam import HP, gaussian_batches

    batches = list(gaussian_batches(be.rank, be.world_size, 8))

    def train(model, opt, steps):
        for x, y in steps:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model = mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=2, backend=be, bucket_cap_mb=0.001, **HP)
    train(model, opt, batches[:5])
    opt.consolidate_state_dict(0)
    saved = io.BytesIO()
    if be.rank == 0:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
    size = torch.tensor([saved.getbuffer().nbytes if be.rank == 0 else 0], dtype=torch.int64)
    be.broadcast(size, src=0)
    data = torch.frombuffer(bytearray(saved.getvalue()), dtype=torch.uint8) if be.rank == 0 else \
        torch.empty(int(size), dtype=torch.uint8)
    be.broadcast(data, src=0)
    files = torch.load(io.BytesIO(data.numpy().tobytes()))
    expect(len(files["opt"]["compressed_opt"]["ranks"]) == be.world_size, "the state dict lacks the ranks' parts")
    resumed_model = copy.deepcopy(model)
    resumed_model.load_state_dict(files["model"])
    resumed = OnebitAdam(resumed_model.parameters(), freeze_step=2, backend=be, bucket_cap_mb=0.001, **HP)
    resumed.load_state_dict(files["opt"])
    train(model, opt, batches[5:])
    train(resumed_model, resumed, batches[5:])
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        expect(torch.equal(a, b), "the resumed rank differs from the uninterrupted one")


@case
def case_optimizer_modes(be):
    """On MPI, every optimizer in every mode it runs in (standalone overlapped and synchronous,
    ZeRO 1 and 2, under DDP's comm hook with a Gloo group of the same ranks beside the MPI
    backend): final loss on digits within 5% of the uncompressed optimizer's, bit-exact resume."""
    import tempfile

    import torch.distributed as dist

    from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam
    from optim_tasks import MODES, full_loss, in_mode, mlp, resume_diff, run_steps, shard_batches

    r, n = be.rank, be.world_size
    store = be.comm.bcast(tempfile.mktemp(prefix="compressed_opt_store_") if r == 0 else None, root=0)
    dist.init_process_group("gloo", store=dist.FileStore(store, n), rank=r, world_size=n)  # for DDP
    setups = {  # optimizer, its modes, hyperparameters, steps, freeze, the uncompressed baseline
        "onebit_adam": (OnebitAdam, MODES, dict(lr=1e-3), 150, dict(freeze_step=40), dict(freeze_step=10**9)),
        "onebit_lamb": (OnebitLamb, MODES, dict(lr=0.02, max_coeff=0.25), 150, dict(freeze_step=75),
                        dict(freeze_step=10**9)),
        "zero_one_adam": (ZeroOneAdam, ("overlap", "sync", "ddp"), dict(lr=3e-3), 78,
                          dict(var_freeze_step=30, var_update_scaler=8, local_step_scaler=10, local_step_clipper=4),
                          dict(var_freeze_step=10**9, var_update_scaler=10**9)),  # every step full precision
    }

    try:
        for name, (cls, modes, hp, steps, schedule, uncompressed) in setups.items():
            batches = list(shard_batches(r, n, steps))
            baseline = mlp()
            run_steps(*in_mode(cls, baseline, "overlap", backend=be, **hp, **uncompressed), batches)
            for mode in modes:
                model = mlp()
                run_steps(*in_mode(cls, model, mode, backend=be, **hp, **schedule), batches)
                ratio = full_loss(model) / full_loss(baseline)
                expect(ratio < 1.05, f"{name} {mode}: final loss {ratio:.3f}x the uncompressed optimizer's")
                short = dict(freeze_step=4) if cls is not ZeroOneAdam else dict(
                    var_freeze_step=6, var_update_scaler=2, local_step_scaler=3, local_step_clipper=4)

                def fresh():
                    model = mlp()
                    return (model, *in_mode(cls, model, mode, backend=be, **hp, **short))

                for cut in (3, 8):  # warmup / phase A, and the compression stage / phase B
                    diff = resume_diff(fresh, batches[:12], cut)
                    expect(diff == 0.0, f"{name} {mode}: resumed after {cut} steps differs by {diff}")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="+", help=f"'all' or some of: {', '.join(CASES)}")
    parser.add_argument("--comm", choices=("world", "self"), default="world")
    args = parser.parse_args(argv)
    names = list(CASES) if args.cases == ["all"] else args.cases
    unknown = [c for c in names if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {list(CASES)}")

    torch.set_num_threads(1)
    from mpi4py import MPI

    comm = MPI.COMM_SELF if args.comm == "self" else MPI.COMM_WORLD
    r, n = comm.Get_rank(), comm.Get_size()
    for name in names:
        try:
            CASES[name](MPIBackend(comm))
        except BaseException as e:  # noqa: BLE001 - report anything, then take the job down
            sys.stderr.write(f"FAIL {name} rank {r}/{n}: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            sys.stderr.flush()
            sys.stdout.flush()
            MPI.COMM_WORLD.Abort(1)
            return 1
        print(f"OK {name} rank {r}/{n}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
