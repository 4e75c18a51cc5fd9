"""One checkpoint file for every rank: ``consolidate_state_dict`` (compressed_opt.consolidate).

The frameworks save the optimizer from rank 0 and load that file on every rank. Checked on 2
Gloo ranks, for every optimizer (and ZeRO stage 2): train into the compression stage, every rank
consolidates, rank 0 alone saves the model and the optimizer, training goes on; then a fresh
model and optimizer on each rank load rank 0's two files and train the same steps. The resumed
ranks must end bit-identical to the uninterrupted ones (parameters and every state tensor). The
same without consolidating must differ on rank 1 (the check can fail), and the stale parts of a
consolidation are gone after the next step.
"""
from __future__ import annotations

import os

import pytest
import torch
from distributed import run_ranks

import compressed_opt
from compressed_opt import state
from compressed_opt.checkpoint import CheckpointError

SAVE_AT, STEPS = 6, 10

CASES = {
    "onebitadam": (compressed_opt.OnebitAdam, {"freeze_step": 3}),
    "onebitadam-zero2": (compressed_opt.OnebitAdam, {"freeze_step": 3, "zero_stage": 2}),
    "onebitlamb": (compressed_opt.OnebitLamb, {"freeze_step": 3}),
    # local steps: intervals 1, 2, 2, 4 ...: step 6 is a local step (between synchronisations)
    "zerooneadam": (compressed_opt.ZeroOneAdam, {"var_freeze_step": 3, "local_step_scaler": 1,
                                                 "local_step_clipper": 4}),
}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _make(name: str, model):
    cls, kwargs = CASES[name]
    return cls(model.parameters(), lr=1e-2, bucket_cap_mb=0.001, **kwargs)  # several buckets


def _train(model, opt, rank: int, steps) -> None:
    for t in steps:
        g = torch.Generator().manual_seed(1000 * rank + t)  # each rank its own data
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt) -> dict:
    out = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"state.{i}.{k}"] = v.detach().clone()
    for j, b in enumerate(opt.engine.buckets):
        # the error feedback (worker_error, server_error) and the algorithm's saved buffers
        for part in state.parts(b.state) + [b.feedback, b.sync]:
            for k in state.names(part, state.SAVED):
                if getattr(part, k) is not None:
                    out[f"bucket.{j}.{k}"] = getattr(part, k).clone()
    return out


