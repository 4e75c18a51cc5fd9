"""Checkpoints and copies of a compressed optimizer: ``state_dict`` / ``load_state_dict`` (with
every rank's own part when consolidated), ``copy.deepcopy`` and pickling.

A mixin of :class:`~compressed_opt.optimizer.CompressedOptimizer` (it comes before
``torch.optim.Optimizer`` in its bases, so ``super()`` here is torch's). What a state dict holds:
torch's ``state`` and ``param_groups``, plus ``"compressed_opt"``: the format version, the
algorithm, ``global_step``, the saving rank and world size, per bucket its saved buffers (error
feedback, ZeRO's shards; :mod:`compressed_opt.buffers`), the exchange the error buffers belong to
(:mod:`compressed_opt.averaging`), the algorithm's own stage fields, and after
``consolidate_state_dict`` every rank's part (:mod:`compressed_opt.consolidate`). Loading checks
it first (:mod:`compressed_opt.checkpoint`).
"""
from __future__ import annotations

import copy
import functools
import warnings

import torch

from compressed_opt.comm import DEFAULT_BLOCK, Backend, get_backend

from . import checkpoint, consolidate, integrations
from .checkpoint import validate_state_dict
from .local_shards import LocalShards


#: attributes a copy pickled by an older version lacks, with what they start from
_ADDED_SINCE_PICKLED = {"scale_block": DEFAULT_BLOCK, "_regathering": False, "_summed_step": dict,
                        "_gathering_for_inline": False, "_warmup_local": dict, "_unit_factor_errors": set,
                        "_announced": set, "_entered": False, "_path_from_env": False, "_layout_agreed": False,
                        "_broadcast_done": False, "_local_shards": functools.partial(LocalShards, "optimizer")}


