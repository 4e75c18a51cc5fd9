"""FSDP2's own HSDP (``fully_shard`` on a 2-D ``(dp_replicate, dp_shard)`` mesh, as torchtitan
shards): the optimizer finds the replicate dimension with no ``backend=``; in the warmup
``p.grad`` holds the global average FSDP made, so clipping sees HSDP + AdamW's norm and the steps
are AdamW's; in the compression stage FSDP leaves each replica its own shard average and the
optimizer's 1-bit exchange crosses the replicas (compressed_opt.fsdp_replicas)."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from distributed import run_ranks
from sharding import fsdp2_hsdp

HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)


def _model(mesh, seed=0):
    torch.manual_seed(seed)
    return fsdp2_hsdp(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)), mesh)


def _loss(model, step, rank):
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + rank))
    return (model(x) - x[:, :4].sin()).square().mean()


def _locals(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def _replicas_equal(tensors, group):
    import torch.distributed as dist

    flat = torch.cat([t.reshape(-1) for t in tensors])
    other = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(other, flat, group=group)
    return all(torch.equal(other[0], o) for o in other)


def _warmup_against_adamw(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    ours, theirs = _model(mesh), _model(mesh)
    opt = compressed_opt.OnebitAdam(ours.parameters(), freeze_step=10, **HP)
    ref = torch.optim.AdamW(theirs.parameters(), **HP)
    norms = []
    for step in range(1, 5):
        pair = []
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            _loss(model, step, rank).backward()
            pair.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
            o.step()
        norms.append(pair)
    replicate = mesh.get_group("dp_replicate")
    out = dict(norms=norms, close=all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                                      for a, b in zip(_locals(ours), _locals(theirs))),
               equal=_replicas_equal(_locals(ours), replicate),
               backend_ranks=opt.backend.world_size, warmup_bytes=opt.comm_stats().warmup_bytes_per_step)
    opt.close()
    return out


def test_warmup_under_fsdps_own_hsdp_is_adamw_with_the_same_clipped_norm():
    """Four ranks, 2 replicas x 2 shards, ``OnebitAdam(model.parameters())`` with no backend: the
    optimizer's exchange is the replicate dimension (2 ranks); in the warmup the gradient norm that
    ``clip_grad_norm_`` sees equals HSDP + AdamW's (FSDP averaged across the replicas in backward)
    and the parameters stay AdamW's within fp32 rounding, the replicas equal; the optimizer sends
    no gradient bytes of its own (FSDP's all-reduce carried them)."""
    for r in run_ranks(_warmup_against_adamw, 4, timeout=120):
        assert r["backend_ranks"] == 2
        for ours, theirs in r["norms"]:
            assert abs(ours - theirs) <= 1e-6 * theirs
        assert r["close"] and r["equal"]
        assert r["warmup_bytes"] < 200  # (the agreement's small headers only)


def _compression(rank, world, native, tracking):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    replicate = mesh.get_group("dp_replicate")
    if native:
        model = _model(mesh)
        opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=3, **HP, variance_tracking=tracking)
    else:  # the shard-only recipe: FSDP over the shard dimension, the optimizer over the replicas
        model = _model(mesh["dp_shard"])
        opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=3, backend=mesh["dp_replicate"], **HP,
                                        variance_tracking=tracking)
    grads_differ, equal, losses = [], [], []
    for step in range(1, 11):
        opt.zero_grad()
        loss = _loss(model, step, rank)
        loss.backward()
        losses.append(float(loss.detach()))
        grads = [p.grad.to_local() for p in model.parameters()]
        grads_differ.append(not _replicas_equal(grads, replicate))
        opt.step()
        equal.append(_replicas_equal(_locals(model), replicate))
    stats = opt.comm_stats()
    dist.barrier()
    out = dict(grads_differ=grads_differ, equal=equal, params=_locals(model), losses=losses,
               ratio=stats.compression_ratio, compressing=opt.compressing)
    opt.close()
    return out


