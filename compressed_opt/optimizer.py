"""A compressed optimizer: a ``torch.optim.Optimizer`` made of its param groups, a gradient-sync
engine and an algorithm.

* the **engine** (:class:`compressed_opt.engine.GradientSync`, ``optimizer.engine``): the buckets,
  the gradient hooks and the communication thread, the rank agreement, the exchange and its paths,
  the bytes per step;
* the **algorithm** (an :class:`Algorithm`: 1-bit Adam's, 1-bit LAMB's, 0/1 Adam's): the engine's
  client, which says what each step is (full precision or compressed) and what each bucket sends,
  the update of each bucket from what came back, and its declared state (per bucket a dataclass of
  its parts, :mod:`compressed_opt.state`; per layer, numbers in ``optimizer.state[p]``);
* :class:`CompressedOptimizer`, this module's optimizer: ``step()`` is the engine's
  :meth:`~compressed_opt.engine.GradientSync.synchronize`, then the algorithm's update; checkpoints
  and copies are :mod:`compressed_opt.checkpoint`'s functions of the two.

docs/design.md 3 has the module table and the flow of one step.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch
from torch.optim import Optimizer

from compressed_opt.comm import DEFAULT_BLOCK, TorchBackend, resolve_backend

from . import checkpoint, consolidate, exchange, fsdp_replicas, integrations, torch_state_dict, traffic
from .engine import COMPRESSION, WARMUP, GradientSync
from .local_shards import LocalShards
from .state import LAYER, STATE, names, parts
from .validation import check_choice, check_group_keys, check_nonneg_float, check_scale_block, check_step_count

logger = logging.getLogger("compressed_opt")


#: the constructor arguments every compressed optimizer takes, documented once: a class decorated
#: with :func:`common_args` has ``{common_args}`` in its docstring where they go (torch.optim
#: composes its docstrings from shared pieces the same way)
COMMON_ARGS_DOC = """backend: a :class:`compressed_opt.comm.Backend`, or one dimension of a
            ``DeviceMesh`` (the data-parallel one: ``mesh["replicate"]``, ``mesh["dp"]``), over
            which the optimizer averages and exchanges; ``None`` picks one
            (:func:`compressed_opt.comm.get_backend`). DTensor parameters (HSDP's shards,
            tensor parallelism) step on their local shards (:mod:`compressed_opt.local_shards`).
        bucket_cap_mb: size cap of the flat buckets (one collective per bucket).
        overlap: launch each bucket's communication from backward as soon as its gradients are
            ready (``False``: everything in ``step()``).
        accumulation_steps: backward passes per ``step()`` (gradient accumulation without
            ``no_sync()``); communication happens once, after the last.
        scale_block: elements per 1-bit scale in the compressed exchange (a multiple of 256;
            docs/design.md 2.2): each block of a rank's chunk is sent with a scale of its own, so
            small values are not drowned by large ones elsewhere in the bucket; the scales add
            ``4 / scale_block`` bytes per element to the bits' ``1/8`` (3% at 1024).
        hierarchy: where the 1-bit exchange runs (:mod:`compressed_opt.exchange`): ``"auto"``
            (hierarchical on two or more nodes of two or more ranks: fp32 inside a node, 1-bit
            between nodes; else flat), ``"node"`` (hierarchical), ``"flat"`` (over all ranks).
        path: per bucket, ``"1bit"`` (the compressed exchange; ``"auto"`` is the same), ``"fp32"``
            (the exact fp32 average instead: no compression), or ``"measure"`` (at the first step
            the ranks time both for each bucket size on their link and every bucket takes the
            faster; kept in ``engine.exchange.paths``, in checkpoints and in rank 0's cache, so a
            rerun takes the same choice: docs/design.md 2.2.2). ``None`` (the default): the
            ``COMPRESSED_OPT_PATH`` environment variable, else ``"1bit"``: decided by the
            arguments alone, so the same seeded job gives the same result every run. The
            resolved path is ``optimizer.engine.path``."""


def common_args(cls):
    """Put :data:`COMMON_ARGS_DOC` into ``cls``'s docstring at ``{common_args}``."""
    if cls.__doc__ and "{common_args}" in cls.__doc__:
        cls.__doc__ = cls.__doc__.replace("{common_args}", COMMON_ARGS_DOC)
    return cls


