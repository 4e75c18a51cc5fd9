"""The base of the compressed optimizers: parameters, buckets, the algorithm's hooks, the public API.

A compressed optimizer is a ``torch.optim.Optimizer`` made of parts, each with one job:

* this module, :class:`CompressedOptimizer`: the parameters and their flat buckets (built at the
  first step, again after ``add_param_group`` or a ``requires_grad`` change), the buffers the
  algorithm declares (:mod:`compressed_opt.buffers`), the hooks an algorithm implements
  (``_needs_average``, ``_bucket_communicate``, ``_bucket_step``, ``_end_step``, ...), and the
  public API (``comm_stats``, ``close``, ``rank0_decides``, ...);
* :mod:`compressed_opt.stepping` (a part of this class): the life cycle of a step, from backward's
  hooks and from ``step()``;
* :mod:`compressed_opt.agreement`: the collectives by which every rank takes the same decisions;
* :mod:`compressed_opt.exchanges`: which exchange averages the buckets, the path of each, the
  error-feedback buffers, and running exchange groups;
* :mod:`compressed_opt.layout`: where the state lives (replicated, or ZeRO's shards);
* :mod:`compressed_opt.persistence` (a part of this class): checkpoints and copies;
* :mod:`compressed_opt.traffic`: bytes per step and what rank 0 reports.

The subclasses (:class:`~compressed_opt.OnebitAdam`, ...) implement the algorithm per bucket;
docs/design.md 3 has the module table and the sequence of a step.
"""
from __future__ import annotations

import logging
import os
import warnings
import weakref

import torch
from torch.optim import Optimizer

from compressed_opt.comm import DEFAULT_BLOCK, resolve_backend

from . import agreement, averaging, ddp, traffic
from .agreement import RankAgreement
from .buckets import Bucket, build_buckets, trained_ids
from .buffers import SAVED, SCRATCH, STATE, Buffer, names, overlay
from .exchanges import Exchanges, exchange_groups
from .layout import Layout, Replicated
from .local_shards import LocalShards
from .persistence import Persistence
from .stepping import Stepping
from .traffic import Reporting
from .validation import check_choice, check_nonneg_float, check_scale_block, check_step_count

logger = logging.getLogger("compressed_opt")


#: which open compressed optimizer holds each parameter (by id; the optimizer holds the parameter)
_OWNERS: weakref.WeakValueDictionary[int, CompressedOptimizer] = weakref.WeakValueDictionary()


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
        hierarchy: where the 1-bit exchange runs (:mod:`compressed_opt.averaging`): ``"auto"``
            (hierarchical on two or more nodes of two or more ranks: fp32 inside a node, 1-bit
            between nodes; else flat), ``"node"`` (hierarchical), ``"flat"`` (over all ranks).
        path: per bucket, ``"1bit"`` (the compressed exchange; ``"auto"`` is the same), ``"fp32"``
            (the exact fp32 average instead: no compression), or ``"measure"`` (at the first step
            the ranks time both for each bucket size on their link and every bucket takes the
            faster; kept in ``exchange_paths``, in checkpoints and in rank 0's cache, so a rerun
            takes the same choice: docs/design.md 2.2.2). ``None`` (the default): the
            ``COMPRESSED_OPT_PATH`` environment variable, else ``"1bit"``: decided by the
            arguments alone, so the same seeded job gives the same result every run. The
            resolved path is ``optimizer.path``."""


def common_args(cls):
    """Put :data:`COMMON_ARGS_DOC` into ``cls``'s docstring at ``{common_args}``."""
    if cls.__doc__ and "{common_args}" in cls.__doc__:
        cls.__doc__ = cls.__doc__.replace("{common_args}", COMMON_ARGS_DOC)
    return cls


