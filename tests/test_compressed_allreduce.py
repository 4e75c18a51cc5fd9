"""compressed_allreduce (docs/design.md 2.2) against the single-process reference, on 1-4 Gloo ranks."""
import pytest
import torch

from allreduce_reference import assert_matches_reference, simulate
from compressed_opt.comm import (
    SingleProcessBackend,
    chunk_numel,
    compressed_allreduce,
    compressed_allreduce_plan,
    error_buffer_sizes,
    get_backend,
    wire_bytes,
)
from distributed import run_ranks, spawn_ranks

SIZES = [0, 1, 5, 32, 33, 1000, 4099, 65_536 + 13]


def rank_input(rank, numel, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 17 * rank + numel)
    return (torch.randn(numel, generator=g) + 0.3 * rank).to(dtype)


def _allreduce_steps(rank, world, sizes, steps, dtype):
    backend = get_backend("auto")
    assert backend.world_size == world and backend.rank == rank
    out = {}
    for numel in sizes:
        we_n, se_n = error_buffer_sizes(numel, world)
        worker_error, server_error = torch.zeros(we_n), torch.zeros(se_n)
        results = []
        for step in range(steps):
            x = rank_input(rank, numel, step, dtype)
            y = compressed_allreduce(x, worker_error, server_error, backend)
            assert y.dtype == dtype and y.shape == x.shape
            results.append(y.clone())
        out[numel] = (results, worker_error.clone(), server_error.clone())
    out["stats"] = backend.stats.snapshot()
    return out


def _reference_steps(world, numel, steps, dtype):
    we = [torch.zeros(numel) for _ in range(world)]
    se = [torch.zeros(chunk_numel(numel, world)) for _ in range(world)]
    outs = []
    for step in range(steps):
        xs = [rank_input(r, numel, step, dtype) for r in range(world)]
        outs.append(simulate(xs, we, se).to(dtype))
    return outs, we, se


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_single_process_reference(world):
    steps = 3
    results = run_ranks(_allreduce_steps, world, SIZES, steps, torch.float32, timeout=180)
    for numel in SIZES:
        ref_outs, ref_we, ref_se = _reference_steps(world, numel, steps, torch.float32)
        for rank in range(world):
            outs, worker_error, server_error = results[rank][numel]
            # identical on every rank
            for step in range(steps):
                assert torch.equal(outs[step], results[0][numel][0][step])
            assert_matches_reference(outs[0], ref_outs[0])
            assert_matches_reference(outs[-1], ref_outs[-1])
            assert_matches_reference(worker_error, ref_we[rank])
            assert_matches_reference(server_error, ref_se[rank])
    # bytes: three collectives per call, as counted by the backend
    stats = results[0]["stats"]
    assert stats["calls"]["all_to_all"] == steps * len([s for s in SIZES if s])
    assert stats["total_bytes"] == steps * sum(wire_bytes(s, world) if s else (world - 1) * 16 for s in SIZES)


@pytest.mark.multiprocess
def test_low_precision_inputs_on_two_ranks():
    results = run_ranks(_allreduce_steps, 2, [1000], 2, torch.bfloat16)
    ref, _, _ = _reference_steps(2, 1000, 2, torch.bfloat16)
    assert_matches_reference(results[0][1000][0][1], ref[1], scale_tol=1e-2)
    results = run_ranks(_allreduce_steps, 2, [1000], 2, torch.float16)
    assert torch.equal(results[0][1000][0][1], results[1][1000][0][1])


def _error_feedback(rank, world, numel, steps):
    backend = get_backend("auto")
    we_n, se_n = error_buffer_sizes(numel, world)
    worker_error, server_error = torch.zeros(we_n), torch.zeros(se_n)
    fixed = rank_input(rank, numel, 0)
    running = torch.zeros(numel, dtype=torch.float64)
    gaps = []
    for step in range(1, steps + 1):
        running += compressed_allreduce(fixed.clone(), worker_error, server_error, backend).double()
        if step in (1, steps):
            gaps.append(running / step)
    return gaps


@pytest.mark.multiprocess
def test_error_feedback_running_mean_approaches_true_mean():
    world, numel, steps = 2, 512, 200
    results = run_ranks(_error_feedback, world, numel, steps)
    true_mean = sum(rank_input(r, numel, 0).double() for r in range(world)) / world
    first, last = results[0]
    err_first = (first - true_mean).norm() / true_mean.norm()
    err_last = (last - true_mean).norm() / true_mean.norm()
    # one 1-bit step is far off; the time average converges like O(1/steps)
    assert err_first > 0.3
    assert err_last < 0.02
    assert err_last < err_first / 20


def _mismatched_sizes(rank, world):
    backend = get_backend("auto")
    numel = 100 if rank == 0 else 120
    we_n, se_n = error_buffer_sizes(numel, world)
    compressed_allreduce(torch.ones(numel), torch.zeros(we_n), torch.zeros(se_n), backend)