class Algorithm:
    """What a compressed optimizer's algorithm provides: the engine's client (what a step is,
    what a bucket sends), the update, and its declared state. Each optimizer's algorithm is a
    subclass of this protocol (its defaults: no per-step statistics, nothing sharded, no per-rank
    state); it keeps its state in its buckets' dataclasses and ``optimizer.state[p]``, and is
    handed the param groups, the per-parameter state and the engine by :meth:`bind`."""

    #: the ``zero_stage`` it runs (1 and 2: ZeRO's shards, :mod:`compressed_opt.zero`)
    zero_stage = 0
    #: per-parameter state that differs between the ranks by the algorithm (each rank's own,
    #: carried per rank by ``consolidate_state_dict``; the bucket entries always are)
    rank_state_names: tuple[str, ...] = ()
    #: its variance tracking (:class:`compressed_opt.variance_tracking.VarianceTracking`), or ``None``
    tracking = None

    def __init__(self, name: str):
        self.name = name
        self.param_groups: list = []
        self.state: dict = {}
        self.engine: GradientSync | None = None
        #: whether it is past its full-precision warmup (the traffic meter's stage of a step)
        self.compressing = False
        #: a number for where it is, which every rank must share (compared every step)
        self.stage = 0

    def bind(self, param_groups: list, state, engine: GradientSync | None) -> None:
        """The optimizer's param groups and per-parameter state (``load_state_dict`` replaces them)."""
        self.param_groups, self.state = param_groups, state
        if engine is not None:
            self.engine = engine

    def __getstate__(self) -> dict:
        """A copy carries the algorithm's own state, not the optimizer's parts it is bound to."""
        return {**self.__dict__, "param_groups": [], "state": {}, "engine": None}

    # --- the engine's client ----------------------------------------------------------------------
    def full_precision(self, step: int) -> bool:
        """Whether step ``step`` (1-based) averages the gradients at full precision."""
        raise NotImplementedError

    def reads_in_place(self, bucket, step: int, inline: bool, native: bool) -> bool:
        """Whether compression step ``step``'s request for ``bucket`` reads the gradients where they
        lie (``gradients.sources``), so that the engine need not copy them: where the exchange runs
        next on this thread (``inline``) and the C passes can read them there (``native``), or where
        :meth:`outgoing` reads them at once."""
        return False

    def outgoing(self, bucket, gradients, step: int):
        """A compression step's :class:`compressed_opt.exchange.Request` for ``bucket`` (``None``: it
        sends nothing now), made from its ``gradients`` (:class:`compressed_opt.engine.Gradients`)
        when they were gathered (on the autograd thread during backward, or in ``synchronize()``);
        it runs with its exchange group's. It must not read the learning rate (schedulers change it
        after ``step()``)."""
        return None

    def statistics(self, step: int, buckets: list) -> torch.Tensor:
        """Floats of this rank that the step's agreement all-gather carries to every rank (the same
        number on every rank); the engine's ``statistics`` holds everyone's, one row per rank."""
        return torch.zeros(0, dtype=torch.float64)

    def observe_average(self, bucket, mean: torch.Tensor, stepped: bool) -> None:
        """A full-precision step's average of ``bucket`` as backward (``stepped``: ``step()``) made
        it: handed to the variance tracking, where the algorithm has one."""
        if self.tracking is not None:
            self.tracking.observe_average(bucket, bucket.state.tracked, mean, stepped, self.engine.global_step + 1)

    def observe_hooked_sums(self, indices: torch.Tensor, sums: torch.Tensor, averaged: bool) -> None:
        """From a DDP hook averaging a full-precision step's gradients: the sums of squares of the
        local gradients (``averaged``: of the average) of the parameters with these indices, handed
        to the variance tracking, where the algorithm has one."""
        if self.tracking is not None:
            self.tracking.observe_hooked(indices, sums, averaged, sum(len(g["params"]) for g in self.param_groups),
                                         self.engine.global_step + 1)

    #: whether a DDP hook should hand the warmup gradients' sums of squares to :meth:`observe_hooked_sums`
    observes_square_sums = False

    def signature(self) -> tuple:
        """The algorithm's options every rank must share (compared before the first step)."""
        return ()

    def validate_group(self, group: dict) -> None:
        """Check a param group's hyperparameters (every group added), normalising them in place."""

    def new_bucket_state(self, bucket):
        """The dataclass of ``bucket``'s state (its ``STATE`` buffers left ``None``: made here from
        ``optimizer.state[p]`` by :meth:`buckets_built`; its ``LAYER`` rows made, at their start)."""
        raise NotImplementedError

    def buckets_built(self, buckets: list, rebuilt: bool) -> None:
        """The buckets were (re)made: each one's state, its ``STATE`` buffers and ``LAYER`` rows
        carrying what ``optimizer.state[p]`` held (each parameter's entries become views of them)."""
        for b in buckets:
            b.state = self.new_bucket_state(b)
            for part in parts(b.state):
                for name in names(part, STATE):
                    flat = b.zeros()
                    for p, view in zip(b.params, b.views(flat)):
                        old = self.state[p].get(name)
                        if old is not None:
                            view.copy_(old)
                        else:
                            self.new_state(p, name, view)
                        self.state[p][name] = view
                    setattr(part, name, flat)
                for name in names(part, LAYER):
                    rows = getattr(part, name)
                    for p, row in zip(b.params, () if rows is None else rows):
                        old = self.state[p].get(name)
                        if old is not None:
                            row.copy_(old)
                        self.state[p][name] = row
        # (torch's and torchtitan's loads of a flattened state dict keep the entries the live state names)
        torch_state_dict.hold_carrier(self.state, self.param_groups, self.engine.backend)

    def new_state(self, param, name: str, view: torch.Tensor) -> None:
        """A parameter's state ``name`` was just made (zeros), as ``view``: set its first value
        where zero is wrong."""

    def tensor_names(self) -> tuple[str, ...]:
        """The per-parameter tensors of ``optimizer.state[p]`` that are views of whole-bucket buffers
        (the ``STATE`` fields of its buckets' dataclasses)."""
        raise NotImplementedError

    def layer_state(self) -> dict[str, int]:
        """The per-layer rows of ``optimizer.state[p]``: name -> width."""
        return {}

    def restore_buckets(self, entries: list[dict]) -> None:
        """A loaded checkpoint's bucket entries (error feedback, ZeRO's shards) into the buckets."""
        checkpoint.restore_buckets(self.engine, entries)

    def check_rebuild(self) -> None:
        """Raise if the state cannot follow the parameters into new buckets."""

    # --- the step --------------------------------------------------------------------------------------
    def update(self, step: int, buckets: list) -> None:
        """Every bucket's update of step ``step``, after the engine synchronised it."""
        raise NotImplementedError

    def end_step(self, step: int, took: bool) -> None:
        """After ``step()``'s update (``took``) or its skip: stage changes, made the same on every rank."""

    # --- checkpoints --------------------------------------------------------------------------------------
    def stage_fields(self) -> dict:
        """The algorithm's stage and counters, saved in ``state_dict()["compressed_opt"]``."""
        return {}

    def load_stage(self, extra: dict) -> None:
        """The algorithm's stage and counters from a (validated) checkpoint."""

    def rank_parameters(self) -> bool:
        """Whether this rank's parameters are its own now (differ from the other ranks')."""
        return False

    def checkpoint_problem(self, rank: int, world: int, consolidated: bool) -> str | None:
        """Why a checkpoint saved by rank ``rank`` of ``world`` cannot be loaded here (``None``: it can)."""
        return None

    def check_ddp(self) -> None:
        """Raise ``ValueError`` if the algorithm cannot drive a ``DistributedDataParallel`` model."""

    # --- what it tells the user ----------------------------------------------------------------------------
    @property
    def last_warmup_step(self) -> int | None:
        """The last full-precision step (``None``: not decided yet)."""
        return None

    def schedule(self) -> str:
        """When it compresses, in words (rank 0's line at its first step)."""
        step = self.last_warmup_step
        if step is None:
            return "full precision until the variance settles (freeze_step='auto'), then the 1-bit exchange"
        return f"full precision through step {step}, then the 1-bit exchange"

    def warmup_at_default(self) -> bool:
        """Whether the warmup's length is the constructor's default (a run may never compress)."""
        return False


