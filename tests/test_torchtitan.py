"""torchtitan 0.3 as it ships, on 4 CPU Gloo ranks: its debug Llama, its own ``parallelize_llama``
(``spmd_backend="partial_dtensor"``: FSDP2's ``fully_shard`` on ``mesh["dp_replicate", "fsdp"]``),
its LR scheduler and checkpoint manager, with ``compressed_opt.integrations.torchtitan``'s
container as the only glue. Tokens are fed from a seeded generator (torchtitan's wheel ships no
tokenizer or dataset); the loss is torchtitan's (each rank's token sum over the global token count,
FSDP's divide factor 1). Skipped without torchtitan (``pip install -e .[torchtitan]``).

The CPU patches below are the tests' own, never the library's: torchtitan's device type ("cuda"
where no accelerator is found), its triton kernels module (imported by the Llama package, unused
here), FlexAttention (no backward on CPU: plain causal SDPA instead), and FSDP's ``PREMUL_SUM``
(Gloo has none: ``set_force_sum_reduction_for_comms``, the same sums divided after)."""
from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e .[torchtitan])")

from distributed import run_ranks  # noqa: E402

pytestmark = pytest.mark.multiprocess

STEPS, FREEZE, LR = 40, 10, 3e-3
BATCH, SEQ, VOCAB = 2, 16, 256


def _cpu_patches():
    """torchtitan on CPU (see the module doc); in each rank, before torchtitan's models are imported."""
    import torch

    kernels = "torchtitan.distributed.minimal_async_ep.kernels"
    if kernels not in sys.modules:
        stub = types.ModuleType(kernels)

        def __getattr__(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def unavailable(*args, **kwargs):
                raise RuntimeError("triton kernels are not available on CPU")
            return unavailable
        stub.__getattr__ = __getattr__
        sys.modules[kernels] = stub
    import torchtitan.trainer  # noqa: F401  (every module that reads the device type)
    from torchtitan.models import llama3  # noqa: F401
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
            if hasattr(module, "device_module"):
                module.device_module = torch.cpu


def _model(dims, seed=0):
    """torchtitan's debug Llama, parallelized by its own ``parallelize_llama``."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry

    spec = model_registry("debugmodel")
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    with torch.device("meta"):
        model = spec.model.build()
    model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                                parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                                compile_config=CompileConfig(), ac_config=None, dump_folder="/tmp")
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def _dims(layout, world):
    from torchtitan.distributed import ParallelDims

    replicate, shard, tp = layout
    dims = ParallelDims(dp_replicate=replicate, dp_shard=shard, cp=1, tp=tp, pp=1, ep=1, world_size=world,
                        spmd_backend="partial_dtensor")
    dims.build_mesh()
    return dims


def _batch(dims, step):
    """This rank's tokens at ``step`` (the same on the ranks of one data-parallel batch index): a
    learnable sequence, each token ``5 t + 3 (mod 256)`` of the one before, from a random start,
    with one token in 8 replaced at random (noise the model cannot learn)."""
    import torch

    index = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    g = torch.Generator().manual_seed(1000 * step + index)
    tokens = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
    for t in range(SEQ):
        tokens[:, t + 1] = (5 * tokens[:, t] + 3) % VOCAB
    noise = torch.rand(BATCH, SEQ + 1, generator=g) < 0.125
    tokens[noise] = torch.randint(0, VOCAB, (int(noise.sum()),), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _job(dims, optimizer_config, folder=None, save_at=None, load_at=None, seed=0):
    """Train ``STEPS`` steps as torchtitan's trainer does; the global mean loss per step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    model = _model(dims, seed)
    optimizers = optimizer_config.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=STEPS)
    checkpointer = CheckpointManager.Config(enable=folder is not None, folder="ckpt", interval=save_at or 10 ** 6,
                                            last_save_model_only=False).build(
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers, states={},
        sd_adapter=None, base_folder=folder or "")
    batches = dims.dp_replicate * dims.dp_shard
    first = 1
    if load_at is not None:
        assert checkpointer.load(step=load_at)
        first = load_at + 1
    losses = {}
    for step in range(first, STEPS + 1):
        inputs, labels = _batch(dims, step)
        optimizers.zero_grad()
        positions = torch.arange(SEQ).expand(BATCH, SEQ)
        pred = model(inputs, positions=positions)
        if hasattr(pred, "full_tensor"):
            pred = pred.full_tensor()
        loss = F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (BATCH * SEQ * batches)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizers.step()
        schedulers.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = float(total) / dims.tp  # (the tp ranks of a batch compute the same loss)
        if step == save_at:
            checkpointer.save(curr_step=step)
    checkpointer.close()
    return model, optimizers, losses


