"""The optimizers through torch's distributed state_dict API (``get_optimizer_state_dict`` /
``set_optimizer_state_dict``), saved and loaded with ``dcp.save`` / ``dcp.load`` (sharded) or
``torch.save`` / ``torch.load`` (a full state dict), in fresh processes, as FSDP2 users,
accelerate and Lightning checkpoint (compressed_opt.torch_state_dict).

Each job trains to step ``SAVE_AT`` (in the compression stage), saves model and optimizer, and
trains on to ``STEPS``; the resumed job, in new processes with a model made from another seed,
loads both and trains the same steps. Its final parameters and optimizer state must equal the
uninterrupted job's bit for bit, on every rank: replicated data parallel (2 ranks), FSDP2's own
HSDP (2 replicas x 2 shards) and HSDP with tensor parallelism (2 x 2 x 2), all three optimizers
and ZeRO 1; sharded, flattened (torchtitan's) and full through DCP; and replicated, a full state
dict of rank 0 alone after consolidate_state_dict. Under HSDP, rank 0's full state dict alone is
refused on every rank (compressed_opt.torch_state_dict).
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
    full = mode == "full"  # (rank 0's full state dict in one file; "full-dcp": every rank's through DCP)
    if mode in ("flat", "full-dcp"):  # (flat: as torchtitan saves)
        options = loading = StateDictOptions(flatten_optimizer_state_dict=mode == "flat",
                                             full_state_dict=mode == "full-dcp")
    else:
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
                state = {"model": get_model_state_dict(model, options=options),
                         "optim": get_optimizer_state_dict(model, opt, options=options)}
                load(state, checkpoint_id=path)
            set_model_state_dict(model, state["model"], options=loading)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    set_optimizer_state_dict(model, opt, state["optim"], options=loading)
                except (ValueError, AssertionError) as exc:  # (ours; torch's, that ZeRO's full state dict meets)
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
            if "zero" in name and mode.startswith("full"):
                # torch's load of a full state dict takes the device from the tensors of the optimizer's own
                # state dict; ZeRO's moments are in its record (the rank's chunks), none in a parameter's state
                assert said[name] == ["raised: Expected device to be set"], (rank, name, said[name])
                continue
            assert said[name] == [], (rank, name, said[name])
            differ = [i for i, (x, y) in enumerate(zip(a[name], b[name])) if not _bitwise_equal(x, y)]
            assert len(a[name]) == len(b[name]) and not differ, (
                f"rank {rank}, {name}: the resumed job differs from the uninterrupted one in tensors {differ} "
                f"(parameters first, then the state of each parameter by name)")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sharded", "flat", "full-dcp", "full"])
def test_replicated_resume_through_torchs_state_dict_api_is_bit_identical(tmp_path, mode):
    """Two ranks, plain data parallel: every optimizer resumes bit for bit, with no warning, from DCP
    checkpoints of torch's state dicts, sharded and flattened (``flatten_optimizer_state_dict=True``,
    torchtitan's), ZeRO 1 included; full (``full_state_dict=True``) as every rank saves it through
    DCP, and as rank 0 alone saves it after ``consolidate_state_dict()``, loaded broadcast from rank
    0 (Lightning's and accelerate's full checkpoints: each rank takes its own part of rank 0's
    record). ZeRO's full state dict is refused by torch at the load (docs/guarantees.md)."""
    _compare(tmp_path, 2, False, mode)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["sharded", "flat", "full-dcp"])
def test_hsdp_resume_through_torchs_state_dict_api_is_bit_identical(tmp_path, mode):
    """Four ranks, FSDP2's own HSDP (2 replicas x 2 shards), the moments DTensors that DCP saves
    per shard (full: gathered, and each rank's shard taken back) and every rank's own record (error
    feedback, 0/1 Adam's local state) under its own key: every optimizer resumes bit for bit,
    sharded, flattened and full through DCP."""
    _compare(tmp_path, 4, True, mode)


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_hsdp_with_tensor_parallelism_resume_through_torchs_state_dict_api_is_bit_identical(tmp_path):
    """Eight ranks, FSDP2's own HSDP with tensor parallelism inside each replica (dp_replicate 2 x
    dp_shard 2 x tp 2, the 3-D mesh torchtitan makes): every optimizer resumes bit for bit."""
    _compare(tmp_path, 8, True, "sharded")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_hsdp_full_state_dict_of_rank_0_alone_is_refused_on_every_rank_at_the_load(tmp_path):
    """HSDP, a full state dict that rank 0 alone saves (accelerate's FULL_STATE_DICT, Lightning's
    full checkpoint, after consolidate_state_dict), loaded as they load it (rank 0's, broadcast):
    the per-layer state of a DTensor parameter is each shard's own, and rank 0's record holds its
    shard's only, so every rank raises (the others saying why and what to use), nothing loaded."""
    _, resumed = _resumed(tmp_path, 4, True, "full")
    for rank, (finals, said) in enumerate(resumed):
        assert set(finals) == {"OnebitAdam", "OnebitLamb", "ZeroOneAdam"}
        for name, lines in said.items():
            assert finals[name] != SAVE_AT and len(lines) == 1, (rank, name, lines)
            # (rank 0 hears of its replica partner, rank 2: position 1 of the replica group it loads with)
            expected = ("raised: .*the checkpoint of rank\\(s\\) 1 failed validation" if rank == 0 else
                        f"raised: .*holds the record of rank 0 and not of rank {rank}.*Save it through DCP")
            assert re.search(expected, lines[0]), (rank, name, lines[0])
