"""The CuPy kernels (``onebit.cu``) against the PyTorch reference and the native CPU path.

The whole module skips where ``compressed_opt.cuda.gpu.is_available()`` is False (no GPU, no
CuPy, or CuPy that cannot run a kernel). Inputs are made on the CPU, copied to the GPU, and the
results compared. A buffer travels as rows ``[nb fp32 scales | chunk / 8 bytes of bits]``, one
scale per block; on the GPU the rows are views at an odd offset, ``gap`` bytes apart, over
garbage, so that every byte must be written, and nothing else, with no alignment assumed:

* sign bits exactly, where the compensated value u cannot round differently: ``u = x + e`` is one
  fp32 addition everywhere; the server's ``z`` is compared exactly against the CPU path (same
  order of additions), and against the reference on dyadic inputs where every sum is exact;
* scales within rtol 1e-5 (the fp64 sum of squares is reduced in another order);
* error buffers allclose (exactly equal where the scales are equal).
"""
from __future__ import annotations

import pytest
import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel
from compressed_opt.cuda import cpu, gpu, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not gpu.is_available(),
        reason="no usable CUDA GPU with CuPy (compressed_opt.cuda.gpu.is_available() is False)",
    ),
]

SIZES = [0, 1, 7, 8, 9, 31, 32, 33, 255, 256, 257, 1000, 4097, 65_537, (1 << 20) + 3]
WORLDS = [1, 2, 3, 4, 8, 64]
BLOCKS = [256, 1024]
OFFSET = 1  # the GPU rows start at an odd byte: no scale is 4-byte aligned


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _cpu_impls():
    impls = [("reference", reference)]
    if cpu.library() is not None:
        impls.append(("cpu", cpu))
    return impls


def _garbage(shape, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape if isinstance(shape, tuple) else (shape,), dtype=torch.uint8, generator=g)


def _rows_on(impl, device, world, row_len, gap, g):
    """(storage, rows): garbage storage on ``device`` and the ``[world, row_len]`` rows in it: for
    the GPU kernels at byte OFFSET of lines of ``row_len + gap + OFFSET`` bytes, else contiguous."""
    if impl is not gpu:
        storage = _garbage((world, row_len), g).to(device)
        return storage, storage
    storage = _garbage((world, row_len + gap + OFFSET), g).to(device)
    return storage, storage[:, OFFSET: OFFSET + row_len]


def _split(rows, chunk, block):
    """(scales [R, nb], bit bytes [R, chunk / 8]) of rows, on the CPU."""
    nb, _ = kernels.rows_layout(chunk, block)
    rows = rows.cpu().clone(memory_format=torch.contiguous_format)  # offset 0: its scales view as fp32
    return reference.row_scales(rows, nb), rows[:, 4 * nb:]


def _outside(storage, gap):
    """The bytes of GPU storage that are not rows (must stay as they were)."""
    return torch.cat([storage[:, :OFFSET].reshape(-1), storage[:, storage.shape[1] - gap:].reshape(-1)]).cpu()


def _run_compress(impl, x, error, world, chunk, block, device, g, gap=0):
    """compress_rows_ on copies placed on ``device``; returns (error, rows) on the CPU."""
    _, row_len = kernels.rows_layout(chunk, block)
    e = error.clone().to(device)
    storage, rows = _rows_on(impl, device, world, row_len, gap, g)
    before = _outside(storage, gap) if storage is not rows else None
    impl.compress_rows_(None if x is None else x.to(device), e, rows, chunk, block)
    if before is not None:
        assert torch.equal(_outside(storage, gap), before), "bytes outside the rows were written"
    return e.cpu(), rows.cpu()


