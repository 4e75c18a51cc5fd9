"""torch.distributed.checkpoint (DCP) at another world size or on another mesh:
``OptimizerState(opt, reshard=True)`` puts the saved moments onto the loading ranks' parameters
(or shards, resharded by DCP), every rank from one replica, and restarts the error feedback with a
warning; without ``reshard=True`` such a load raises on every rank, never resumes wrong state; ZeRO
is refused up front."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import compressed_opt
from compressed_opt.dcp import OptimizerState

from distributed import run_ranks
from test_dcp import _train  # (the same seeded steps as the same-rank round trips)

CONFIGS = {
    "OnebitAdam": dict(freeze_step=3),
    "OnebitLamb": dict(freeze_step=3),
    "ZeroOneAdam": dict(var_freeze_step=3, var_update_scaler=2, local_step_scaler=4),
}
SAVE_AT, MORE = 8, 3  # (0/1 Adam: step 8 is a local step, between synchronisations; 11 a sync)


def _model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))


def _moments(opt, whole=lambda p, t: t) -> dict:
    """``{(i, name): tensor}``: the per-parameter buffers, each made whole by ``whole``."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return {(i, name): whole(p, opt.state[p][name].detach().clone())
            for i, p in enumerate(params) for name in opt.engine.client.tensor_names() if name in opt.state[p]}


# --- replicated: 2 ranks -> 1 process and -> 3 ranks ------------------------------------------------
def _save_replicated(rank, world, root):
    warnings.simplefilter("ignore", UserWarning)
    out = {}
    for name, kw in CONFIGS.items():
        model = _model(0)
        opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, **kw)
        _train(model, opt, rank, range(1, SAVE_AT + 1))
        dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=os.path.join(root, name))
        out[name] = (_moments(opt), opt.global_step, opt.compressing, opt.engine.client.rank_parameters())
    return out


def _load_replicated(rank, world, root):
    out = {}
    for name, kw in CONFIGS.items():
        model = _model(1)
        opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, **kw)
        state = {"model": model.state_dict(), "optim": OptimizerState(opt, reshard=True)}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dcp.load(state, checkpoint_id=os.path.join(root, name))
        model.load_state_dict(state["model"])
        reset = [str(w.message) for w in caught if "start again from zero" in str(w.message)]
        loaded = (_moments(opt), opt.global_step, opt.compressing)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _train(model, opt, rank, range(SAVE_AT + 1, SAVE_AT + MORE + 1))
        after = [p.detach().clone() for p in model.parameters()]
        out[name] = (loaded, reset, after)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_replicated_checkpoint_reshards_onto_one_process_and_onto_three_ranks(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(_save_replicated, 2, root, timeout=240)
    assert saved[0]["ZeroOneAdam"][3], "0/1 Adam should be saved between synchronisations (its ranks' own state)"
    own = saved[0]["ZeroOneAdam"][0]
    assert any(not torch.equal(own[k], saved[1]["ZeroOneAdam"][0][k]) for k in own), "ranks' local states differ"
    single = _load_replicated(0, 1, root)
    three = run_ranks(_load_replicated, 3, root, timeout=240)
    for name in CONFIGS:
        moments, step, compressing, _ = saved[0][name]
        for result in (single, *three):
            (loaded, at, stage), reset, after = result[name]
            assert (at, stage) == (step, compressing) == (SAVE_AT, True), name
            assert loaded.keys() == moments.keys(), name
            for key, value in moments.items():  # rank 0's, on every rank (0/1 Adam's own state too)
                assert torch.equal(loaded[key], value), (name, key)
            assert len(reset) == 1, (name, reset)
            assert all(torch.isfinite(p).all() for p in after), name
        for r in (1, 2):  # the three ranks go on as one replica
            assert all(torch.equal(a, b) for a, b in zip(three[0][name][2], three[r][name][2])), (name, r)


def _load_without_reshard(rank, world, path):
    opt = compressed_opt.OnebitAdam(_model(1).parameters(), lr=1e-2, **CONFIGS["OnebitAdam"])
    try:
        dcp.load({"optim": OptimizerState(opt)}, checkpoint_id=path)
        return "loaded", opt.global_step
    except BaseException as exc:  # noqa: BLE001 - (DCP's CheckpointException is a BaseException)
        return str(exc) + "".join(map(str, getattr(exc, "failures", {}).values())), opt.global_step


def test_without_reshard_another_world_size_is_refused_and_says_how(tmp_path):
    """Saved by 2 ranks: on 1 this module's error names reshard=True; on 3, DCP's missing-key
    error for rank 2's entry, on every rank (DCP checks the template's keys first); nothing loads."""
    run_ranks(_save_replicated, 2, str(tmp_path), timeout=240)
    path = os.path.join(str(tmp_path), "OnebitAdam")
    model = _model(1)
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, **CONFIGS["OnebitAdam"])
    with pytest.raises(ValueError, match=r"state of 2 ranks, and it is loaded on 1.*reshard=True"):
        dcp.load({"optim": OptimizerState(opt)}, checkpoint_id=path)
    assert opt.global_step == 0
    for said, step in run_ranks(_load_without_reshard, 3, path, timeout=120):
        assert "Missing key in checkpoint state_dict: optim.rank2" in said and step == 0, said[:300]


