"""Meshes, not raw groups: tensor parallelism on ("dp", "tp") = (2, 2) with the optimizer on
``mesh["dp"]``, and the pipeline recipe (one optimizer per stage, on its stage's data-parallel
group), on 4 Gloo ranks, across the freeze.

* Tensor parallel (``parallelize_module``: Colwise then Rowwise on "tp"): the DTensor parameters
  (``Shard(0)``, ``Shard(1)``, and the Rowwise bias ``Replicate()``) step on their local tensors;
  the exchange runs over "dp" only (the backend's ranks are the dp group's); in warmup every
  shard equals the same optimizer on the unsharded model (float tolerance; 1-bit LAMB's trust
  ratios from whole-layer norms); the dp replicas are bit-identical at every step, and so are the
  tp ranks' copies of the replicated bias.
* Pipeline: stages {0, 1} and {2, 3}, each with its own model and optimizer on its group
  (``backend=mesh["dp"]`` of a ("pp", "dp") mesh): each compresses, its replicas are identical,
  and neither communicates outside its group.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import UnheldCollectives, run_ranks

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

NAMES = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")
FREEZE, STEPS = 4, 10


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 6))


def _optimizer(name, params, backend):
    import compressed_opt

    kw = dict(var_freeze_step=FREEZE, var_update_scaler=2, local_step_scaler=4) if name == "ZeroOneAdam" \
        else dict(freeze_step=FREEZE)
    return getattr(compressed_opt, name)(params, lr=1e-2, backend=backend, **kw)


def _equal_over(group, tensors) -> bool:
    for t in tensors:
        both = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(both, t.contiguous(), group=group)
        if not all(torch.equal(both[0], b) for b in both[1:]):
            return False
    return True


def _tensor_parallel(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_group()
    r_dp = mesh.get_coordinate()[0]
    out = {}
    for name in NAMES:
        model, whole = _model(), _model()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = _optimizer(name, model.parameters(), mesh["dp"])
        reference = _optimizer(name, whole.parameters(), mesh["dp"])
        gap, replicas, tp_copies, compared = 0.0, True, True, 0
        unheld, calls = [], 0
        for step in range(1, STEPS + 1):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + r_dp))
            full_precision = not opt.compressing
            with UnheldCollectives() as sent:  # (1-bit LAMB's whole-layer norms over "tp" among them)
                for m, o in ((model, opt), (whole, reference)):
                    o.zero_grad()
                    m(x).square().mean().backward()
                    o.step()
            unheld += sent.unheld
            calls += sent.calls
            if full_precision:
                gap = max(gap, max((p.full_tensor() - q.detach()).abs().max().item()
                                   for p, q in zip(model.parameters(), whole.parameters())))
            local = [p.to_local().detach() for p in model.parameters()]
            if (opt.schedule.steps_since_sync if name == "ZeroOneAdam" else 0) == 0:
                compared += 1
                replicas &= _equal_over(dp, local)
            tp_copies &= _equal_over(mesh["tp"].get_group(), [model[2].bias.to_local().detach()])
        out[name] = dict(gap=gap, replicas=replicas, tp_copies=tp_copies, compared=compared,
                         compressing=opt.compressing, sent=opt.backend.stats.total_bytes,
                         unheld=unheld, calls=calls,
                         exchange_ranks=sorted(dist.get_process_group_ranks(opt.backend.group)),
                         dp_ranks=sorted(dist.get_process_group_ranks(dp)))
    return out


def test_tensor_parallel_parameters_step_on_their_shards_and_exchange_over_dp():
    for rank, out in enumerate(run_ranks(_tensor_parallel, 4, timeout=540)):
        for name in NAMES:
            r = out[name]
            where = f"{name}, rank {rank}: {r}"
            assert r["compressing"] and r["sent"] > 0, where
            assert r["exchange_ranks"] == r["dp_ranks"] and len(r["dp_ranks"]) == 2, where
            assert r["gap"] < 1e-5, where
            assert r["replicas"] and r["compared"] >= 5 and r["tp_copies"], where
            assert r["calls"] > 0 and r["unheld"] == [], where  # every tensor sent is drained at exit


def _pipeline(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage, r_dp = mesh.get_coordinate()
    torch.manual_seed(stage)  # each stage its own model
    model = nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 16))
    opt = _optimizer("OnebitAdam", model.parameters(), mesh["dp"])
    for step in range(1, STEPS + 1):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * step + 10 * stage + r_dp))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    group = mesh["dp"].get_group()
    return dict(stage=stage, compressing=opt.compressing, calls=sum(opt.backend.stats.calls.values()),
                exchange_ranks=sorted(dist.get_process_group_ranks(opt.backend.group)),
                replicas=_equal_over(group, [p.detach() for p in model.parameters()]))


def test_pipeline_recipe_one_optimizer_per_stage_on_its_group():
    results = run_ranks(_pipeline, 4, timeout=240)
    for rank, r in enumerate(results):
        assert r["compressing"] and r["calls"] > 0 and r["replicas"], (rank, r)
        assert r["exchange_ranks"] == ([0, 1] if r["stage"] == 0 else [2, 3]), (rank, r)


def _sequence_parallel(rank, world):
    """A tensor-parallel plan with sequence parallelism (torchtitan's): the LayerNorm's weight and
    bias are replicated over "tp" and their gradients come out ``Partial(sum)``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r_dp = mesh.get_coordinate()[0]

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.LayerNorm(16))

    model, whole = make(), make()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(output_layouts=Shard(1)),
                                           "3": SequenceParallel()})
    opt, reference = _optimizer("OnebitAdam", model.parameters(), mesh["dp"]), \
        _optimizer("OnebitAdam", whole.parameters(), mesh["dp"])
    partial, gap, norm_copies = [], 0.0, True
    for step in range(1, STEPS + 1):
        x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(100 * step + r_dp))
        full_precision = not opt.compressing
        for m, o in ((model, opt), (whole, reference)):
            o.zero_grad()
            m(x).square().mean().backward()
            if m is model:  # (reduced over "tp" as autograd made it: the plan's Partial(sum) is summed)
                partial.append(str(model[3].weight.grad.placements))
            o.step()
        if full_precision:  # (the norm's: Adam's first steps amplify TP's rounding where a gradient is ~eps)
            gap = max(gap, max((p.full_tensor() - q.detach()).abs().max().item()
                               for p, q in zip(model[3].parameters(), whole[3].parameters())))
        norm_copies &= _equal_over(mesh["tp"].get_group(), [model[3].weight.to_local().detach()])
    return dict(partial=partial[0], gap=gap, norm_copies=norm_copies, compressing=opt.compressing)


