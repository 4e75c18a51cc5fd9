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