def test_zero_state_is_not_resharded_and_says_so():
    opt = compressed_opt.OnebitAdam(_model(0).parameters(), zero_stage=1)
    with pytest.raises(ValueError, match="ZeRO's state .* not resharded"):
        OptimizerState(opt, reshard=True)
    with pytest.raises(TypeError, match="reshard must be True or False"):
        OptimizerState(opt, reshard="yes")


# --- HSDP: (2 replicas x 2 shards) -> (1 x 4) ------------------------------------------------------
def _hsdp(shape, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = _model(seed)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    return mesh, model


def _whole(opt):
    from torch.distributed.tensor import DTensor

    def whole(p, local):
        dt = opt.engine.local_shards.public_of(p)  # (the DTensor whose shard p is, else p)
        return DTensor.from_local(local, dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                                  stride=dt.stride()).full_tensor()
    return whole


def _replica0_whole(opt, replicas) -> dict:
    """Replica 0's moments, made whole (``replicas``: the mesh dimension of the replicas): what
    every rank of a resharded run must hold its part of."""
    params = [q for g in opt.param_groups for q in g["params"]]
    out = {}
    for (i, buffer), value in _moments(opt).items():
        mine = value if replicas.get_local_rank() == 0 else torch.zeros_like(value)
        dist.broadcast(mine, src=dist.get_global_rank(replicas.get_group(), 0), group=replicas.get_group())
        out[i, buffer] = _whole(opt)(params[i], mine)
    return out


def _resharded(model, opt, path, rank):
    """Load ``path`` resharded onto ``model`` and ``opt`` and train on: the moments as loaded, made
    whole, the step, the stage, and whether the parameters stayed finite."""
    state = {"model": model.state_dict(), "optim": OptimizerState(opt, reshard=True)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        loaded = _moments(opt, _whole(opt))
        _train(model, opt, rank, range(SAVE_AT + 1, SAVE_AT + MORE + 1))
    finite = all(torch.isfinite(p.to_local()).all() for p in model.parameters())
    return loaded, opt.global_step, opt.compressing, finite


def _hsdp_save(rank, world, root):
    warnings.simplefilter("ignore")
    mesh, out = None, {}
    for name, kw in CONFIGS.items():
        mesh, model = _hsdp((2, 2), 0)
        r_rep, r_shard = mesh.get_coordinate()
        opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, backend=mesh["replicate"], **kw)
        _train(model, opt, 10 * r_rep + r_shard, range(1, SAVE_AT + 1))
        dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=os.path.join(root, name))
        out[name] = (_replica0_whole(opt, mesh["replicate"]), opt.global_step)
    return out


def _hsdp_load(rank, world, root):
    out = {}
    for name, kw in CONFIGS.items():
        mesh, model = _hsdp((1, 4), 1)
        opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, backend=mesh["replicate"], **kw)
        path = os.path.join(root, name)
        with pytest.raises(ValueError, match="sharded otherwise|another rank could not"):
            dcp.load({"optim": OptimizerState(opt)}, checkpoint_id=path)  # same world size, another mesh
        assert opt.global_step == 0
        out[name] = _resharded(model, opt, path, rank)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_hsdp_checkpoint_reshards_onto_another_mesh(tmp_path):
    """Saved on a (2, 2) HSDP mesh, loaded on (1, 4): each parameter's moments, made whole again,
    are replica 0's (DCP read each rank's new shard out of the old ones); training goes on."""
    root = str(tmp_path)
    _every_rank_holds_replica0s(run_ranks(_hsdp_save, 4, root, timeout=300),
                                run_ranks(_hsdp_load, 4, root, timeout=300))