def test_partial_gradients_of_a_sequence_parallel_plan_are_reduced_over_their_mesh():
    """The norm weights' ``Partial(sum)`` gradients are summed over "tp" (as autograd makes them,
    so ``p.grad`` after backward holds the sum), as
    DTensor's ops sum them for torch's optimizers: in warmup the norm's weight and bias equal the
    optimizer's on the unsharded model (a tp rank's own part of the sum would step them elsewhere),
    and the tp ranks' copies of the norm weight stay equal, into the compression stage."""
    for rank, r in enumerate(run_ranks(_sequence_parallel, 4, timeout=240)):
        assert r["partial"] == "(Replicate(),)", (rank, r)
        assert r["compressing"] and r["gap"] < 1e-5 and r["norm_copies"], (rank, r)


def _plain_beside_tensor_parallel(rank, world, sequence_parallel):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    import compressed_opt

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_group()
    torch.manual_seed(0)  # a plain layer (an embedding, a norm: what a tp plan leaves) before the tp ones
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 6))
    plan = {"2": ColwiseParallel(), "4": RowwiseParallel()}
    if sequence_parallel:  # (then a norm whose gradients come out Partial(sum), as torchtitan's plan leaves them)
        model.append(nn.LayerNorm(6))
        plan.update({"4": RowwiseParallel(output_layouts=Shard(1)), "5": SequenceParallel()})
    parallelize_module(model, mesh["tp"], plan)
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=3, backend=mesh["dp"])
    averaged, replicas = [], []
    for step in range(1, 7):
        shape = (2, 4, 16) if sequence_parallel else (8, 16)
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(100 * step + mesh.get_coordinate()[0]))
        opt.zero_grad()
        model(x).square().mean().backward()
        if not opt.compressing:  # a full-precision step: every p.grad the replicas' average after backward
            averaged.append(_equal_over(dp, [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                                             for p in model.parameters()]))
        opt.step()
        replicas.append(_equal_over(dp, [p.to_local().detach() if hasattr(p, "to_local") else p.detach()
                                         for p in model.parameters()]))
    out = dict(averaged=averaged, replicas=replicas, compressing=opt.compressing)
    opt.close()
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_plain_parameters_beside_tensor_parallel_ones_keep_the_replicas_equal(sequence_parallel):
    """A tp plan leaves some layers plain (embeddings, norms): their gradients are averaged over dp
    at the end of backward (overlap), and the DTensor parameters' buckets with them, so their
    gradients must be the shards' by then (they were bound only in ``step()``: each replica kept
    its own gradient on the tp layers and the replicas drifted apart from step 1). With sequence
    parallelism the norm's ``Partial`` gradient is reduced once, at that binding, and kept reduced
    (reduced again in ``step()``, a new tensor dropped the average, and the replicas drifted)."""
    for out in run_ranks(_plain_beside_tensor_parallel, 4, sequence_parallel, timeout=120):
        assert out["compressing"]
        assert out["averaged"] == [True] * 3, out
        assert out["replicas"] == [True] * 6, out
