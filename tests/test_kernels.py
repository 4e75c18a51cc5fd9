"""Compression invariants of the kernels (docs/design.md 2.1, 2.2), on every CPU path, and agreement of
the native CPU path with the PyTorch reference. A buffer of ``world`` chunks travels as ``world``
rows ``[one fp32 scale per block | the chunk's sign bits]``."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel
from compressed_opt.cuda import cpu, reference

PATHS = ["dispatch", "reference"]


def _impl(path):
    return kernels if path == "dispatch" else reference


def _rows(world, chunk, block, fill=0):
    return torch.full((world, kernels.rows_layout(chunk, block)[1]), fill, dtype=torch.uint8)


def _split(rows, chunk, block):
    """(scales [R, nb], bits [R, chunk]) of rows."""
    nb, _ = kernels.rows_layout(chunk, block)
    bits = reference.unpack_bits(rows[:, 4 * nb:].contiguous()).view(rows.shape[0], -1)[:, :chunk]
    return reference.row_scales(rows, nb), bits


floats = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, allow_subnormal=False, width=32)


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=60, deadline=None)
@given(data=st.data(), world=st.integers(1, 3), chunk=st.sampled_from([32, 256, 288, 640]),
       block=st.sampled_from([256, 512]))
def test_compress_invariants(path, data, world, chunk, block):
    n = data.draw(st.integers(0, world * chunk))
    x = torch.tensor(data.draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float32)
    err0 = torch.tensor(data.draw(st.lists(floats, min_size=n, max_size=n)), dtype=torch.float32)
    err = err0.clone()
    rows = _rows(world, chunk, block)
    _impl(path).compress_rows_(x, err, rows, chunk, block)
    u = x + err0
    scales, bits = _split(rows, chunk, block)
    padded = torch.zeros(world * chunk)
    padded[:n] = u
    valid = torch.arange(world * chunk) < n
    for j in range(world):
        for b, lo in enumerate(range(0, chunk, block)):
            k = slice(j * chunk + lo, j * chunk + min(lo + block, chunk))
            part, mask = padded[k], valid[k]
            got = bits[j, lo: lo + part.numel()]
            # the sign bits: 1 exactly where u >= 0 (zero counts as +); invalid elements' bits are 1
            assert torch.equal(got[mask], part[mask] >= 0) and got[~mask].all()
            # the block's scale is ||u_block|| / sqrt(its valid elements), 0 without any
            count = int(mask.sum())
            want = part[mask].double().norm().item() / math.sqrt(count) if count else 0.0
            assert scales[j, b].item() == pytest.approx(want, rel=1e-5, abs=1e-30)
    # compensated == decompressed + new error
    out = torch.empty(n)
    _impl(path).decompress_rows_(rows, out, chunk, block)
    torch.testing.assert_close(out + err, u, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_zero_counts_as_plus(path):
    x = torch.tensor([0.0, -0.0, -1.0, 2.0, 0.0])
    err = torch.zeros(5)
    rows = _rows(1, 32, 256)
    _impl(path).compress_rows_(x, err, rows, 32, 256)
    scales, bits = _split(rows, 32, 256)
    assert bits[0, :5].tolist() == [True, True, False, True, True] and bits[0, 5:].all()
    assert scales.item() == pytest.approx(math.sqrt(5 / 5))
    # a zero input decompresses to +scale, so its error is -scale
    assert err[0].item() == pytest.approx(-scales.item())


@pytest.mark.parametrize("path", PATHS)
def test_all_zero_vector_has_zero_scale_and_error(path):
    x, err = torch.zeros(600), torch.zeros(600)
    rows = _rows(2, 320, 256, fill=7)
    _impl(path).compress_rows_(x, err, rows, 320, 256)
    scales, bits = _split(rows, 320, 256)
    assert not scales.any() and not err.any() and bits.all()


@pytest.mark.parametrize("path", PATHS)
def test_each_block_gets_a_scale_of_its_own(path):
    """A block of small values next to one of large values in the same chunk: each decompresses
    at its own size (one scale for the chunk would send the small ones at the large ones')."""
    chunk, block = 512, 256
    x = torch.cat([torch.full((256,), 100.0), torch.full((256,), -0.01)])
    err = torch.zeros(512)
    rows = _rows(1, chunk, block)
    _impl(path).compress_rows_(x, err, rows, chunk, block)
    out = torch.empty(512)
    _impl(path).decompress_rows_(rows, out, chunk, block)
    torch.testing.assert_close(out, x)  # each block is constant: its 1 bit and scale are exact
    assert not err.abs().max() > 1e-5


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 33, 255, 256, 257, 4095, 4097, 100_003])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
@pytest.mark.parametrize("block", [256, 1024])
def test_cpu_path_matches_reference(n, world, block):
    if cpu.library() is None:
        pytest.skip("no C compiler: the CPU path is the reference itself")
    g = torch.Generator().manual_seed(n * 7 + world + block)
    chunk = chunk_numel(n, world) or 32
    x = torch.randn(n, generator=g)
    e1 = torch.randn(n, generator=g)
    e2 = e1.clone()
    r1, r2 = _rows(world, chunk, block), _rows(world, chunk, block)
    reference.compress_rows_(x, e1, r1, chunk, block)
    cpu.compress_rows_(x, e2, r2, chunk, block)
    (s1, b1), (s2, b2) = _split(r1, chunk, block), _split(r2, chunk, block)
    assert torch.equal(b1, b2)
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=0)
    torch.testing.assert_close(e1, e2, rtol=0, atol=1e-5)

    # the server side: random rows in, this rank's chunk (m valid elements) out
    nb, row_len = kernels.rows_layout(chunk, block)
    rows_in = torch.randint(0, 256, (world, row_len), dtype=torch.uint8, generator=g)
    rows_in[:, : 4 * nb] = torch.rand(world, nb, generator=g).view(torch.uint8).view(world, 4 * nb)
    m = min(n, chunk)
    z1 = torch.randn(m, generator=g)
    z2 = z1.clone()
    q1, q2 = torch.empty(row_len, dtype=torch.uint8), torch.empty(row_len, dtype=torch.uint8)
    reference.average_compress_rows_(rows_in, z1, q1, chunk, block)
    cpu.average_compress_rows_(rows_in, z2, q2, chunk, block)
    (s1, b1), (s2, b2) = _split(q1.view(1, -1), chunk, block), _split(q2.view(1, -1), chunk, block)
    assert torch.equal(b1, b2)
    torch.testing.assert_close(s1, s2, rtol=1e-6, atol=0)
    torch.testing.assert_close(z1, z2, rtol=0, atol=1e-5)

    # decompress from rows that lie apart (a view that skips bytes between rows)
    storage = torch.randint(0, 256, (world, row_len + 3), dtype=torch.uint8, generator=g)
    storage[:, : 4 * nb] = torch.rand(world, nb, generator=g).view(torch.uint8).view(world, 4 * nb)
    framed = storage[:, :row_len]
    out1, out2 = torch.empty(n), torch.empty(n)
    reference.decompress_rows_(framed, out1, chunk, block)
    cpu.decompress_rows_(framed, out2, chunk, block)
    assert torch.equal(out1, out2)