def _every_rank_holds_replica0s(saved, loaded) -> None:
    """Every loading rank's moments, made whole, are the saving replica 0's, and it trained on in
    the compression stage."""
    for name in CONFIGS:
        whole, step = saved[0][name]
        for rank, out in enumerate(loaded):
            moments, at, compressing, finite = out[name]
            assert (at, compressing, finite) == (step + MORE, True, True), (name, rank)
            assert moments.keys() == whole.keys(), (name, rank)
            assert all(torch.equal(moments[key], whole[key]) for key in whole), (name, rank)


# --- FSDP2's own HSDP with tensor parallelism: (2 x 2 x 2) -> (1 x 4) ---------------------------------
def _own_mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp")[:len(shape)])


def _three_d_save(rank, world, root):
    from sharding import fsdp2_hsdp

    warnings.simplefilter("ignore")
    out = {}
    for name, kw in CONFIGS.items():
        mesh = _own_mesh((2, 2, 2))
        model = fsdp2_hsdp(_model(0), mesh)
        opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, **kw)
        _train(model, opt, rank // 2, range(1, SAVE_AT + 1))  # (a tp pair: one batch)
        dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=os.path.join(root, name))
        out[name] = (_replica0_whole(opt, mesh["dp_replicate"]), opt.global_step)
    return out


def _three_d_load(rank, world, root):
    from sharding import fsdp2_hsdp

    warnings.simplefilter("ignore")
    out = {}
    for name, kw in CONFIGS.items():
        model = fsdp2_hsdp(_model(1), _own_mesh((1, 4)))
        opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, **kw)
        out[name] = _resharded(model, opt, os.path.join(root, name), rank)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_3d_checkpoint_of_fsdps_own_hsdp_reshards_onto_a_2d_mesh(tmp_path):
    """Saved under FSDP2's own HSDP with tensor parallelism, (dp_replicate 2, dp_shard 2, tp 2) on 8
    ranks (FSDP's _StridedShard over tp's Shard), loaded on (1, 4) with no tp: each parameter's
    moments, made whole, are replica 0's; every optimizer trains on in the compression stage."""
    root = str(tmp_path)
    _every_rank_holds_replica0s(run_ranks(_three_d_save, 8, root, timeout=300),
                                run_ranks(_three_d_load, 4, root, timeout=300))


# --- tensor parallel: (dp 2 x tp 2) -> (dp 4 x tp 1) ----------------------------------------------
def _tp(shape, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    model = _model(seed)
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return mesh, model


def _tp_run(rank, world, root, shape, resume):
    warnings.simplefilter("ignore")
    mesh, model = _tp(shape, 1 if resume else 0)
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, backend=mesh["dp"], **CONFIGS["OnebitAdam"])
    if resume:
        state = {"model": model.state_dict(), "optim": OptimizerState(opt, reshard=True)}
        dcp.load(state, checkpoint_id=root)
        model.load_state_dict(state["model"])
    else:
        _train(model, opt, mesh.get_coordinate()[0], range(1, SAVE_AT + 1))
        dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=root)
    whole = _moments(opt, _whole(opt))  # (every dp replica holds the same)
    _train(model, opt, mesh.get_coordinate()[0], range(SAVE_AT + 1, SAVE_AT + MORE + 1))
    return whole, opt.global_step, all(torch.isfinite(p.full_tensor()).all() for p in model.parameters())


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_tensor_parallel_checkpoint_reshards_onto_another_tp_degree(tmp_path):
    """Saved on (dp 2, tp 2), loaded on (dp 4, tp 1): each parameter's moments, made whole, are
    the saved ones; the run goes on."""
    saved = run_ranks(_tp_run, 4, str(tmp_path), (2, 2), False, timeout=300)
    loaded = run_ranks(_tp_run, 4, str(tmp_path), (4, 1), True, timeout=300)
    for rank in range(4):
        whole, step, finite = loaded[rank]
        assert (step, finite) == (SAVE_AT + MORE, True), rank
        assert whole.keys() == saved[0][0].keys()
        for key, value in saved[0][0].items():
            assert torch.equal(whole[key], value), (rank, key)


