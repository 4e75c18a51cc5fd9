"""Faults and bad state end in a clear error on every rank, never in a hang or a silent divergence.

* checkpoints: strict validation on load, and ranks whose checkpoints disagree (step, stage, one
  bad file) all raise (``compressed_opt.checkpoint``);
* ``compressed_allreduce`` refuses buffers that overlap and tensors that require grad;
* ranks built with different ``bucket_cap_mb`` are told so;
* MPI: an uncaught exception on one rank aborts the job; a stalled rank makes the others abort
  after the backend's ``timeout``;
* Gloo: a stalled rank makes the others raise after the process group's ``timeout``.

Measured times are printed (``pytest -s``) as ``FAULT ...`` lines.
"""
from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, ZeroOneAdam
from compressed_opt.comm import SingleProcessBackend, compressed_allreduce, error_buffer_sizes
from distributed import spawn_ranks
from optim_tasks import checkpoint_round_trip
from test_mpi_backend import MPIEXEC, needs_mpi4py, needs_mpiexec

HP = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _trained(cls=OnebitAdam, steps=3, **kw):
    """A model and optimizer after ``steps`` single-process steps (frozen after step 2), and its
    checkpoint as ``torch.load(weights_only=True)`` returns it."""
    model = _model()
    freeze = {"var_freeze_step": 2} if cls is ZeroOneAdam else {"freeze_step": 2}
    opt = cls(model.parameters(), backend=SingleProcessBackend(), **freeze, **HP, **kw)
    _train(model, opt, steps)
    return model, opt, checkpoint_round_trip(model, opt)["opt"]


def _frozen(opt):
    """Whether the optimizer is past its warmup: 1-bit Adam's compression stage, 0/1 Adam's frozen variance."""
    return opt.schedule.frozen if isinstance(opt, ZeroOneAdam) else opt.compressing


def _fresh(cls=OnebitAdam):
    model = _model()
    freeze = {"var_freeze_step": 2} if cls is ZeroOneAdam else {"freeze_step": 2}
    return cls(model.parameters(), backend=SingleProcessBackend(), **freeze, **HP)


# --- A. checkpoint validation, one process ------------------------------------------------------
def _set(path, value):
    def edit(sd):
        *where, last = path
        d = sd
        for k in where:
            d = d[k]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value
    return edit


_DELETE = object()


def _param_state(index, field, value):
    def edit(sd):
        sd["state"][index][field] = value
    return edit


def _drop_group(sd):
    sd["param_groups"].append(copy.deepcopy(sd["param_groups"][0]))


def _short_group(sd):
    sd["param_groups"][0]["params"] = sd["param_groups"][0]["params"][:-1]