class Persistence:
    # --- checkpoints ---------------------------------------------------------------------------
    def _state_dict(self) -> dict:
        sd = super().state_dict()
        buckets = self._bucket_entries()
        sd["compressed_opt"] = {
            "format": checkpoint.FORMAT,
            "algorithm": type(self).__name__,
            "global_step": self.global_step,
            "rank": self.backend.rank,
            "world_size": self.backend.world_size,
            "buckets": buckets,
            "averaging": None if self.exchanges.chosen is None else list(self.exchanges.chosen.key),
            "paths": {str(n): p for n, p in sorted(self.exchanges.paths.items())},
            "scale_block": self.scale_block,
            "param_fields": checkpoint.field_counts(sd["state"]),
            "shards": self._local_shards.position(),
            **self._extra_state(),
        }
        if self._consolidated is not None and self._consolidated[0] == self.global_step:
            parts = list(self._consolidated[1])
            parts[self.backend.rank] = self.rank_part()
            sd["compressed_opt"]["ranks"] = parts
        return sd

    def _load_state_dict(self, state_dict: dict) -> None:
        validate_state_dict(self, state_dict)  # strict checks; every rank agrees or raises (compressed_opt.checkpoint)
        state_dict = checkpoint.upgrade(self, state_dict)  # an older format, laid out as this one
        state_dict, own_params = consolidate.own_part(self, state_dict)  # this rank's part of a consolidated one
        extra = state_dict.get("compressed_opt")
        if extra is None:
            raise ValueError(
                f"this state dict has no 'compressed_opt' entry: it was not saved by a "
                f"{type(self).__name__} (to start from another optimizer's state, load its "
                "parameters and let this optimizer warm up)"
            )
        if extra.get("algorithm") != type(self).__name__:
            raise ValueError(f"state dict of {extra.get('algorithm')} given to {type(self).__name__}")
        plain = {k: v for k, v in state_dict.items() if k != "compressed_opt"}
        originals = {k: dict(v) for k, v in plain.get("state", {}).items()}
        super().load_state_dict(plain)
        # torch casts floating state to each parameter's dtype; our buffers stay fp32. The state's
        # keys are what the saved groups list, by position (indices, or names as torch.optim allows)
        index_to_param = dict(zip((i for g in plain["param_groups"] for i in g["params"]),
                                  (p for g in self.param_groups for p in g["params"])))
        for idx, saved in originals.items():
            p = index_to_param[idx]
            for name in self.bucket_state_names:
                if name in saved:
                    self.state[p][name] = saved[name].to(device=p.device, dtype=torch.float32).clone()
            for name in self.layer_state:
                if name in saved:
                    self.state[p][name] = saved[name].to(device=p.device, dtype=torch.float64).clone()
        with torch.no_grad():  # (0/1 Adam between synchronisations: this rank's own parameters)
            positional = [p for g in self.param_groups for p in g["params"]]
            for idx, values in own_params.items():  # (a consolidated part's: positions)
                positional[int(idx)].copy_(values)
        self.global_step = int(extra["global_step"])
        # (a checkpoint from before the choice was saved: the flat exchange's buffers)
        self.exchanges.saved_key = tuple(extra.get("averaging") or ["flat", extra["world_size"]])
        self.exchanges.paths = {int(n): p for n, p in extra.get("paths", {}).items()}
        self._load_extra_state(extra)
        self._consolidated = None
        self._buckets = None
        self._param_places = None
        self._layout_key = None
        self._watch_again()  # the ranks are checked again; the first compression step watches the loop again
        same_layout = extra["world_size"] == self.backend.world_size and extra["rank"] == self.backend.rank
        if same_layout:
            self._pending_bucket_state = list(extra["buckets"])
        else:
            has_errors = any("worker_error" in e for e in extra["buckets"])
            if has_errors:
                warnings.warn(
                    f"{type(self).__name__}: checkpoint of rank {extra['rank']} of {extra['world_size']} loaded on "
                    f"rank {self.backend.rank} of {self.backend.world_size}: the error-feedback buffers "
                    "(worker and server error) were reset to zero; momentum, variance and stage were kept",
                    RuntimeWarning,
                    stacklevel=2,
                )

    def _restore_bucket_state(self, saved: list[dict]) -> None:
        if not any(set(s) - {"numel"} for s in saved):
            return  # saved before any bucket held state (e.g. accelerate's prepare round trip)
        if len(saved) != len(self._buckets) or any(s["numel"] != b.numel for s, b in zip(saved, self._buckets)):
            if any(set(s) - {"numel", "worker_error", "server_error"} for s in saved):
                # (ZeRO: the shards of m, v and the masters are laid out by the buckets)
                raise ValueError(
                    f"{type(self).__name__}: the checkpoint's buckets ({[s['numel'] for s in saved]} elements) do "
                    f"not match this optimizer's ({[b.numel for b in self._buckets]}): the sharded state cannot be "
                    "placed. Resume with the same parameters and bucket_cap_mb"
                )
            warnings.warn(
                "the checkpoint's buckets do not match this optimizer's (different parameters or "
                "bucket_cap_mb): the error-feedback buffers were reset to zero",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        for s, b in zip(saved, self._buckets):
            for name in self.saved_bucket_buffers:
                if name in s:
                    b.flats[name] = s[name].to(b.device).clone()

    def _bucket_entries(self) -> list[dict]:
        """Per bucket, what ``state_dict()["compressed_opt"]["buckets"]`` (and a copy) carries:
        its size, this rank's error-feedback buffers and the algorithm's saved bucket buffers
        (loaded but not yet placed, before the first step after a load: as loaded)."""
        if self._buckets is None and self._pending_bucket_state is not None:
            return [dict(entry) for entry in self._pending_bucket_state]
        entries = []
        for b in self._buckets or ():
            entry = {"numel": b.numel}
            for name in self.saved_bucket_buffers:
                if name in b.flats:
                    entry[name] = b.flats[name]
            entries.append(entry)
        return entries

    @property
    def stage_fields(self) -> tuple[str, ...]:
        """The names of the algorithm's own fields in ``state_dict()["compressed_opt"]`` (its stage
        and counters: what a load must find, :mod:`compressed_opt.checkpoint`)."""
        return tuple(self._extra_state())

    def rank_part(self) -> dict:
        """What of the state is this rank's own (see :mod:`compressed_opt.consolidate`): its bucket
        entries, its ``rank_state_names`` per parameter, and its parameters where
        :meth:`rank_parameters` says they are its own."""
        params = [p for g in self.param_groups for p in g["params"]]
        state = {}
        for i, p in enumerate(params):
            own = {name: self.state[p][name] for name in self.rank_state_names if name in self.state.get(p, {})}
            if own:
                state[i] = own
        values = {i: p.detach() for i, p in enumerate(params)} if self.rank_parameters() else {}
        return {"rank": self.backend.rank, "buckets": self._bucket_entries(), "state": state, "params": values}

    def rank_parameters(self) -> bool:
        """Whether this rank's parameters are its own now (differ from the other ranks'), so a
        consolidated checkpoint carries them per rank."""
        return False

    def model_parameter(self, p) -> torch.Tensor:
        """The model's parameter that ``p`` (an entry of ``param_groups``) stands for: the DTensor
        whose local shard ``p`` is (HSDP, tensor parallelism), else ``p`` itself."""
        found = self._local_shards.dtensor_of(p)
        return p if found is None else found

    @property
    def comm_device(self) -> torch.device:
        """The device of the optimizer's collectives (its parameters')."""
        return next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective, between steps: gather what of the state is each rank's own (error feedback,
        ZeRO shards, 0/1 Adam's local state between synchronisations) onto rank ``to``, whose
        ``state_dict()`` until the next step carries it, so that one file resumes every rank
        exactly: each rank that loads it takes its own part. Every rank must call it, as torch's
        ``ZeroRedundancyOptimizer.consolidate_state_dict``; Lightning does before it saves, and
        under the HF Trainer and accelerate's ``save_state`` one line makes it run
        (:mod:`compressed_opt.integrations`). Without it, ``state_dict()`` holds this rank's state
        only (resume with each rank's own file)."""
        world = self.backend.world_size
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
            raise ValueError(f"consolidate_state_dict: to must be a rank in [0, {world}), got {to!r}")
        if not self._launcher.idle():
            raise RuntimeError(
                f"{type(self).__name__}.consolidate_state_dict between backward() and step(): this step's gradient "
                "communication has started. Consolidate (and save) between steps"
            )
        parts = consolidate.gather_rank_parts(self, to)
        self._consolidated = None if parts is None else (self.global_step, parts)

    # --- torch.optim's contract: state-dict hooks, copies and pickling ---------------------------
    @torch._disable_dynamo
    def state_dict(self) -> dict:
        """torch's state dict (``state``, ``param_groups``) plus ``"compressed_opt"``: the stage,
        counters and this rank's error-feedback buffers (see the module doc). State-dict pre hooks
        run first and post hooks last, on the whole dict (``"compressed_opt"`` included), as
        ``torch.optim.Optimizer.state_dict`` runs them."""
        if self._consolidated is None and self.backend.world_size > 1:
            integrations.check_consolidated(self)  # under a framework that saves from one rank: warns what to add
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(post_hooks)()  # run below, on the whole dict
        try:
            sd = self._state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        for hook in list(post_hooks.values()):
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer class (see ``state_dict()``). The optimizer keeps
        copies: the given dict's tensors are not used afterwards. Load-state-dict pre hooks get
        (a shallow copy of) the whole dict and may return a replacement; post hooks run once the
        optimizer is fully restored, as with ``torch.optim.Optimizer.load_state_dict``."""
        state_dict = dict(state_dict)  # shallow copy, as torch's
        pre_hooks = self._optimizer_load_state_dict_pre_hooks
        post_hooks = self._optimizer_load_state_dict_post_hooks
        for hook in list(pre_hooks.values()):
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        self._optimizer_load_state_dict_pre_hooks = type(pre_hooks)()
        self._optimizer_load_state_dict_post_hooks = type(post_hooks)()
        try:
            self._load_state_dict(state_dict)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        # the bucket buffers wait for the buckets (built at the next step): copies, not the caller's
        pending = self.__dict__.get("_pending_bucket_state")
        if pending:
            self._pending_bucket_state = [
                {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
                for entry in pending
            ]
        for hook in list(post_hooks.values()):
            hook(self)

    #: what belongs to this process's run rather than to the algorithm: not carried by
    #: ``copy.deepcopy`` or pickle, made again by the copy (see ``__getstate__``)
    _runtime_attributes = frozenset({
        "backend", "_launcher", "_buckets", "_layout_key", "_param_places", "_averager", "_rank_statistics",
        "_consolidated", "_agreement", "_exchanges", "_traffic", "_entered",
        "_regathering", "_backward_norms",
        "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
        "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
        "_optimizer_load_state_dict_post_hooks",
    })

    def _algorithm_state(self, how: str) -> dict:
        """What a copy carries: every attribute but the runtime ones, with the bucket buffers
        (error feedback and the algorithm's saved buffers) as ``state_dict()`` carries them."""
        name = type(self).__name__
        if self.__dict__.get("_averager") is not None:
            raise RuntimeError(
                f"{how} of a {name} that drives a DistributedDataParallel communication hook is not "
                "supported: the hook belongs to the DDP model. Save state_dict() and load it into a new "
                "optimizer (whose first forward through the DDP model attaches it again)"
            )
        if self.__dict__.get("_local_shards"):
            raise RuntimeError(f"{how} of a {name} holding DTensor parameters (HSDP, tensor parallelism) is not "
                               "supported: they belong to the sharded model. Save state_dict() (or use "
                               "compressed_opt.dcp.OptimizerState) and load it into a new optimizer")
        launcher = self.__dict__.get("_launcher")
        if launcher is not None and not launcher.idle():
            raise RuntimeError(
                f"{how} of a {name} between backward() and step(): this step's gradient communication "
                "has started (and may have changed the momentum and error feedback), which a copy cannot "
                "carry. Copy the optimizer between steps (after step(), before the next backward)"
            )
        cls = type(self)
        state = {
            k: v for k, v in self.__dict__.items()
            # nor methods patched onto the instance (an LR scheduler wraps ``step``: that wrapper
            # would step the original), as torch's optimizers' copies drop them
            if k not in self._runtime_attributes and not (callable(v) and callable(getattr(cls, k, None)))
        }
        if self._buckets is not None:
            state["_pending_bucket_state"] = self._bucket_entries()
        state["_ranks_checked"] = False  # the copy checks again that the ranks agree
        if state.get("_overlap") is not None and state["_overlap"].name == "AHEAD":
            state["_overlap"] = type(state["_overlap"]).WATCH  # and watches the loop again before exchanging ahead
        # its paths and choice (an unpickled copy whose backend is still to be made: as it carries them)
        pending = self.__dict__.get("_pending_runtime")
        state["_carried_exchange"] = pending if pending is not None else self._exchanges.carried()
        state.pop("_pending_runtime", None)
        # (an unpickled optimizer whose backend is still to be made carries its spec and place)
        backend = self.__dict__.get("backend")
        state["_copy_of"] = None if backend is None else (backend.rank, backend.world_size)
        return state

    def __copy__(self):
        raise TypeError(
            f"copy.copy() of a {type(self).__name__} is not supported: the copy would share the original's "
            "state tensors and parameters, and both would hook the same gradients. Use copy.deepcopy() "
            "(a working, independent optimizer), or state_dict() and load_state_dict() of a new one"
        )

    def __deepcopy__(self, memo):
        """An independent, working optimizer in the same state: ``step()`` on the same gradients
        gives the same result as the original's. It carries what ``state_dict()`` carries (stage,
        counters, moments, error-feedback buffers, every other attribute), deep-copied with
        ``memo`` (deep-copy ``(model, optimizer)`` together and the copy optimizes the copied
        model's parameters); its runtime parts are made anew: buckets (at its first step),
        gradient hooks on its own parameters, and a backend of the same kind over the same
        communicator (``TorchBackend`` on the same process group, ``MPIBackend`` on the same
        communicator; a backend of another class is shared with the original). Hooks registered
        with ``register_*_hook`` are not copied, as with ``torch.optim``. Raises between
        ``backward()`` and ``step()`` and under a DDP communication hook."""
        state = self._algorithm_state("copy.deepcopy()")
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        state = copy.deepcopy(state, memo)
        if "backend" in self.__dict__:
            state["backend"] = _backend_like(self.backend)
        copied.__setstate__(state)
        return copied

    def __getstate__(self) -> dict:
        """Pickling (``pickle``, ``torch.save(optimizer)``): what ``copy.deepcopy`` carries, with
        the backend as its kind (``"single"``, ``"torch"`` on the default process group,
        ``"mpi"`` on ``COMM_WORLD``), made by ``get_backend`` when the unpickled optimizer first
        needs it (so it may be unpickled before ``init_process_group``), on the same rank of the
        same world size (else it raises: the error-feedback buffers belong to that rank; to move
        between world sizes use ``state_dict()``). A backend that cannot be made again that way
        (another process group or communicator, another class) raises ``TypeError`` here."""
        state = self._algorithm_state("pickling")
        if "backend" in self.__dict__:
            state["_backend_spec"] = _backend_spec(self.backend, type(self).__name__)
        return state

    def __setstate__(self, state: dict) -> None:
        had_differentiable = "differentiable" in (state.get("defaults") or self.__dict__.get("defaults") or {})
        if "_copy_of" not in state:
            # torch's own use: load_state_dict sets ``state`` and ``param_groups`` this way
            super().__setstate__(state)
        else:
            state = dict(state)
            place = state.pop("_copy_of")
            super().__setstate__(state)  # fresh (empty) hook dicts, the step wrapper
            if "backend" not in state and place is not None:
                self._unpickled_place = place  # checked when the backend is made (__getattr__)
            self._buckets = None
            self._layout_key = None
            self._param_places = None
            self._averager = None
            self._consolidated = None
            self._entered = False
            self._regathering = False
            self._backward_norms = None
            for name, value in _ADDED_SINCE_PICKLED.items():  # a copy pickled by an older version
                if name not in self.__dict__:
                    self.__dict__[name] = value() if callable(value) else value
            self._upgrade_pickled()
            carried = self.__dict__.pop("_carried_exchange", None)
            if "backend" in self.__dict__:
                self._start_runtime(carried)
            else:  # (made with the backend, when it is first needed: __getattr__)
                self.__dict__["_pending_runtime"] = carried if carried is not None else {}
            self._launcher = self._new_launcher()
            if not self.__dict__.get("_closed", False):
                self._start_hooks()
        if not had_differentiable:
            self.defaults.pop("differentiable", None)  # torch's __setstate__ adds it; we have none

    def _upgrade_pickled(self) -> None:
        """A copy pickled by an older version, in this version's attributes."""
        d = self.__dict__
        if "_overlap" not in d:  # (before the Overlap state: two flags)
            from .stepping import Overlap

            d["_overlap"] = Overlap.WATCH
            d.pop("_speculate", None)
            d.pop("_scaler_seen", None)
        for gone in ("_gather_inv_scale", "_scales_may_differ"):  # (a GradScaler's scale is never handed over now)
            d.pop(gone, None)
        if "exchange_paths" in d or "_saved_averaging" in d:  # (before compressed_opt.exchanges)
            saved = d.pop("_saved_averaging", None)
            d.setdefault("_carried_exchange", {"paths": d.pop("exchange_paths", None) or {},
                                               "saved_key": None if saved is None else tuple(saved)})
            d.pop("_candidates", None)
            d.pop("_averaging", None)

    #: the runtime parts made with the backend (:meth:`_start_runtime`), on first use after unpickling
    _RUNTIME_PARTS = frozenset({"_agreement", "_exchanges", "_traffic"})

    def __getattr__(self, name: str):
        # only reached for attributes that are missing: an unpickled optimizer's backend, made on
        # first use from the kind it was pickled with (and the runtime parts made with it)
        if name in self._RUNTIME_PARTS and "_pending_runtime" in self.__dict__:
            self.backend  # noqa: B018 - makes the backend, then the runtime parts
            return self.__dict__[name]
        spec = self.__dict__.get("_backend_spec") if name == "backend" else None
        if spec is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        kind, kwargs = spec
        backend = get_backend(kind, **kwargs)
        place = self.__dict__.get("_unpickled_place")
        if place is not None and place != (backend.rank, backend.world_size):
            raise RuntimeError(
                f"this {type(self).__name__} was pickled on rank {place[0]} of {place[1]} and is used on rank "
                f"{backend.rank} of {backend.world_size}: its error-feedback buffers (and ZeRO shards) belong "
                "to that rank. Unpickle it on the same rank of the same world size, or move between world "
                "sizes with state_dict() / load_state_dict()"
            )
        self.__dict__["backend"] = backend
        del self.__dict__["_backend_spec"]
        self.__dict__.pop("_unpickled_place", None)
        self._start_runtime(self.__dict__.pop("_pending_runtime", None))
        return backend


def _backend_like(backend: Backend) -> Backend:
    """A new backend of the same kind over the same communicator, for a deep copy (its own
    workspaces and byte counts); a backend of another class is shared."""
    from compressed_opt.comm import SingleProcessBackend

    kind = type(backend)
    if kind is SingleProcessBackend:
        return SingleProcessBackend()
    if kind.__name__ == "TorchBackend" and kind.__module__ == "compressed_opt.comm.torch_backend":
        return kind(group=backend.group)
    if kind.__name__ == "MPIBackend" and kind.__module__ == "compressed_opt.comm.mpi_backend":
        return kind(comm=backend.comm, cuda_aware=backend.cuda_aware)
    return backend


def _backend_spec(backend: Backend, owner: str) -> tuple[str, dict]:
    """``(kind, kwargs)`` for ``get_backend`` that makes ``backend`` again in another process;
    ``TypeError`` if none can."""
    from compressed_opt.comm import SingleProcessBackend

    kind = type(backend)
    if kind is SingleProcessBackend:
        return "single", {}
    if kind.__name__ == "TorchBackend" and kind.__module__ == "compressed_opt.comm.torch_backend":
        import torch.distributed as dist

        if backend.group is None or backend.group is dist.group.WORLD:
            return "torch", {}
    elif kind.__name__ == "MPIBackend" and kind.__module__ == "compressed_opt.comm.mpi_backend":
        if backend.comm is backend._mpi.COMM_WORLD:
            return "mpi", {"cuda_aware": backend.cuda_aware}
    raise TypeError(
        f"cannot pickle a {owner} whose backend is {backend!r}: only backends that get_backend() can make "
        "again in the loading process are pickled (single process, torch.distributed's default group, "
        "MPI's COMM_WORLD). Save state_dict() instead, or deep-copy within this process"
    )