def _replicas_equal(model, group):
    import torch
    import torch.distributed as dist

    flat = torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1)
                      for p in model.parameters()])
    other = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(other, flat, group=group)
    return all(torch.equal(other[0], o) for o in other)


def _compare(rank, world, layout):
    """torchtitan's AdamW, then OnebitAdam, on the same run."""
    _cpu_patches()
    from torchtitan.components.optimizer import default_adamw

    from compressed_opt.integrations.torchtitan import onebit_config

    dims = _dims(layout, world)
    _, _, adamw = _job(dims, default_adamw(lr=LR, fused=False))
    model, optimizers, ours = _job(dims, onebit_config("OnebitAdam", lr=LR, freeze_step=FREEZE, betas=(0.9, 0.95),
                                                       weight_decay=0.1))
    (opt,) = list(optimizers)
    stats = opt.comm_stats()
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters())
    replicas = dims.dp_replicate
    out = dict(adamw=adamw, ours=ours, stats=stats.as_dict(), local=local, replicas=replicas,
               equal=_replicas_equal(model, dims.get_mesh("dp_replicate").get_group()),
               names=type(optimizers).__name__, group_keys=sorted(opt.param_groups[0]))
    opt.close()
    return out


def test_hsdp_2x2_trains_across_the_freeze_near_adamw_with_20x_fewer_bytes_across_replicas():
    """HSDP 2x2 (dp_replicate 2, dp_shard 2): 40 steps, freeze at 10; the step-40 loss within 3% of
    torchtitan's AdamW on the same run; the replicas equal; a compression step sends at least 20x
    fewer bytes across the replicas (counted by the optimizer's backend) than AdamW's HSDP all-reduce
    of the same shard (an fp32 ring all-reduce over the replicas: 2 (R-1)/R * 4 bytes per element of
    this rank's shard, computed from the parameter count)."""
    results = run_ranks(_compare, 4, (2, 2, 1), timeout=240)
    for r in results:
        adamw, ours = r["adamw"][STEPS], r["ours"][STEPS]
        assert abs(ours - adamw) <= 0.03 * adamw, (ours, adamw)
        assert ours < r["ours"][1] - 2.0  # (it learned)
        assert r["equal"]
        assert r["stats"]["stage"] == "compression" and r["stats"]["compression_steps"] == STEPS - FREEZE
        hsdp = 2 * (r["replicas"] - 1) / r["replicas"] * 4 * r["local"]
        assert hsdp / r["stats"]["compression_bytes_per_step"] >= 20
        assert "fused" not in r["group_keys"] and "foreach" not in r["group_keys"]
    print("step 40: AdamW", results[0]["adamw"][STEPS], "OnebitAdam", results[0]["ours"][STEPS],
          "bytes ratio", 2 * 0.5 * 4 * results[0]["local"] / results[0]["stats"]["compression_bytes_per_step"])


def test_hsdp_with_tensor_parallelism_2x2x2_trains_near_adamw_with_20x_fewer_bytes_across_replicas():
    """dp_replicate 2 x dp_shard 2 x tp 2 on 8 ranks, the 3-D mesh torchtitan makes for replicas, FSDP
    and tensor parallelism together: the same checks as HSDP 2x2's."""
    results = run_ranks(_compare, 8, (2, 2, 2), timeout=600)
    for r in results:
        adamw, ours = r["adamw"][STEPS], r["ours"][STEPS]
        assert abs(ours - adamw) <= 0.03 * adamw, (ours, adamw)
        assert ours < r["ours"][1] - 2.0
        assert r["equal"]
        assert r["stats"]["stage"] == "compression" and r["stats"]["compression_steps"] == STEPS - FREEZE
        hsdp = 2 * (r["replicas"] - 1) / r["replicas"] * 4 * r["local"]
        assert hsdp / r["stats"]["compression_bytes_per_step"] >= 20
    print("3-D step 40: AdamW", results[0]["adamw"][STEPS], "OnebitAdam", results[0]["ours"][STEPS],
          "bytes ratio", 2 * 0.5 * 4 * results[0]["local"] / results[0]["stats"]["compression_bytes_per_step"])