def test_average_compress_is_the_mean_of_decompressed_rows():
    world, chunk, block = 4, 768, 256
    g = torch.Generator().manual_seed(1)
    nb, row_len = kernels.rows_layout(chunk, block)
    rows = torch.randint(0, 256, (world, row_len), dtype=torch.uint8, generator=g)
    rows[:, : 4 * nb] = torch.rand(world, nb, generator=g).view(torch.uint8).view(world, 4 * nb)
    err = torch.zeros(chunk)
    out_row = torch.empty(row_len, dtype=torch.uint8)
    kernels.average_compress_rows_(rows, err, out_row, chunk, block)
    decompressed = torch.empty(world * chunk)
    kernels.decompress_rows_(rows, decompressed, chunk, block)
    z = decompressed.view(world, chunk).mean(0)
    out = torch.empty(chunk)
    kernels.decompress_rows_(out_row.view(1, -1), out, chunk, block)
    torch.testing.assert_close(out + err, z, rtol=1e-6, atol=1e-6)


def test_kernels_reject_bad_buffers():
    x, err = torch.zeros(64), torch.zeros(64)
    rows = _rows(2, 32, 256)
    with pytest.raises(TypeError, match="error must be torch.float32"):
        kernels.compress_rows_(x, err.double(), rows, 32, 256)
    with pytest.raises(ValueError, match="block must be a positive multiple of 256"):
        kernels.compress_rows_(x, err, rows, 32, 100)
    with pytest.raises(ValueError, match="chunk must be a multiple of 32"):
        kernels.compress_rows_(x, err, rows, 40, 256)
    with pytest.raises(ValueError, match=r"rows must be \[rows, 8\] bytes"):
        kernels.compress_rows_(x, err, rows[:, :6], 32, 256)
    with pytest.raises(ValueError, match="cannot hold 64"):
        kernels.compress_rows_(x, err, rows[:1], 32, 256)
    with pytest.raises(ValueError, match="x has 8 elements"):
        kernels.compress_rows_(x[:8], err, rows, 32, 256)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.compress_rows_(torch.zeros(128)[::2], err, rows, 32, 256)
    with pytest.raises(ValueError, match="error must hold at most 32"):
        kernels.average_compress_rows_(rows, err, torch.empty(8, dtype=torch.uint8), 32, 256)
    with pytest.raises(ValueError, match="out has 65 elements"):
        kernels.decompress_rows_(rows, torch.empty(65), 32, 256)


def test_reference_is_forced_by_environment(monkeypatch):
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    assert kernels.kernel_path(torch.device("cpu")) == "reference"
