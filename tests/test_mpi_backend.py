"""MPIBackend in real MPI jobs: ``tests/mpi_worker.py`` run by ``mpiexec`` on 2 and 3 ranks, and as
a singleton (no ``mpiexec``) on ``COMM_SELF``.

MPI jobs run in subprocesses, never in the pytest process: ``import mpi4py.MPI`` initialises MPI,
which should not happen in a process that other tests fork from. ``run_worker`` is the launcher
for further worker cases (``run_worker(["case", ...], n=3)``).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("mpi_worker.py")
TIMEOUT_S = 120
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
needs_mpi4py = pytest.mark.skipif(not HAVE_MPI4PY,
                                  reason="mpi4py is not installed (pip install 'compressed-opt[mpi]' mpich)")


def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (a venv with the ``mpich`` wheel) first: it matches the
    MPI that mpi4py loads there; else the one on ``PATH``."""
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec found beside python or on PATH")
WORKER_CASES = re.findall(r"^@case\ndef case_(\w+)\(", WORKER.read_text(), re.M)
QUICK_CASES = [c for c in WORKER_CASES if c != "optimizer_modes"]


def run_worker(cases, n: int | None = None, args=(), timeout: float = TIMEOUT_S) -> str:
    """Run the worker's ``cases`` on ``n`` ranks under mpiexec (``n=None``: one process, no
    mpiexec); fail on a non-zero exit or a hang, else return its output (stdout + stderr)."""
    cmd = [sys.executable, "-P", str(WORKER), *args, *cases]
    if n is not None:
        cmd = [MPIEXEC, "-n", str(n), *cmd]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # its own process group: a hang is killed whole
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung for {timeout} s; output:\n{out}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}; output:\n{out}")
    return out


def assert_all_ok(out: str, cases, n: int) -> None:
    """Every rank reported every case (lines of different ranks can interleave)."""
    ok = set(re.findall(r"OK (\w+) rank (\d+)/(\d+)", out))
    missing = [(c, r) for c in cases for r in range(n) if (c, str(r), str(n)) not in ok]
    assert not missing, f"cases not reported OK (case, rank): {missing}\noutput:\n{out}"


def test_worker_has_cases():
    assert {"all_reduce", "all_gather", "all_to_all", "broadcast", "barrier", "stats"} <= set(WORKER_CASES)


@pytest.mark.mpi
@pytest.mark.multiprocess
@needs_mpi4py
@needs_mpiexec
@pytest.mark.parametrize("n", [2, 3])
def test_mpi_collectives(n):
    # every optimizer in every mode on 2 ranks; on 3 (and 1, below) the collectives and OnebitAdam
    # against its reference: the modes on 3 ranks run on Gloo (test_modes, test_zero)
    cases = WORKER_CASES if n == 2 else QUICK_CASES
    assert_all_ok(run_worker(cases, n=n), cases, n)


@pytest.mark.mpi
@needs_mpi4py
def test_mpi_singleton_comm_self():
    """Size 1 on COMM_SELF, started without mpiexec (MPI's singleton init)."""
    assert_all_ok(run_worker(QUICK_CASES, args=["--comm", "self"]), QUICK_CASES, 1)


def test_import_does_not_start_mpi():
    code = ("import sys, compressed_opt.comm.mpi_backend as m; "
            "assert 'mpi4py.MPI' not in sys.modules, 'importing the module initialised MPI'")
    subprocess.run([sys.executable, "-P", "-c", code], check=True, timeout=TIMEOUT_S,
                   env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_missing_mpi4py_says_how_to_install(monkeypatch):
    from compressed_opt.comm import mpi_backend

    monkeypatch.setattr(mpi_backend, "_MPI", None)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # makes "from mpi4py import MPI" fail
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    with pytest.raises(ImportError, match=r"compressed-opt\[mpi\].*mpich"):
        mpi_backend.MPIBackend()
