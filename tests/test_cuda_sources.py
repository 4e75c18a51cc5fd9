"""The CUDA kernels' source compiles, without a GPU: nvcc to PTX for the archs we support.

CuPy compiles ``onebit.cu`` with NVRTC at first use on a GPU; this catches syntax and type errors
(and any warning) on machines that have nvcc but no GPU, and checks that every kernel that
``compressed_opt.cuda.gpu`` launches is in the module under its unmangled name.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import compressed_opt.cuda
from compressed_opt.cuda import gpu

SOURCE = Path(compressed_opt.cuda.__file__).with_name("onebit.cu")
NVCC = shutil.which("nvcc")


def test_source_is_installed_with_the_package():
    assert SOURCE.is_file()
    assert gpu.SOURCE == SOURCE


def test_source_is_nvrtc_friendly():
    text = SOURCE.read_text(encoding="utf-8")
    # NVRTC has no system headers; CuPy compiles the file as one translation unit.
    assert not re.search(r"^\s*#\s*include", text, re.MULTILINE)
    for name in gpu.SIGNATURES:
        assert re.search(rf'extern "C" __global__ void {name}\(', text), name


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_compiles_to_ptx_with_every_kernel(arch, tmp_path):
    ptx = tmp_path / f"onebit_{arch}.ptx"
    cmd = [NVCC, "-ptx", f"-arch={arch}", "--Werror", "all-warnings", "-o", str(ptx), str(SOURCE)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx.read_text()))
    assert entries == set(gpu.SIGNATURES)


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")
def test_kernel_parameters_match_the_launch_signatures(tmp_path):
    """The argument kinds gpu.py passes (pointer / int64 / int32) are the kernels' parameters."""
    ptx = tmp_path / "onebit.ptx"
    done = subprocess.run(
        [NVCC, "-ptx", "-arch=sm_80", "-o", str(ptx), str(SOURCE)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    text = ptx.read_text()
    width = {"p": "u64", "q": "u64", "i": "u32", "f": "f32"}  # PTX types of 8-byte pointers, long long, int, float
    for name, kinds in gpu.SIGNATURES.items():
        params = re.search(rf"\.entry\s+{name}\((.*?)\)", text, re.DOTALL).group(1)
        types = re.findall(r"\.param\s+\.(\w+)", params)
        assert [t.replace("s", "u") for t in types] == [width[k] for k in kinds], name


# A device's resident blocks per kernel, e.g. an H100's 132 SMs at 8 blocks each.
RESIDENT = {name: 132 * 8 for name in gpu.SIGNATURES}
_INT_RANGE = {"p": (0, 1 << 64), "q": (-(1 << 63), 1 << 63), "i": (-(1 << 31), 1 << 31)}
_FLOAT = {"f"}


def _check_launch(plan, name, resident=RESIDENT):
    """The plan is one launch of ``name`` within the device limits, its arguments of the kinds of
    the kernel's signature; returns its grid."""
    assert [launch[0] for launch in plan] == [name]
    _, (grid_x, grid_y), args = plan[0]
    assert 1 <= grid_x <= min(resident[name], gpu.MAX_GRID_X) and 1 <= grid_y <= gpu.MAX_GRID_Y
    kinds = gpu.SIGNATURES[name]
    assert len(args) == len(kinds)
    for kind, value in zip(kinds, args):
        if kind in _FLOAT:
            assert isinstance(value, float), (kind, value)
            continue
        lo, hi = _INT_RANGE[kind]
        assert isinstance(value, int) and lo <= value < hi, (kind, value)
    return grid_x, grid_y


GEOMETRIES = [  # (world, chunk, block, n)
    (1, 32, 256, 0), (1, 32, 256, 20), (3, 288, 256, 800), (4, 1024, 1024, 4000), (2, 1056, 1024, 2000),
    (8, 1 << 20, 1024, 8 << 20), (64, 4096, 256, 64 * 4096 - 5), (1024, 32, 256, 1024 * 32), (1, 1 << 22, 1 << 22, 7),
    (16, 1 << 27, 256, 1 << 31),
]


@pytest.mark.parametrize("world,chunk,block,n", GEOMETRIES)
def test_compress_plans_cover_every_unit(world, chunk, block, n):
    """One warp per (row, block) unit, walked grid-stride: the grid gives every unit a warp of its
    own unless the device is full, and has no block without a unit."""
    nb, row_len = compressed_opt.cuda.rows_layout(chunk, block)
    units = world * nb
    plan = gpu.compress_plan(0x1001, 0x2001, 0x3001, row_len + 3, world, chunk, block, n, RESIDENT)
    grid, _ = _check_launch(plan, "co_compress_rows")
    assert plan[0][2] == (0x1001, 0x2001, 0x3001, row_len + 3, world, chunk, block, n)
    assert grid * gpu.WARPS >= min(units, RESIDENT["co_compress_rows"] * gpu.WARPS)
    assert (grid - 1) * gpu.WARPS < units
    plan = gpu.compress_plan(0, 0x2001, 0x3001, row_len, world, chunk, block, n, RESIDENT)  # x = None
    assert plan[0][2][0] == 0


@pytest.mark.parametrize("world,chunk,block,n", GEOMETRIES)
def test_fused_local_momentum_compress_plans_are_the_compress_plans(world, chunk, block, n):
    """The local momentum's pass fused into the compression: the compression's grid (one warp per
    (row, block) unit), with the pass's inputs before the compression's arguments."""
    nb, row_len = compressed_opt.cuda.rows_layout(chunk, block)
    plain = gpu.compress_plan(0x1001, 0x2001, 0x3001, row_len + 3, world, chunk, block, n, RESIDENT)
    plan = gpu.lerp_scale_clamp_compress_plan(0x1001, 0x4001, 0.1, 0x5001, 0x6001, 0x7001, 7, 1, 0x2001, 0x3001,
                                              row_len + 3, world, chunk, block, n, RESIDENT)
    grid, _ = _check_launch(plan, "co_lerp_scale_clamp_compress_rows")
    assert grid == plain[0][1][0]
    assert plan[0][2] == (0x1001, 0x4001, 0.1, 0x5001, 0x6001, 0x7001, 7, 1, 0x2001, 0x3001, row_len + 3, world, chunk,
                          block, n)
    assert gpu.lerp_scale_clamp_compress_plan(0, 0, 0.1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 32, 256, 0, RESIDENT) == []


@pytest.mark.parametrize("world,chunk,block,n", GEOMETRIES)
def test_average_compress_plans_cover_every_block(world, chunk, block, n):
    nb, row_len = compressed_opt.cuda.rows_layout(chunk, block)
    m = min(n, chunk)
    world = min(world, 1024)
    plan = gpu.average_compress_plan(0x1001, row_len, world, chunk, block, 0x2001, 0x3001, m, RESIDENT)
    grid, _ = _check_launch(plan, "co_average_compress_rows")
    assert plan[0][2] == (0x1001, row_len, world, chunk, block, 0x2001, 0x3001, m)
    assert grid * gpu.WARPS >= min(nb, RESIDENT["co_average_compress_rows"] * gpu.WARPS)
    assert (grid - 1) * gpu.WARPS < nb


@pytest.mark.parametrize("world,chunk,block,n", GEOMETRIES + [(100_000, 32, 256, 100_000 * 32 - 1)])
def test_decompress_plans_cover_every_row_and_tile(world, chunk, block, n):
    """Blocks along y walk the rows (more rows than the grid's y limit wrap round), warps along x
    a row's tiles; the grid stays within what the device holds at once."""
    _, row_len = compressed_opt.cuda.rows_layout(chunk, block)
    plan = gpu.decompress_plan(0x1001, row_len + 5, chunk, block, 0x2001, n, RESIDENT)
    if n == 0:
        assert plan == []
        return
    name = "co_decompress_rows"
    grid_x, grid_y = _check_launch(plan, name)
    nrows = -(-n // chunk)
    assert plan[0][2] == (0x1001, row_len + 5, nrows, chunk, block, 0x2001, n)
    assert nrows <= world and grid_y == min(nrows, gpu.MAX_GRID_Y)
    tiles = -(-min(n, chunk) // gpu.TILE)
    per_row = -(-RESIDENT[name] // grid_y)  # the blocks per row the device holds at once
    assert grid_x * gpu.WARPS >= min(tiles, per_row * gpu.WARPS) and (grid_x - 1) * gpu.WARPS < tiles


def test_plans_without_work_launch_nothing():
    """No rows, or chunks of no element: nothing to write, no launch (a grid of 0 is an error)."""
    assert gpu.compress_plan(0, 0, 0, 0, 0, 32, 256, 0, RESIDENT) == []
    assert gpu.compress_plan(0, 0, 0, 0, 3, 0, 256, 0, RESIDENT) == []
    assert gpu.average_compress_plan(0, 0, 3, 0, 256, 0, 0, 0, RESIDENT) == []
    assert gpu.decompress_plan(0, 8, 32, 256, 0, 0, RESIDENT) == []
    # but an empty buffer still writes its rows (scales 0, bits 1)
    assert len(gpu.compress_plan(0, 0, 0x10, 8, 2, 32, 256, 0, RESIDENT)) == 1
    assert len(gpu.average_compress_plan(0, 8, 2, 32, 256, 0, 0x10, 0, RESIDENT)) == 1


def test_gpu_module_has_the_cpu_modules_api():
    """The dispatcher calls the same three functions, with the same parameters, on either path."""
    import inspect

    from compressed_opt.cuda import cpu

    for name in ("compress_rows_", "average_compress_rows_", "decompress_rows_"):
        assert inspect.signature(getattr(gpu, name)) == inspect.signature(getattr(cpu, name)), name