def _assert_same_rows(got, want, chunk, block, what, exact_error=True):
    (e1, r1), (e2, r2) = got, want
    (s1, b1), (s2, b2) = _split(r1, chunk, block), _split(r2, chunk, block)
    assert torch.equal(b1, b2), f"{what}: sign bits differ"
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=0, msg=f"{what}: scales")
    if exact_error and torch.equal(s1, s2):
        assert torch.equal(e1, e2), f"{what}: error differs with the same scales"
    atol = 1e-5 * max(float(s2.max()) if s2.numel() else 0.0, 1e-30)
    torch.testing.assert_close(e1, e2, rtol=1e-5, atol=atol, msg=f"{what}: error")


def _compress_inputs(n, with_x, g):
    x = torch.randn(n, generator=g) if with_x else None
    error = torch.randn(n, generator=g)
    if n > 5:  # exact zeros count as +
        error[5] = 0.0
        if with_x:
            x[5] = 0.0
    return x, error


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("with_x", [True, False])
def test_compress_matches_cpu(dev, n, world, block, with_x):
    g = torch.Generator().manual_seed(n * 16 + world * 2 + with_x + block)
    chunk = chunk_numel(n, world) or 32
    x, error = _compress_inputs(n, with_x, g)
    got = _run_compress(gpu, x, error, world, chunk, block, dev, g, gap=3 if with_x else 0)
    for name, impl in _cpu_impls():
        want = _run_compress(impl, x, error, world, chunk, block, "cpu", g)
        _assert_same_rows(got, want, chunk, block, f"compress n={n} world={world} block={block} vs {name}")


@pytest.mark.parametrize("chunk,block", [(32, 256), (288, 256), (1056, 256), (1056, 1024), (4096, 1024)])
def test_compress_writes_every_byte(dev, chunk, block):
    """The same result over rows of 0x00 and of 0xFF, with empty chunks and blocks (scale 0, bits 1)."""
    world = 4
    n = chunk + chunk // 3 + 1  # row 0 full, row 1 partly, rows 2 and 3 empty
    g = torch.Generator().manual_seed(chunk + block)
    x, error = _compress_inputs(n, True, g)
    _, row_len = kernels.rows_layout(chunk, block)
    results = []
    for fill in (0x00, 0xFF):
        rows = torch.full((world, row_len), fill, dtype=torch.uint8, device=dev)
        e = error.clone().to(dev)
        gpu.compress_rows_(x.to(dev), e, rows, chunk, block)
        results.append(rows.cpu())
    assert torch.equal(results[0], results[1])
    scales, bits = _split(results[0], chunk, block)
    assert not scales[2:].any() and (bits[2:] == 255).all()
    assert (scales[0] > 0).all()


def test_compress_through_dispatch_and_unaligned_views(dev):
    """Views at odd offsets (no alignment assumed) through the public dispatcher."""
    g = torch.Generator().manual_seed(3)
    n, world, block = 10_001, 3, 256
    chunk = chunk_numel(n, world)
    _, row_len = kernels.rows_layout(chunk, block)
    x = torch.randn(n + 1, generator=g)
    error = torch.randn(n + 1, generator=g)
    e_gpu = error.clone().to(dev)[1:]
    rows_gpu = torch.zeros(world * row_len + 1, dtype=torch.uint8, device=dev)[1:].view(world, row_len)
    assert kernels.kernel_path(dev) == "cuda"
    kernels.compress_rows_(x.to(dev)[1:], e_gpu, rows_gpu, chunk, block)
    e_ref, rows_ref = error[1:].clone(), torch.zeros(world, row_len, dtype=torch.uint8)
    reference.compress_rows_(x[1:], e_ref, rows_ref, chunk, block)
    _assert_same_rows((e_gpu.cpu(), rows_gpu.cpu()), (e_ref, rows_ref), chunk, block, "unaligned")


