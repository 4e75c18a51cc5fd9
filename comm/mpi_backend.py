"""The MPI backend: the :class:`~compressed_opt.comm.backend.Backend` collectives on mpi4py.

Design
------
* **Nonblocking collectives.** Every collective is launched with MPI's nonblocking call
  (``Iallreduce`` with ``MPI.SUM``, ``Iallgather``, ``Ialltoall``, ``Ibcast``); ``async_op=True``
  returns an :class:`MPIWork` around the request, whose ``wait()`` completes it and then runs the
  post-processing (copy back from a staging buffer, divide by the world size for ``op="avg"``)
  exactly once. Synchronous calls wait at once. MPI only progresses some collectives inside MPI
  calls, so overlap depends on the MPI library (e.g. MPICH's ``MPIR_CVAR_ASYNC_PROGRESS``).
* **Zero copy on the CPU.** A CPU tensor goes to MPI as a byte view of its own memory (a NumPy
  view, no copy) with an explicit MPI datatype. Data movement (gather, all-to-all, broadcast)
  moves bytes (``MPI.BYTE``), so every dtype works, bfloat16 and float16 included. Reductions use
  the element type (``FLOAT``, ``DOUBLE``, ``INT8/16/32/64_T``, ``UINT8_T``; ``bool`` reduces
  with logical or). MPI has no portable sum for bfloat16 and float16: they are summed in a
  reused float32 staging buffer and rounded back once, after the average is taken.
* **CUDA tensors.** With a CUDA-aware MPI the device pointer goes straight to MPI (a small object
  exposing ``__cuda_array_interface__``, which mpi4py accepts), after the current stream is
  synchronised so MPI reads finished data. Otherwise the tensor is staged through pinned host
  buffers and copied back after the wait. ``cuda_aware=None`` detects support: the MPI library's
  ``MPIX_Query_cuda_support()`` (Open MPI; MPICH 4 and later) where it has one, else the
  environment (``MPIR_CVAR_ENABLE_GPU``, ``OMPI_MCA_opal_cuda_support``, ``MV2_USE_CUDA``);
  ``True``/``False`` forces it.
* **Buffers.** Staging buffers are kept in the backend's workspace, in per-(dtype, size, device)
  pools: a buffer is taken for a collective and given back when that collective is waited on,
  so concurrent collectives of the same size never share one.

* **Faults.** An MPI job whose rank dies of an uncaught exception hangs: that rank waits in
  ``MPI_Finalize``, the others in the collective it never joins. The first backend made in a
  multi-rank job therefore chains ``sys.excepthook`` and ``threading.excepthook`` (once per
  process; ``abort_on_exception=False`` opts out): they print the traceback as before, then call
  ``MPI.COMM_WORLD.Abort(1)``, which ends every rank of the job (what ``python -m mpi4py`` does).
  MPI itself has no timeout for a rank that stalls without dying (stopped, swapped out, stuck in
  a loop); ``timeout`` (seconds; default ``$COMPRESSED_OPT_TIMEOUT``, unset or 0: none) makes
  every wait a polling ``MPI_Test`` loop with that deadline, and a wait past it prints which
  collective on which rank and aborts the job.

mpi4py is imported when the first backend is made (``import mpi4py.MPI`` initialises MPI), so
this module imports without it.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import re
import sys
import threading
import time
from typing import Callable, Optional

import torch

from .backend import Backend, Work

_MPI = None

_INSTALL_HINT = (
    "MPIBackend needs mpi4py and an MPI library: pip install 'compressed-opt[mpi]' "
    "plus an MPI, e.g. pip install mpich (or an MPI from your system/cluster)"
)


def _import_mpi():
    global _MPI
    if _MPI is None:
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError(f"{_INSTALL_HINT} ({e})") from e
        except RuntimeError as e:  # mpi4py installed, but no MPI library could be loaded
            raise ImportError(f"{_INSTALL_HINT} ({e})") from e
        _MPI = MPI
    return _MPI


# --- faults: abort the job instead of hanging it ---------------------------------------------------
TIMEOUT_ENV = "COMPRESSED_OPT_TIMEOUT"
_abort_hooks_installed = False


def resolve_timeout(timeout=None) -> Optional[float]:
    """Seconds a wait may take (``None``: no limit): ``timeout`` if given, else
    ``$COMPRESSED_OPT_TIMEOUT``; 0 (or the variable unset or empty) means no limit."""
    where = "timeout"
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "").strip()
        if not raw:
            return None
        where = TIMEOUT_ENV
        try:
            timeout = float(raw)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"{where} must be a number of seconds >= 0 (0: no limit), got {timeout!r}")
    return None if timeout == 0 or math.isinf(timeout) else float(timeout)


def abort_job(message: str, errorcode: int = 1) -> None:
    """Print ``message`` to stderr and end every rank of the MPI job (``MPI_Abort`` on
    ``COMM_WORLD``): a rank that cannot go on must not leave the others in a collective."""
    try:
        sys.stderr.write(message.rstrip("\n") + "\n")
        sys.stdout.flush()
        sys.stderr.flush()
        # the launcher forwards each rank's output asynchronously: give it a moment, or the
        # traceback printed just before can be cut off when MPI_Abort tears the job down
        time.sleep(0.2)
    finally:
        _import_mpi().COMM_WORLD.Abort(errorcode)


def install_abort_on_exception() -> bool:
    """Make an uncaught exception in any thread of this process abort the whole MPI job, after
    the traceback is printed (chains ``sys.excepthook`` and ``threading.excepthook``; a thread's
    ``SystemExit`` is ignored, as by default). Once per process; ``False`` if already installed.
    Does nothing to a process alone in ``COMM_WORLD`` (its exit already ends the job)."""
    global _abort_hooks_installed
    if _abort_hooks_installed:
        return False
    MPI = _import_mpi()
    world = MPI.COMM_WORLD
    if world.Get_size() < 2:
        return False
    _abort_hooks_installed = True
    previous_hook, previous_thread_hook = sys.excepthook, threading.excepthook
    where = f"rank {world.Get_rank()} of {world.Get_size()}"

    def excepthook(exc_type, exc, tb):
        try:
            previous_hook(exc_type, exc, tb)
        finally:
            abort_job(f"compressed_opt: uncaught {exc_type.__name__} on {where}: aborting the MPI job "
                      "(MPI_Abort) so that the other ranks do not wait for it forever")

    def thread_excepthook(args):
        try:
            previous_thread_hook(args)
        finally:
            if args.exc_type is not SystemExit:
                name = args.thread.name if args.thread is not None else "a thread"
                abort_job(f"compressed_opt: uncaught {args.exc_type.__name__} in thread {name!r} on {where}: "
                          "aborting the MPI job (MPI_Abort) so that the other ranks do not wait for it forever")

    sys.excepthook = excepthook
    threading.excepthook = thread_excepthook
    return True


def _wait_until(request, timeout: float, what: str, comm) -> None:
    """``request.Wait()`` with a deadline: ``MPI_Test`` in a loop with short, growing sleeps
    (at most 0.5 ms, so a late collective costs little), aborting the job past ``timeout``."""
    deadline = time.monotonic() + timeout
    pause = 0.0
    while not request.Test():
        if time.monotonic() > deadline:
            abort_job(
                f"compressed_opt MPIBackend: rank {comm.Get_rank()} of {comm.Get_size()} waited more than "
                f"{timeout:g} s for {what}: another rank is stalled, dead or in a different collective. "
                f"Aborting the MPI job (the limit is MPIBackend(timeout=...) or ${TIMEOUT_ENV})"
            )
        if pause:
            time.sleep(pause)
        pause = min(max(2 * pause, 1e-5), 5e-4)


# --- CUDA-aware detection ------------------------------------------------------------------------
_TRUE = ("1", "true", "yes", "on")


def _loaded_mpi_library() -> Optional[str]:
    """Path of the MPI shared library this process loaded (via mpi4py), if it can be found."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if re.search(r"/lib(mpi|mpich)\.(so|dylib)[.\d]*$", path):
                    return path
    except OSError:
        pass
    return ctypes.util.find_library("mpi")