@pytest.mark.parametrize("tracking", [True, False])
def test_compression_stage_under_fsdps_own_hsdp_is_the_optimizers_exchange(tracking):
    """From the freeze on, FSDP leaves each replica its own shard average (the replicas' gradients
    differ after backward: FSDP's all-reduce is skipped) and the 1-bit exchange crosses the
    replicas: the replicas stay equal after every step and each compression step sends many times
    fewer bytes than an fp32 all-reduce. Without variance tracking the run is the shard-only
    recipe's (FSDP over ``mesh["dp_shard"]``, ``backend=mesh["dp_replicate"]``) bit for bit; with it
    (the default) the tracking's warmup calibration sees only FSDP's averages, not each rank's own
    gradients, so the runs differ after the freeze (docs/design.md 3.3)."""
    native = run_ranks(_compression, 4, True, tracking, timeout=150)
    recipe = run_ranks(_compression, 4, False, tracking, timeout=150)
    for n, r in zip(native, recipe):
        assert n["compressing"]
        assert n["grads_differ"] == [False] * 3 + [True] * 7  # (warmup: FSDP's global average)
        assert r["grads_differ"] == [True] * 10  # (the recipe: the optimizer averages in step())
        assert all(n["equal"]) and all(r["equal"])
        assert n["ratio"] > 5
        if not tracking:
            assert all(torch.equal(a, b) for a, b in zip(n["params"], r["params"]))