@pytest.mark.multiprocess
def test_ranks_that_disagree_on_the_size_all_raise():
    outcomes = spawn_ranks(_mismatched_sizes, 2, timeout=60)
    for status, value in outcomes:
        assert status == "error"
        assert "different tensors on different ranks" in value and "rank 0: 100" in value and "rank 1: 120" in value


# --- single process --------------------------------------------------------------------------
@pytest.mark.parametrize("numel", SIZES)
def test_world_of_one_matches_reference(numel):
    backend = SingleProcessBackend()
    we_n, se_n = error_buffer_sizes(numel, 1)
    we, se = torch.zeros(we_n), torch.zeros(se_n)
    ref_we, ref_se = [torch.zeros(we_n)], [torch.zeros(se_n)]
    for step in range(3):
        x = rank_input(0, numel, step)
        expected = simulate([x], ref_we, ref_se)
        assert_matches_reference(compressed_allreduce(x.clone(), we, se, backend), expected)


def test_shape_and_non_contiguous_input():
    backend = SingleProcessBackend()
    base = torch.randn(8, 6)
    x = base.t()  # non-contiguous
    we_n, se_n = error_buffer_sizes(x.numel(), 1)
    y = compressed_allreduce(x, torch.zeros(we_n), torch.zeros(se_n), backend)
    assert y.shape == (6, 8)
    expected = simulate([base.t().contiguous()], [torch.zeros(we_n)], [torch.zeros(se_n)])
    assert_matches_reference(y, expected)


def test_a_plan_called_directly_checks_unless_agreed_and_agreed_skips_the_header():
    """The plan behind compressed_allreduce, called with agreed=True after one checked exchange,
    gives the same result bit for bit without the header all-gather; called without it, it checks
    its arguments as compressed_allreduce does (its kernels trust the buffers' sizes)."""
    n = 4099
    we_n, se_n = error_buffer_sizes(n, 1)
    backend, other = SingleProcessBackend(), SingleProcessBackend()
    errors = [torch.zeros(we_n), torch.zeros(se_n)], [torch.zeros(we_n), torch.zeros(se_n)]
    plan = compressed_allreduce_plan(n, backend, torch.device("cpu"))
    for step in range(3):
        x = rank_input(0, n, step)
        want = compressed_allreduce(x.clone(), *errors[0], other)
        calls = dict(backend.stats.calls)
        got = plan(x.clone(), *errors[1], agreed=step > 0)
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(*errors))
        sent = {k: v - calls.get(k, 0) for k, v in backend.stats.calls.items()}
        assert sent == ({"all_gather": 1, "all_to_all": 1} if step > 0 else {"all_gather": 2, "all_to_all": 1})
    with pytest.raises(ValueError, match="worker_error"):
        plan(torch.zeros(n), torch.zeros(we_n - 1), torch.zeros(se_n))
    with pytest.raises(ValueError, match="4099 elements"):
        plan(torch.zeros(n + 1), *[torch.zeros(k) for k in error_buffer_sizes(n + 1, 1)])


def test_a_result_left_in_its_rows_is_the_expanded_result():
    """expand=False (a caller that reads the result's 1-bit rows): the tensor is left as it was,
    the error buffers and rows are those of the exchange that expands, and the rows decompress to
    its result bit for bit; alone and coalesced with an exchange that expands."""
    from compressed_opt.comm import coalesced_compressed_allreduce, result_rows
    from compressed_opt.cuda import decompress_rows_

    n, backend, other = 4099, SingleProcessBackend(), SingleProcessBackend()
    sizes = error_buffer_sizes(n, 1)
    plan = compressed_allreduce_plan(n, backend, torch.device("cpu"))
    kept, expanded = [torch.zeros(k) for k in sizes], [torch.zeros(k) for k in sizes]
    for step in range(3):
        x = rank_input(0, n, step)
        want = compressed_allreduce(x.clone(), *expanded, other)
        left = x.clone()
        plan(left, *kept, agreed=step > 0, expand=False)
        assert torch.equal(left, x)
        assert all(torch.equal(a, b) for a, b in zip(kept, expanded))
        assert torch.equal(plan.gathered, result_rows(n, other, torch.device("cpu")))
        got = torch.empty(n)
        decompress_rows_(plan.gathered.view(1, -1), got, plan.chunk, plan.block)
        assert torch.equal(got, want)
    m = 333
    small = compressed_allreduce_plan(m, backend, torch.device("cpu"))
    small(torch.zeros(m), *[torch.zeros(k) for k in error_buffer_sizes(m, 1)])  # (agreed)
    xs = [rank_input(0, n, 9), rank_input(0, m, 9)]
    errors = [[e.clone() for e in kept], [torch.zeros(k) for k in error_buffer_sizes(m, 1)]]
    ref = [compressed_allreduce(x.clone(), *[e.clone() for e in es], other) for x, es in zip(xs, errors)]
    tensors = [x.clone() for x in xs]
    rows = coalesced_compressed_allreduce([plan, small], tensors, [e[0] for e in errors], [e[1] for e in errors],
                                          expands=[False, True])
    assert torch.equal(tensors[0], xs[0]) and torch.equal(tensors[1], ref[1])
    got = torch.empty(n)
    decompress_rows_(rows[0].contiguous(), got, plan.chunk, plan.block)
    assert torch.equal(got, ref[0])