def detect_cuda_aware() -> bool:
    """Whether the MPI that mpi4py loaded can take CUDA device pointers.

    Asks the library's ``MPIX_Query_cuda_support()`` (Open MPI's extension, also in MPICH >= 4)
    where it exists; without it, falls back to the usual environment switches.
    """
    _import_mpi()  # the query is only valid after MPI_Init
    path = _loaded_mpi_library()
    if path:
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            query = None
        if query is not None:
            query.restype, query.argtypes = ctypes.c_int, []
            return bool(query())
    env = os.environ
    return any(
        env.get(k, "").strip().lower() in _TRUE
        for k in ("MPIR_CVAR_ENABLE_GPU", "OMPI_MCA_opal_cuda_support", "MV2_USE_CUDA")
    )


# --- buffers ---------------------------------------------------------------------------------------
class _CudaBytes:
    """A device buffer as mpi4py sees it: ``__cuda_array_interface__`` over the tensor's bytes."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # keeps the memory alive while MPI uses it
        self.__cuda_array_interface__ = {
            "shape": (tensor.numel() * tensor.element_size(),),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


def _byte_buffer(tensor: torch.Tensor):
    """Zero-copy view of a contiguous tensor's bytes, in a form mpi4py accepts."""
    if tensor.is_cuda:
        return _CudaBytes(tensor)
    if tensor.device.type != "cpu":
        raise TypeError(f"MPIBackend supports CPU and CUDA tensors, got device {tensor.device}")
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


