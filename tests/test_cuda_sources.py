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
    width = {"p": "u64", "q": "u64", "i": "u32"}  # PTX types of 8-byte pointers, long long, int
    for name, kinds in gpu.SIGNATURES.items():
        params = re.search(rf"\.entry\s+{name}\((.*?)\)", text, re.DOTALL).group(1)
        types = re.findall(r"\.param\s+\.(\w+)", params)
        assert [t.replace("s", "u") for t in types] == [width[k] for k in kinds], name