def test_error_buffer_sizes():
    assert error_buffer_sizes(100, 1) == (100, 128)
    assert error_buffer_sizes(100, 4) == (100, 32)
    assert error_buffer_sizes(0, 3) == (0, 0)
    assert error_buffer_sizes(1 << 24, 2) == (1 << 24, 1 << 23)
    with pytest.raises(ValueError):
        error_buffer_sizes(-1, 2)


def test_wire_bytes_are_about_32x_below_fp32_allreduce():
    numel, world = 16 << 20, 2
    fp32_ring = 2 * (world - 1) / world * 4 * numel
    assert fp32_ring / wire_bytes(numel, world) > 31


@pytest.mark.parametrize(
    "tensor, we, se, exc, match",
    [
        (torch.ones(8, dtype=torch.int32), torch.zeros(8), torch.zeros(32), TypeError, "float32, bfloat16 or float16"),
        (torch.ones(8, dtype=torch.float64), torch.zeros(8), torch.zeros(32), TypeError,
         "float32, bfloat16 or float16"),
        (torch.ones(8), torch.zeros(9), torch.zeros(32), ValueError, "worker_error must be a contiguous buffer of 8"),
        (torch.ones(8), torch.zeros(8), torch.zeros(8), ValueError, "server_error must be a contiguous buffer of 32"),
        (torch.ones(8), torch.zeros(8, dtype=torch.float16), torch.zeros(32), TypeError,
         "worker_error must be float32"),
        (torch.ones(8), torch.zeros(8, device="meta"), torch.zeros(32), ValueError, "worker_error is on meta"),
    ],
)
def test_bad_input_names_the_problem(tensor, we, se, exc, match):
    with pytest.raises(exc, match=match):
        compressed_allreduce(tensor, we, se, SingleProcessBackend())


def test_backend_must_be_a_backend():
    with pytest.raises(TypeError, match="backend must be"):
        compressed_allreduce(torch.ones(8), torch.zeros(8), torch.zeros(32), "gloo")


def test_get_backend_without_process_group(monkeypatch):
    for var in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)
    assert isinstance(get_backend("auto"), SingleProcessBackend)
    with pytest.raises(RuntimeError, match="init_process_group"):
        get_backend("torch")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=4 says this is one of 4 ranks"):
        get_backend("auto")
    with pytest.raises(ValueError, match="backend kind"):
        get_backend("nccl2")


def test_a_single_rank_exchanges_a_large_buffer_in_one_piece():
    """One rank's collectives are local copies: pieces (and their staging copies) would gain nothing."""
    numel, steps = (4 << 20) + 13, 2
    backend = SingleProcessBackend()
    we_n, se_n = error_buffer_sizes(numel, 1)
    worker_error, server_error = torch.zeros(we_n), torch.zeros(se_n)
    ref_outs, ref_we, ref_se = _reference_steps(1, numel, steps, torch.float32)
    for step in range(steps):
        y = compressed_allreduce(rank_input(0, numel, step, torch.float32), worker_error, server_error, backend)
    assert_matches_reference(y, ref_outs[-1])
    assert_matches_reference(worker_error, ref_we[0])
    assert_matches_reference(server_error, ref_se[0])
    calls = backend.stats.snapshot()["calls"]
    assert calls["all_to_all"] == steps  # (two ranks: 2 pieces, below)
    assert calls["all_gather"] == 2 * steps  # the rows in one piece, and the header


@pytest.mark.multiprocess
def test_large_buffers_travel_in_concurrent_pieces():
    numel, steps = (4 << 20) + 13, 2
    results = run_ranks(_allreduce_steps, 2, [numel], steps, torch.float32, timeout=180)
    ref_outs, ref_we, ref_se = _reference_steps(2, numel, steps, torch.float32)
    for rank in range(2):
        outs, worker_error, server_error = results[rank][numel]
        assert torch.equal(outs[-1], results[0][numel][0][-1])
        assert_matches_reference(outs[-1], ref_outs[-1])
        assert_matches_reference(worker_error, ref_we[rank])
        assert_matches_reference(server_error, ref_se[rank])
    stats = results[0]["stats"]
    assert stats["calls"]["all_to_all"] == 2 * steps  # 2 x 256 KiB of bits per rank: 2 pieces
    assert stats["total_bytes"] == steps * wire_bytes(numel, 2)
