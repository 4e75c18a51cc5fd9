"""FSDP2's own HSDP (``fully_shard(module, mesh=mesh)`` on a 2-D ``(replicate, shard)`` mesh): the
exchange across the replicas taken over from FSDP in the compression stage.

FSDP2's HSDP reduces each gradient in two collectives at the end of backward: a reduce-scatter
averaging over the shard group (inside one replica), then an all-reduce averaging over the
replicate group (across replicas, the slow link) at full precision. In the warmup that is the
gradient rule the optimizer keeps: ``p.grad`` holds the global average after backward, so
``clip_grad_norm_`` clips the norm HSDP + AdamW clips, and the optimizer averages nothing again
(the engine's averager, :meth:`compressed_opt.engine.GradientSync.attach_averager`). In a
compression step the replicas' exchange is the optimizer's 1-bit one: FSDP must leave each
replica's shard average in ``p.grad`` and skip its all-reduce.

FSDP2's public API has no switch for that in torch 2.13: ``set_requires_all_reduce(False)`` keeps
the reduce-scatter's output in an internal accumulation buffer for a later all-reduce and leaves
``p.grad`` unset (it serves gradient accumulation), and ``set_all_reduce_hook`` runs after the
native all-reduce. :class:`FsdpReplicas` therefore sets, before each backward, each FSDP parameter
group's mesh information (``FSDPParamGroup.mesh_info``, a private attribute: the one place this
library reaches into FSDP) to the native HSDP one for a full-precision step, or to a shard-only
one of the same mesh and shard dimension for a compression step: FSDP then reduce-scatters
(averaging over the shard group, its divisor the shard group's size) and writes ``p.grad``
without the all-reduce. Where the attribute is not there (another torch), the optimizer refuses
FSDP's own HSDP with the shard-only recipe to use instead.

:class:`compressed_opt.DiLoCo` swaps the same way: the native HSDP information in its warmup steps
(data parallel), the shard-only one in its local steps (no traffic across the replicas).
"""
from __future__ import annotations

try:
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
except ImportError:  # pragma: no cover - a torch without FSDP2's layout
    _module_state_mapping = FSDPMeshInfo = HSDPMeshInfo = None

#: what to do where FSDP2's internals are not as this module knows them
RECIPE = ("shard the model over the shard dimension only (fully_shard(module, mesh=mesh['shard'])) and give "
          "the optimizer the replicate dimension (backend=mesh['replicate'])")


class FsdpReplicas:
    """The FSDP parameter groups holding an optimizer's parameters under FSDP2's own HSDP, and the
    two mesh informations of each (see the module doc). The engine's averager: FSDP averages the
    full-precision steps' gradients across the replicas; the ranks' initial parameters are not
    made equal by FSDP (``equal_start``), so the engine broadcasts rank 0's over the replicas."""

    equal_start = False

    def __init__(self, groups: list):
        self._groups = [_Swap(group) for group in groups]

    @property
    def replicate_group(self):
        """The process group FSDP all-reduces over: across the replicas."""
        return self._groups[0].native.replicate_process_group

    def next_step(self, full_precision: bool) -> None:
        """Before the next backward: FSDP's all-reduce across the replicas where the next step is a
        full-precision one, else the reduce-scatter alone."""
        for swap in self._groups:
            swap.set(full_precision)


class _Swap:
    """One FSDP parameter group's two mesh informations (and divide factors), swapped in turn."""

    __slots__ = ("group", "native", "shard_only", "follows", "factor", "written")

    def __init__(self, group):
        self.group = group
        self.native = native = group.mesh_info
        self.shard_only = FSDPMeshInfo(native.mesh, shard_mesh_dim=native.shard_mesh_dim)
        self.shard_only.reduce_scatter_process_group = getattr(native, "reduce_scatter_process_group", None)
        # resharding after forward to the same mesh (reshard_after_forward=True) names the same object;
        # another one there would be a reshard to a smaller mesh, which FSDP refuses for DTensor
        # parameters (tensor parallelism inside the replicas): it follows the swap
        self.follows = getattr(group, "post_forward_mesh_info", None) is native
        self.factor = self.written = getattr(group, "gradient_divide_factor", None)

    def set(self, full_precision: bool) -> None:
        group = self.group
        group.mesh_info = self.native if full_precision else self.shard_only
        if self.follows:
            group.post_forward_mesh_info = group.mesh_info
        # a divide factor set by the user (torchtitan: 1.0, the loss divided by the global token count),
        # read again where it is no longer the one last written here (set_gradient_divide_factor after
        # the optimizer was made), divides HSDP's sum over all ranks; shard-only, FSDP sums over the
        # shard group alone and the optimizer averages the replicas: f / R keeps the same sum over all
        # ranks divided by f
        current = getattr(group, "gradient_divide_factor", None)
        if current != self.written:
            self.factor = current
        if self.factor is not None:
            self.written = group.gradient_divide_factor = (
                self.factor if full_precision else self.factor / self.native.replicate_mesh_size)


def find(dtensor_params: list, owner: str) -> FsdpReplicas | None:
    """The FSDP parameter groups with HSDP mesh information that hold some of ``dtensor_params``
    (FSDP2's registry of the modules it manages), or ``None`` where none does (the parameters are
    DTensors of another making: the optimizer then averages the replicas itself). Raises where
    FSDP2's internals are not as :mod:`compressed_opt.fsdp_replicas` knows them."""
    wanted = {id(p) for p in dtensor_params}
    if not wanted:
        return None
    if _module_state_mapping is None:
        raise ValueError(f"{owner}: FSDP's own HSDP (a 2-D mesh) is not supported with this torch: {RECIPE}")
    found, seen = [], set()
    for ref in list(_module_state_mapping.values()):
        state = ref()
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            if id(group) in seen or not any(id(fp.sharded_param) in wanted for fp in group.fsdp_params):
                continue
            seen.add(id(group))
            if not isinstance(group.mesh_info, HSDPMeshInfo):
                raise ValueError(f"{owner}: some parameters on a 2-D mesh are held by an FSDP group that is not "
                                 f"HSDP: {RECIPE}")
            found.append(group)
    return FsdpReplicas(found) if found else None