def test_zero_counts_as_plus_and_zero_vector(dev):
    x = torch.tensor([0.0, -0.0, -1.0, 2.0, 0.0], device=dev)
    err = torch.zeros(5, device=dev)
    rows = torch.zeros(1, 8, dtype=torch.uint8, device=dev)
    gpu.compress_rows_(x, err, rows, 32, 256)
    scales, bits = _split(rows, 32, 256)
    assert bits.tolist() == [[0b11111011, 255, 255, 255]]
    assert scales.item() == pytest.approx(1.0)
    zeros = torch.zeros(1000, device=dev)
    _, row_len = kernels.rows_layout(512, 256)
    rows = torch.zeros(2, row_len, dtype=torch.uint8, device=dev)
    gpu.compress_rows_(None, zeros, rows, 512, 256)
    scales, bits = _split(rows, 512, 256)
    assert not scales.any() and not zeros.any() and (bits == 255).all()


def test_empty_inputs(dev):
    """No valid element: the rows are still written (scales 0, bits 1); nothing else happens."""
    chunk, block = 288, 256
    nb, row_len = kernels.rows_layout(chunk, block)
    empty = torch.empty(0, device=dev)
    rows = torch.full((3, row_len), 7, dtype=torch.uint8, device=dev)
    gpu.compress_rows_(None, empty, rows, chunk, block)
    gpu.compress_rows_(empty, empty, rows, chunk, block)
    assert not rows[:, : 4 * nb].any() and (rows[:, 4 * nb:] == 255).all()
    out_row = torch.full((row_len,), 7, dtype=torch.uint8, device=dev)
    inputs = torch.randint(0, 256, (3, row_len), dtype=torch.uint8, device=dev)
    gpu.average_compress_rows_(inputs, empty, out_row, chunk, block)
    assert not out_row[: 4 * nb].any() and (out_row[4 * nb:] == 255).all()
    gpu.decompress_rows_(inputs, empty, chunk, block)
    gpu.compress_rows_(None, empty, torch.empty(0, 0, dtype=torch.uint8, device=dev), 0, block)  # chunk 0
    gpu.compress_rows_(None, empty, torch.empty(0, row_len, dtype=torch.uint8, device=dev), chunk, block)  # no rows
    assert empty.cpu().numel() == 0  # waits for the stream: a failed launch would show here


def test_each_block_gets_a_scale_of_its_own(dev):
    chunk, block = 512, 256
    x = torch.cat([torch.full((256,), 100.0), torch.full((256,), -0.01)]).to(dev)
    err = torch.zeros(512, device=dev)
    rows = torch.empty(1, kernels.rows_layout(chunk, block)[1], dtype=torch.uint8, device=dev)
    gpu.compress_rows_(x, err, rows, chunk, block)
    out = torch.empty(512, device=dev)
    gpu.decompress_rows_(rows, out, chunk, block)
    torch.testing.assert_close(out, x)
    assert not err.abs().max() > 1e-5


def test_error_feedback_over_many_steps(dev):
    """Repeated calls on the same buffers; each step starts the reference from the GPU's error
    buffer, so rounding cannot build up."""
    g = torch.Generator().manual_seed(11)
    n, world, block = 300_001, 4, 1024
    chunk = chunk_numel(n, world)
    _, row_len = kernels.rows_layout(chunk, block)
    error = torch.zeros(n, device=dev)
    rows = torch.empty(world, row_len, dtype=torch.uint8, device=dev)
    for step in range(20):
        x = torch.randn(n, generator=g) * (step + 1)
        e_ref, rows_ref = error.to("cpu", copy=True), torch.empty(world, row_len, dtype=torch.uint8)
        gpu.compress_rows_(x.to(dev), error, rows, chunk, block)
        reference.compress_rows_(x, e_ref, rows_ref, chunk, block)
        _assert_same_rows((error.cpu(), rows.cpu()), (e_ref, rows_ref), chunk, block, f"step {step}")