CORRUPTIONS = {
    "format 999": (_set(("compressed_opt", "format"), 999), r"checkpoint format 999 .*reads \(1, 2, 3\)"),
    "format garbage": (_set(("compressed_opt", "format"), "garbage"),
                       r"checkpoint format 'garbage' .*reads \(1, 2, 3\)"),
    "no format": (_set(("compressed_opt", "format"), _DELETE), r"no 'format' key"),
    "no algorithm": (_set(("compressed_opt", "algorithm"), _DELETE), r"lacks the key\(s\) 'algorithm'"),
    "no global_step": (_set(("compressed_opt", "global_step"), _DELETE), r"lacks the key\(s\) 'global_step'"),
    "no rank": (_set(("compressed_opt", "rank"), _DELETE), r"lacks the key\(s\) 'rank'"),
    "no world_size": (_set(("compressed_opt", "world_size"), _DELETE), r"lacks the key\(s\) 'world_size'"),
    "no buckets": (_set(("compressed_opt", "buckets"), _DELETE), r"lacks the key\(s\) 'buckets'"),
    "no frozen": (_set(("compressed_opt", "frozen"), _DELETE), r"lacks the key\(s\) 'frozen'"),
    "not a dict": (_set(("compressed_opt",), [1, 2]), r"\['compressed_opt'\] must be a dict, got list"),
    "step not a number": (_set(("compressed_opt", "global_step"), "abc"),
                          r"global_step must be an int >= 0, got 'abc'"),
    "step negative": (_set(("compressed_opt", "global_step"), -3), r"global_step must be an int >= 0, got -3"),
    "step a float": (_set(("compressed_opt", "global_step"), 2.5), r"global_step must be an int >= 0, got 2.5"),
    "rank past world": (_set(("compressed_opt", "rank"), 4), r"0 <= rank < world_size, got rank 4"),
    "exp_avg shape": (_param_state(2, "exp_avg", torch.zeros(3, 4)),
                      r"parameter 2, 'exp_avg': shape \(3, 4\) in the checkpoint, "
                      r"but the parameter's shape is \(3, 5\)"),
    "exp_avg_sq flat": (_param_state(0, "exp_avg_sq", torch.zeros(30)),
                        r"parameter 0, 'exp_avg_sq': shape \(30,\) .* is \(5, 6\)"),
    "exp_avg not a tensor": (_param_state(1, "exp_avg", [0.0] * 5),
                             r"parameter 1, 'exp_avg': expected a floating-point tensor"),
    "extra group": (_drop_group, r"2 parameter group\(s\), this optimizer 1"),
    "short group": (_short_group, r"parameter group 0 has 3 parameters in the checkpoint and 4 here"),
    "worker_error a list": (_set(("compressed_opt", "buckets", 0, "worker_error"), [0.0]),
                            r"bucket 0, 'worker_error': expected a tensor, got list"),
    "server_error short": (_set(("compressed_opt", "buckets", 0, "server_error"), torch.zeros(1)),
                           r"bucket 0, 'server_error': 1 elements, expected 64"),
    "frozen not a bool": (_set(("compressed_opt", "frozen"), "yes"), r"'frozen' must be True or False"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_bad_checkpoint_raises_a_clear_error_and_loads_nothing(name):
    edit, message = CORRUPTIONS[name]
    _, _, sd = _trained()
    edit(sd)
    opt = _fresh()
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(sd)
    assert opt.global_step == 0 and not _frozen(opt) and not opt.state  # nothing was loaded


def test_zero_one_adam_checkpoint_without_its_counters_names_them():
    _, _, sd = _trained(ZeroOneAdam)
    del sd["compressed_opt"]["var_interval"], sd["compressed_opt"]["lr_sums"]
    with pytest.raises(ValueError, match=r"lacks the key\(s\) 'var_interval', 'lr_sums'"):
        _fresh(ZeroOneAdam).load_state_dict(sd)
    _, _, sd = _trained(ZeroOneAdam)
    sd["compressed_opt"]["local_step_interval"] = "two"
    with pytest.raises(ValueError, match=r"'local_step_interval' must be an int >= 0, got 'two'"):
        _fresh(ZeroOneAdam).load_state_dict(sd)


@pytest.mark.parametrize("cls", [OnebitAdam, ZeroOneAdam])
def test_valid_checkpoint_still_loads(cls):
    _, opt, sd = _trained(cls)
    fresh = _fresh(cls)
    fresh.load_state_dict(sd)
    assert fresh.global_step == opt.global_step == 3 and _frozen(fresh)


# --- A and C. ranks that disagree: checkpoints, bucket_cap_mb (one Gloo job for both) -------------
def _disagreeing_ranks(rank, world):
    """Every rank trains the same run (5 steps, frozen after 3) and keeps its checkpoints; then
    every rank loads, case by case, a combination that must raise on every rank, and last a
    matching one that must load and train on. Then optimizers with different ``bucket_cap_mb``."""
    model = _model()
    opt = OnebitAdam(model.parameters(), freeze_step=3, **HP)
    saved = {}
    g = torch.Generator().manual_seed(10 + rank)
    for step in range(1, 6):
        x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        saved[step] = checkpoint_round_trip(model, opt)["opt"]
    outcomes = {}

    def attempt(case, sd):
        fresh = OnebitAdam(_model().parameters(), freeze_step=3, **HP)
        try:
            fresh.load_state_dict(sd)
            outcomes[case] = ("loaded", fresh.global_step)
        except ValueError as exc:
            outcomes[case] = ("raised", str(exc), fresh.global_step, _frozen(fresh))

    # rank 1 resumes from a later step than rank 0 (same stage)
    attempt("steps", saved[4 if rank == 1 else 5])
    # same step, but rank 1's file says it is still in warmup (e.g. a run with another freeze_step)
    other_stage = copy.deepcopy(saved[4])
    if rank == 1:
        other_stage["compressed_opt"]["frozen"] = False
    attempt("stage", other_stage)
    # same step and stage, but a counter of the stage differs (the step the variance froze at)
    other_freeze = copy.deepcopy(saved[4])
    if rank == 1:
        other_freeze["compressed_opt"]["freeze_step"] = 2
    attempt("counters", other_freeze)
    # rank 0's file is damaged: rank 0 says why, rank 1 must not wait for it or load alone
    bad = copy.deepcopy(saved[4])
    if rank == 0:
        bad["compressed_opt"]["format"] = 999
    attempt("one bad file", bad)
    # the checkpoints of one step: they load, and training goes on in step
    model = _model()
    opt = OnebitAdam(model.parameters(), freeze_step=3, **HP)
    opt.load_state_dict(saved[4])
    _train(model, opt, 2)
    outcomes["matching"] = ("loaded", opt.global_step, [p.detach().clone() for p in model.parameters()])
    # C: a bucket cap this small cuts the model into several buckets on rank 1, one on rank 0
    model = _model()
    opt = OnebitAdam(model.parameters(), freeze_step=2, bucket_cap_mb=25 if rank == 0 else 0.0001, **HP)
    try:
        _train(model, opt, 1)
        outcomes["bucket_cap_mb"] = ("trained", len(opt.engine.buckets))
    except ValueError as exc:
        outcomes["bucket_cap_mb"] = ("raised", str(exc), len(opt.engine.buckets))
    return outcomes


@pytest.fixture(scope="module")
def disagreeing():
    """The outcomes of :func:`_disagreeing_ranks` on 2 Gloo ranks (one job for several tests)."""
    started = time.monotonic()
    (s0, r0), (s1, r1) = spawn_ranks(_disagreeing_ranks, 2, timeout=90, pg_timeout=60)
    assert s0 == s1 == "ok", (r0, r1)
    return r0, r1, time.monotonic() - started


@pytest.mark.multiprocess
def test_ranks_with_disagreeing_checkpoints_all_raise(disagreeing):
    r0, r1, elapsed = disagreeing
    for r in (r0, r1):
        for case in ("steps", "stage", "counters", "one bad file"):
            assert r[case][0] == "raised", (case, r[case])
            assert r[case][2:] == (0, False), "a failed load must leave the optimizer as it was"
        assert "rank 0: global_step 5" in r["steps"][1] and "rank 1: global_step 4" in r["steps"][1]
        assert "rank 0: global_step 4, frozen (compression stage" in r["stage"][1]
        assert "rank 1: global_step 4, not frozen (warmup" in r["stage"][1]
        assert "stage counters differ" in r["counters"][1] and "freeze_step" in r["counters"][1]
    assert "checkpoint format 999" in r0["one bad file"][1]
    assert "rank(s) 0 failed validation" in r1["one bad file"][1] and "no rank loaded" in r1["one bad file"][1]
    assert r0["matching"][1] == r1["matching"][1] == 6
    assert all(torch.equal(a, b) for a, b in zip(r0["matching"][2], r1["matching"][2]))
    print(f"FAULT disagreeing checkpoints: 4 cases raised on both ranks; whole run {elapsed:.1f} s")


# --- B. compressed_allreduce input validation -----------------------------------------------------
def test_compressed_allreduce_refuses_overlapping_buffers_and_tensors_that_require_grad():
    be = SingleProcessBackend()
    we_n, se_n = error_buffer_sizes(64, 1)
    arena = torch.zeros(64 + we_n + se_n + 64)
    x = arena[:64]
    cases = [
        ((x, torch.zeros(we_n), arena[32 : 32 + se_n]), "server_error overlaps tensor"),
        ((x, arena[:we_n], torch.zeros(se_n)), "worker_error overlaps tensor"),
        ((x, arena[10 : 10 + we_n], torch.zeros(se_n)), "worker_error overlaps tensor"),
        ((torch.ones(64), arena[64 : 64 + we_n], arena[64 + we_n - 1 : 64 + we_n - 1 + se_n]),
         "server_error overlaps worker_error"),
        ((x.view(8, 8).t(), torch.zeros(we_n), arena[56 : 56 + se_n]), "server_error overlaps tensor"),
        ((nn.Parameter(torch.ones(64)), torch.zeros(we_n), torch.zeros(se_n)), "tensor requires grad"),
        ((torch.ones(64, requires_grad=True) * 2, torch.zeros(we_n), torch.zeros(se_n)), "tensor requires grad"),
    ]
    for args, message in cases:
        before = [a.detach().clone() for a in args]
        with pytest.raises(ValueError, match=message):
            compressed_allreduce(*args, be)
        assert all(torch.equal(a.detach(), b) for a, b in zip(args, before)), f"{message}: modified before raising"
    # separate slices of one arena are fine, and a parameter's detach() is what to pass
    assert torch.equal(compressed_allreduce(arena[:64].fill_(1.0), arena[64 : 64 + we_n],
                                            arena[64 + we_n : 64 + we_n + se_n], be), torch.ones(64))
    p = nn.Parameter(torch.ones(64))
    compressed_allreduce(p.detach(), torch.zeros(we_n), torch.zeros(se_n), be)


# --- C. different bucket_cap_mb per rank ----------------------------------------------------------
@pytest.mark.multiprocess
def test_ranks_with_different_bucket_cap_mb_are_told_so(disagreeing):
    r0, r1, _ = disagreeing
    assert r0["bucket_cap_mb"][2] == 1 and r1["bucket_cap_mb"][2] > 1  # the layouts really differ
    for kind, value, _ in (r0["bucket_cap_mb"], r1["bucket_cap_mb"]):
        assert kind == "raised" and "the ranks disagree" in value, value
        assert re.search(r"rank 1 has bucket_cap_mb=9.9\d*e-05 unlike rank 0's 25 "
                         r"\(the ranks would cut different buckets\)", value), value


# --- E. a stalled rank under Gloo: the process group's timeout bounds the wait ---------------------
PG_TIMEOUT_S = 5.0


def _stall_rank_1(rank, world):
    """Rank 1 stops itself (SIGSTOP); rank 0's all-reduce on a group made with a 5 s timeout
    must raise after about that long. (The group is made after ``init_process_group``, whose
    own rendezvous would be bounded by the same short timeout if it were set there: ranks that
    start a few seconds apart on a loaded machine would fail before the test begins.)"""
    import datetime

    import torch.distributed as dist

    from compressed_opt.comm.torch_backend import TorchBackend

    group = dist.new_group(timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # stalled: neither dead nor taking part
        return "resumed"
    backend = TorchBackend(group)
    started = time.monotonic()
    try:
        backend.all_reduce(torch.ones(16))
        raise AssertionError("the all-reduce completed without rank 1")
    except RuntimeError as exc:
        waited, message = time.monotonic() - started, str(exc)
    finally:
        os.kill(pids[1], signal.SIGCONT)  # a launcher would end rank 1 now; here it returns
    return waited, message


@pytest.mark.multiprocess
def test_gloo_stalled_rank_makes_the_others_raise_within_the_process_group_timeout():
    started = time.monotonic()
    (s0, r0), (s1, r1) = spawn_ranks(_stall_rank_1, 2, timeout=60)
    everyone_exited = time.monotonic() - started
    assert s0 == "ok", r0
    waited, message = r0
    assert PG_TIMEOUT_S - 0.5 <= waited <= PG_TIMEOUT_S + 5, (waited, message)
    assert re.search(r"time(d)? ?out", message, re.I), message
    print(f"FAULT gloo stall: rank 0 raised after {waited:.2f} s (timeout {PG_TIMEOUT_S:g} s): {message[:100]!r}; "
          f"every process exited {everyone_exited:.1f} s after the spawn")


# --- D and E. MPI: an uncaught exception aborts the job; a stalled rank, past the timeout ----------
FAULTS_WORKER = Path(__file__).with_name("mpi_faults_worker.py")
MPI_BOUND_S = 30  # the job must be gone this long after the fault
MPI_TIMEOUT_S = 3.0


def _run_mpi_fault(case, *args, env_timeout=None):
    """Run the faults worker on 2 ranks; ``(exit code, output, seconds from the fault to the
    job's exit, seconds from start to exit)``. A job still running after the bound fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("COMPRESSED_OPT_TIMEOUT", None)
    if env_timeout is not None:
        env["COMPRESSED_OPT_TIMEOUT"] = str(env_timeout)
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-P", str(FAULTS_WORKER), case, *map(str, args)]
    started = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=MPI_BOUND_S + 30)  # startup (two torch imports) + the bound
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} hung; output:\n{out}")
    ended = time.time()
    fault = re.search(r"FAULT_AT ([\d.]+)", out)
    assert fault, out
    return proc.returncode, out, ended - float(fault.group(1)), ended - started


def _ranks_left(grace_s: float = 5.0):
    """The worker processes still alive, after up to ``grace_s`` for aborted ranks to finish
    exiting (mpiexec may return while the kernel still tears one down)."""
    deadline = time.time() + grace_s
    while True:
        ps = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout
        left = [line for line in ps.splitlines() if str(FAULTS_WORKER) in line and "ps -eo" not in line]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.mpi
@pytest.mark.multiprocess
@needs_mpi4py
@needs_mpiexec
@pytest.mark.parametrize("case, where", [("raise", "rank 1 of 2"),
                                         ("thread_raise", "thread 'injected-fault' on rank 1 of 2")])
def test_mpi_uncaught_exception_on_one_rank_aborts_the_job(case, where):
    rc, out, after_fault, total = _run_mpi_fault(case)
    assert rc != 0, out
    assert "RuntimeError: injected fault" in out, out  # the traceback is still printed
    assert f"uncaught RuntimeError {'in ' if 'thread' in where else 'on '}{where}: aborting the MPI job" in out, out
    assert "UNEXPECTED" not in out, out
    assert after_fault < MPI_BOUND_S, (after_fault, out)
    assert not _ranks_left()
    print(f"FAULT mpi {case}: exit code {rc}, every rank gone {after_fault:.2f} s after the fault "
          f"({total:.1f} s in all)")


@pytest.mark.mpi
@pytest.mark.multiprocess
@needs_mpi4py
@needs_mpiexec
def test_mpi_stalled_rank_aborts_the_job_after_the_timeout():
    rc, out, after_fault, total = _run_mpi_fault("stall", env_timeout=MPI_TIMEOUT_S)
    assert rc != 0, out
    assert f"timeout={MPI_TIMEOUT_S}" in out, out  # from $COMPRESSED_OPT_TIMEOUT
    assert f"rank 0 of 2 waited more than {MPI_TIMEOUT_S:g} s for all_reduce of 1024 x torch.float32" in out, out
    assert "UNEXPECTED" not in out, out
    assert MPI_TIMEOUT_S <= after_fault < MPI_TIMEOUT_S + 10, (after_fault, out)
    assert not _ranks_left()
    print(f"FAULT mpi stall: exit code {rc}, every rank gone {after_fault:.2f} s after the stall "
          f"(timeout {MPI_TIMEOUT_S:g} s; {total:.1f} s in all)")


def test_mpi_timeout_argument_is_checked(monkeypatch):
    from compressed_opt.comm.mpi_backend import resolve_timeout

    monkeypatch.delenv("COMPRESSED_OPT_TIMEOUT", raising=False)
    assert resolve_timeout(None) is None and resolve_timeout(0) is None and resolve_timeout(2) == 2.0
    monkeypatch.setenv("COMPRESSED_OPT_TIMEOUT", "7.5")
    assert resolve_timeout(None) == 7.5 and resolve_timeout(1) == 1.0
    monkeypatch.setenv("COMPRESSED_OPT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="COMPRESSED_OPT_TIMEOUT='soon' is not a number"):
        resolve_timeout(None)
    for bad in (-1, "3", True, float("nan")):
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            resolve_timeout(bad)
