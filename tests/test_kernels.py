"""Compression invariants of the kernels (docs/design.md 2.1), on every CPU path, and agreement of the
native CPU path with the PyTorch reference."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressed_opt import cuda as kernels
from compressed_opt.cuda import cpu, reference

PATHS = ["dispatch", "reference"]


def _impl(path):
    return kernels if path == "dispatch" else reference


floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_subnormal=False, width=32)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=60, deadline=None)
@given(x=st.lists(floats, min_size=0, max_size=300), e=st.data())
def test_compress_invariants(path, x, e):
    n = len(x)
    x = torch.tensor(x, dtype=torch.float32)
    err0 = torch.tensor(e.draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float32)
    err = err0.clone()
    packed = torch.zeros(kernels.packed_numel(n) + 1, dtype=torch.uint8)
    scale = torch.empty(1)
    _impl(path).compress_(x, err, packed, scale)
    u = x + err0
    bits = reference.unpack_bits(packed)
    # the sign bits: 1 exactly where u >= 0 (zero counts as +); padding bits are 1
    assert torch.equal(bits[:n], u >= 0)
    assert bits[n:].all()
    # the scale is ||u|| / sqrt(n)
    expected = u.double().norm().item() / math.sqrt(n) if n else 0.0
    assert scale.item() == pytest.approx(expected, rel=1e-5, abs=1e-30)
    # compensated == decompressed + new error
    decompressed = scale * (bits[:n].float() * 2 - 1)
    torch.testing.assert_close(decompressed + err, u, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_zero_counts_as_plus(path):
    x = torch.tensor([0.0, -0.0, -1.0, 2.0, 0.0])
    err = torch.zeros(5)
    packed = torch.zeros(1, dtype=torch.uint8)
    scale = torch.empty(1)
    _impl(path).compress_(x, err, packed, scale)
    assert reference.unpack_bits(packed)[:5].tolist() == [True, True, False, True, True]
    assert scale.item() == pytest.approx(math.sqrt(5 / 5))
    # a zero input decompresses to +scale, so its error is -scale
    assert err[0].item() == pytest.approx(-scale.item())


@pytest.mark.parametrize("path", PATHS)
def test_all_zero_vector_has_zero_scale_and_error(path):
    x = torch.zeros(40)
    err = torch.zeros(40)
    packed = torch.empty(5, dtype=torch.uint8)
    scale = torch.empty(1)
    _impl(path).compress_(x, err, packed, scale)
    assert scale.item() == 0.0 and not err.any() and (packed == 255).all()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4095, 4096, 4097, 100_003])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_cpu_path_matches_reference(n, world):
    if cpu.library() is None:
        pytest.skip("no C compiler: the CPU path is the reference itself")
    g = torch.Generator().manual_seed(n * 7 + world)
    x = torch.randn(n, generator=g)
    e1 = torch.randn(n, generator=g)
    e2 = e1.clone()
    p1, p2 = (torch.empty(kernels.packed_numel(n) + 3, dtype=torch.uint8),
              torch.empty(kernels.packed_numel(n) + 3, dtype=torch.uint8))
    s1, s2 = torch.empty(1), torch.empty(1)
    reference.compress_(x, e1, p1, s1)
    cpu.compress_(x, e2, p2, s2)
    assert torch.equal(p1, p2)
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=0)
    torch.testing.assert_close(e1, e2, rtol=0, atol=1e-5)

    row = -(-n // 8) + 2
    chunks = torch.randint(0, 256, (world, row), dtype=torch.uint8, generator=g)
    scales = torch.rand(world, generator=g)
    z1 = torch.randn(n, generator=g)
    z2 = z1.clone()
    q1, q2 = torch.empty(row, dtype=torch.uint8), torch.empty(row, dtype=torch.uint8)
    reference.average_compress_(chunks, scales, z1, q1, s1)
    cpu.average_compress_(chunks, scales, z2, q2, s2)
    assert torch.equal(q1, q2)
    torch.testing.assert_close(z1, z2, rtol=0, atol=1e-5)

    framed = torch.randint(0, 256, (world, row + 4), dtype=torch.uint8, generator=g)
    out1, out2 = torch.empty(min(n, world * row * 8)), torch.empty(min(n, world * row * 8))
    reference.decompress_(framed[:, 4:], scales, out1)
    cpu.decompress_(framed[:, 4:], scales, out2)
    assert torch.equal(out1, out2)


def test_average_compress_is_the_mean_of_decompressed_chunks():
    world, n = 4, 64
    g = torch.Generator().manual_seed(1)
    chunks = torch.randint(0, 256, (world, n // 8), dtype=torch.uint8, generator=g)
    scales = torch.rand(world, generator=g)
    err = torch.zeros(n)
    packed = torch.empty(n // 8, dtype=torch.uint8)
    scale = torch.empty(1)
    kernels.average_compress_(chunks, scales, err, packed, scale)
    signs = reference.unpack_bits(chunks).view(world, n).float() * 2 - 1
    z = (scales[:, None] * signs).mean(0)
    out = torch.empty(n)
    kernels.decompress_(packed.view(1, -1), scale, out)
    torch.testing.assert_close(out + err, z, rtol=1e-6, atol=1e-6)


def test_kernels_reject_bad_buffers():
    x, err = torch.zeros(16), torch.zeros(16)
    packed, scale = torch.empty(2, dtype=torch.uint8), torch.empty(1)
    with pytest.raises(TypeError, match="error must be torch.float32"):
        kernels.compress_(x, err.double(), packed, scale)
    with pytest.raises(ValueError, match="packed needs 2 bytes"):
        kernels.compress_(x, err, packed[:1], scale)
    with pytest.raises(ValueError, match="x has 8 elements"):
        kernels.compress_(x[:8], err, packed, scale)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.compress_(torch.zeros(32)[::2], err, packed, scale)
    with pytest.raises(ValueError, match="one scale per row"):
        kernels.decompress_(packed.view(1, 2), torch.ones(2), torch.empty(16))


def test_reference_is_forced_by_environment(monkeypatch):
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    assert kernels.kernel_path(torch.device("cpu")) == "reference"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("n", [0, 5, 1000, 4099])
def test_split_compression_equals_one_call(path, n):
    """compress_(finish=False) + finish_ (what the allreduce runs around its collectives) gives
    the same bits, scale and error as one compress_, on the worker and the server side."""
    impl = _impl(path)
    g = torch.Generator().manual_seed(n)
    x, e = torch.randn(n, generator=g), torch.randn(n, generator=g)
    out = []
    for finish in (True, False):
        err, packed, scale = e.clone(), torch.empty(kernels.packed_numel(n) + 1, dtype=torch.uint8), torch.empty(1)
        impl.compress_(x, err, packed, scale, finish)
        if not finish:
            impl.finish_(err, scale)
        out.append((err, packed, scale))
    assert all(torch.equal(a, b) for a, b in zip(*out))
    chunks = torch.randint(0, 256, (3, -(-n // 8) + 1), dtype=torch.uint8, generator=g)
    scales = torch.rand(3, generator=g)
    out = []
    for finish in (True, False):
        err, packed, scale = e.clone(), torch.empty(chunks.shape[1], dtype=torch.uint8), torch.empty(1)
        impl.average_compress_(chunks, scales, err, packed, scale, finish)
        if not finish:
            impl.finish_(err, scale)
        out.append((err, packed, scale))
    assert all(torch.equal(a, b) for a, b in zip(*out))
