"""DTensor parameters stepped on their local shards: FSDP2 inside each replica (HSDP), tensor
parallelism, with the optimizer's exchange over the data-parallel replicas only.

With HSDP the model is sharded over the ranks of one replica (``fully_shard(..., mesh=mesh["shard"])``,
or FSDP2's own HSDP on the 2-D mesh, :mod:`compressed_opt.fsdp_replicas`) and replicated across
``mesh["replicate"]``; FSDP's reduce-scatter averages each gradient over the
shard group and leaves every rank the gradient of its own shard. The cross-replica average, the
slow inter-node link, is then the optimizer's: its backend is the replicate group
(``TorchBackend(group=mesh["replicate"].get_group())``), where rank ``r`` of one replica holds the
same shard as rank ``r`` of every other. The optimizer therefore steps each parameter's *local*
tensor, as if it were a plain parameter of this rank's model: full-precision averaging over the
replicas in warmup, the 1-bit exchange of the shard's momentum in the compression stage, and
optimizer state and error buffers the size of the shard. Tensor-parallel parameters (``Shard`` or
``Replicate`` on a "tp" mesh) are the same case with the data-parallel group as the backend.

:class:`LocalShards` keeps, for every DTensor parameter, a plain ``nn.Parameter`` that shares its
local tensor's memory. The optimizer's ``param_groups`` and ``state`` hold the model's own DTensor
parameters, as torch's optimizers do (so torch's ``get_optimizer_state_dict`` maps them to their
names); the engine and the algorithm see the same groups through :meth:`LocalShards.working` and
the state through :meth:`LocalShards.state_of`, with each DTensor replaced by its plain shard
parameter, and step those. Before each step the shards' ``.grad`` point at the DTensor gradients'
local tensors. What it refuses, and why, is in :meth:`LocalShards.check_backend` and
:meth:`LocalShards.bind_grads`.
"""
from __future__ import annotations

import weakref
from collections.abc import MutableMapping

import torch
import torch.distributed as dist

from compressed_opt.comm.torch_backend import TorchBackend

try:  # (torch builds without distributed support have no DTensor)
    from torch.distributed.tensor import DTensor, Partial, Replicate
except ImportError:  # pragma: no cover - every supported torch has it
    DTensor = Partial = Replicate = None


