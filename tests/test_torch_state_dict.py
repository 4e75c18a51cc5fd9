"""The optimizers through torch's distributed state_dict API (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``), saved and loaded with ``dcp.save`` / ``dcp.load`` (sharded) or
``torch.save`` / ``torch.load`` (a full state dict), in fresh processes, as FSDP2 users,
accelerate and Lightning checkpoint (compressed_opt.torch_state_dict).

Each job trains to step ``SAVE_AT`` (in the compression stage), saves model and optimizer, and
trains on to ``STEPS``; the resumed job, in new processes with a model made from another seed,
loads both and trains the same steps. Its final parameters and optimizer state must equal the
uninterrupted job's bit for bit, on every rank: replicated data parallel (2 ranks), FSDP2's own
HSDP (2 replicas x 2 shards) and HSDP with tensor parallelism (2 x 2 x 2), all three optimizers
and ZeRO 1, sharded. A full state dict is
refused on every rank at the load (torch's full load takes the record apart:
compressed_opt.torch_state_dict).
"""
from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import compressed_opt
from distributed import run_ranks
from sharding import fsdp2_hsdp
from test_dcp import CONFIGS  # (the same configurations as through compressed_opt.dcp.OptimizerState)

SAVE_AT, STEPS = 6, 9


def _model(seed, mesh):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))
    # FSDP2's own HSDP as torchtitan shards (with tensor parallelism inside the replicas: the 3-D mesh)
    return model if mesh is None else fsdp2_hsdp(model, mesh)


def _train(model, opt, steps):
    rank = dist.get_rank() // (2 if dist.get_world_size() == 8 else 1)  # (tp ranks: the same batch)
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 12, generator=g)).square().mean().backward()
        opt.step()


def _local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _final(model, opt) -> list[torch.Tensor]:
    out = [_local(p) for p in model.parameters()]
    for p in (p for g in opt.param_groups for p in g["params"]):
        out += [_local(v) for _, v in sorted(opt.state.get(p, {}).items()) if torch.is_tensor(v)]
    return out


def _bitwise_equal(x, y) -> bool:
    """Bit for bit (the per-layer rows hold NaN in the columns a layout leaves unused)."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8),
                                                                      y.contiguous().view(torch.uint8))


def _job(rank, world, root, hsdp, mode, resume):
    """Every config of the layout: train (or resume) and save at SAVE_AT in ``mode``; the finals."""
    from torch.distributed.checkpoint import load, save
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_model_state_dict,
                                                         set_optimizer_state_dict)

    warnings.simplefilter("ignore")
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")) if world == 4 else \
            init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    full = mode == "full"
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    # (a full state dict loads as Lightning and accelerate load it: rank 0's, broadcast)
    loading = StateDictOptions(full_state_dict=full, broadcast_from_rank0=full)
    finals, said = {}, {}
    for name, config in CONFIGS.items():
        if hsdp and "zero" in name:
            continue  # (ZeRO shards the exchange's chunks: FSDP2 already shards the state)
        path = os.path.join(root, f"{name}-{mode}")
        model = _model(1 if resume else 0, mesh)
        opt = getattr(compressed_opt, name.split("-")[0])(model.parameters(), lr=1e-2, **config)
        if not resume:
            _train(model, opt, range(1, SAVE_AT + 1))
            if full:
                opt.consolidate_state_dict()  # (every rank's own state into rank 0's state dict)
            state = {"model": get_model_state_dict(model, options=options),
                     "optim": get_optimizer_state_dict(model, opt, options=options)}
            if full:
                if rank == 0:
                    torch.save(state, path)
                dist.barrier()
            else:
                save(state, checkpoint_id=path)
        else:
            if full:  # (every rank reads the one file, as a full state dict resumes)
                state = torch.load(path, weights_only=True)
            else:
                state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
                load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"], options=loading)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    set_optimizer_state_dict(model, opt, state["optim"], options=loading)
                except ValueError as exc:
                    finals[name], said[name] = opt.global_step, [f"raised: {exc}"]
                    opt.close()
                    continue
            said[name] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
            assert opt.global_step == SAVE_AT and opt.compressing, (name, opt.global_step)
        _train(model, opt, range(SAVE_AT + 1, STEPS + 1))
        finals[name] = _final(model, opt)
        opt.close()
    return finals, said


def _resumed(tmp_path, world, hsdp, mode):
    through = run_ranks(_job, world, str(tmp_path), hsdp, mode, False, timeout=240)
    resumed = run_ranks(_job, world, str(tmp_path), hsdp, mode, True, timeout=240)
    return through, resumed


def _compare(tmp_path, world, hsdp, mode):
    through, resumed = _resumed(tmp_path, world, hsdp, mode)
    for rank in range(world):
        (a, _), (b, said) = through[rank], resumed[rank]
        assert set(a) == set(b) and a, (a.keys(), b.keys())
        for name in a:
            assert said[name] == [], (rank, name, said[name])
            differ = [i for i, (x, y) in enumerate(zip(a[name], b[name])) if not _bitwise_equal(x, y)]
            assert len(a[name]) == len(b[name]) and not differ, (
                f"rank {rank}, {name}: the resumed job differs from the uninterrupted one in tensors {differ} "
                f"(parameters first, then the state of each parameter by name)")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_replicated_resume_through_torchs_state_dict_api_is_bit_identical(tmp_path):
    """Two ranks, plain data parallel: every optimizer (ZeRO 1 included) resumes bit for bit from a
    sharded DCP checkpoint, with no warning."""
    _compare(tmp_path, 2, False, "sharded")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_hsdp_resume_through_torchs_state_dict_api_is_bit_identical(tmp_path):
    """Four ranks, FSDP2's own HSDP (2 replicas x 2 shards), the moments DTensors that DCP saves
    per shard and every rank's own record (error feedback, 0/1 Adam's local state) under its own
    key: every optimizer resumes bit for bit."""
    _compare(tmp_path, 4, True, "sharded")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_hsdp_with_tensor_parallelism_resume_through_torchs_state_dict_api_is_bit_identical(tmp_path):
    """Eight ranks, FSDP2's own HSDP with tensor parallelism inside each replica (dp_replicate 2 x
    dp_shard 2 x tp 2, the 3-D mesh torchtitan makes): every optimizer resumes bit for bit."""
    _compare(tmp_path, 8, True, "sharded")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_full_state_dict_is_refused_on_every_rank_at_the_load(tmp_path):
    """HSDP, a full state dict saved as accelerate's FULL_STATE_DICT and Lightning's full
    checkpoint save it (after consolidate_state_dict) and loaded as they load it (rank 0's,
    broadcast): torch's load takes the record apart into the fresh optimizer's keys, so every rank
    raises, saying why and what to use, and nothing is loaded."""
    _, resumed = _resumed(tmp_path, 4, True, "full")
    for rank, (finals, said) in enumerate(resumed):
        assert set(finals) == {"OnebitAdam", "OnebitLamb", "ZeroOneAdam"}
        for name, lines in said.items():
            assert finals[name] != SAVE_AT and len(lines) == 1, (rank, name, lines)
            assert re.search("raised: .*went through torch's full state dict.*Save and load it sharded", lines[0]), (
                rank, name, lines[0])
