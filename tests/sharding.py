"""A model sharded as torchtitan shards it, for the tests of FSDP2's own HSDP."""
from __future__ import annotations

from torch import nn


def fsdp2_hsdp(model: nn.Sequential, mesh) -> nn.Sequential:
    """``model`` on ``mesh``, ``(dp_replicate, dp_shard)`` or ``(dp_replicate, dp_shard, tp)``: with a
    "tp" dimension, layer "0" Colwise and layer "2" Rowwise on ``mesh["tp"]`` first (the parameters
    then on the 3-D mesh; the other layers on the 2-D one); then ``fully_shard`` of every Linear and
    of the model on the (replicate, shard) mesh."""
    from torch.distributed.fsdp import fully_shard

    if "tp" in mesh.mesh_dim_names:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        mesh = mesh["dp_replicate", "dp_shard"]
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model