def _default_job(rank, world, shape):
    """OnebitAdam with defaults but the freeze on (2, 2), clipping each step, or with tensor
    parallelism and bf16 autocast on (2, 2, 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    three_d = len(shape) == 3
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp")[:len(shape)])
    # (seeded per rank: the optimizer starts every replica from rank 0's)
    model = fsdp2_hsdp(_layers(rank), mesh) if three_d else _model(mesh, seed=rank)
    opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=3)  # (defaults otherwise)
    for step in range(1, 9):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=three_d):
            loss = _loss(model, step, rank // 2 if three_d else rank)  # (a tp pair: one batch)
        loss.backward()
        if not three_d:  # (torch's clip_grad_norm_ refuses parameters on two meshes, as this model's last layer
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # is; tests/test_torchtitan.py clips on 3-D)
        opt.step()
    out = _locals(model)
    opt.close()
    return out


@pytest.mark.parametrize("shape", [(2, 2), (2, 2, 2)])
def test_the_same_seeded_job_twice_is_bit_for_bit_the_same(shape):
    """Defaults (overlap, variance tracking) but the freeze, clipping each step, under FSDP2's own
    HSDP, and with tensor parallelism (the 3-D mesh, bf16 autocast, no clipping), run twice in fresh processes:
    the same shards, bit for bit."""
    world = 2 ** len(shape)
    first = run_ranks(_default_job, world, shape, timeout=180)
    second = run_ranks(_default_job, world, shape, timeout=180)
    for a, b in zip(first, second):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _resume(rank, world, root, phase):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt
    from compressed_opt.dcp import OptimizerState

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model(mesh, seed=0 if phase == "through" else 3)
    opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=3)
    start = 1
    if phase == "resumed":
        state = {"model": model.state_dict(), "optim": OptimizerState(opt)}
        dcp.load(state, checkpoint_id=root)
        model.load_state_dict(state["model"])
        start = 6
    for step in range(start, 9):
        opt.zero_grad()
        _loss(model, step, rank).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step == 5 and phase == "through":
            dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=root)
    out = _locals(model)
    opt.close()
    return out


def test_a_resume_in_the_compression_stage_is_bit_for_bit(tmp_path):
    """Saved through DCP at step 5 (past the freeze: FSDP reduce-scatters only), resumed in fresh
    processes from another initialisation: the same shards at step 8 as the run that went through."""
    through = run_ranks(_resume, 4, str(tmp_path / "ck"), "through", timeout=120)
    resumed = run_ranks(_resume, 4, str(tmp_path / "ck"), "resumed", timeout=120)
    for a, b in zip(through, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _divide_factor(rank, world, summed):
    """Default FSDP (the mean over the 4 ranks), or torchtitan's way: ``set_gradient_divide_factor(1.0)``
    (a sum) with each rank's loss divided by the world size, set before the optimizer is made
    (``summed="before"``) or after (``"after"``); 3 warmup and 5 compression steps."""
    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    def sum_instead():
        for m in model.modules():
            if hasattr(m, "set_gradient_divide_factor"):
                m.set_gradient_divide_factor(1.0)
                m.set_force_sum_reduction_for_comms(True)  # (Gloo has no PREMUL_SUM: sums, divided after)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model(mesh)
    if summed == "before":
        sum_instead()
    opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=3, **HP)
    if summed == "after":
        sum_instead()
    for step in range(1, 9):
        opt.zero_grad()
        loss = _loss(model, step, rank)
        (loss / world if summed else loss).backward()
        opt.step()
    out = _locals(model)
    opt.close()
    return out


def test_a_gradient_divide_factor_set_by_the_user_gives_the_same_steps_in_the_compression_stage():
    """torchtitan sets FSDP's divide factor to 1.0 and divides the loss by the global count itself.
    In the compression stage FSDP then sums over its shard group only and the optimizer averages the
    replicas, which made the gradient 1/R of HSDP's; the optimizer now gives FSDP f/R there, so
    the run is the default run's (within rounding: the divisions happen elsewhere). A factor set
    after the optimizer was made is read at the next step (it was read at construction only, and
    the compression steps' gradients were 1/R of HSDP's)."""
    mean = run_ranks(_divide_factor, 4, False, timeout=120)
    for when in ("before", "after"):
        summed = run_ranks(_divide_factor, 4, when, timeout=120)
        for a, b in zip(mean, summed):
            assert all(torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b)), when


NAMES = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")


def _optimizer(name, params, **kw):
    import compressed_opt

    config = dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=4) if name == "ZeroOneAdam" \
        else dict(freeze_step=4)
    return getattr(compressed_opt, name)(params, lr=1e-2, **config, **kw)


def _layers(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))


def _three_d(rank, world):
    """Each optimizer on (dp_replicate 2, dp_shard 2, tp 2) with no ``backend=``, beside the same
    optimizer on the whole model over the 4 data-parallel ranks of this rank's tp position, fed the
    same batches (a data-parallel rank's batch, the same on its tp ranks)."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from compressed_opt.comm import TorchBackend

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    rep, shard, tp = mesh.get_coordinate()
    # the data-parallel ranks of each tp position (every rank makes every group)
    dp_whole, _ = dist.new_subgroups_by_enumeration([[r for r in range(world) if r % 2 == t] for t in range(2)])
    replicate, tp_group = mesh.get_group("dp_replicate"), mesh.get_group("tp")
    out = {}
    for name in NAMES:
        model = fsdp2_hsdp(_layers(), mesh)  # (the last layer left to FSDP alone: on the 2-D mesh)
        whole = _layers()
        opt = _optimizer(name, model.parameters())
        reference = _optimizer(name, whole.parameters(), backend=TorchBackend(group=dp_whole))
        gap, replicas, tp_copies, steps = 0.0, True, True, 0
        for step in range(1, 11):
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + 2 * rep + shard))
            full_precision = not opt.compressing
            for m, o in ((model, opt), (whole, reference)):
                o.zero_grad()
                (m(x) - x[:, :4].sin()).square().mean().backward()
                o.step()
            if full_precision:
                steps += 1
                gap = max(gap, max((p.full_tensor() - q.detach()).abs().max().item()
                                   for p, q in zip(model.parameters(), whole.parameters())))
            if (opt.schedule.steps_since_sync if name == "ZeroOneAdam" else 0) == 0:
                replicas &= _replicas_equal(_locals(model), replicate)
            tp_copies &= _replicas_equal([model[2].bias.to_local().detach()], tp_group)  # (Replicate on tp)
        stats = opt.comm_stats()
        out[name] = dict(gap=gap, warmup_steps=steps, replicas=replicas, tp_copies=tp_copies,
                         compressing=opt.compressing, exchange=sorted(dist.get_process_group_ranks(opt.backend.group)),
                         replicate=sorted(dist.get_process_group_ranks(replicate)), ratio=stats.compression_ratio)
        opt.close()
        reference.close()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_3d_mesh_with_tensor_parallelism_steps_as_the_whole_model_and_compresses_across_the_replicas():
    """FSDP2's own HSDP with tensor parallelism, (dp_replicate, dp_shard, tp) = (2, 2, 2) on 8 ranks,
    as torchtitan lays out replicas x FSDP x TP (parameters on the 3-D mesh, and the layer left to
    FSDP alone on the 2-D one), no ``backend=``: the optimizer's exchange is the replicate
    dimension; in the warmup every parameter equals the same optimizer's on the whole model
    averaged over the 4 data-parallel ranks (float tolerance; 1-bit LAMB's trust ratios from the
    whole layers' norms, summed over the shard and the tp ranks); from the freeze on the replicas
    stay bit-identical and so do the tp ranks' copies of the Rowwise bias."""
    for rank, out in enumerate(run_ranks(_three_d, 8, timeout=240)):
        for name in NAMES:
            r = out[name]
            where = f"{name}, rank {rank}: {r}"
            assert r["exchange"] == r["replicate"] and len(r["exchange"]) == 2, where
            assert r["warmup_steps"] >= (2 if name == "ZeroOneAdam" else 4) and r["gap"] < 1e-5, where
            assert r["compressing"] and r["replicas"] and r["tp_copies"], where
            assert r["ratio"] > 5, where


