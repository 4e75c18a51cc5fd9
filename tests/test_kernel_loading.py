"""Loading the native CPU kernels never breaks training (compressed_opt.cuda.build, which
compressed_opt.cuda.cpu.library calls; issue 26): a cached library loads without a compiler, an
unwritable cache dir falls back to a per-user temporary dir and then to the PyTorch reference with
one warning, the cache dir follows COMPRESSED_OPT_CACHE_DIR and XDG_CACHE_HOME; and importing the
package from the repository root says what to do."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings

import pytest
import torch

from compressed_opt import cuda as kernels
from compressed_opt._source_tree import shadowing_error
from compressed_opt.cuda import build, cpu, reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None, reason="no C compiler here")


@pytest.fixture
def env(monkeypatch, tmp_path):
    """A fresh lookup of the library under this test's environment (a home and a temporary dir of
    its own, no cache variables), forgotten again afterwards so that other tests look it up anew."""
    for name in ("COMPRESSED_OPT_CACHE_DIR", "XDG_CACHE_HOME", "COMPRESSED_OPT_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    monkeypatch.setattr(build, "_warned", False)
    cpu.library.cache_clear()
    yield monkeypatch
    cpu.library.cache_clear()


def _temp_dir(tmp_path):
    return tmp_path / "tmp" / f"compressed_opt-{os.getuid()}"


def _libraries(folder) -> list[str]:
    return sorted(p.name for p in folder.glob("onebit_cpu_*.so")) if folder.is_dir() else []


def _no_compiler(env, tmp_path) -> None:
    env.setenv("CC", str(tmp_path / "no-such-cc"))


def _file(tmp_path):
    """A regular file: no folder can be made under it, even by root (who may write to a 0o500 folder)."""
    path = tmp_path / "afile"
    path.write_text("not a folder")
    return path


def _lookup(call=cpu.library):
    """``(call(), the compressed_opt RuntimeWarnings it emitted)``."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = call()
    return out, [w for w in record if issubclass(w.category, RuntimeWarning) and "compressed_opt" in str(w.message)]


@needs_compiler
def test_cached_library_loads_without_compiler(env, tmp_path):
    cache = tmp_path / "cache"
    env.setenv("COMPRESSED_OPT_CACHE_DIR", str(cache))
    assert cpu.library() is not None  # compiled with the real compiler
    assert _libraries(cache)
    _no_compiler(env, tmp_path)
    cpu.library.cache_clear()
    lib, warned = _lookup()
    assert lib is not None and lib.co_has_avx2() in (0, 1)
    assert warned == []
    assert not _temp_dir(tmp_path).exists()


@needs_compiler
def test_unwritable_cache_dir_compiles_into_temporary_dir_with_one_warning(env, tmp_path):
    cache = _file(tmp_path) / "cache"
    env.setenv("COMPRESSED_OPT_CACHE_DIR", str(cache))
    lib, warned = _lookup()
    assert lib is not None
    temp = _temp_dir(tmp_path)
    assert _libraries(temp)
    assert stat.S_IMODE(temp.stat().st_mode) & 0o077 == 0
    assert len(warned) == 1
    message = str(warned[0].message)
    assert str(cache) in message and "not writable" in message and str(temp) in message
    assert "COMPRESSED_OPT_CACHE_DIR" in message
    cpu.library.cache_clear()  # once per process: the library found again in the temporary dir, silently
    lib, warned = _lookup()
    assert lib is not None and warned == []


def test_temporary_dir_writable_by_others_is_refused(env, tmp_path):
    env.setenv("COMPRESSED_OPT_CACHE_DIR", str(_file(tmp_path) / "cache"))
    temp = _temp_dir(tmp_path)
    temp.mkdir()
    temp.chmod(0o777)
    lib, warned = _lookup()
    assert lib is None
    assert len(warned) == 1 and "writable by others" in str(warned[0].message)
    assert _libraries(temp) == []