def _differences(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _resume_from_rank0(rank, world, name, folder, consolidated):
    import torch.distributed as dist

    model = _model(0)
    opt = _make(name, model)
    _train(model, opt, rank, range(1, SAVE_AT + 1))
    facts = {"own_parameters": opt.engine.client.rank_parameters()}
    if consolidated:
        opt.consolidate_state_dict(0)
    if rank == 0:
        sd = opt.state_dict()
        facts["parts"] = len(sd["compressed_opt"].get("ranks", []))
        torch.save(sd, os.path.join(folder, "optimizer.pt"))
        torch.save(model.state_dict(), os.path.join(folder, "model.pt"))
    dist.barrier()
    _train(model, opt, rank, range(SAVE_AT + 1, STEPS + 1))
    facts["stale_parts"] = "ranks" in opt.state_dict()["compressed_opt"]
    uninterrupted = _snapshot(model, opt)

    resumed_model = _model(1)  # other initial values: everything must come from the files
    resumed = _make(name, resumed_model)
    resumed_model.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt")))
    facts["warnings"] = [str(w.message) for w in caught]
    _train(resumed_model, resumed, rank, range(SAVE_AT + 1, STEPS + 1))
    facts["differences"] = _differences(uninterrupted, _snapshot(resumed_model, resumed))
    return facts


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", sorted(CASES))
def test_one_file_resumes_every_rank_bit_exactly(name, tmp_path):
    results = run_ranks(_resume_from_rank0, 2, name, str(tmp_path), True, timeout=180)
    assert results[0]["parts"] == 2
    for rank, r in enumerate(results):
        assert r["differences"] == [], f"rank {rank} resumed differently: {r['differences'][:8]}"
        assert r["warnings"] == [], r["warnings"]
        assert not r["stale_parts"], "a step after consolidating, state_dict() still carried the old parts"
    if name == "zerooneadam":  # the case of parameters that differ between the ranks
        assert all(r["own_parameters"] for r in results)


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_without_consolidating_rank1_resumes_differently(tmp_path):
    """The control: rank 0's own state on rank 1 resets its error feedback (warned), and the
    resumed run differs (on both ranks: rank 1's exchanges feed rank 0's average too), so the
    bit-exact check above can fail."""
    results = run_ranks(_resume_from_rank0, 2, "onebitadam", str(tmp_path), False, timeout=180)
    assert results[0]["parts"] == 0
    assert results[0]["warnings"] == []
    assert any("reset to zero" in w for w in results[1]["warnings"]), results[1]["warnings"]
    assert any(k.startswith("param.") for k in results[1]["differences"]), results[1]["differences"]


def _save_consolidated(rank, world, folder):
    model = _model(0)
    opt = _make("onebitadam", model)
    _train(model, opt, rank, range(1, SAVE_AT + 1))
    opt.consolidate_state_dict(to=1)
    sd = opt.state_dict()
    if rank == 1:
        torch.save(sd, os.path.join(folder, "optimizer.pt"))
    with pytest.raises(ValueError, match="must be a rank"):
        opt.consolidate_state_dict(to=2)
    return "ranks" in sd["compressed_opt"]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_consolidated_file_on_another_world_size_and_damaged(tmp_path):
    has_parts = run_ranks(_save_consolidated, 2, str(tmp_path), timeout=100)
    assert has_parts == [False, True], "only rank `to` carries the parts"
    sd = torch.load(tmp_path / "optimizer.pt")
    single = compressed_opt.comm.SingleProcessBackend()
    model = _model(0)
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=0.001, backend=single)
    with pytest.warns(RuntimeWarning, match="holds the state of 2 ranks and is loaded on 1"):
        opt.load_state_dict(sd)
    assert opt.compressing and opt.global_step == SAVE_AT
    _train(model, opt, 0, range(SAVE_AT + 1, STEPS + 1))  # error feedback from zero, training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())

    damaged = {**sd, "compressed_opt": {**sd["compressed_opt"], "ranks": sd["compressed_opt"]["ranks"][:1]}}
    fresh = compressed_opt.OnebitAdam(_model(0).parameters(), lr=1e-2, freeze_step=3, bucket_cap_mb=0.001,
                                      backend=single)
    with pytest.raises(CheckpointError, match="list of 2 per-rank parts"):
        fresh.load_state_dict(damaged)
    parts = [dict(p) for p in sd["compressed_opt"]["ranks"]]
    parts[1]["state"] = {0: {"exp_avg": torch.zeros(3)}}
    with pytest.raises(CheckpointError, match="no per-rank state"):
        fresh.load_state_dict({**sd, "compressed_opt": {**sd["compressed_opt"], "ranks": parts}})


def test_consolidating_between_backward_and_step_is_refused():
    model = _model(0)
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=1,
                                    backend=compressed_opt.comm.SingleProcessBackend())
    _train(model, opt, 0, range(1, 4))  # compression stage: the exchange launches from backward
    g = torch.Generator().manual_seed(7)
    torch.nn.functional.mse_loss(model(torch.randn(16, 8, generator=g)), torch.randn(16, 4, generator=g)).backward()
    with pytest.raises(RuntimeError, match="between backward\\(\\) and step\\(\\)"):
        opt.consolidate_state_dict()
    opt.step()
    opt.consolidate_state_dict()  # between steps: fine
    assert len(opt.state_dict()["compressed_opt"]["ranks"]) == 1
