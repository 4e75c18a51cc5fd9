"""One rank of a fault scenario (``benchmarks/faults.py`` launches it; not run on its own).

    torchrun --standalone --nproc-per-node 2 benchmarks/fault_child.py --scenario nan_compression
    mpiexec -n 2 python benchmarks/fault_child.py --scenario mpi_raise

Every rank trains a 3-layer MLP on random data (its own per rank) with OnebitAdam
(freeze_step=20) and prints, for the runner:

* ``PID <rank> <pid>`` at start (the runner watches these processes until they are gone);
* ``FAULT_AT <rank> <time.time()>`` as the fault is injected;
* ``RESULT {json}`` at the end: ``outcome`` ("trained on" or the exception's first line), the
  step it was raised at, ``global_step``, ``nonfinite_steps``, whether parameters and optimizer
  state are finite, sha256 of the parameters, the warnings caught, and what the scenario measured.
  A rank that raises prints its RESULT and then raises again (under mpiexec the library's hook
  then aborts the job).

Under torchrun the ranks use Gloo (``init_process_group``); under mpiexec torch.distributed is not
initialised and the optimizer picks the MPI backend itself.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import os
import signal
import sys
import threading
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from compressed_opt import OnebitAdam  # noqa: E402

UNDER_MPI = "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
RANK = int(os.environ.get("RANK") or os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
FREEZE = 20


def say(line: str) -> None:
    """One line in one write (the ranks share torchrun's stdout: print's two writes interleave)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def fault(what: str) -> None:
    say(f"FAULT_AT {RANK} {time.time():.6f} {what}")


class Run:
    """A model, its OnebitAdam and this rank's data stream; ``it`` counts the loop's iterations
    (the "step" of the scenarios; it equals ``opt.global_step`` unless a step was skipped)."""

    current: Run | None = None

    def __init__(self, seed: int = 0, ddp_after: bool = False):
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
        self.opt = OnebitAdam(self.model.parameters(), lr=1e-3, freeze_step=FREEZE, path="1bit")
        self.net = self.model
        if ddp_after:  # as Trainer / Lightning / accelerate do: wrapped after the optimizer was made
            fault("model wrapped in DistributedDataParallel after the optimizer was made")
            self.net = nn.parallel.DistributedDataParallel(self.model)
        self.gen = torch.Generator().manual_seed(100 + RANK)
        self.it = 0
        self.bytes = {}  # iteration -> bytes this rank's backend sent in it
        Run.current = self

    def train(self, iterations: int, before=None, nan_at=None, clip=False, no_backward_at=None) -> Run:
        for _ in range(iterations):
            self.it += 1
            if before is not None:
                before(self)
            x, y = torch.randn(16, 64, generator=self.gen), torch.randint(0, 10, (16,), generator=self.gen)
            if nan_at == self.it and RANK == 1:
                fault(f"NaN in rank 1's input at step {self.it}")
                x[0, 0] = float("nan")
            sent = self.opt.backend.stats.total_bytes
            self.opt.zero_grad()
            loss = nn.functional.cross_entropy(self.net(x), y)
            if no_backward_at == self.it and RANK == 1:
                fault(f"rank 1 calls step() without a backward at step {self.it}")
            else:
                loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.bytes[self.it] = self.opt.backend.stats.total_bytes - sent
        return self

    def checkpoint(self) -> dict:
        """The optimizer's state dict as a file gives it back (``torch.load(weights_only=True)``)."""
        buf = io.BytesIO()
        torch.save(self.opt.state_dict(), buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)


def at(step: int, action):
    """A ``before`` callback: ``action(run)`` at iteration ``step``."""
    return lambda run: action(run) if run.it == step else None


def on_rank1(what: str, action):
    def act(run):
        if RANK == 1:
            fault(what)
            action(run)
    return act


# --- the scenarios ---------------------------------------------------------------------------------
def recreate():
    run = Run()

    def new_optimizer(r):
        fault(f"optimizer re-created at step {r.it} (the old one dropped)")
        r.opt = OnebitAdam(r.model.parameters(), lr=1e-3, freeze_step=FREEZE, path="1bit")  # old one: just dropped

    run.train(60, before=lambda r: new_optimizer(r) if r.it in (10, 20, 30) else None)
    return {"comm_threads": sum(t.name.startswith("compressed_opt_comm") for t in threading.enumerate())}


def nan_compression():
    Run().train(40, nan_at=25)


def nan_warmup():
    Run().train(40, nan_at=5)


def seeds():
    fault("model seeded with the rank")
    run = Run(seed=RANK)
    start = sha(run.model)
    run.train(40)
    return {"sha_at_start": start}