class MPIWork(Work):
    """An MPI request; ``wait()`` completes it, then runs ``then`` once. With a ``timeout``
    (seconds, ``comm`` given) a wait longer than that aborts the job (see the module docstring)."""

    def __init__(self, request, then: Optional[Callable[[], None]] = None, keep: tuple = (),
                 timeout: Optional[float] = None, what: str = "a collective", comm=None):
        self._request, self._then, self._keep, self._done = request, then, keep, False
        self._timeout, self._what, self._comm = timeout, what, comm

    def wait(self) -> None:
        if self._done:
            return
        if self._timeout is None or self._comm is None:
            self._request.Wait()
        else:
            _wait_until(self._request, self._timeout, self._what, self._comm)
        self._done = True  # before then(): a failing copy-back must not rerun on a second wait
        self._keep = ()
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def is_completed(self) -> bool:
        if not self._done and self._request.Test():
            self.wait()
        return self._done


class MPIBackend(Backend):
    """Collectives over an mpi4py communicator (default ``MPI.COMM_WORLD``). See the module
    docstring for how buffers reach MPI."""

    name = "mpi"

    def __init__(self, comm=None, cuda_aware: Optional[bool] = None, timeout: Optional[float] = None,
                 abort_on_exception: bool = True):
        MPI = _import_mpi()
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        super().__init__(rank=self.comm.Get_rank(), world_size=self.comm.Get_size())
        #: seconds a wait may take before the job is aborted (None: no limit)
        self.timeout = resolve_timeout(timeout)
        if abort_on_exception:
            install_abort_on_exception()
        self.cuda_aware = detect_cuda_aware() if cuda_aware is None else bool(cuda_aware)
        self._reduce_types = {
            torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE,
            torch.int8: MPI.INT8_T,
            torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T,
            torch.int64: MPI.INT64_T,
            torch.uint8: MPI.UINT8_T,
            torch.bool: MPI.C_BOOL,
        }

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"cuda_aware={self.cuda_aware}, timeout={self.timeout})")

    def _duplicate(self):
        """``comm.Dup()``: the same ranks, another communication context."""
        return MPIBackend(self.comm.Dup(), cuda_aware=self.cuda_aware, timeout=self.timeout, abort_on_exception=False)

    def _work(self, request, then, keep, what: str) -> MPIWork:
        return MPIWork(request, then, keep, timeout=self.timeout, what=what, comm=self.comm)

    # --- staging buffers ---------------------------------------------------------------------
    def _take(self, dtype: torch.dtype, numel: int, device) -> torch.Tensor:
        """A staging buffer from the pool of its kind (pinned when it stages a CUDA tensor on the
        host: ``device`` is then ``cpu-pinned``)."""
        pool = self.workspace(("mpi-stage", dtype, numel, str(device)), list)
        if pool:
            return pool.pop()
        if str(device) == "cpu-pinned":
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        return torch.empty(numel, dtype=dtype, device=device)

    def _give(self, buf: torch.Tensor, device) -> None:
        self.workspace(("mpi-stage", buf.dtype, buf.numel(), str(device)), list).append(buf)

    def _staged(self, tensor: torch.Tensor, dtype: torch.dtype, copy_in: bool):
        """The tensor MPI should use in place of ``tensor``: ``tensor`` itself when MPI can take
        it as is, else a staging buffer of ``dtype`` (on the host unless the MPI is CUDA-aware),
        filled from ``tensor`` when ``copy_in``. Returns ``(buffer, where)``; ``where`` is None
        when no staging buffer was taken."""
        host = tensor.is_cuda and not self.cuda_aware
        if dtype == tensor.dtype and not host:
            return tensor, None
        where = "cpu-pinned" if host else tensor.device
        buf = self._take(dtype, tensor.numel(), where)
        if copy_in:
            buf.copy_(tensor.reshape(-1))
        return buf, where

    def _sync_device(self, *tensors: torch.Tensor) -> None:
        """MPI reads device memory directly: wait for the work queued on the current stream."""
        for t in tensors:
            if t.is_cuda:
                torch.cuda.current_stream(t.device).synchronize()
                return

    # --- collectives ---------------------------------------------------------------------------
    def _all_reduce(self, tensor, op, async_op):
        MPI = self._mpi
        low = tensor.dtype in (torch.bfloat16, torch.float16)
        dtype = torch.float32 if low else tensor.dtype
        if dtype not in self._reduce_types:
            raise TypeError(f"MPIBackend.all_reduce does not support {tensor.dtype}")
        if op == "avg" and not dtype.is_floating_point:
            raise TypeError(f"all_reduce op='avg' needs a floating-point tensor, got {tensor.dtype}")
        buf, where = self._staged(tensor, dtype, copy_in=True)
        self._sync_device(buf)
        mpi_op = MPI.LOR if dtype == torch.bool else MPI.SUM
        data = _byte_buffer(buf)
        request = self.comm.Iallreduce(MPI.IN_PLACE, [data, self._reduce_types[dtype]], mpi_op)

        copy_back = self._copy_back(tensor, buf, where, None, None)

        def then():
            if op == "avg":
                buf.div_(self.world_size)
            copy_back()

        return self._work(request, then, (tensor, buf, data), f"all_reduce of {tensor.numel()} x {tensor.dtype}")

    def _reduction_bytes(self, t):
        # MPI has no bf16/fp16 sum: they are reduced (and sent) as fp32
        return t.numel() * 4 if t.dtype in (torch.bfloat16, torch.float16) else super()._reduction_bytes(t)

    def _reduce_scatter(self, output, input, op, async_op):
        MPI = self._mpi
        if input.dtype not in self._reduce_types or not input.dtype.is_floating_point:
            raise TypeError(f"MPIBackend.reduce_scatter supports float32/float64 tensors, got {input.dtype}")
        send, send_at = self._staged(input, input.dtype, copy_in=True)
        recv, recv_at = self._staged(output, output.dtype, copy_in=False)
        self._sync_device(send, recv)
        mpi_type = self._reduce_types[input.dtype]
        sdata, rdata = _byte_buffer(send), _byte_buffer(recv)
        request = self.comm.Ireduce_scatter_block([sdata, mpi_type], [rdata, mpi_type], MPI.SUM)
        copy_back = self._copy_back(output, recv, recv_at, send, send_at)

        def then():
            if op == "avg":
                recv.div_(self.world_size)
            copy_back()

        return self._work(request, then, (input, output, sdata, rdata),
                          f"reduce_scatter of {input.numel()} x {input.dtype}")

    def _byte_exchange(self, output, input, collective, what: str):
        """A collective that moves raw bytes (all-gather, all-to-all): any dtype, staged or not."""
        MPI = self._mpi
        send, send_at = self._staged(input, input.dtype, copy_in=True)
        recv, recv_at = self._staged(output, output.dtype, copy_in=False)
        self._sync_device(send, recv)
        sdata, rdata = _byte_buffer(send), _byte_buffer(recv)
        request = collective([sdata, MPI.BYTE], [rdata, MPI.BYTE])
        return self._work(request, self._copy_back(output, recv, recv_at, send, send_at),
                          (input, output, sdata, rdata), f"{what} of {input.numel()} x {input.dtype}")

    def _all_gather(self, output, input, async_op):
        return self._byte_exchange(output, input, self.comm.Iallgather, "all_gather")

    def _all_to_all(self, output, input, async_op):
        return self._byte_exchange(output, input, self.comm.Ialltoall, "all_to_all")

    def _broadcast(self, tensor, src, async_op):
        buf, where = self._staged(tensor, tensor.dtype, copy_in=self.rank == src)
        self._sync_device(buf)
        data = _byte_buffer(buf)
        request = self.comm.Ibcast([data, self._mpi.BYTE], root=src)
        if self.rank == src:  # the source's tensor is unchanged: only give the buffer back
            then = self._copy_back(None, None, None, buf, where)
        else:
            then = self._copy_back(tensor, buf, where, None, None)
        return self._work(request, then, (tensor, data),
                          f"broadcast of {tensor.numel()} x {tensor.dtype} from rank {src}")

    def _copy_back(self, output, recv, recv_at, send, send_at) -> Callable[[], None]:
        def then():
            if recv_at is not None:
                output.copy_(recv.view_as(output))
                self._give(recv, recv_at)
            if send_at is not None:
                self._give(send, send_at)

        return then

    def _split(self, groups, mine):
        """``MPI_Comm_split``: colour = the group's index, key = the rank (so ranks stay in order).
        The new backend keeps this one's ``cuda_aware`` and ``timeout``; the abort hooks are
        process-wide and were already decided by the first backend."""
        comm = self.comm.Split(mine, self.rank)
        timeout = 0 if self.timeout is None else self.timeout
        return MPIBackend(comm, cuda_aware=self.cuda_aware, timeout=timeout, abort_on_exception=False)

    def node_leader(self) -> int:
        """The lowest rank of this communicator that shares memory with this rank (one node:
        ``MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)``), the same on every rank of the node.
        Collective over the communicator."""
        MPI = self._mpi
        shared = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        try:
            return shared.allreduce(self.rank, op=MPI.MIN)
        finally:
            shared.Free()

    def _barrier(self) -> None:
        if self.timeout is None:
            self.comm.Barrier()
        else:
            self._work(self.comm.Ibarrier(), None, (), "a barrier").wait()
