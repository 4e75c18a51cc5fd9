"""The kernel registry and its one agreement harness (compressed_opt.cuda.registry, .harness).

Every native pass whose rounding depends on PyTorch's kernels registers a check; the registry binds
the native pass only where the check agrees, else the reference, with a warning once.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from compressed_opt.cuda import cpu, gpu, harness, reference, registry
from compressed_opt.cuda.harness import Check

CPU = torch.device("cpu")
assert gpu.LerpScaleClamp  # (imported: the CUDA implementation registers its check; CuPy is not needed for that)
#: the checks of passes that run on the CPU (the CUDA ones: tests/gpu)
CPU_CHECKS = sorted(name for name, check in harness.CHECKS.items() if not check.device)


@pytest.fixture
def fresh(monkeypatch):
    """A harness and a registry that have checked and bound nothing yet (restored after)."""
    monkeypatch.setattr(harness, "_agreed", {})
    monkeypatch.setattr(registry, "_bound", {})


def test_every_pass_of_the_one_bit_exchange_has_a_check():
    assert {"lerp_compress", "divide_descend", "keep_descend", "lamb_passes", "lamb_warmup", "direction_sumsq",
            "zero_passes", "lerp_scale_clamp_compress"} <= set(harness.CHECKS)
    assert harness.CHECKS["lerp_scale_clamp_compress"].device  # (run on the CUDA device it binds for)


@pytest.mark.parametrize("name", CPU_CHECKS)
def test_each_native_pass_agrees_with_its_reference_here(name, fresh):
    """On this machine (gcc and the C library: CI's too), every CPU pass gives its reference's
    outputs on all its cases, tails and empty segments included; no warning."""
    assert cpu.library() is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert harness.agrees(name) is True


def _disagreeing(seed: int, native: bool):
    out = torch.arange(5, dtype=torch.float32)
    if native:
        out[3] = torch.nextafter(out[3], torch.tensor(10.0))  # one ulp off in one element
    return out


def test_a_disagreeing_pass_is_replaced_by_its_reference_with_one_warning(monkeypatch, fresh):
    monkeypatch.setitem(harness.CHECKS, "divide_descend", Check(((1,), (2,)), _disagreeing))
    with pytest.warns(RuntimeWarning, match="'divide_descend' does not give its PyTorch reference's bits"):
        kernels = registry.kernels_for(CPU)
    assert kernels.path == "cpu"
    assert kernels.divide_descend_ is reference.divide_descend_  # the reference serves
    assert kernels.keep_descend_ is cpu.keep_descend_  # the others keep their native pass
    assert kernels.Lerp is cpu.Lerp
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: asked again, no second warning
        assert harness.agrees("divide_descend") is False
        assert registry.kernels_for(CPU) is kernels  # bound once per device


def test_a_pass_that_cannot_run_here_is_not_bound_and_not_warned_about(monkeypatch, fresh):
    monkeypatch.setitem(harness.CHECKS, "keep_descend",
                        Check(((1,),), lambda seed, native: None if native else torch.zeros(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernels = registry.kernels_for(CPU)
    assert kernels.keep_descend_ is reference.keep_descend_
    assert kernels.divide_descend_ is cpu.divide_descend_


def test_tolerance_is_relative_and_only_for_numbers(monkeypatch, fresh):
    """``close``: numbers (a sum's order) within it agree; tensors are always compared bit for bit."""
    near = Check(((1.0,),), lambda x, native: [torch.ones(2), x * (1 + 2**-22 if native else 1)], close=2**-20)
    far = Check(((1.0,),), lambda x, native: [torch.ones(2), x * (1 + 2**-18 if native else 1)], close=2**-20)
    bits = Check(((1.0,),), lambda x, native: torch.full((2,), x * (1 + 2**-22 if native else 1)), close=2**-20)
    for name, check in (("near", near), ("far", far), ("bits", bits)):
        monkeypatch.setitem(harness.CHECKS, name, check)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert [harness.agrees(n) for n in ("near", "far", "bits")] == [True, False, False]


def test_the_reference_path_binds_the_reference_everywhere(monkeypatch, fresh):
    """``COMPRESSED_OPT_KERNELS=reference``: every pass is the reference's."""
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    kernels = registry.kernels_for(CPU)
    assert kernels.path == "reference"
    for name in ("compress_rows_", "average_compress_rows_", "decompress_rows_", "sources", "sumsq_each", "gather_",
                 "Lerp", "LerpScaleClamp", "ScaleClamp", "divide_descend_", "keep_descend_"):
        assert getattr(kernels, name) is getattr(reference, name), name