def lr_rank1():
    def change(r):
        r.opt.param_groups[0]["lr"] = 2e-3
    Run().train(40, before=at(30, on_rank1("lr changed on rank 1 only at step 30", change)))


def _load(saved_at: dict, edit=None):
    """Train, keep this rank's checkpoint of iteration ``saved_at[RANK]``, then load it (after
    ``edit``) into a fresh model and optimizer on every rank, and train on."""
    run, saved = Run(), None
    for _ in range(max(saved_at.values())):
        run.train(1)
        if run.it == saved_at[RANK]:
            saved = run.checkpoint()
    if edit is not None:
        edit(saved)
    fresh = Run()
    fault(f"every rank loads its checkpoint (rank {RANK}: step {saved_at[RANK]})")
    fresh.opt.load_state_dict(saved)
    fresh.train(5)


def ckpt_steps():
    _load({0: 10, 1: 12})


def ckpt_stages():
    _load({0: FREEZE - 2, 1: FREEZE + 2})


def ckpt_shape():
    def edit(sd):
        if RANK == 1:
            sd["state"][1]["exp_avg"] = torch.zeros(1)  # parameter 1: the first Linear's bias, (64,)
    _load({0: 25, 1: 25}, edit)


def ckpt_format():
    def edit(sd):
        sd["compressed_opt"]["format"] = 999
    _load({0: 25, 1: 25}, edit)


def requires_grad():
    def freeze_bias(r):
        r.model[0].bias.requires_grad_(False)
    Run().train(40, before=at(5, on_rank1("requires_grad=False on one parameter, rank 1 only, step 5", freeze_bias)))


def _at_10_on_rank1(what, action):
    Run().train(40, before=at(10, on_rank1(what, action)))


def mpi_raise():
    def fail(r):
        raise RuntimeError("injected fault on rank 1 at step 10")
    _at_10_on_rank1("uncaught exception on rank 1", fail)


def stall():
    _at_10_on_rank1("rank 1 stopped (SIGSTOP)", lambda r: os.kill(os.getpid(), signal.SIGSTOP))


def sigkill():
    _at_10_on_rank1("rank 1 killed (SIGKILL)", lambda r: os.kill(os.getpid(), signal.SIGKILL))


def no_backward_warmup():
    Run().train(40, no_backward_at=5)


def no_backward_compression():
    Run().train(40, no_backward_at=25)  # (frozen after step 20; from step 22 the exchange starts in backward)


def ddp_after():
    run = Run(ddp_after=True).train(40, clip=True)
    warm, compressed = run.bytes[5], run.bytes[30]
    return {"bytes_warmup_step": warm, "bytes_compression_step": compressed,
            "warmup_over_compression": round(warm / compressed, 1)}


SCENARIOS = {f.__name__: f for f in (recreate, nan_compression, nan_warmup, seeds, lr_rank1, ckpt_steps, ckpt_stages,
                                     ckpt_shape, ckpt_format, requires_grad, mpi_raise, stall, sigkill, ddp_after,
                                     no_backward_warmup, no_backward_compression)}


# --- reporting -------------------------------------------------------------------------------------
def sha(model) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors(v)


def facts(run: Run | None) -> dict:
    if run is None:
        return {}
    opt = run.opt
    out = {"it": run.it, "global_step": opt.global_step, "frozen": bool(opt.compressing),
           "nonfinite_steps": opt.engine.nonfinite_steps, "params_with_state": len(opt.state),
           "sha256": sha(run.model)}
    try:
        state = list(tensors(opt.state_dict()))
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        state, out["state_dict_error"] = [], repr(exc)[:200]
    out["finite"] = all(bool(torch.isfinite(t).all()) for t in [*run.model.parameters(), *state]
                        if t.is_floating_point())
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", required=True, choices=sorted(SCENARIOS))
    parser.add_argument("--pg-timeout", type=float, default=120.0, help="init_process_group's timeout (torchrun)")
    args = parser.parse_args()
    say(f"PID {RANK} {os.getpid()}")
    if not UNDER_MPI:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    result = {"rank": RANK, "scenario": args.scenario}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result.update(SCENARIOS[args.scenario]() or {})
            result["outcome"] = "trained on"
        except BaseException as exc:
            first = (str(exc).strip().splitlines() or [""])[0]
            result["outcome"] = f"{type(exc).__name__}: {first}"
            result["error_at"] = time.time()
            result["exception_types"] = [c.__name__ for c in type(exc).__mro__]  # CheckpointError is a ValueError
            raise
        finally:
            result.update(facts(Run.current))
            result["warnings"] = sorted({f"{w.category.__name__}: {w.message}"[:200] for w in caught})
            say("RESULT " + json.dumps(result))
    if not UNDER_MPI:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