def test_streams_compress_at_once(dev):
    """Two streams compressing at once each get their own right scales (nothing is shared)."""
    g = torch.Generator().manual_seed(5)
    n, world, block = 1 << 20, 2, 1024
    chunk = chunk_numel(n, world)
    _, row_len = kernels.rows_layout(chunk, block)
    sources = [(torch.randn(n, generator=g) * (i + 1)) for i in range(2)]
    streams = [torch.cuda.Stream(dev) for _ in sources]
    errors = [torch.empty(n, device=dev) for _ in sources]
    rowss = [torch.empty(world, row_len, dtype=torch.uint8, device=dev) for _ in sources]
    on_dev = [src.to(dev) for src in sources]
    torch.cuda.synchronize(dev)
    for _ in range(10):
        for stream, e, rows, src in zip(streams, errors, rowss, on_dev):
            with torch.cuda.stream(stream):
                e.copy_(src)
                gpu.compress_rows_(None, e, rows, chunk, block)
    torch.cuda.synchronize(dev)
    for src, rows in zip(sources, rowss):
        want = torch.empty(world, row_len, dtype=torch.uint8)
        reference.compress_rows_(None, src.clone(), want, chunk, block)
        torch.testing.assert_close(_split(rows, chunk, block)[0], _split(want, chunk, block)[0], rtol=1e-5, atol=0)


def _average_inputs(world, chunk, block, m, g, dyadic=False):
    """Random rows (garbage bits, valid scales) and an error of m elements."""
    nb, row_len = kernels.rows_layout(chunk, block)
    rows = _garbage((world, row_len), g)
    if dyadic:  # powers of two and multiples of 2^-8: every sum below is exact in fp32
        scales = 2.0 ** torch.randint(-2, 3, (world, nb), generator=g).float()
        error = torch.randint(-512, 512, (m,), generator=g).float() / 256
    else:
        scales = torch.rand(world, nb, generator=g) + 0.05
        error = torch.randn(m, generator=g)
    rows[:, : 4 * nb] = scales.view(torch.uint8).view(world, 4 * nb)
    return rows, error


def _run_average(impl, rows, error, chunk, block, device, g, gap=0):
    """average_compress_rows_ on copies on ``device`` (on the GPU, strided rows at an odd offset,
    and an out_row at an odd offset); returns (error, out_row as [1, row_len]) on the CPU."""
    world, row_len = rows.shape
    e = error.clone().to(device)
    if impl is not gpu:
        inputs, out_storage, out_row = rows.clone().to(device), None, _garbage(row_len, g).to(device)
    else:
        storage = _garbage((world, row_len + gap + OFFSET), g).to(device)
        inputs = storage[:, OFFSET: OFFSET + row_len]
        inputs.copy_(rows.to(device))
        out_storage = _garbage(row_len + 2 * OFFSET, g).to(device)
        out_row = out_storage[OFFSET: OFFSET + row_len]
        before = out_storage.cpu()
    impl.average_compress_rows_(inputs, e, out_row, chunk, block)
    if out_storage is not None:
        after = out_storage.cpu()
        assert after[:OFFSET].equal(before[:OFFSET]) and after[OFFSET + row_len:].equal(before[OFFSET + row_len:])
        assert torch.equal(inputs.cpu(), rows), "the input rows were written"
    return e.cpu(), out_row.cpu().view(1, -1)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("chunk", [32, 288, 4096, 100_032])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("short", [0, 5, 300])
def test_average_compress_matches_cpu_path(dev, world, chunk, block, short):
    """Same order of additions as onebit_cpu.c: identical z, hence identical bits."""
    if cpu.library() is None:
        pytest.skip("no C compiler: no native CPU path to compare bit for bit")
    g = torch.Generator().manual_seed(world * 1000 + chunk + block + short)
    m = max(0, chunk - short)  # error may hold fewer than chunk elements
    rows, error = _average_inputs(world, chunk, block, m, g)
    got = _run_average(gpu, rows, error, chunk, block, dev, g, gap=world % 4)
    want = _run_average(cpu, rows, error, chunk, block, "cpu", g)
    _assert_same_rows(got, want, chunk, block, f"average world={world} chunk={chunk} m={m} block={block}")


