"""Faults injected into an MPI job (not a pytest module; ``tests/test_faults.py`` runs it).

    mpiexec -n 2 python -P tests/mpi_faults_worker.py CASE [TIMEOUT_S]

Every rank makes an ``MPIBackend`` (which installs the abort-on-exception hooks) and passes a
barrier, then:

* ``raise``: rank 1 raises an uncaught exception; the others wait in an all-reduce it never joins;
* ``thread_raise``: the same from a thread of rank 1 (its main thread then sleeps);
* ``stall``: rank 1 stops itself (``SIGSTOP``); the others wait in an all-reduce, with the
  backend's ``timeout`` (``TIMEOUT_S``; without it, ``$COMPRESSED_OPT_TIMEOUT``).

Rank 1 prints ``FAULT_AT <time.time()>`` as it injects the fault. The job must end non-zero,
every rank gone, instead of hanging. A rank that gets past its collective prints ``UNEXPECTED``
(it should not).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from compressed_opt.comm.mpi_backend import MPIBackend  # noqa: E402


def main() -> None:
    case = sys.argv[1]
    timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
    be = MPIBackend() if timeout is None else MPIBackend(timeout=timeout)
    be.barrier()
    print(f"READY {case} rank {be.rank}/{be.world_size} timeout={getattr(be, 'timeout', None)}", flush=True)
    if be.rank == 1:
        print(f"FAULT_AT {time.time():.3f}", flush=True)  # the time the fault is injected
        if case == "raise":
            raise RuntimeError("injected fault on rank 1")
        if case == "thread_raise":
            t = threading.Thread(target=_fail, name="injected-fault")
            t.start()
            t.join()
            time.sleep(120)
        elif case == "stall":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raise SystemExit(f"unknown case {case!r}")
    t = torch.ones(1024)
    be.all_reduce(t)  # the other rank never joins
    print(f"UNEXPECTED rank {be.rank}: the all-reduce completed", flush=True)


def _fail() -> None:
    raise RuntimeError("injected fault in a thread of rank 1")


if __name__ == "__main__":
    main()