def _accumulating(rank, world):
    """Each optimizer through the freeze three ways: one batch a step; two half batches (loss / 2),
    FSDP reducing each; the same with FSDP's ``set_requires_gradient_sync(False)`` on the first.
    Per optimizer and way: this rank's shards."""
    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    out = {}
    for name in ("OnebitAdam", "OnebitLamb", "ZeroOneAdam"):
        kwargs = {"var_freeze_step": 3} if name == "ZeroOneAdam" else {"freeze_step": 3}
        for way in ("one", "halves", "no_sync"):
            model = _model(mesh)
            opt = getattr(compressed_opt, name)(model.parameters(), **kwargs, **HP)
            for step in range(1, 8):
                opt.zero_grad()
                x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + rank))
                for i, part in enumerate((x,) if way == "one" else (x[:4], x[4:])):
                    if way == "no_sync":
                        model.set_requires_gradient_sync(i == 1)
                    loss = (model(part) - part[:, :4].sin()).square().mean()
                    (loss if way == "one" else loss / 2).backward()
                opt.step()
            out[name, way] = (_locals(model), opt.compressing)
            opt.close()
    return out


def test_gradient_accumulation_under_fsdps_own_hsdp_steps_as_one_batch():
    """Two micro-batches a step, as torchtitan accumulates (FSDP reduce-scattering each, or only
    the last with ``set_requires_gradient_sync``), through the freeze and four compression steps:
    every optimizer's shards are the one-batch run's within fp32 rounding."""
    for out in run_ranks(_accumulating, 4, timeout=180):
        for name in ("OnebitAdam", "OnebitLamb", "ZeroOneAdam"):
            one, compressing = out[name, "one"]
            assert compressing
            for way in ("halves", "no_sync"):
                got, _ = out[name, way]
                assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(one, got)), (name, way)