@pytest.mark.parametrize("world", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("m", [1, 33, 2048, 50_001])
@pytest.mark.parametrize("block", BLOCKS)
def test_average_compress_matches_reference_on_exact_sums(dev, world, m, block):
    """Dyadic inputs and a power-of-two world: z is exact in any order of additions, so the
    bits (exact zeros included) and the errors match the reference."""
    g = torch.Generator().manual_seed(world + m + block)
    chunk = chunk_numel(m, 1) + 32
    rows, error = _average_inputs(world, chunk, block, m, g, dyadic=True)
    got = _run_average(gpu, rows, error, chunk, block, dev, g, gap=1)
    want = _run_average(reference, rows, error, chunk, block, "cpu", g)
    _assert_same_rows(got, want, chunk, block, f"average world={world} m={m} vs reference")


def test_average_compress_1024_ranks(dev):
    """The most ranks the kernels take: exact sums against the reference, and the CPU path."""
    world, chunk, block, m = 1024, 3104, 1024, 3100
    g = torch.Generator().manual_seed(1024)
    rows, error = _average_inputs(world, chunk, block, m, g, dyadic=True)
    got = _run_average(gpu, rows, error, chunk, block, dev, g, gap=3)
    for name, impl in _cpu_impls():
        want = _run_average(impl, rows, error, chunk, block, "cpu", g)
        _assert_same_rows(got, want, chunk, block, f"average world=1024 vs {name}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("block", BLOCKS)
def test_average_compress_random_against_reference(dev, world, block):
    """Random floats: bits agree wherever z is not within rounding of 0."""
    g = torch.Generator().manual_seed(world + block)
    chunk = m = 20_000
    nb, _ = kernels.rows_layout(chunk, block)
    rows, error = _average_inputs(world, chunk, block, m, g)
    signs = reference.unpack_bits(rows[:, 4 * nb:].contiguous()).view(world, -1)[:, :m].double() * 2 - 1
    weights = (reference.row_scales(rows, nb).double() / world).repeat_interleave(block, dim=1)[:, :m]
    z = error.double() + (weights * signs).sum(0)  # exact enough
    e1, r1 = _run_average(gpu, rows, error, chunk, block, dev, g)
    e2, r2 = _run_average(reference, rows, error, chunk, block, "cpu", g)
    far = z.abs() > 1e-5
    (s1, b1), (s2, b2) = _split(r1, chunk, block), _split(r2, chunk, block)
    b1, b2 = reference.unpack_bits(b1)[:m], reference.unpack_bits(b2)[:m]
    assert torch.equal(b1[far], b2[far])
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=0)
    torch.testing.assert_close(e1[far], e2[far], rtol=1e-5, atol=1e-5)


def _decompress_inputs(nrows, chunk, block, g):
    nb, row_len = kernels.rows_layout(chunk, block)
    rows = _garbage((nrows, row_len), g)
    rows[:, : 4 * nb] = (torch.rand(nrows, nb, generator=g) + 0.1).view(torch.uint8).view(nrows, 4 * nb)
    return rows


@pytest.mark.parametrize("nrows", [1, 2, 3, 8])
@pytest.mark.parametrize("chunk", [32, 256, 288, 1056, 8000])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("gap", [0, 5])
@pytest.mark.parametrize("missing", [0, 1, 9, 300])
def test_decompress_matches_reference(dev, nrows, chunk, block, gap, missing):
    """Rows may be strided (a view skipping `gap` bytes per row, at an odd offset)."""
    g = torch.Generator().manual_seed(nrows * 100 + chunk + block + gap + missing)
    rows = _decompress_inputs(nrows, chunk, block, g)
    n = max(0, nrows * chunk - missing)
    want = torch.empty(n)
    reference.decompress_rows_(rows, want, chunk, block)
    storage = _garbage((nrows, rows.shape[1] + gap + OFFSET), g).to(dev)
    on_dev = storage[:, OFFSET: OFFSET + rows.shape[1]]
    on_dev.copy_(rows.to(dev))
    out = torch.full((n + 3,), 7.0, device=dev)
    gpu.decompress_rows_(on_dev, out[:n], chunk, block)
    assert torch.equal(out[:n].cpu(), want)
    assert (out[n:] == 7.0).all()  # nothing written past n


@pytest.mark.parametrize("n", [0, 1, 100, 255, 256, 257, 1023, 1024, 1025, 2047, 2048 * 3 - 1, 2048 * 4])
def test_decompress_partial_rows(dev, n):
    g = torch.Generator().manual_seed(n)
    chunk, block = 2048, 1024
    rows = _decompress_inputs(4, chunk, block, g)
    want = torch.empty(n)
    reference.decompress_rows_(rows, want, chunk, block)
    out = torch.empty(n, device=dev)
    kernels.decompress_rows_(rows.to(dev), out, chunk, block)
    assert torch.equal(out.cpu(), want)


def test_round_trip_compressed_allreduce_shapes(dev):
    """Worker compress -> server average-compress -> decompress, as in docs/design.md 2.2, on one device."""
    g = torch.Generator().manual_seed(9)
    world, n, block = 4, 4 * 8 * 1000 - 77, 1024
    chunk = chunk_numel(n, world)
    _, row_len = kernels.rows_layout(chunk, block)
    xs = [torch.randn(n, generator=g) for _ in range(world)]
    results = {}
    for name, impl, device in [("gpu", gpu, dev), ("cpu", cpu if cpu.library() else reference, "cpu")]:
        worker_errors = [torch.zeros(n, device=device) for _ in range(world)]
        sent = [torch.empty(world, row_len, dtype=torch.uint8, device=device) for _ in range(world)]
        for i in range(world):
            impl.compress_rows_(xs[i].to(device), worker_errors[i], sent[i], chunk, block)
        served = torch.empty(world, row_len, dtype=torch.uint8, device=device)
        for j in range(world):
            rows_in = torch.stack([sent[i][j] for i in range(world)])  # row j of every rank
            m = min(chunk, n - j * chunk)
            impl.average_compress_rows_(rows_in, torch.zeros(m, device=device), served[j], chunk, block)
        out = torch.empty(n, device=device)
        impl.decompress_rows_(served, out, chunk, block)
        results[name] = out.cpu()
    torch.testing.assert_close(results["gpu"], results["cpu"], rtol=1e-5, atol=1e-6)


def test_no_host_synchronisation(dev):
    """The three kernels run with torch's sync debug mode set to error."""
    n, world, block = 1 << 16, 4, 1024
    chunk = chunk_numel(n, world)
    _, row_len = kernels.rows_layout(chunk, block)
    x = torch.randn(n, device=dev)
    e = torch.zeros(n, device=dev)
    rows = torch.empty(world, row_len, dtype=torch.uint8, device=dev)
    out_row = torch.empty(row_len, dtype=torch.uint8, device=dev)
    server_e = torch.zeros(chunk, device=dev)
    out = torch.empty(n, device=dev)
    gpu.compress_rows_(x, e, rows, chunk, block)  # warm: compile
    torch.cuda.synchronize(dev)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            kernels.compress_rows_(x, e, rows, chunk, block)
            kernels.average_compress_rows_(rows, server_e, out_row, chunk, block)
            kernels.decompress_rows_(rows, out, chunk, block)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(dev)


@pytest.mark.parametrize("n,world,block", [(1 << 22, 1, 1 << 22), (1 << 22, 8, 256), ((1 << 24) + 77, 8, 1024)])
def test_sizes_cover_many_units(dev, n, world, block):
    """Large buffers: many units per warp (grid-stride), and one block of a whole 4M chunk."""
    g = torch.Generator().manual_seed(n + world)
    chunk = chunk_numel(n, world)
    error = torch.randn(n, generator=g)
    impl = cpu if cpu.library() is not None else reference
    got = _run_compress(gpu, None, error, world, chunk, block, dev, g, gap=2)
    want = _run_compress(impl, None, error, world, chunk, block, "cpu", g)
    _assert_same_rows(got, want, chunk, block, f"n={n} world={world} block={block}")
