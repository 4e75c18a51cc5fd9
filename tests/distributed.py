"""Run a function on several Gloo ranks (spawned processes) with a timeout, for tests.

Each run gets its own file store in a fresh temporary folder, so concurrent tests never share a
port. ``fn(rank, world_size, *args)`` runs in every rank after ``init_process_group``; what it
returns is pickled back. A rank that raises, dies or outlives ``timeout`` fails the run with the
ranks' tracebacks, and every process is killed: a hang fails fast. Ranks are fresh processes,
forked from a server that has imported torch and compressed_opt (:func:`_context`). ``pg_timeout`` (seconds) is
the process group's own timeout for a collective (``init_process_group(timeout=...)``; torch's
default, 30 minutes for Gloo, when ``None``).
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _rank_main(rank, world_size, store_path, out_dir, fn, args, pg_timeout=None):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size, **extra)
        try:
            value = ("ok", fn(rank, world_size, *args))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        value = ("error", traceback.format_exc())
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(result_path + ".tmp", result_path)


# Besides torch and compressed_opt, what nearly every rank imported on its own, each time: torch._dynamo (torch's
# optimizers import it at their first construction, ~2 s), scikit-learn (optim_tasks' digits, ~3 s), pytest (the
# test module the rank's function comes from) and torch.distributed.checkpoint.
_PRELOAD = ["torch", "torch.distributed", "compressed_opt", "compressed_opt.comm", "torch._dynamo", "sklearn.datasets",
            "pytest", "torch.distributed.checkpoint"]


def _context():
    """Fresh rank processes forked from a server that imported torch and compressed_opt once
    (``forkserver``, and ``_PRELOAD``'s other modules): the same isolation as ``spawn`` (a new process
    per rank, no state of the test process), without paying the imports (~3.5 s a run on 2 cores,
    ~5 s more per rank for the others) for every run."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class RanksFailed(AssertionError):
    pass


def spawn_ranks(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float | None = None):
    """``[(status, value)]`` per rank: ``("ok", result)`` or ``("error", traceback)``. Fails
    (``RanksFailed``) only when a rank hangs past ``timeout`` or dies without a word."""
    with tempfile.TemporaryDirectory(prefix="co-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = _context()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, store, tmp, fn, args, pg_timeout), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        outcomes, missing = [], []
        for r in range(world_size):
            path = os.path.join(tmp, f"rank{r}.pkl")
            if not os.path.exists(path):
                missing.append(f"rank {r} " + ("timed out" if r in hung else f"died (exit code {procs[r].exitcode})"))
                continue
            with open(path, "rb") as f:
                outcomes.append(pickle.load(f))
        if missing:
            raise RanksFailed("; ".join(missing) + "".join(f"\n{v}" for s, v in outcomes if s == "error"))
        return outcomes


def run_ranks(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float | None = None):
    """Results of ``fn`` on ranks ``0..world_size-1``; fails with every rank's traceback if any
    rank raised. ``fn`` must be importable (a module-level function of a test module)."""
    outcomes = spawn_ranks(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout)
    errors = [f"rank {r} raised:\n{v}" for r, (s, v) in enumerate(outcomes) if s == "error"]
    if errors:
        raise RanksFailed("\n".join(errors))
    return [v for _, v in outcomes]


def child_env() -> dict:
    """The environment for a subprocess that starts a job of its own (a benchmark script): one
    thread, no PYTHONPATH, and no launcher variables (they would make it join the test's job)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(var, None)
    return env


def userns_link_possible() -> tuple[bool, str]:
    """Whether ``benchmarks/slowlink.py`` can make its link inside a user namespace here (what a
    user without root gets), and why not."""
    import sys

    if not sys.platform.startswith("linux"):
        return False, "user namespaces are Linux-only"
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    sys.path.insert(0, bench)
    try:
        import slowlink
    finally:
        sys.path.remove(bench)
    return slowlink.netns_supported("userns")


class UnheldCollectives:
    """Within ``with``: the shapes of the tensors handed to ``torch.distributed``'s
    ``all_reduce``, ``all_to_all_single`` and ``broadcast`` that the library did not hold first
    (:func:`compressed_opt.comm.torch_backend.hold`: a tensor a Gloo thread lets go of after the
    interpreter began to exit aborts the process). Only the calls made inside are checked: a
    test's own collectives belong outside."""

    NAMES = ("all_reduce", "all_to_all_single", "broadcast")

    def __init__(self):
        self.unheld: list[tuple[str, tuple]] = []
        self.calls = 0

    def __enter__(self):
        import torch.distributed as dist

        from compressed_opt.comm import torch_backend

        self._saved = {name: getattr(dist, name) for name in self.NAMES}
        for name, real in self._saved.items():
            def checked(tensor, *args, _name=name, _real=real, **kwargs):
                newest = torch_backend._HELD[-1] if torch_backend._HELD else ()
                self.calls += 1
                if not any(t is tensor for t, _ in newest):
                    self.unheld.append((_name, tuple(tensor.shape)))
                return _real(tensor, *args, **kwargs)
            setattr(dist, name, checked)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for name, real in self._saved.items():
            setattr(dist, name, real)
        return False