def _tp(rank, world):
    """OnebitAdam on dp_replicate 2 x tp 2 (torchtitan's parallelize_llama then also applies
    fully_shard on ``mesh["dp_replicate", "fsdp"]``, fsdp of size 1: parameters on the 3-D mesh
    ``(dp_replicate, fsdp, tp)``)."""
    _cpu_patches()
    from compressed_opt.integrations.torchtitan import onebit_config

    dims = _dims((2, 1, 2), world)
    model, optimizers, losses = _job(dims, onebit_config("OnebitAdam", lr=LR, freeze_step=FREEZE))
    (opt,) = list(optimizers)
    out = dict(losses=losses, equal=_replicas_equal(model, dims.get_mesh("dp_replicate").get_group()),
               stage=opt.comm_stats().stage, replicas=opt.backend.world_size,
               meshes=sorted({p.device_mesh.mesh_dim_names for p in model.parameters()}))
    opt.close()
    return out


def test_tp_2x2_with_replicas_trains_and_keeps_the_replicas_equal():
    """dp_replicate 2 x tp 2: 40 steps across the freeze; the loss falls, the replicas stay equal."""
    for r in run_ranks(_tp, 4, timeout=240):
        assert r["stage"] == "compression" and r["equal"] and r["replicas"] == 2
        assert r["losses"][STEPS] < r["losses"][1] - 2.0
    print("tp: meshes", r["meshes"], "loss step 1", r["losses"][1], "step 40", r["losses"][STEPS])


def _resume(rank, world, folder, load, name):
    _cpu_patches()
    from compressed_opt.integrations.torchtitan import onebit_config

    dims = _dims((2, 2, 1) if world == 4 else (2, 2, 2), world)
    config = onebit_config(name, lr=LR, freeze_step=FREEZE)
    model, optimizers, losses = _job(dims, config, folder=folder, save_at=None if load else 20,
                                     load_at=20 if load else None, seed=1 if load else 0)
    (opt,) = list(optimizers)
    opt.close()
    return losses


def _checkpoint_keys(root) -> list[str]:
    """The keys of the one DCP checkpoint under ``root``."""
    import os

    from torch.distributed.checkpoint import FileSystemReader

    (folder,) = [d for d, _, names in os.walk(root) if ".metadata" in names]
    return list(FileSystemReader(folder).read_metadata().state_dict_metadata)


# torchtitan 0.3.0's checkpoint of the 3-D mesh (dp_replicate x dp_shard x tp) on CPU does not give back the
# trained model: with its own AdamW, a model saved after 1 (2) steps loads 1.5e-3 (4.5e-3) away from the trained
# one in every parameter, one update per step taken, and the step-21 loss after a step-20 resume is 6.35 against
# the uninterrupted 4.99 (docs/torchtitan.md). A model saved and loaded through its ModelWrapper without
# training round-trips. Strict: the day torchtitan gives the model back, this passes and must lose the mark.
THREE_D_RESUME = pytest.mark.xfail(strict=True, reason="torchtitan's 3-D checkpoint loses the model, AdamW's too")


@pytest.mark.parametrize("world,name", [(4, "OnebitAdam"), pytest.param(8, "OnebitLamb", marks=THREE_D_RESUME)])
def test_resume_from_a_step_20_checkpoint_reproduces_the_step_40_loss(tmp_path, world, name):
    """HSDP 2x2 (OnebitAdam), and with tensor parallelism 2x2x2 (OnebitLamb, whose per-layer
    statistics are the whole layers'), in the compression stage at step 20: torchtitan's
    CheckpointManager saves at step 20; fresh ranks (another seed for the initial weights, which
    the checkpoint replaces) load it and train to step 40: every loss from step 21 on is the
    uninterrupted run's, bit for bit. (Our own 3-D resume, through torch's state_dict API and DCP,
    is bit for bit: tests/test_torch_state_dict.py.)"""
    whole = run_ranks(_resume, world, str(tmp_path), False, name, timeout=400)
    # torchtitan's own checkpoint (the container does not override it): its flat optimizer state,
    # every rank's record under its own key beside the moments
    keys = _checkpoint_keys(tmp_path)
    assert {k.rsplit(".rank", 1)[1] for k in keys if ".compressed_opt.rank" in k} == {str(r) for r in range(world)}
    assert any(k.endswith(".exp_avg") for k in keys) and not any(".compressed_opt.0." in k for k in keys)
    resumed = run_ranks(_resume, world, str(tmp_path), True, name, timeout=400)
    for w, r in zip(whole, resumed):
        assert sorted(r) == list(range(21, STEPS + 1))
        assert [r[s] for s in r] == [w[s] for s in r]