# --- as a user runs it: examples/hsdp_dcp.py under torchrun ----------------------------------------
def _torchrun(ranks, *args):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-P", "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           os.path.join(root, "examples", "hsdp_dcp.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=root)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_the_hsdp_example_saves_on_four_ranks_and_resumes_resharded_on_two(tmp_path):
    """``examples/hsdp_dcp.py``: HSDP (2, 2) trains across the freeze and saves; on 2 ranks
    without ``--reshard`` the load is refused naming ``reshard=True``; with it the run resumes
    in the compression stage and goes on."""
    ckpt = str(tmp_path / "ckpt")
    saved = _torchrun(4, "--replicas", "2", "--steps", "12", "--save", ckpt)
    assert saved.returncode == 0, saved.stdout + saved.stderr
    assert "compression: 7 steps" in saved.stdout and f"saved {ckpt}" in saved.stdout, saved.stdout
    refused = _torchrun(2, "--replicas", "1", "--steps", "2", "--load", ckpt)
    assert refused.returncode != 0 and "reshard=True" in refused.stderr, refused.stderr[-2000:]
    resumed = _torchrun(2, "--replicas", "1", "--steps", "4", "--load", ckpt, "--reshard")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed at step 12 (compressing)" in resumed.stdout and "step 16: loss" in resumed.stdout, resumed.stdout
    assert "start again from zero" in resumed.stderr


def test_resharding_a_checkpoint_of_another_model_or_optimizer_raises_and_loads_nothing(tmp_path):
    """The wrong checkpoint, resharded: another layer width (DCP's size check), another layer
    count, another optimizer (its buffers and algorithm): each raises, and nothing is loaded."""
    from torch.distributed.checkpoint.api import CheckpointException

    run_ranks(_save_replicated, 2, str(tmp_path), timeout=240)
    path = os.path.join(str(tmp_path), "OnebitAdam")
    wider = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 6))
    shorter = nn.Sequential(nn.Linear(12, 24))
    cases = [(compressed_opt.OnebitAdam, wider, "Size mismatch"),
             (compressed_opt.OnebitAdam, shorter, "state of 4 parameters, this optimizer has 2"),
             (compressed_opt.OnebitLamb, _model(1), "state.0.exp_avg_sq_fresh")]
    for cls, model, said in cases:
        opt = cls(model.parameters(), lr=1e-2, freeze_step=3)
        with pytest.raises((CheckpointException, ValueError)) as caught:
            dcp.load({"optim": OptimizerState(opt, reshard=True)}, checkpoint_id=path)
        text = str(caught.value) + "".join(map(str, getattr(caught.value, "failures", {}).values()))
        assert said in text, (cls.__name__, text[-500:])
        assert opt.global_step == 0 and not opt.state, cls.__name__


def _one_rank_cannot_load(rank, world):
    warnings.simplefilter("ignore")
    model = _model(0)
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, **CONFIGS["OnebitAdam"])
    _train(model, opt, rank, range(1, 5))
    entries = OptimizerState(opt).state_dict()
    if rank == 1:
        entries["rank1"] = b"not a state"  # (a damaged entry of this rank only)
    fresh = compressed_opt.OnebitAdam(_model(1).parameters(), lr=1e-2, **CONFIGS["OnebitAdam"])
    try:
        OptimizerState(fresh).load_state_dict(entries)
        return "loaded", fresh.global_step
    except Exception as exc:  # noqa: BLE001 - what each rank says is the result
        return f"{type(exc).__name__}: {exc}", fresh.global_step


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_entry_one_rank_cannot_load_raises_on_every_rank():
    """Rank 1's entry damaged, rank 0's sound: both raise (rank 0 saying another rank could not),
    neither loads, and neither waits for the other in the optimizer's collective load."""
    (said0, step0), (said1, step1) = run_ranks(_one_rank_cannot_load, 2, timeout=90)
    assert "another rank could not load" in said0, said0
    assert "this rank's entry of the checkpoint could not be read" in said1, said1
    assert step0 == step1 == 0