def _inf_in_one_shard(rank, world, name, bad_step):
    """Rank 1's gradient gets an inf in one element of its shard of the first layer at ``bad_step``
    (an overflow there): after FSDP's reduce-scatter no other shard holds it, and in the warmup
    only rank 1's replica peer, through FSDP's all-reduce."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    warnings.simplefilter("ignore")
    shape = (2, 2) if world == 4 else (2, 2, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp")[:len(shape)])
    model = _model(mesh)
    kwargs = {"var_freeze_step": 3} if name == "ZeroOneAdam" else {"freeze_step": 3}
    opt = getattr(compressed_opt, name)(model.parameters(), **kwargs, **HP)
    for step in range(1, 9):
        opt.zero_grad()
        _loss(model, step, rank // (world // 4)).backward()
        if step == bad_step and rank == 1:
            with torch.no_grad():
                next(model.parameters()).grad.to_local().view(-1)[0] = float("inf")
        opt.step()
    out = dict(taken=opt.global_step, shards=_locals(model))
    opt.close()
    return out


@pytest.mark.parametrize("world,name,bad_step", [(4, "OnebitAdam", 2), (4, "OnebitLamb", 5), (4, "ZeroOneAdam", 5),
                                                 (8, "OnebitAdam", 5)])
def test_an_inf_in_one_shard_skips_the_step_on_every_shard_and_replica(world, name, bad_step):
    """An inf in one element of one rank's gradient shard under FSDP2's own HSDP (and with tensor
    parallelism): every rank skips that step, not only the replicas of that shard, so every shard
    of the model takes the same steps and the replicas stay equal. Before, the other shard group
    stepped (7 steps against 8, silently), or Gloo aborted (1-bit LAMB)."""
    results = run_ranks(_inf_in_one_shard, world, name, bad_step, timeout=180)
    assert [r["taken"] for r in results] == [7] * world
    half = world // 2  # (rank r and r + half: the same shard of the two replicas)
    for r in range(half):
        assert all(torch.equal(a, b) and torch.isfinite(a).all()
                   for a, b in zip(results[r]["shards"], results[r + half]["shards"]))


def _auto_freeze(rank, world):
    """``freeze_step="auto"`` on one Linear layer whose two shards (FSDP splits its 64 rows) see
    gradients that settle at different paces: the first half's loss weight grows each step, the
    second half's target moves. Each rank's first compressing step."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    torch.manual_seed(0)
    model = fsdp2_hsdp(nn.Sequential(nn.Linear(12, 64)), mesh)
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step="auto")
    for step in range(1, 141):
        opt.zero_grad()
        y = model(torch.randn(8, 12, generator=torch.Generator().manual_seed(100 * step + rank)))
        w = 1.0 + 0.2 * step
        (y[:, :32].square().mean() * w * w + (y[:, 32:] - step % 7).square().mean()).backward()
        opt.step()
        if opt.compressing:
            break
    opt.close()
    return step if opt.compressing else None


def test_the_automatic_freeze_is_one_decision_for_every_shard_of_the_model():
    """``freeze_step="auto"`` under FSDP2's own HSDP watches the whole model's variance (each layer's
    shards summed over FSDP's shard group), so every rank freezes at the same step. Before, each
    replica group decided from its own shard: here the two froze at steps 129 and 96."""
    steps = run_ranks(_auto_freeze, 4, timeout=180)
    assert steps[0] is not None and steps == [steps[0]] * 4, steps


def _lr_by_parity(rank, world):
    """The odd ranks give the optimizer another learning rate: alike within each replica group
    ((0, 2) and (1, 3)), different between the shard groups."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    import compressed_opt

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = _model(mesh)
    opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=3, **dict(HP, lr=2e-2 if rank % 2 else 1e-2))
    try:
        opt.zero_grad()
        _loss(model, 1, rank).backward()
        opt.step()
    except ValueError as exc:
        return str(exc)
    finally:
        opt.close()
    return None


def test_shards_with_other_hyperparameters_raise_on_every_rank():
    """Hyperparameters that differ between the shards of the model but not between the replicas
    the optimizer exchanges over: the shards compare the step, stage and hyperparameters as the
    replicas do, so every rank raises at step 1, naming the ranks. Before, each shard stepped with
    its own learning rate, silently."""
    said = run_ranks(_lr_by_parity, 4, timeout=120)
    for rank, message in enumerate(said):
        assert message is not None and "the ranks disagree at step 1" in message, (rank, message)
        assert re.search(r"rank [13]'s learning rate, betas, eps or weight decay differ from rank [02]'s", message), (
            rank, message)