class CompressedOptimizer(Stepping, Reporting, Persistence, Optimizer):
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """``False``, as torch's own optimizers: ``GradScaler.step`` unscales ``p.grad`` in place, then
        calls ``step()`` only where it found no inf/NaN. A compression step's gradients are each rank's
        own, so at the end of backward the ranks share whether any holds inf/NaN and mark every rank's
        alike (:mod:`compressed_opt.stepping`): every rank's scaler skips and backs off together.
        ``True`` with DTensor parameters: ``step()`` is then called at once, and refuses the scaler."""
        return bool(self.__dict__.get("_local_shards"))

    #: the per-bucket buffers this class adds (name -> role and dtype, compressed_opt.buffers);
    #: ``declared`` merges the tables along the class hierarchy (a sharded layout overlays its
    #: own, :mod:`compressed_opt.zero`, with ``sharded_buffers``: how it lays out this class's)
    buffers: dict[str, Buffer] = {
        "grad": Buffer(SCRATCH),  # this rank's gradients, then what the step averages or exchanges
        "worker_error": Buffer(SAVED),  # e_i of the compressed allreduce (docs/design.md 2.2)
        "server_error": Buffer(SAVED),  # E_i, this rank's chunk
    }
    declared: dict[str, Buffer]
    #: made from ``declared``: the ``STATE`` buffers (shown per parameter in
    #: ``optimizer.state[p][name]``), the ``SAVED`` ones (in ``state_dict()["compressed_opt"]
    #: ["buckets"]``) and the ``SCRATCH`` ones
    bucket_state_names: tuple[str, ...] = ()
    saved_bucket_buffers: tuple[str, ...] = ()
    scratch_names: frozenset[str] = frozenset()
    #: per-parameter state that is a row of a small float64 per-bucket tensor of per-layer
    #: numbers, ``(layers, width)``: name -> width (declared ``LAYER`` buffers)
    layer_state: dict[str, int] = {}
    #: per-parameter state that differs between the ranks by the algorithm (each rank's own,
    #: carried per rank by :meth:`consolidate_state_dict`; the bucket entries always are)
    rank_state_names: tuple[str, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        table: dict[str, Buffer] = {}
        for klass in reversed(cls.__mro__):
            table.update(klass.__dict__.get("buffers", {}))
        cls._declare(cls, table)

    @staticmethod
    def _declare(target, table: dict[str, Buffer]) -> None:
        """Set ``target``'s (a class, or an instance with another layout) declared buffers and
        the name lists made from them."""
        target.declared = table
        target.bucket_state_names = names(table, STATE)
        target.saved_bucket_buffers = names(table, SAVED)
        target.scratch_names = frozenset(names(table, SCRATCH))

    #: how a sharded layout declares this class's buffers (over compressed_opt.zero.BUFFERS)
    sharded_buffers: dict[str, Buffer] = {}

    def overlay_buffers(self, table: dict[str, Buffer]) -> None:
        """This optimizer keeps its state in another layout (ZeRO's shards): its buffers are the
        class's overlaid with ``table`` (:func:`compressed_opt.buffers.overlay`)."""
        self._declare(self, overlay(type(self).declared, table))

    def __init__(self, params, defaults: dict, backend=None, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, accumulation_steps: int = 1, hierarchy: str = "auto", path: str | None = None,
                 layout: Layout | None = None, scale_block: int = DEFAULT_BLOCK):
        check_choice("hierarchy", hierarchy, averaging.HIERARCHIES)
        #: elements per 1-bit scale of the compressed exchange (the same on every rank)
        self.scale_block = check_scale_block(scale_block)
        #: where the state lives, replicated or sharded (compressed_opt.layout): chosen here, once
        self.layout = Replicated() if layout is None else layout
        self.layout.check_options(self, path, hierarchy)
        self.layout.declare_buffers(self)
        self.hierarchy = hierarchy
        self._buckets: list[Bucket] | None = None
        #: DTensor parameters, stepped on their local shards (compressed_opt.local_shards)
        self._local_shards = LocalShards(type(self).__name__)
        super().__init__(params, defaults)
        backend = resolve_backend(backend)  # (None: from the launch; a DeviceMesh dimension: its group)
        self._local_shards.check_backend(backend, self.layout.sharded)
        self.backend = backend
        self._path_from_env = path is None and bool(os.environ.get(averaging.PATH_ENV))
        self.path = averaging.resolve_path(path, self.layout.sharded, backend.world_size)
        cap = check_nonneg_float("bucket_cap_mb", bucket_cap_mb)
        if cap == 0:
            raise ValueError("Invalid bucket_cap_mb: 0 (must be > 0)")
        self.bucket_cap_bytes = max(4, int(cap * 2**20))
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        self.overlap = overlap
        self.accumulation_steps = check_step_count("accumulation_steps", accumulation_steps, minimum=1)
        self.global_step = 0
        self._layout_key = None
        self._layout_hash = 0
        self._pending_bucket_state: list[dict] | None = None
        self._consolidated: tuple[int, list[dict]] | None = None  # (global_step, every rank's part)
        self._averager = None  # what averages the warmup gradients in the optimizer's place (attach_averager)
        self._closed = False
        #: steps skipped on every rank because some rank's gradients held inf/NaN (no GradScaler)
        self.nonfinite_steps = 0
        self._announced: set[str] = set()  # the rank-0 log lines already written ("start", "compression")
        self._start_runtime()
        self._init_stepping()
        self._start_hooks()

    def _start_runtime(self, carried: dict | None = None) -> None:
        """The parts that belong to this process's run, made anew by a copy: the rank agreement,
        the exchanges (with a copy's ``carried`` paths and choice) and the traffic meter."""
        self._agreement = RankAgreement(self.backend, type(self).__name__)
        self._exchanges = Exchanges(self.backend, self.hierarchy, self.path, self.layout.sharded, self.scale_block,
                                   type(self).__name__)
        if carried:
            self._exchanges.paths = dict(carried.get("paths") or {})
            self._exchanges.saved_key = carried.get("saved_key")
        #: bytes per step by stage, from the backend's counters (:meth:`comm_stats`)
        self._traffic = traffic.TrafficMeter(self.backend)

    def _start_hooks(self) -> None:
        """The runtime side of an optimizer that was just made or copied: it owns its parameters
        (an older optimizer on them is closed), hooks their gradients, and, before its first step
        in a multi-rank job, watches for a DDP wrapper (:func:`compressed_opt.ddp.watch_for_ddp`)."""
        self._take_parameters()
        self._launcher.watch(p for g in self.param_groups for p in g["params"])
        if self.global_step == 0 and torch.distributed.is_available() and torch.distributed.is_initialized():
            ddp.watch_for_ddp(self)

    # --- parameters and buckets ---------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if self._buckets is not None:
            self._check_rebuild()
        self._param_places = None
        super().add_param_group(self._local_shards.localize_group(param_group))
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
                if type(p) not in (torch.Tensor, torch.nn.Parameter):
                    raise TypeError(
                        f"{type(self).__name__} takes plain parameters or DTensor parameters, got a "
                        f"{type(p).__name__} (a tensor subclass the optimizer cannot step)"
                    )
                if p.is_complex():
                    raise TypeError(f"{type(self).__name__} does not support complex parameters (got {p.dtype})")
                if not p.is_floating_point():
                    raise TypeError(f"{type(self).__name__} needs floating-point parameters, got {p.dtype}")
            self._validate_group(group)
        except (TypeError, ValueError):
            self.param_groups.pop()  # a rejected group must not stay behind
            raise
        if self._buckets is not None:
            self._ranks_checked = False  # new parameters: check the ranks agree again
        launcher = getattr(self, "_launcher", None)
        if launcher is not None:
            launcher.watch(group["params"])

    def _validate_group(self, group: dict) -> None:
        """Subclasses check a param group's hyperparameters (called for every group added)."""

    @property
    def buckets(self) -> list[Bucket]:
        self._ensure_buckets()
        return self._buckets

    def _ensure_buckets(self) -> None:
        key = tuple(trained_ids(g["params"]) for g in self.param_groups)
        if self._buckets is not None and key == self._layout_key:
            return
        rebuilt = self._buckets is not None
        if rebuilt:
            self._check_rebuild()
            # what backward launched belongs to the old layout: let it land, then drop it
            self._launcher.wait()
            self._launcher.reset()
        shards = self._local_shards
        self._buckets = build_buckets(self.param_groups, self.bucket_cap_bytes, shards.numel_for_buckets,
                                      shards.bucket_kind if shards else None)
        for b in self._buckets:
            b.flats.declared = self.declared
        self._layout_key = key
        self._layout_hash = agreement.layout_hash(self._buckets)
        for b in self._buckets:
            for name in self.bucket_state_names:
                flat = b.flat(name)
                for p, view in zip(b.params, b.views(flat)):
                    old = self.state[p].get(name)
                    if old is not None:
                        view.copy_(old)
                    else:
                        self._new_state(p, name, view)
                    self.state[p][name] = view
            for name in self.layer_state:
                rows = b.flats[name] = self._new_layer_rows(name, b)
                for p, row in zip(b.params, rows):
                    old = self.state[p].get(name)
                    if old is not None:
                        row.copy_(old)
                    self.state[p][name] = row
        self._launcher.attach(self._buckets, exchange_groups(self._buckets, self.bucket_cap_bytes))
        self._ranks_checked = False if rebuilt else self._ranks_checked
        pending, self._pending_bucket_state = self._pending_bucket_state, None
        if pending is not None:
            self._restore_bucket_state(pending)
        elif rebuilt and self.compressing:
            warnings.warn(
                "parameters changed during the compression stage: the error-feedback buffers "
                "start again from zero",
                RuntimeWarning,
                stacklevel=3,
            )

    def _new_state(self, param, name: str, view: torch.Tensor) -> None:
        """A parameter's state ``name`` was just made (zeros), as ``view``: subclasses set its
        first value where zero is wrong."""

    def _new_layer_rows(self, name: str, bucket: Bucket) -> torch.Tensor:
        """The ``(layers, layer_state[name])`` float64 tensor of the bucket's per-layer state
        ``name`` before any step (each parameter's ``state[p][name]`` becomes a view of its row)."""
        raise NotImplementedError

    def _check_rebuild(self) -> None:
        """Raise if this optimizer cannot carry its state over to new buckets."""
        self.layout.check_rebuild(self)

    # --- the exchange (compressed_opt.exchanges) ------------------------------------------------------
    @property
    def exchanges(self) -> Exchanges:
        """How the buckets are averaged: the exchange, the path per bucket, the error buffers."""
        return self._exchanges

    @property
    def averaging(self):
        """How the 1-bit exchange averages a bucket (:mod:`compressed_opt.averaging`): chosen at
        the first step."""
        return self.exchanges.averaging

    @property
    def exchange_paths(self) -> dict[int, str]:
        """Per bucket size (elements), ``"1bit"`` or ``"fp32"`` (``path="measure"``: what the link
        measured; empty otherwise)."""
        return self.exchanges.paths

    def error_buffers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's (worker_error, server_error), zero on first use, sized for the exchange."""
        return self.exchanges.error_buffers(bucket)

    def error_ranges(self, bucket: Bucket) -> tuple[tuple[int, int], tuple[int, int]]:
        """The bucket elements ``[lo, hi)`` the worker and the server error cover (their first
        ``hi - lo`` elements): what a per-element rescaling of the errors multiplies."""
        return self.exchanges.error_ranges(bucket)

    def reset_error_buffers(self) -> None:
        """Zero every bucket's error-feedback buffers (they hold another quantity from now on)."""
        self.exchanges.reset_errors(self._buckets or [])

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (bucket buffers that are not workspace, plus
        per-parameter state that is not a view of them): what ZeRO sharding reduces."""
        total = 0
        for b in self._buckets or ():
            total += sum(t.numel() * t.element_size() for name, t in b.flats.items() if name not in self.scratch_names)
        return total

    # --- the algorithm's hooks -----------------------------------------------------------------
    @property
    def compressing(self) -> bool:
        """Whether the optimizer is past its full-precision warmup."""
        raise NotImplementedError

    def _needs_average(self, step: int) -> bool:
        """Whether step ``step`` (1-based) averages the gradients at full precision first."""
        raise NotImplementedError

    def _bucket_communicate(self, bucket: Bucket, group: dict, grad: torch.Tensor, step: int):
        """The algorithm's exchange for a step that does not average gradients at full precision,
        run as soon as the bucket's gradients are ready (possibly on the communication thread,
        during backward): ``None``, or a generator that runs the passes before its compressed
        average, yields the request ``(bucket, x, averaging)`` (as ``Layout.exchange`` does; at
        most once), then runs the passes after it (:meth:`compressed_opt.exchanges.Exchanges.run`). It must not read the
        learning rate (schedulers change it after ``step()``, not before). By default there is
        none here: ``_bucket_step`` communicates."""

    def _place(self, param) -> tuple[int, int]:
        """``(index in state_dict() order, index of its param group)``; made once per set of
        groups (``add_param_group`` and ``load_state_dict`` start it again)."""
        places = getattr(self, "_param_places", None)
        if places is None:
            places = self._param_places = {
                p: (i, gi)
                for i, (gi, p) in enumerate((gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"])
            }
        return places[param]

    def param_index(self, param) -> int:
        """A parameter's index in ``state_dict()`` order (all groups' params, in order)."""
        return self._place(param)[0]

    def group_of(self, param) -> dict:
        """The param group holding ``param`` (the current dict: ``load_state_dict`` replaces them)."""
        return self.param_groups[self._place(param)[1]]

    @property
    def averager(self):
        """What carries the full-precision averaging in place of the optimizer (``None``: the
        optimizer averages itself); see :meth:`attach_averager`."""
        return self._averager

    def attach_averager(self, averager) -> None:
        """From now on ``averager`` averages the warmup gradients into ``p.grad`` during backward
        and has made the ranks' initial parameters equal (DDP's reducer through the hook of
        :mod:`compressed_opt.ddp`, which owns its own state): the optimizer launches no averaging
        of its own and broadcasts nothing. The compression stage's exchange stays the optimizer's."""
        self._averager = averager
        self._launcher.enabled = False

    #: whether a DDP hook should hand the warmup gradients' sums of squares to
    #: :meth:`observe_local_square_sums` (the variance tracking does)
    observes_square_sums = False

    def observe_local_square_sums(self, indices: torch.Tensor, sums: torch.Tensor, averaged: bool = False) -> None:
        """From a DDP hook averaging a full-precision step's gradients: the sums of squares of the
        local gradients, before the average (``averaged``: of the average, before the loop sees
        it), of the parameters with these indices (:meth:`param_index`, int64); what the variance
        tracking calibrates with (nothing here)."""

    def observe_mean_square_sums(self, bucket: Bucket, mean: torch.Tensor, stepped: bool = False) -> None:
        """The bucket's average as backward (or, ``stepped``, step() for this step's update) made it
        (the variance tracking's calibration; nothing here)."""

    def _step_statistics(self, step: int) -> torch.Tensor:
        """Floats of this rank that the step's agreement all-gather carries to every rank (the same
        number on every rank; :attr:`_rank_statistics` holds everyone's, one row per rank)."""
        return torch.zeros(0, dtype=torch.float64)

    def _before_update(self, step: int, averaged: bool) -> None:
        """After the ranks agreed to take the step and the exchanges ran, before any bucket's
        update."""

    def _stage_code(self) -> int:
        """A number for where the algorithm is (every rank must be at the same)."""
        return int(self.compressing)

    def _signature(self) -> list[int]:
        """What the ranks compare before the first step (:func:`compressed_opt.agreement.signature`)."""
        return agreement.signature(self._buckets, self.param_groups,
                                   (self._extra_signature(), self.hierarchy, self.path, self.scale_block),
                                   self.bucket_cap_bytes)

    def _extra_signature(self) -> tuple:
        """The algorithm's options every rank must share (compared before the first step)."""
        return ()

    def averages_next_step(self) -> bool:
        """Whether the next step is a full-precision one (its gradients averaged, not compressed)."""
        return self._needs_average(self.global_step + 1)

    def _bucket_step(self, bucket: Bucket, group: dict, grad: torch.Tensor, step: int, averaged: bool) -> None:
        """The update of the bucket's parameters; ``grad`` holds the averaged gradient (when
        ``averaged``) or this rank's gradient, after ``_bucket_communicate``."""
        raise NotImplementedError

    def _end_step(self, step: int) -> None:
        """After every bucket's update: stage changes. Must decide the same on every rank."""

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: dict) -> None:
        pass

    def _grad_buffer(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's flat fp32 gradient workspace."""
        return self.layout.grad_buffer(self, bucket)

    def _gather(self, bucket: Bucket, grad: torch.Tensor, step: int) -> None:
        """``grad`` <- this rank's gradients of the bucket (unscaled)."""
        bucket.gather_grads(grad)

    def _before_step(self) -> None:
        """At the start of ``step()``, before any collective."""
        self._consolidated = None  # the parts gathered for a checkpoint describe the step before
        self._local_shards.bind_grads(scaled="found_inf" in self.__dict__)  # (GradScaler.step sets found_inf)

    def rank0_decides(self, wants: bool) -> bool:
        """Rank 0's ``wants``, on every rank (a one-element broadcast): for decisions computed
        from floats that might differ between ranks in the last bit, such as an auto freeze."""
        return self._agreement.rank0_decides(wants, self.comm_device)

    def _take_parameters(self) -> None:
        """A compressed optimizer made on parameters that another one holds replaces it: the old
        one is closed (its hooks and thread would otherwise keep communicating)."""
        for p in (p for g in self.param_groups for p in g["params"]):
            old = _OWNERS.get(id(p))
            if old is not None and old is not self and not old._closed:
                warnings.warn(
                    f"a new {type(self).__name__} took the parameters of an existing {type(old).__name__}; "
                    "the old one was closed (call optimizer.close() when you replace an optimizer)",
                    RuntimeWarning, stacklevel=3,
                )
                old.close()
            _OWNERS[id(p)] = self

    def close(self) -> None:
        """Stop communicating: wait for what is in flight, remove the gradient hooks and the
        communication thread. The optimizer cannot step afterwards. Also done when the optimizer
        is garbage collected, when it is used as a context manager and leaves it, and when a new
        compressed optimizer takes the same parameters."""
        if self._closed:
            return
        self._closed = True
        self._launcher.close()
        ddp.forget(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

