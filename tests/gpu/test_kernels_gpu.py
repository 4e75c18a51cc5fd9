"""The CuPy kernels (``onebit.cu``) against the PyTorch reference and the native CPU path.

The whole module skips where ``compressed_opt.cuda.gpu.is_available()`` is False (no GPU, no
CuPy, or CuPy that cannot run a kernel). Inputs are made on the CPU, copied to the GPU, and the
results compared:

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


@pytest.fixture(scope="module")
def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _cpu_impls():
    impls = [("reference", reference)]
    if cpu.library() is not None:
        impls.append(("cpu", cpu))
    return impls


def _garbage(numel: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (numel,), dtype=torch.uint8, generator=g)


def _run_compress(impl, x, error, nbytes, device, g):
    """compress_ on copies placed on `device`; returns (error, packed, scale) on the CPU."""
    e = error.clone().to(device)
    packed = _garbage(nbytes, g).to(device)  # every byte must be overwritten
    scale = torch.full((1,), 123.0, device=device)
    impl.compress_(None if x is None else x.to(device), e, packed, scale)
    return e.cpu(), packed.cpu(), scale.cpu()


def _assert_same_compression(got, want, what, exact_error=True):
    (e1, p1, s1), (e2, p2, s2) = got, want
    assert torch.equal(p1, p2), f"{what}: sign bits differ"
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=0, msg=f"{what}: scale")
    if exact_error and torch.equal(s1, s2):
        assert torch.equal(e1, e2), f"{what}: error differs with the same scale"
    torch.testing.assert_close(e1, e2, rtol=1e-5, atol=1e-5 * max(float(s2), 1e-30), msg=f"{what}: error")


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("with_x", [True, False])
@pytest.mark.parametrize("extra_bytes", [0, 3])
def test_compress_matches_cpu(dev, n, with_x, extra_bytes):
    g = torch.Generator().manual_seed(n * 4 + with_x * 2 + extra_bytes)
    x = torch.randn(n, generator=g) if with_x else None
    error = torch.randn(n, generator=g)
    if n > 5:  # exact zeros count as +
        error[5] = 0.0
        if with_x:
            x[5] = 0.0
    nbytes = kernels.packed_numel(n) + extra_bytes
    got = _run_compress(gpu, x, error, nbytes, dev, g)
    assert (got[1][kernels.packed_numel(n):] == 255).all()  # bits past n are 1
    for name, impl in _cpu_impls():
        want = _run_compress(impl, x, error, nbytes, "cpu", torch.Generator().manual_seed(1))
        _assert_same_compression(got, want, f"compress n={n} vs {name}")


def test_compress_through_dispatch_and_unaligned_views(dev):
    """Views at odd offsets (no alignment assumed) through the public dispatcher."""
    g = torch.Generator().manual_seed(3)
    n = 10_001
    x = torch.randn(n + 1, generator=g)
    error = torch.randn(n + 1, generator=g)
    e_gpu = error.to(dev)[1:]
    p_gpu = torch.zeros(kernels.packed_numel(n) + 1, dtype=torch.uint8, device=dev)[1:]
    s_gpu = torch.zeros(2, device=dev)[1:]
    assert kernels.kernel_path(dev) == "cuda"
    kernels.compress_(x.to(dev)[1:], e_gpu, p_gpu, s_gpu)
    e_ref, p_ref, s_ref = error[1:].clone(), torch.zeros(kernels.packed_numel(n), dtype=torch.uint8), torch.zeros(1)
    reference.compress_(x[1:], e_ref, p_ref, s_ref)
    _assert_same_compression((e_gpu.cpu(), p_gpu.cpu(), s_gpu.cpu()), (e_ref, p_ref, s_ref), "unaligned")


def test_zero_counts_as_plus_and_zero_vector(dev):
    x = torch.tensor([0.0, -0.0, -1.0, 2.0, 0.0], device=dev)
    err = torch.zeros(5, device=dev)
    packed = torch.zeros(1, dtype=torch.uint8, device=dev)
    scale = torch.empty(1, device=dev)
    gpu.compress_(x, err, packed, scale)
    assert packed.item() == 0b11111011
    assert scale.item() == pytest.approx(1.0)
    zeros = torch.zeros(1000, device=dev)
    packed = torch.zeros(125 + 2, dtype=torch.uint8, device=dev)
    gpu.compress_(None, zeros, packed, scale)
    assert scale.item() == 0.0 and not zeros.any() and (packed == 255).all()


def test_error_feedback_over_many_steps(dev):
    """Repeated calls reuse the device workspace: every call must see a clean reduction.

    Each step starts the reference from the GPU's error buffer, so rounding cannot build up.
    """
    g = torch.Generator().manual_seed(11)
    n = 300_001
    error = torch.zeros(n, device=dev)
    packed = torch.empty(kernels.packed_numel(n), dtype=torch.uint8, device=dev)
    scale = torch.empty(1, device=dev)
    for step in range(20):
        x = torch.randn(n, generator=g) * (step + 1)
        e_ref, p_ref, s_ref = error.to("cpu", copy=True), torch.empty_like(packed, device="cpu"), torch.empty(1)
        gpu.compress_(x.to(dev), error, packed, scale)
        reference.compress_(x, e_ref, p_ref, s_ref)
        _assert_same_compression((error.cpu(), packed.cpu(), scale.cpu()), (e_ref, p_ref, s_ref), f"step {step}")


def test_streams_do_not_share_a_workspace(dev):
    """Two streams compressing at once each get the right scale."""
    g = torch.Generator().manual_seed(5)
    sources = [(torch.randn(1 << 20, generator=g) * (i + 1)).to(dev) for i in range(2)]
    streams = [torch.cuda.Stream(dev) for _ in sources]
    errors = [torch.empty_like(src) for src in sources]
    packeds = [torch.empty(1 << 17, dtype=torch.uint8, device=dev) for _ in sources]
    scales = [torch.empty(1, device=dev) for _ in sources]
    torch.cuda.synchronize(dev)
    for _ in range(10):
        for stream, e, p, sc, src in zip(streams, errors, packeds, scales, sources):
            with torch.cuda.stream(stream):
                e.copy_(src)
                gpu.compress_(None, e, p, sc)
    torch.cuda.synchronize(dev)
    for src, sc in zip(sources, scales):
        expected = src.double().norm() / (src.numel() ** 0.5)
        assert sc.item() == pytest.approx(expected.item(), rel=1e-5)


def _average_inputs(world, n, row_bytes, g, dyadic=False):
    chunks = _garbage(world * row_bytes, g).view(world, row_bytes)
    if dyadic:  # powers of two and multiples of 2^-8: every sum below is exact in fp32
        scales = 2.0 ** torch.randint(-2, 3, (world,), generator=g).float()
        error = torch.randint(-512, 512, (n,), generator=g).float() / 256
    else:
        scales = torch.rand(world, generator=g) + 0.05
        error = torch.randn(n, generator=g)
    return chunks, scales, error


def _run_average(impl, chunks, scales, error, device, g):
    e = error.clone().to(device)
    packed = _garbage(chunks.shape[1], g).to(device)
    scale = torch.full((1,), 123.0, device=device)
    impl.average_compress_(chunks.to(device), scales.to(device), e, packed, scale)
    return e.cpu(), packed.cpu(), scale.cpu()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("n", [0, 1, 9, 255, 257, 4096, 100_003])
@pytest.mark.parametrize("short", [0, 5])
def test_average_compress_matches_cpu_path(dev, world, n, short):
    """Same order of additions as onebit_cpu.c: identical z, hence identical bits."""
    if cpu.library() is None:
        pytest.skip("no C compiler: no native CPU path to compare bit for bit")
    g = torch.Generator().manual_seed(world * 1000 + n + short)
    row_bytes = kernels.packed_numel(n) + (1 if short else 0)
    m = max(0, n - short)  # error may hold fewer than 8 * row_bytes elements
    chunks, scales, error = _average_inputs(world, m, row_bytes, g)
    got = _run_average(gpu, chunks, scales, error, dev, g)
    want = _run_average(cpu, chunks, scales, error, "cpu", g)
    _assert_same_compression(got, want, f"average world={world} n={m}")
    assert (got[1][kernels.packed_numel(m):] == 255).all()


@pytest.mark.parametrize("world", [1, 2, 4, 8, 64, 1024])
@pytest.mark.parametrize("n", [1, 33, 2048, 50_001])
def test_average_compress_matches_reference_on_exact_sums(dev, world, n):
    """Dyadic inputs and a power-of-two world: z is exact in any order of additions, so the
    bits (exact zeros included) and the errors match the reference."""
    g = torch.Generator().manual_seed(world + n)
    chunks, scales, error = _average_inputs(world, n, kernels.packed_numel(n), g, dyadic=True)
    got = _run_average(gpu, chunks, scales, error, dev, g)
    want = _run_average(reference, chunks, scales, error, "cpu", g)
    _assert_same_compression(got, want, f"average world={world} n={n} vs reference")


@pytest.mark.parametrize("world", WORLDS)
def test_average_compress_random_against_reference(dev, world):
    """Random floats: bits agree wherever z is not within rounding of 0."""
    g = torch.Generator().manual_seed(world)
    n = 20_000
    chunks, scales, error = _average_inputs(world, n, kernels.packed_numel(n), g)
    signs = reference.unpack_bits(chunks).view(world, -1)[:, :n].double() * 2 - 1
    z = error.double() + ((scales.double() / world)[:, None] * signs).sum(0)  # exact enough
    e1, p1, s1 = _run_average(gpu, chunks, scales, error, dev, g)
    e2, p2, s2 = _run_average(reference, chunks, scales, error, "cpu", g)
    far = z.abs() > 1e-5
    b1, b2 = reference.unpack_bits(p1)[:n], reference.unpack_bits(p2)[:n]
    assert torch.equal(b1[far], b2[far])
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=0)
    torch.testing.assert_close(e1[far], e2[far], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 8])
@pytest.mark.parametrize("row_bytes", [1, 3, 32, 33, 1000])
@pytest.mark.parametrize("gap", [0, 5])
@pytest.mark.parametrize("missing", [0, 1, 9])
def test_decompress_matches_reference(dev, rows, row_bytes, gap, missing):
    """Rows of packed may be strided (a view skipping `gap` bytes per row and a 2-byte header)."""
    g = torch.Generator().manual_seed(rows * 100 + row_bytes + gap + missing)
    storage = _garbage(rows * (row_bytes + gap + 2), g).view(rows, row_bytes + gap + 2)
    scales = torch.rand(rows, generator=g) + 0.1
    n = max(0, rows * row_bytes * 8 - missing)
    want = torch.empty(n)
    reference.decompress_(storage[:, 2 : 2 + row_bytes], scales, want)
    packed = storage.to(dev)[:, 2 : 2 + row_bytes]
    assert packed.stride(0) == row_bytes + gap + 2
    out = torch.full((n + 3,), 7.0, device=dev)
    gpu.decompress_(packed, scales.to(dev), out[:n])
    assert torch.equal(out[:n].cpu(), want)
    assert (out[n:] == 7.0).all()  # nothing written past n


@pytest.mark.parametrize("n", [0, 1, 100, 255, 256, 257, 2047, 2048 * 3 - 1, 2048 * 4])
def test_decompress_partial_rows(dev, n):
    g = torch.Generator().manual_seed(n)
    packed = _garbage(4 * 256, g).view(4, 256)
    scales = torch.rand(4, generator=g)
    want = torch.empty(n)
    reference.decompress_(packed, scales, want)
    out = torch.empty(n, device=dev)
    kernels.decompress_(packed.to(dev), scales.to(dev), out)
    assert torch.equal(out.cpu(), want)


def test_round_trip_compressed_allreduce_shapes(dev):
    """Worker compress -> server average-compress -> decompress, as in docs/design.md 2.2, on one device."""
    g = torch.Generator().manual_seed(9)
    world, n = 4, 4 * 8 * 1000
    chunk = n // world
    xs = [torch.randn(n, generator=g) for _ in range(world)]
    results = {}
    for name, impl, device in [("gpu", gpu, dev), ("cpu", cpu if cpu.library() else reference, "cpu")]:
        worker_errors = [torch.zeros(n, device=device) for _ in range(world)]
        packed = torch.empty(world, n // 8, dtype=torch.uint8, device=device)
        scales = torch.empty(world, device=device)
        for i in range(world):
            impl.compress_(xs[i].to(device), worker_errors[i], packed[i], scales[i : i + 1])
        server_bits = torch.empty(world, chunk // 8, dtype=torch.uint8, device=device)
        server_scales = torch.empty(world, device=device)
        for j in range(world):
            rows = packed[:, j * chunk // 8 : (j + 1) * chunk // 8].contiguous()
            impl.average_compress_(
                rows, scales, torch.zeros(chunk, device=device), server_bits[j], server_scales[j : j + 1]
            )
        out = torch.empty(n, device=device)
        impl.decompress_(server_bits, server_scales, out)
        results[name] = out.cpu()
    torch.testing.assert_close(results["gpu"], results["cpu"], rtol=1e-5, atol=1e-6)


def test_no_host_synchronisation(dev):
    """The three kernels run with torch's sync debug mode set to error."""
    n = 1 << 16
    x = torch.randn(n, device=dev)
    e = torch.zeros(n, device=dev)
    packed = torch.empty(n // 8, dtype=torch.uint8, device=dev)
    scale = torch.empty(1, device=dev)
    chunks = torch.randint(0, 256, (4, n // 32), dtype=torch.uint8, device=dev)
    scales = torch.rand(4, device=dev)
    server_e = torch.zeros(n // 4, device=dev)
    out = torch.empty(n, device=dev)
    gpu.compress_(x, e, packed, scale)  # warm: compile, workspace
    torch.cuda.synchronize(dev)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            kernels.compress_(x, e, packed, scale)
            kernels.average_compress_(chunks, scales, server_e, packed[: n // 32], scale)
            kernels.decompress_(chunks, scales, out[: n])
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize(dev)


def test_sizes_cover_many_tiles_and_blocks(dev):
    """Large buffers: many blocks per pass, grid-stride tiles, the last block's reduction."""
    for n in (1 << 22, (1 << 24) + 77):
        g = torch.Generator().manual_seed(n)
        error = torch.randn(n, generator=g)
        got = _run_compress(gpu, None, error, kernels.packed_numel(n), dev, g)
        want = _run_compress(reference, None, error, kernels.packed_numel(n), "cpu", g)
        _assert_same_compression(got, want, f"n={n}")