def is_dtensor(p) -> bool:
    return DTensor is not None and isinstance(p, DTensor)


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p``: its local shard for a DTensor (FSDP2, TP), else ``p``."""
    return p.to_local() if is_dtensor(p) else p


class LocalShards:
    """The DTensor parameters an optimizer holds, each with the plain parameter that is its local
    tensor (see the module doc)."""

    def __init__(self, owner: str):
        self._owner = owner
        #: (the DTensor parameter, the plain parameter that is its local tensor), in order
        self.pairs: list[tuple[torch.Tensor, torch.nn.Parameter]] = []
        self._mesh_ranks: set[int] = set()
        #: id of a shard parameter whose layer is split over mesh dimensions -> (its nominal size
        #: there: the layer's size over their ranks, the same on each, so buckets are laid out alike;
        #: the indices in :attr:`_groups` of the dimensions' groups)
        self._split: dict[int, tuple[int, tuple[int, ...]]] = {}
        #: the process groups layers are split over (FSDP's shard dimension, tensor parallelism's),
        #: in the order the parameters first name them: the same on every rank
        self._groups: list = []
        self._mesh_backends: list[TorchBackend | None] = []  # their collectives (made at the first)
        self._dtensor_of: dict[int, torch.Tensor] = {}  # id of a shard parameter -> its DTensor
        self._shard_of: dict[int, torch.nn.Parameter] = {}  # id of a DTensor -> its shard parameter
        #: FSDP2's own HSDP: the group its 2-D mesh replicates the parameters over (else ``None``)
        self.replicate_group = None
        #: per pair, the local tensor of the gradient that the last step() or zero_grad() left (a weak
        #: reference) and its version: what :meth:`backward_since_step` compares
        self._left: list[tuple[weakref.ref, int] | None] = []

    def register_group(self, param_group: dict) -> dict:
        """A param group (as ``add_param_group`` takes it) with its parameters as a list, each DTensor
        among them registered (:meth:`register`); anything torch.optim refuses (a set of parameters)
        is left for it to refuse."""
        params = param_group.get("params")
        if not isinstance(params, (torch.Tensor, list, tuple)) and not hasattr(params, "__next__"):
            return param_group
        listed = [params] if isinstance(params, torch.Tensor) else list(params)
        if not any(is_dtensor(p) for p in listed):
            consumed = not isinstance(params, (torch.Tensor, list, tuple))  # (a generator: its list)
            return dict(param_group, params=listed) if consumed else param_group
        self.register(listed)
        return dict(param_group, params=listed)

    def register(self, params: list) -> None:
        """Make, for each DTensor of ``params`` not yet registered, the plain parameter that shares its
        local tensor, and hook its gradient (:meth:`bind_one`)."""
        for p in params:
            if not is_dtensor(p) or id(p) in self._shard_of:
                continue
            mesh = p.device_mesh
            dims = [0] if mesh.ndim == 1 else self._replicated_over(p)
            with torch.no_grad():
                local = p.to_local()
            shard = torch.nn.Parameter(local, requires_grad=p.requires_grad)
            self.pairs.append((p, shard))
            self._dtensor_of[id(shard)] = p
            self._shard_of[id(p)] = shard
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_binder(weakref.ref(self), shard))
            split, parts = [], 1
            for dim in dims:
                group = mesh.get_group(dim)
                self._mesh_ranks.update(dist.get_process_group_ranks(group))
                if _splits(p.placements[dim]) and mesh.size(dim) > 1:
                    split.append(self._group_index(group))
                    parts *= mesh.size(dim)
            if split:
                self._split[id(shard)] = (-(-p.numel() // parts), tuple(split))

    def _group_index(self, group) -> int:
        """The index of ``group`` in :attr:`_groups` (appended where new)."""
        for i, known in enumerate(self._groups):
            if known is group:
                return i
        self._groups.append(group)
        self._mesh_backends.append(None)
        return len(self._groups) - 1

    def local_of(self, p):
        """The parameter the engine steps for ``p``: a registered DTensor's plain shard parameter,
        else ``p`` (a DTensor the optimizer was not made with raises, :meth:`check_registered`)."""
        shard = self._shard_of.get(id(p))
        if shard is not None:
            return shard
        self.check_registered(p)
        return p

    def check_registered(self, p) -> None:
        """``TypeError`` if ``p`` is a DTensor the optimizer was not made with."""
        if is_dtensor(p) and id(p) not in self._shard_of:
            raise TypeError(
                f"{self._owner}: its param groups hold DTensor parameters it was not made with: the model was sharded "
                "after the optimizer was made and the sharded parameters were put into optimizer.param_groups "
                "(accelerate's prepare does so under FSDP2). The optimizer steps the local shards of the DTensor "
                "parameters it is made with: make it from the sharded model's parameters (docs/frameworks.md, "
                "'accelerate: the FSDP2 plugin with HSDP')"
            )

    def public_of(self, p):
        """The optimizer's own parameter (the key of ``optimizer.state``) for an engine's parameter."""
        return self._dtensor_of.get(id(p), p)

    def working(self, param_groups: list) -> list:
        """The param groups as the engine and the algorithm step them: ``param_groups`` itself without
        DTensor parameters, else a view of each group whose ``"params"`` are the plain shard
        parameters (its hyperparameters are the group's own, as a scheduler leaves them)."""
        return [_WorkingGroup(g, self) for g in param_groups] if self.pairs else param_groups

    def state_of(self, state):
        """``optimizer.state`` as the engine and the algorithm key it (by the parameters they step)."""
        return _WorkingState(state, self) if self.pairs else state

    def _replicated_over(self, p) -> list[int]:
        """For a DTensor on a mesh of several dimensions replicated over the first, FSDP2's own HSDP
        (placements ``(Replicate(), Shard(0))`` on ``(replicate, shard)``; with tensor parallelism
        ``(Replicate(), Shard(0), tp's)`` on ``(replicate, shard, tp)``): records the replicate dimension's group
        (:attr:`replicate_group`, the optimizer's exchange) and returns the other dimensions, those
        this rank's replica is laid out over. Refuses any other layout of several dimensions."""
        mesh, placements = p.device_mesh, p.placements
        if not isinstance(placements[0], Replicate) or any(isinstance(pl, Partial) for pl in placements):
            raise ValueError(
                f"{self._owner}: a DTensor parameter on a {mesh.ndim}-D device mesh {mesh.mesh_dim_names} with "
                f"placements {placements}: the optimizer takes meshes replicated over their first dimension, as "
                "FSDP2's own HSDP lays them out ((replicate, shard) or (replicate, shard, tp): (Replicate(), "
                "Shard(0), ...)), or 1-D meshes. Shard the model over the shard (and tp) dimensions and give the "
                "optimizer the replicate one (backend=mesh['replicate'])"
            )
        group = mesh.get_group(0)
        if self.replicate_group is not None and self.replicate_group is not group:
            raise ValueError(f"{self._owner}: DTensor parameters replicated over two different meshes; one optimizer "
                             "takes the parameters of one HSDP mesh")
        self.replicate_group = group
        return list(range(1, mesh.ndim))

    def position(self) -> list[int] | None:
        """``[rank, world size]`` of the whole job when the optimizer holds shards (its state is
        this rank's shards'; a checkpoint records it, and another rank's is refused), else ``None``."""
        return [dist.get_rank(), dist.get_world_size()] if self.pairs else None

    def numel_for_buckets(self, p) -> int:
        """The size a parameter counts for in the bucket layout: a split layer's nominal share
        (the same on every rank of its mesh, so their buckets hold the same layers)."""
        split = self._split.get(id(p))
        return p.numel() if split is None else split[0]

    def bucket_kind(self, p) -> tuple[int, ...] | None:
        """The groups ``p``'s layer is split over (``None``: held whole): layers split otherwise never
        share a bucket, so that each bucket's statistics take the same collectives on every rank
        (and a layer every rank of a mesh holds whole, whose exchange must come out the same on
        all of them, never shares one with a split layer)."""
        split = self._split.get(id(p))
        return None if split is None else split[1]

    # --- per-layer statistics over whole layers ------------------------------------------------------
    def _split_over(self, params) -> tuple[int, ...]:
        """The indices in :attr:`_groups` of the groups the layers of ``params``, one bucket's, are split
        over: the same for all of them (:meth:`bucket_kind`); none where they are held whole."""
        split = self._split.get(id(params[0])) if params else None
        return () if split is None else split[1]

    def whole_layer_sums(self, params, values: torch.Tensor) -> torch.Tensor:
        """Per layer of ``params`` (one bucket's), ``values`` (this shard's sums) summed over the ranks
        the layers are split over (one all-reduce of a float per layer and group: FSDP's shard
        group, then tensor parallelism's on a 3-D mesh, whose product is the layer's ranks); as they
        are where the layers are held whole. ``values`` is left as it is."""
        over = self._split_over(params) if self._split else ()
        if over:
            values = values.clone()
            for i in over:
                self._backend(i).all_reduce(values)
        return values

    def whole_sums(self, params, values: list[float], device) -> list[float]:
        """``values`` (sums over this rank's part of ``params``' layers, one bucket's) summed over the
        ranks the layers are split over: the same on every shard of the model. As they are where
        the layers are held whole."""
        if not self._split or not self._split_over(params):
            return values
        return self.whole_layer_sums(params, torch.tensor(values, dtype=torch.float64, device=device)).tolist()

    def whole_layer_norms(self, params, norms: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of ``norms`` (per-layer L2 norms of this shard, of ``params``: one bucket's) as the norms
        of the whole layers."""
        if not self._split or not self._split_over(params):
            return norms
        return [self.whole_layer_sums(params, n.double().square()).sqrt().to(n.dtype) for n in norms]

    def whole_layer_maxima(self, params, values: list[float]) -> list[float]:
        """Per layer of ``params`` (one bucket's), the maximum over the ranks the layers are split over
        (every rank's values gathered, group by group: one float per layer and rank; a maximum is
        exact in any order)."""
        over = self._split_over(params) if self._split else ()
        if not over:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        for i in over:
            backend = self._backend(i)
            every = torch.empty(backend.world_size * t.numel(), dtype=t.dtype)
            backend.all_gather(every, t)
            t = every.view(backend.world_size, -1).amax(dim=0)
        return t.tolist()

    def split_backends(self) -> list[TorchBackend]:
        """The collectives over each group layers are split over (FSDP's shard group, tensor
        parallelism's), in the same order on every rank: over them the shards of one model agree on
        each step as its replicas do (:meth:`compressed_opt.engine.GradientSync.synchronize`)."""
        return [self._backend(i) for i in range(len(self._groups))]

    def _backend(self, i: int) -> TorchBackend:
        """The collectives over the ``i``-th group layers are split over, through the comm layer
        (which keeps what it sends until torch lets go of it: ``compressed_opt.comm.torch_backend``)."""
        if self._mesh_backends[i] is None:
            self._mesh_backends[i] = TorchBackend(self._groups[i])
        return self._mesh_backends[i]

    def check_backend(self, backend, sharded_state: bool) -> None:
        """The backend's ranks and the DTensors' mesh share only this rank: the exchange must pair
        the same shard of every replica, never two shards of one replica. ZeRO is refused: the
        state is the shard's already."""
        if not self.pairs:
            return
        if sharded_state:
            raise ValueError(f"{self._owner}: zero_stage=1/2 with DTensor parameters: the optimizer state is "
                             "already the size of each rank's shard; use zero_stage=0")
        if backend.world_size == 1:
            return
        group = getattr(backend, "group", False)
        if group is False:
            raise ValueError(f"{self._owner}: DTensor parameters need a torch.distributed backend "
                             "(compressed_opt.comm.TorchBackend(group=...)) whose ranks the check can see")
        ours = set(dist.get_process_group_ranks(group or dist.group.WORLD))
        shared = ours & self._mesh_ranks
        if shared != {dist.get_rank()}:
            raise ValueError(
                f"{self._owner}: the DTensor parameters are sharded over ranks {sorted(self._mesh_ranks)}, and the "
                f"optimizer's backend exchanges over ranks {sorted(ours)}: the exchange would average different "
                "shards. With HSDP, shard the model over mesh['shard'] and pass backend=compressed_opt.comm."
                "TorchBackend(group=mesh['replicate'].get_group()) (tensor parallelism: the data-parallel group)"
            )

    def bind_one(self, p, shard) -> None:
        """``shard.grad`` <- the local tensor of ``p.grad`` (reduced first where ``Partial``), as soon
        as autograd has accumulated it (tensor parallelism: during backward). The optimizer's plain
        parameters are averaged over the replicas at the end of backward in a full-precision step
        (overlap, as DDP): the shards' buckets are averaged then too, so their gradients must be
        there; else each replica kept its own gradient on the DTensor parameters while the
        average went nowhere, and the replicas drifted apart from step 1. (FSDP assigns its
        gradients itself at the end of backward: :meth:`bind_grads`, in ``step()``.)"""
        with torch.no_grad():
            if not _moved(p, shard):  # (moved: bind_grads refuses it in step())
                shard.grad = _reduced_grad(p).to_local()

    def bind_grads(self, scaled: bool = False) -> None:
        """Each shard parameter's ``.grad`` <- its DTensor's gradient's local tensor (its
        ``requires_grad`` follows the DTensor's). Refuses a parameter whose local memory FSDP
        replaced after the optimizer was made. A gradient still pending a reduction (``Partial``,
        e.g. a norm weight under sequence parallelism) is reduced over its mesh first (collective,
        in parameter order on every rank of the mesh). ``scaled``: the step was
        called by ``torch.amp.GradScaler.step``, refused: the gradients reach the shards only
        here, so its unscaling found none (the optimizer tells it that it handles scaling itself,
        else it stops at torch's assertion), and a rank that found inf in its own shard would
        skip ``step()`` alone."""
        if scaled and self.pairs:
            raise RuntimeError(
                f"{self._owner} with DTensor parameters (HSDP, tensor parallelism) under torch.amp.GradScaler: not "
                "supported (a rank that finds inf/NaN in its shard would skip step() alone). Train in bf16 "
                "(torch.autocast(dtype=torch.bfloat16) needs no scaler), or without a GradScaler"
            )
        for p, shard in self.pairs:
            if _moved(p, shard):
                raise RuntimeError(
                    f"{self._owner}: a DTensor parameter's local tensor moved after the optimizer was made (the model "
                    "was moved or re-sharded, e.g. model.to(...) or load_state_dict(assign=True)): the optimizer "
                    "would step the old memory. Make the optimizer after the model is in place"
                )
            if shard.requires_grad != p.requires_grad:
                shard.requires_grad_(p.requires_grad)
            if p.grad is None:
                shard.grad = None
                continue
            with torch.no_grad():
                shard.grad = _reduced_grad(p).to_local()

    def clear_grads(self, set_to_none: bool) -> None:
        """The shards' gradients, as ``zero_grad`` leaves the DTensor parameters'."""
        for _, shard in self.pairs:
            if shard.grad is None:
                continue
            if set_to_none:
                shard.grad = None
            else:
                shard.grad.zero_()
        if not set_to_none:  # (zeroed in place: not a backward's; set to None, nothing is left to compare)
            self.note_gradients()

    def note_gradients(self) -> None:
        """At the end of ``step()`` (the gradients it took, as the step left them: its averages are
        written in place) and of ``zero_grad()``: what :meth:`backward_since_step` compares."""
        self._left = gradients_seen([p for p, _ in self.pairs])

    def backward_since_step(self) -> bool:
        """Whether a backward gave some DTensor parameter a gradient since the last ``step()`` or
        ``zero_grad()`` (:func:`backward_since`). FSDP assigns its gradients after backward, where no
        hook of the optimizer sees them; this is how ``zero_grad()`` finds a backward that no
        ``step()`` followed."""
        return backward_since([p for p, _ in self.pairs], self._left)


@torch.no_grad()
def gradients_seen(params: list) -> list[tuple[weakref.ref, int] | None]:
    """What :func:`backward_since` compares: each parameter's gradient (its local tensor, held
    weakly) and that tensor's version counter."""
    return [None if p.grad is None else (weakref.ref(g := local_tensor(p.grad)), g._version) for p in params]


@torch.no_grad()
def backward_since(params: list, seen: list) -> bool:
    """Whether some parameter's gradient is another tensor than in ``seen`` (:func:`gradients_seen`),
    or the same one changed in place (accumulated): a backward ran since ``seen`` was taken."""
    for p, was in zip(params, seen or [None] * len(params)):
        if p.grad is None:
            continue
        g = local_tensor(p.grad)
        if was is None or was[0]() is not g or g._version != was[1]:
            return True
    return False


class _WorkingGroup(MutableMapping):
    """A param group as the engine steps it (:meth:`LocalShards.working`): its ``"params"`` the shard
    parameters of its DTensors, every other key the group's own (read and written through)."""

    __slots__ = ("group", "_shards")

    def __init__(self, group: dict, shards: LocalShards):
        self.group, self._shards = group, shards

    def __getitem__(self, key):
        value = self.group[key]
        return [self._shards.local_of(p) for p in value] if key == "params" else value

    def __setitem__(self, key, value):
        self.group[key] = [self._shards.public_of(p) for p in value] if key == "params" else value

    def __delitem__(self, key):
        del self.group[key]

    def __iter__(self):
        return iter(self.group)

    def __len__(self):
        return len(self.group)


class _WorkingState(MutableMapping):
    """``optimizer.state`` keyed by the parameters the engine steps (:meth:`LocalShards.state_of`)."""

    __slots__ = ("state", "_shards")

    def __init__(self, state, shards: LocalShards):
        self.state, self._shards = state, shards

    def __getitem__(self, p):
        return self.state[self._shards.public_of(p)]

    def __setitem__(self, p, value):
        self.state[self._shards.public_of(p)] = value

    def __delitem__(self, p):
        del self.state[self._shards.public_of(p)]

    def __contains__(self, p):
        return self._shards.public_of(p) in self.state

    def get(self, p, default=None):  # (not Mapping's: a defaultdict would make the entry it looks for)
        return self.state.get(self._shards.public_of(p), default)

    def __iter__(self):
        return (self._shards.local_of(p) for p in self.state)

    def __len__(self):
        return len(self.state)


def _splits(placement) -> bool:
    """Whether a placement splits the tensor over its mesh dimension: ``Shard``, and FSDP's
    ``_StridedShard`` over a tensor-parallel shard (which is no ``Shard`` to ``isinstance``)."""
    return not isinstance(placement, (Replicate, Partial))


def _moved(p, shard) -> bool:
    """Whether the DTensor parameter's local tensor is no longer the shard parameter's memory."""
    with torch.no_grad():
        local = p.to_local()
    return local.shape != shard.shape or bool(local.numel() and local.data_ptr() != shard.data_ptr())


def _reduced_grad(p):
    """``p.grad``, where still pending a sum over its mesh (``Partial``: a tensor-parallel plan's
    replicated norm weights under sequence parallelism) reduced there first, as DTensor's own ops
    reduce it for torch's optimizers, and kept as ``p.grad``: the shard's gradient is then its local
    tensor once and for all, the one the replicas' average lands in (reduced again in ``step()``, a
    new tensor would drop that average, and the replicas drifted apart)."""
    g = p.grad
    if any(isinstance(pl, Partial) for pl in g.placements):
        g = p.grad = g.redistribute(g.device_mesh, [Replicate() if isinstance(pl, Partial) else pl
                                                    for pl in g.placements])
    return g


def _binder(owner: weakref.ref, shard):
    """The gradient hook of one DTensor parameter (:meth:`LocalShards.bind_one`); it holds its
    :class:`LocalShards` weakly: a dropped optimizer's hooks do nothing."""
    def hook(p):
        shards = owner()
        if shards is not None and p.grad is not None:
            shards.bind_one(p, shard)
    return hook