class CompressedOptimizer(Optimizer):
    """The base of the compressed optimizers (see the module docstring). Subclasses make their
    :class:`Algorithm` and pass it with their ``defaults``."""

    def __init__(self, params, defaults: dict, algorithm: Algorithm, *, backend=None, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, accumulation_steps: int = 1, hierarchy: str = "auto", path: str | None = None,
                 scale_block: int = DEFAULT_BLOCK):
        check_choice("hierarchy", hierarchy, exchange.HIERARCHIES)
        scale_block = check_scale_block(scale_block)
        cap = check_nonneg_float("bucket_cap_mb", bucket_cap_mb)
        if cap == 0:
            raise ValueError("Invalid bucket_cap_mb: 0 (must be > 0)")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        accumulation_steps = check_step_count("accumulation_steps", accumulation_steps, minimum=1)
        sharded = algorithm.zero_stage > 0
        if sharded and hierarchy == "node":
            raise ValueError("hierarchy='node' with zero_stage > 0: ZeRO's shards are the flat exchange's server "
                             "chunks; use hierarchy='auto' or 'flat' (flat) or zero_stage=0")
        self._algorithm = algorithm
        #: DTensor parameters, stepped on their local shards (compressed_opt.local_shards)
        self._local_shards = LocalShards(type(self).__name__)
        super().__init__(params, defaults)
        replicas = self._local_shards.replicate_group
        if backend is None and replicas is not None:  # FSDP2's own HSDP: the exchange crosses its replicas
            backend = TorchBackend(group=replicas)
        backend = resolve_backend(backend)  # (None: from the launch; a DeviceMesh dimension: its group)
        self._local_shards.check_backend(backend, sharded)
        path_from_env = path is None and bool(os.environ.get(exchange.PATH_ENV))
        path = exchange.resolve_path(path, sharded, backend.world_size)
        #: the gradient-sync engine (compressed_opt.engine): buckets, hooks, agreement, exchange
        self.engine = GradientSync(
            type(self).__name__, self._local_shards.working(self.param_groups), backend, algorithm, self._local_shards,
            bucket_cap_bytes=max(4, int(cap * 2**20)), overlap=overlap, accumulation_steps=accumulation_steps,
            hierarchy=hierarchy, path=path, scale_block=scale_block, sharded=sharded,
            shard_gradients=algorithm.zero_stage == 2)
        self.engine.path_from_env = path_from_env
        self._bind_views()
        if replicas is not None:
            found = fsdp_replicas.find([p for p, _ in self._local_shards.pairs], type(self).__name__)
            if found is not None:  # FSDP averages the warmup's gradients across the replicas
                self.engine.attach_averager(found)
        self._consolidated: tuple[int, list[dict]] | None = None  # (global_step, every rank's part)
        self._announced: set[str] = set()  # the rank-0 log lines already written ("start", "compression")
        self.engine.start()

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """``False``, as torch's own optimizers: ``GradScaler.step`` unscales ``p.grad`` in place, then
        calls ``step()`` only where it found no inf/NaN. A compression step's gradients are each rank's
        own, so at the end of backward the ranks share whether any holds inf/NaN and mark every rank's
        alike (:mod:`compressed_opt.engine`): every rank's scaler skips and backs off together.
        ``True`` with DTensor parameters: ``step()`` is then called at once, and refuses the scaler."""
        return bool(self.__dict__.get("_local_shards") and self._local_shards.pairs)

    # --- what a user reads ---------------------------------------------------------------------------------
    @property
    def backend(self):
        """The :class:`compressed_opt.comm.Backend` the optimizer communicates over (its ``stats``
        count the bytes)."""
        return self.engine.backend

    @property
    def global_step(self) -> int:
        """Steps taken (a skipped step does not count)."""
        return self.engine.global_step

    @property
    def compressing(self) -> bool:
        """Whether the optimizer is past its full-precision warmup."""
        return self._algorithm.compressing

    def comm_stats(self) -> traffic.CommReport:
        """This rank's communication so far, by stage: bytes per step in warmup and in the
        compression stage (counted on the backend), against an fp32 all-reduce of the same
        parameters, with the freeze step, the exchange and the path of each bucket
        (:class:`compressed_opt.traffic.CommReport`; ``print()`` it for a summary)."""
        return traffic.report(self.engine, self._algorithm)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the buckets' buffers that are not workspace:
        moments, error feedback, ZeRO's shards, derived values): what ZeRO sharding reduces."""
        return checkpoint.state_bytes(self.engine)

    def no_sync(self):
        """Context manager: backward passes inside accumulate gradients without communicating
        (gradient accumulation, as ``DistributedDataParallel.no_sync``); the next backward outside
        communicates them all."""
        return self.engine.no_sync()

    def close(self) -> None:
        """Stop communicating: wait for what is in flight, remove the gradient hooks and the
        communication thread. The optimizer cannot step afterwards. Also done when the optimizer
        is garbage collected, when it is used as a context manager and leaves it, and when a new
        compressed optimizer takes the same parameters."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- parameters -----------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        engine = self.__dict__.get("engine")
        if engine is not None and engine._buckets is not None:
            self._algorithm.check_rebuild()
        super().add_param_group(self._local_shards.register_group(param_group))
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                if type(self._local_shards.local_of(p)) not in (torch.Tensor, torch.nn.Parameter):
                    raise TypeError(
                        f"{type(self).__name__} takes plain parameters or DTensor parameters, got a "
                        f"{type(p).__name__} (a tensor subclass the optimizer cannot step)"
                    )
                if p.is_complex():
                    raise TypeError(f"{type(self).__name__} does not support complex parameters (got {p.dtype})")
                if not p.is_floating_point():
                    raise TypeError(f"{type(self).__name__} needs floating-point parameters, got {p.dtype}")
            self._algorithm.validate_group(group)
            warned = self.__dict__.setdefault("_ignored_keys", set())  # (keys warned about: once each)
            ignored = [k for k in check_group_keys(type(self).__name__, group) if k not in warned]
        except (TypeError, ValueError):
            self.param_groups.pop()  # a rejected group must not stay behind
            raise
        if ignored:
            warned.update(ignored)
            warnings.warn(f"{type(self).__name__} ignores the param group key(s) {', '.join(ignored)}: it runs its own "
                          "passes (torch.optim.AdamW's implementation choices mean nothing here)", UserWarning,
                          stacklevel=3)
        if engine is not None:
            self._bind_views()
            engine.watch(self._local_shards.local_of(p) for p in group["params"])
            if engine._buckets is not None:
                engine._ranks_checked = False  # new parameters: check the ranks agree again

    def _bind_views(self) -> None:
        """Point the engine and the algorithm at ``param_groups`` and ``state`` as they step them: the
        same objects, or, with DTensor parameters, views keyed by their local shards
        (:meth:`compressed_opt.local_shards.LocalShards.working`)."""
        engine = self.engine  # (first: an unpickled optimizer's is made on first use, with its local shards)
        shards = self._local_shards
        groups = shards.working(self.param_groups)
        engine.bind(groups)
        self._algorithm.bind(groups, shards.state_of(self.state), engine)

    # --- a step -----------------------------------------------------------------------------------------------
    # Always eager, also when called from code torch.compile traces (torch's own optimizers do the
    # same for what dynamo cannot trace): traced, the counters' Python attribute writes were dropped
    # (global_step stayed 0: no freeze, step-1 bias correction forever), and the collectives,
    # threads and C kernels cannot be traced. torch._disable_dynamo imports dynamo at the first
    # call, not at import.
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):
        """One step on every rank alike: the engine synchronises (the gradients averaged at full
        precision in the warmup, the algorithm's 1-bit exchange in the compression stage; every
        rank agrees to take the step, or to skip it), then the algorithm's update. Returns the
        closure's loss, if a closure was given."""
        engine, algorithm = self.engine, self._algorithm
        if engine.closed:
            raise RuntimeError(f"this {type(self).__name__} was closed; make a new optimizer to keep training")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._consolidated = None  # (the parts gathered for a checkpoint describe the step before)
        if self._local_shards.pairs or "found_inf" in self.__dict__:  # (GradScaler.step sets found_inf)
            self._local_shards.bind_grads(scaled="found_inf" in self.__dict__)
        stage = COMPRESSION if algorithm.compressing else WARMUP  # (of this step: before it ends)
        step, took = engine.global_step + 1, False
        try:
            took = engine.synchronize()
            if took:
                algorithm.update(step, engine.ensure_buckets())
        finally:
            algorithm.end_step(step, took)
            engine.end_step(stage, took)
            if self._local_shards.pairs:
                self._local_shards.note_gradients()  # (zero_grad() then tells a backward without step())
        if took and len(self._announced) < 2:
            traffic.announce(self._announced, engine, algorithm, stage)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's, after what backward launched has landed; the gradients of this step start
        again (the next backward communicates them anew, as under DDP)."""
        engine = self.engine  # (first: an unpickled optimizer's is made here, with its shards)
        shards = self._local_shards
        engine.zero_grad(unseen_backward=bool(shards.pairs) and shards.backward_since_step())
        super().zero_grad(set_to_none)
        if shards.pairs:
            shards.clear_grads(set_to_none)

    # --- checkpoints and copies (compressed_opt.checkpoint) -----------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective, between steps: gather what of the state is each rank's own (error feedback,
        ZeRO shards, 0/1 Adam's local state between synchronisations) onto rank ``to``, whose
        ``state_dict()`` until the next step carries it, so that one file resumes every rank
        exactly: each rank that loads it takes its own part. Every rank must call it, as torch's
        ``ZeroRedundancyOptimizer.consolidate_state_dict``; Lightning does before it saves, and
        under the HF Trainer and accelerate's ``save_state`` one line makes it run
        (:mod:`compressed_opt.integrations`). Without it, ``state_dict()`` holds this rank's state
        only (resume with each rank's own file)."""
        world = self.engine.backend.world_size
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
            raise ValueError(f"consolidate_state_dict: to must be a rank in [0, {world}), got {to!r}")
        if not self.engine.idle:
            raise RuntimeError(
                f"{type(self).__name__}.consolidate_state_dict between backward() and step(): this step's gradient "
                "communication has started. Consolidate (and save) between steps"
            )
        part = checkpoint.rank_part(self.engine, self._algorithm, self.engine.param_groups, self._algorithm.state)
        parts = consolidate.gather_rank_parts(self.engine, part, to)
        self._consolidated = None if parts is None else (self.engine.global_step, parts)

    @torch._disable_dynamo
    def state_dict(self) -> dict:
        """torch's state dict (``state``, ``param_groups``) plus ``"compressed_opt"``: the stage,
        counters and this rank's error-feedback buffers (:mod:`compressed_opt.checkpoint`), also
        carried where torch's ``get_optimizer_state_dict`` keeps it (the moments of DTensor
        parameters as DTensors, :mod:`compressed_opt.torch_state_dict`). State-dict pre hooks run
        first and post hooks last, on the whole dict (``"compressed_opt"`` included), as
        ``torch.optim.Optimizer.state_dict`` runs them."""
        post_hooks = self._optimizer_state_dict_post_hooks
        self._optimizer_state_dict_post_hooks = type(post_hooks)()  # run below, on the whole dict
        try:
            sd = super().state_dict()
        finally:
            self._optimizer_state_dict_post_hooks = post_hooks
        sd["state"] = torch_state_dict.without_carrier(sd["state"])
        # under a framework that saves from one rank: warns what to add (with DTensor parameters the
        # frameworks save through torch's state_dict API, each rank its own record: nothing to add)
        if self._consolidated is None and self.engine.backend.world_size > 1 and not self._local_shards.pairs:
            integrations.check_consolidated(self)
        sd = checkpoint.with_extra(sd, self.engine, self._algorithm, self._consolidated, self._local_shards)
        algorithm = self._algorithm  # (what torch's state_dict API keeps of it: compressed_opt.torch_state_dict)
        own = dict(enumerate(p.detach() for g in self.engine.param_groups for p in g["params"])) \
            if algorithm.rank_parameters() else {}
        sd = torch_state_dict.publish(sd, [p for g in self.param_groups for p in g["params"]],
                                      algorithm.tensor_names(), algorithm.rank_state_names, own, self.engine.backend)
        for hook in list(post_hooks.values()):
            result = hook(self, sd)
            if result is not None:
                sd = result
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer class (see ``state_dict()``), after strict checks on
        every rank (:func:`compressed_opt.checkpoint.validate_state_dict`). The optimizer keeps
        copies: the given dict's tensors are not used afterwards. Load-state-dict pre hooks get (a
        shallow copy of) the whole dict and may return a replacement; post hooks run once the
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
            schema = checkpoint.schema_of(self.engine, self._algorithm)
            plain, extra, own_params = checkpoint.prepare_load(schema, state_dict)
            super().load_state_dict(plain)
            # (through the algorithm's views: keyed by the parameters it steps, torch's load just rebound them)
            checkpoint.finish_load(schema, self._algorithm.state, self.engine.param_groups, plain, extra, own_params)
        finally:
            self._optimizer_load_state_dict_pre_hooks = pre_hooks
            self._optimizer_load_state_dict_post_hooks = post_hooks
        self._consolidated = None
        torch_state_dict.hold_carrier(self.state, self.param_groups, self.engine.backend)
        self.engine.prepare_backward()  # (the loaded stage decides the next backward's averaging)
        for hook in list(post_hooks.values()):
            hook(self)

    def __copy__(self):
        raise TypeError(
            f"copy.copy() of a {type(self).__name__} is not supported: the copy would share the original's "
            "state tensors and parameters, and both would hook the same gradients. Use copy.deepcopy() "
            "(a working, independent optimizer), or state_dict() and load_state_dict() of a new one"
        )

    def __deepcopy__(self, memo):
        """An independent, working optimizer in the same state: ``step()`` on the same gradients
        gives the same result as the original's. It carries what ``state_dict()`` carries (stage,
        counters, moments, error-feedback buffers) and the constructor's arguments, deep-copied
        with ``memo`` (deep-copy ``(model, optimizer)`` together and the copy optimizes the copied
        model's parameters); its runtime parts are made anew: the engine (buckets at its first
        step, gradient hooks on its own parameters, a backend of the same kind over the same
        communicator: a backend of another class is shared with the original). Hooks registered
        with ``register_*_hook`` are not copied, as with ``torch.optim``. Raises between
        ``backward()`` and ``step()`` and under a DDP communication hook."""
        return checkpoint.deep_copy(self, memo)

    def __getstate__(self) -> dict:
        """Pickling (``pickle``, ``torch.save(optimizer)``): what ``copy.deepcopy`` carries, with the
        backend as its kind (``"single"``, ``"torch"`` on the default process group, ``"mpi"`` on
        ``COMM_WORLD``), made when the unpickled optimizer first needs it (so it may be unpickled
        before ``init_process_group``), on the same rank of the same world size (else it raises: the
        error-feedback buffers belong to that rank; to move between world sizes use
        ``state_dict()``). A backend that cannot be made again that way raises ``TypeError`` here."""
        return checkpoint.pickled(self)

    def __setstate__(self, state: dict) -> None:
        if "_copy" not in state:
            had_differentiable = "differentiable" in self.__dict__.get("defaults", {})
            super().__setstate__(state)  # torch's own use: load_state_dict sets ``state`` and ``param_groups``
            if not had_differentiable:
                self.defaults.pop("differentiable", None)  # (torch adds it; we take none)
            if "_algorithm" in self.__dict__:
                self._bind_views()
            return
        checkpoint.unpickled(self, state)

    def __getattr__(self, name: str):
        # only reached for attributes that are missing: an unpickled optimizer's engine, made on
        # first use (its backend made then, on the rank and world size it was pickled on)
        if name == "engine" and "_pending_engine" in self.__dict__:
            return checkpoint.revive_pending(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