@pytest.mark.parametrize("unusable", ["under a file", "a file", "home under a file"])
def test_nothing_writable_and_no_compiler_uses_reference(env, tmp_path, unusable):
    if unusable == "under a file":
        env.setenv("COMPRESSED_OPT_CACHE_DIR", str(_file(tmp_path) / "cache"))
    elif unusable == "a file":
        env.setenv("COMPRESSED_OPT_CACHE_DIR", str(_file(tmp_path)))
    else:
        env.setenv("HOME", str(_file(tmp_path) / "home"))
    env.setattr(tempfile, "tempdir", str(_file(tmp_path)))  # no temporary dir either
    _no_compiler(env, tmp_path)
    path, warned = _lookup(lambda: kernels.kernel_path(torch.device("cpu")))
    assert path == "reference"
    assert cpu.library() is None
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "not writable" in message and "no-such-cc" in message and "PyTorch reference" in message
    assert "COMPRESSED_OPT_CACHE_DIR" in message and "CC" in message
    # the public kernels still compress, through the reference
    chunk = block = 256
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    error = torch.zeros_like(x)
    rows = torch.zeros(4, kernels.rows_layout(chunk, block)[1], dtype=torch.uint8)
    expected_error, expected_rows = error.clone(), rows.clone()
    reference.compress_rows_(x, expected_error, expected_rows, chunk, block)
    _, warned = _lookup(lambda: kernels.compress_rows_(x, error, rows, chunk, block))
    assert warned == []
    assert torch.equal(rows, expected_rows) and torch.equal(error, expected_error)
    out = torch.empty_like(x)
    kernels.decompress_rows_(rows, out, chunk, block)
    torch.testing.assert_close(out + error, x)


def test_no_compiler_with_a_writable_cache_says_set_cc(env, tmp_path):
    env.setenv("COMPRESSED_OPT_CACHE_DIR", str(tmp_path / "cache"))
    _no_compiler(env, tmp_path)
    lib, warned = _lookup()
    assert lib is None
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "no-such-cc" in message and "CC to a working C compiler" in message
    assert "COMPRESSED_OPT_CACHE_DIR" not in message
    assert not _temp_dir(tmp_path).exists()


@needs_compiler
def test_xdg_cache_home_holds_the_library(env, tmp_path):
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    lib, warned = _lookup()
    assert lib is not None and warned == []
    assert _libraries(tmp_path / "xdg" / "compressed_opt")
    assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_empty_or_relative_xdg_cache_home_is_ignored(env, tmp_path, xdg):
    env.setenv("XDG_CACHE_HOME", xdg)
    env.setenv("COMPRESSED_OPT_CACHE_DIR", "")
    assert build.cache_dir() == tmp_path / "home" / ".cache" / "compressed_opt"


def test_compressed_opt_cache_dir_beats_xdg_cache_home(env, tmp_path):
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env.setenv("COMPRESSED_OPT_CACHE_DIR", str(tmp_path / "ours"))
    assert build.cache_dir() == tmp_path / "ours"
    _no_compiler(env, tmp_path)
    lib, warned = _lookup()
    assert lib is None and len(warned) == 1 and "not writable" not in str(warned[0].message)
    assert (tmp_path / "ours").is_dir() and not (tmp_path / "xdg").exists()  # looked for and made there


def test_shadowing_error_says_what_to_do():
    package_dir = os.path.join(ROOT, "compressed_opt")
    missing = ImportError("cannot import name 'comm' from partially initialized module 'compressed_opt'",
                          name="compressed_opt")
    error = shadowing_error(missing, package_dir)
    assert error is not None
    message = str(error)
    assert "shadowing the installed package" in message
    assert "-P" in message and "another folder" in message and "pip install -e ." in message
    assert shadowing_error(ModuleNotFoundError("No module named 'torch'", name="torch"), package_dir) is None
    assert shadowing_error(missing, os.path.join(os.path.dirname(ROOT), "compressed_opt")) is None


_WITHOUT_EDITABLE_FINDER = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in "
    "getattr(f, '__module__', '')]; import compressed_opt"
)


def test_import_from_the_repository_root_without_an_editable_install_says_what_to_do():
    """``python -c "import compressed_opt"`` in the repository root finds ``./compressed_opt``
    first (the current folder leads sys.path); without the editable install's finder, as with a
    regular install, its subpackages are missing."""
    done = subprocess.run([sys.executable, "-c", _WITHOUT_EDITABLE_FINDER], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "shadowing the installed package" in done.stderr, done.stderr
    assert "pip install -e ." in done.stderr and "circular import" not in done.stderr


@needs_compiler
def test_other_sources_compile_as_the_kernels_do_or_say_why(env, tmp_path):
    """``build.compile_like_kernels`` (the benchmarks' own C loops): built with the kernels' compiler
    and flags; without a compiler or with a source that does not compile, why not."""
    import ctypes

    good, bad = tmp_path / "good.c", tmp_path / "bad.c"
    good.write_text("int seven(void) { return 7; }\n")
    bad.write_text("int seven(void) { return }\n")
    assert build.compile_like_kernels([good], tmp_path / "good.so") is None
    assert ctypes.CDLL(str(tmp_path / "good.so")).seven() == 7
    assert "failed" in build.compile_like_kernels([bad], tmp_path / "bad.so")
    assert not (tmp_path / "bad.so").exists()
    _no_compiler(env, tmp_path)
    assert "no-such-cc" in build.compile_like_kernels([good], tmp_path / "again.so")
