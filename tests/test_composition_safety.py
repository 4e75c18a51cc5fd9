"""What cannot be composed is refused with a message, never a crash or a silent wrong result.

* DTensor parameters sharded over the optimizer's own ranks (FSDP2's ``fully_shard`` on the whole
  world, with the default backend) are refused when the optimizer is made, on every rank, naming
  the HSDP recipe (before: a SIGSEGV in the gather kernel, which read ``data_ptr()`` 0; the
  supported compositions: tests/test_hsdp.py, tests/test_meshes.py);
* no native kernel receives a tensor it was not written for: the kernels' checked entry points
  refuse a tensor subclass, and the segmented passes leave one to PyTorch's own ops;
* a DDP model and the optimizer's backend over different ranks (same size, other members: the
  warmup would average over one group and the 1-bit exchange over the other) raise on every rank,
  naming the argument to pass; so does a DDP subgroup with the default (world) backend.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, ZeroOneAdam
from compressed_opt import cuda as kernels
from compressed_opt.cuda import Segments, gather_
from distributed import spawn_ranks


def _dtensors(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    out = {}
    for cls in (OnebitAdam, ZeroOneAdam):
        try:
            cls(model.parameters())
            out[cls.__name__] = "accepted"
        except (TypeError, ValueError) as exc:
            out[cls.__name__] = str(exc)
    d = distribute_tensor(torch.randn(32, 4), mesh, [Shard(0)])
    out["plain_memory"] = kernels.plain_memory(d)
    try:  # the C pass must not read a DTensor's data_ptr(): PyTorch's own ops take it, and refuse it
        gather_([d], torch.zeros(128), Segments([128]))
        out["gather"] = "ran"
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        out["gather"] = type(exc).__name__
    try:
        kernels.compress_rows_(d.to_local().contiguous(), d, torch.zeros(2, 68, dtype=torch.uint8), 256, 256)
        out["compress"] = "ran"
    except TypeError as exc:
        out["compress"] = str(exc)
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_dtensor_parameters_over_the_optimizers_ranks_are_refused_and_never_reach_a_kernel():
    for status, out in spawn_ranks(_dtensors, 2, timeout=90):
        assert status == "ok", out
        for name in ("OnebitAdam", "ZeroOneAdam"):
            assert "DTensor parameters are sharded over ranks [0, 1]" in out[name], out
            assert "mesh['replicate']" in out[name], out
        assert out["plain_memory"] is False
        assert out["gather"] != "ran", out  # an error from PyTorch, not a crash
        assert "tensor subclass" in out["compress"], out


def test_plain_tensors_and_parameters_are_addressable():
    assert kernels.plain_memory(torch.zeros(3)) and kernels.plain_memory(nn.Parameter(torch.zeros(3)))
    assert kernels.plain_memory(torch.zeros(0))


def _groups(rank, world, backend_groups):
    import torch.distributed as dist

    from compressed_opt.comm import TorchBackend

    ddp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    other = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    ddp_group = ddp_groups[rank // 2]
    backend = TorchBackend(group=other[rank % 2]) if backend_groups == "other" else None
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = OnebitAdam(model.parameters(), freeze_step=2, backend=backend)
    net = nn.parallel.DistributedDataParallel(model, process_group=ddp_group)
    try:
        net(torch.ones(3, 4)).sum().backward()  # the first forward finds the DDP model
        opt.step()
        return "trained"
    except ValueError as exc:
        return str(exc)


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend_groups", ["other", "world"])
def test_a_ddp_group_other_than_the_backends_raises_on_every_rank(backend_groups):
    outcomes = spawn_ranks(_groups, 4, backend_groups, timeout=120)
    for status, message in outcomes:
        assert status == "ok", message
        assert "TorchBackend(group=" in message, message
        assert ("ranks" in message) if backend_groups == "other" else ("4" in message and "2 ranks" in message)


def _swapped(rank, world):
    """As accelerate's ``prepare`` under FSDP2: the optimizer made from the plain model, then the
    model sharded and its DTensor parameters put into ``optimizer.param_groups``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = OnebitAdam(model.parameters(), freeze_step=2)
    fully_shard(model, mesh=mesh["shard"])
    opt.param_groups[0]["params"] = list(model.parameters())
    opt.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    try:
        opt.step()
    except TypeError as exc:
        return str(exc)
    return "stepped"


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_dtensor_parameters_put_into_the_groups_after_the_optimizer_was_made_are_refused_clearly():
    """accelerate's FSDP2 prepare swaps the parameters of an optimizer made before it; the first
    ``step()`` used to fail inside DTensor (``c10d.broadcast_ ... no sharding strategy``), and now
    says what happened and what to do, on every rank."""
    for status, out in spawn_ranks(_swapped, 2, timeout=90):
        assert status == "ok", out
        assert "DTensor parameters it was not made with" in out and "make it from the sharded model" in out, out
