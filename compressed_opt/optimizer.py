"""The base of the compressed optimizers: buckets, gradient averaging, rank agreement, checkpoints.

Subclasses implement the algorithm per bucket in :meth:`CompressedOptimizer._bucket_step`; this
class owns everything around it, in the order of a step:

1. closure (if any), buckets built or rebuilt (after ``add_param_group``);
2. once, before the first step: every rank checks that all ranks have the same parameter shapes
   and hyperparameters (an all-gather of a signature), raising on every rank if not;
3. ``torch.amp.GradScaler``: the optimizer handles scaling itself (``_step_supports_amp_scaling``,
   answered to the GradScaler)
   so that a non-finite gradient on *any* rank makes *every* rank skip the step (a one-element
   all-reduce of the flags), where GradScaler alone would skip only on the overflowing rank and
   leave the others waiting in a collective;
4. per bucket, *communication*: the rank's gradients copied into a flat fp32 buffer; if the
   algorithm wants the full-precision average this step (:meth:`_needs_average`), one all-reduce
   per bucket, else the algorithm's own exchange (:meth:`_bucket_communicate`, e.g. 1-bit Adam's
   momentum update and compressed allreduce: a generator that yields its compressed average's
   request, so that an exchange group of short buckets, :func:`exchange_groups`, shares its
   collectives). With ``overlap=True`` (the default) this runs during backward, launched by hooks
   as soon as a bucket's (an exchange group's) gradients are complete
   (:mod:`compressed_opt.overlap`), and ``step()`` only waits for what is still in flight;
   then, per bucket, the *update* (:meth:`_bucket_step`);
5. ``_end_step``: stage changes (freezing), decided identically on every rank.

The rest of the state a resumed run needs (stage, counters, error buffers) goes into
``state_dict()["compressed_opt"]``.
"""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import sys
import warnings
import weakref

import torch
from torch.optim import Optimizer

from compressed_opt.comm import DEFAULT_BLOCK, Backend, get_backend

from . import averaging, ddp, frameworks, path_cache, traffic
from .buckets import Bucket, build_buckets
from .buffers import SAVED, SCRATCH, STATE, Buffer, names, overlay
from .layout import Layout, Replicated
from .overlap import BucketLauncher, GradientsChangedAfterLaunch
from .persistence import Persistence
from .validation import check_choice, check_nonneg_float, check_scale_block, check_step_count

logger = logging.getLogger("compressed_opt")


#: which open compressed optimizer holds each parameter (by id; the optimizer holds the parameter)
_OWNERS: weakref.WeakValueDictionary[int, CompressedOptimizer] = weakref.WeakValueDictionary()


#: the constructor arguments every compressed optimizer takes, documented once: a class decorated
#: with :func:`common_args` has ``{common_args}`` in its docstring where they go (torch.optim
#: composes its docstrings from shared pieces the same way)
COMMON_ARGS_DOC = """backend: a :class:`compressed_opt.comm.Backend`; ``None`` picks one
            (:func:`compressed_opt.comm.get_backend`).
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
        path: per bucket, ``"1bit"`` (the compressed exchange), ``"fp32"`` (the exact fp32
            average instead: no compression), ``"measure"`` (at the first step the ranks time both
            for each bucket size on their link and every bucket takes the faster; kept in
            ``exchange_paths`` and in checkpoints), or ``"auto"``: ``"measure"``, except under
            ZeRO and on one rank (``"1bit"``). ``None`` (the default): the
            ``COMPRESSED_OPT_PATH`` environment variable, else ``"auto"``. The resolved path is
            ``optimizer.path``."""


def common_args(cls):
    """Put :data:`COMMON_ARGS_DOC` into ``cls``'s docstring at ``{common_args}``."""
    if cls.__doc__ and "{common_args}" in cls.__doc__:
        cls.__doc__ = cls.__doc__.replace("{common_args}", COMMON_ARGS_DOC)
    return cls


class CompressedOptimizer(Persistence, Optimizer):
    @property
    def _step_supports_amp_scaling(self) -> bool:
        """``True`` to ``torch.amp.GradScaler`` (its ``step()`` then hands this optimizer
        ``found_inf`` and the scale instead of skipping the step on the overflowing rank alone),
        ``False`` to anyone else who asks: Lightning reads the flag as "unscales inside ``step()``,
        cannot be clipped" and refuses ``gradient_clip_val``, but gradients unscaled beforehand
        (``scaler.unscale_``, then clipping) are what ``step()`` expects."""
        return sys._getframe(1).f_code is torch.amp.GradScaler.step.__code__  # (f_locals would keep a
        # snapshot of the caller's locals alive)

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

    def _overlay_buffers(self, table: dict[str, Buffer]) -> None:
        """This optimizer keeps its state in another layout (ZeRO's shards): its buffers are the
        class's overlaid with ``table`` (:func:`compressed_opt.buffers.overlay`)."""
        self._declare(self, overlay(type(self).declared, table))

    def __init__(self, params, defaults: dict, backend: Backend | None = None, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, accumulation_steps: int = 1, hierarchy: str = "auto", path: str | None = None,
                 layout: Layout | None = None, scale_block: int = DEFAULT_BLOCK):
        check_choice("hierarchy", hierarchy, averaging.HIERARCHIES)
        #: elements per 1-bit scale of the compressed exchange (the same on every rank)
        self.scale_block = check_scale_block(scale_block)
        #: where the state lives, replicated or sharded (compressed_opt.layout): chosen here, once
        self.layout = Replicated() if layout is None else layout
        self.layout.check_options(self, path, hierarchy)
        self.layout.declare_buffers(self)
        #: per bucket size (elements), "1bit" or "fp32" (path="measure": what the link measured)
        self.exchange_paths: dict[int, str] = {}
        self.hierarchy = hierarchy
        self._averaging = None  # chosen at the first step, on every rank alike (compressed_opt.averaging)
        self._candidates = None  # the exchanges it is chosen from
        self._saved_averaging = None  # the averaging key of a loaded checkpoint's error buffers
        self._buckets: list[Bucket] | None = None
        super().__init__(params, defaults)
        if backend is None:
            backend = get_backend("auto")
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a compressed_opt.comm.Backend or None, got {type(backend).__name__}")
        self.backend = backend
        #: bytes per step by stage, from the backend's counters (:meth:`comm_stats`)
        self._traffic = traffic.TrafficMeter(backend)
        self._announced: set[str] = set()  # the rank-0 log lines already written ("start", "compression")
        self._path_from_env = path is None and bool(os.environ.get(averaging.PATH_ENV))
        self.path = averaging.resolve_path(path, self.layout.sharded, backend.world_size)
        cap = check_nonneg_float("bucket_cap_mb", bucket_cap_mb)
        if cap == 0:
            raise ValueError("Invalid bucket_cap_mb: 0 (must be > 0)")
        self.bucket_cap_bytes = max(4, int(cap * 2**20))
        self.global_step = 0
        self._layout_key = None
        self._ranks_checked = False
        self._pending_bucket_state: list[dict] | None = None
        self._consolidated: tuple[int, list[dict]] | None = None  # (global_step, every rank's part)
        self._frameworks_checked = False
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        self.overlap = overlap
        self.accumulation_steps = check_step_count("accumulation_steps", accumulation_steps, minimum=1)
        self._launcher = BucketLauncher(self, self.accumulation_steps)
        self._scaler_seen = False
        self._gather_inv_scale: float | None = None  # 1/scale of a GradScaler, applied when gathering
        self._averager = None  # what averages the warmup gradients in the optimizer's place (attach_averager)
        self._regathering = False  # step() gathers the averages backward wrote into p.grad
        #: whether the ranks agreed that the loop leaves p.grad alone between backward and step(),
        #: so the compression stage may exchange during backward (see compressed_opt.overlap)
        self._speculate = False
        self._closed = False
        self._broadcast_done = False
        self._layout_agreed = False  # the ranks checked a layout once: agree on it every step after
        self._entered = False  # this step's first collective (the entry agreement) happened on this rank
        self._layout_hash = 0
        #: steps skipped on every rank because some rank's gradients held inf/NaN (no GradScaler)
        self.nonfinite_steps = 0
        self._start_hooks()

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
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            for p in group["params"]:
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
        key = tuple(tuple(id(p) for p in g["params"] if p.requires_grad) for g in self.param_groups)
        if self._buckets is not None and key == self._layout_key:
            return
        rebuilt = self._buckets is not None
        if rebuilt:
            self._check_rebuild()
            # what backward launched belongs to the old layout: let it land, then drop it
            self._launcher.wait()
            self._launcher.reset()
        self._buckets = build_buckets(self.param_groups, self.bucket_cap_bytes)
        for b in self._buckets:
            b.flats.declared = self.declared
        self._layout_key = key
        self._layout_hash = _layout_hash(self._buckets)
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

    @property
    def averaging(self):
        """How the 1-bit exchange averages a bucket (:mod:`compressed_opt.averaging`): chosen at
        the first step."""
        if self._averaging is None:
            if self.backend.world_size > 1:  # (choosing is collective: in step(), on every rank)
                raise RuntimeError(f"{type(self).__name__}: the exchange is chosen at the first step()")
            self._averaging = averaging.FlatAveraging(self.backend, self.scale_block)
        return self._averaging

    def _choose_averaging(self) -> None:
        """In ``step()`` on every rank (collective), at the first step and after a checkpoint is
        loaded: the flat or the hierarchical exchange (:func:`averaging.candidates`; with
        ``path="measure"`` the faster on these links, and a loaded checkpoint's exchange where it
        is one of them), and the path of each bucket size; error buffers loaded from a checkpoint
        of another exchange are dropped (warned)."""
        with self._traffic.setup():  # (once: not a step's traffic)
            self._choose_averaging_once()

    def _choose_averaging_once(self) -> None:
        if self._candidates is None:
            self._candidates = averaging.candidates(self.backend, self.hierarchy, self.layout.sharded,
                                                    self.scale_block)
        measured = self.path == "measure"
        saved = None if self._saved_averaging is None else tuple(self._saved_averaging)
        keep = next((a for a in self._candidates if a.key == saved), None) if measured else None
        numels = [b.numel for b in self._buckets or ()]
        if keep is not None:  # the measured choice of the run that saved it
            self._averaging = keep
        elif self._averaging is None and measured and len(self._candidates) > 1 and numels:
            self._averaging, self.exchange_paths = self._measured_choice(self._candidates, numels)
        elif self._averaging is None:
            self._averaging = self._candidates[0]
        self._drop_foreign_errors()
        if measured and not self.exchange_paths and numels:
            _, self.exchange_paths = self._measured_choice([self._averaging], numels)

    def _measured_choice(self, candidates, numels):
        """``path="measure"``: the exchange and the paths per bucket size, from rank 0's cache of
        an earlier run of this job, else measured on the link and kept there (collective)."""
        return path_cache.choose(candidates, self.backend, numels, self.comm_device, self.scale_block,
                                 averaging.choose_measured)

    def _drop_foreign_errors(self) -> None:
        saved, self._saved_averaging = self._saved_averaging, None
        if saved is None or self._averaging is None or tuple(saved) == self._averaging.key:
            return
        self.exchange_paths = {}  # measured on another exchange: measured again
        dropped = False
        for b in self._buckets or ():
            for name in ("worker_error", "server_error"):
                dropped |= b.flats.pop(name, None) is not None
        if dropped:
            warnings.warn(
                f"{type(self).__name__}: the checkpoint's error-feedback buffers belong to another exchange "
                f"({tuple(saved)}, now {self._averaging.key}: hierarchy or node layout changed); they were reset to "
                "zero", RuntimeWarning, stacklevel=4,
            )

    def error_buffers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's (worker_error, server_error), zero on first use, sized for the exchange."""
        if "worker_error" not in bucket.flats:
            we, se = self.averaging.error_sizes(bucket.numel)
            bucket.flats["worker_error"] = torch.zeros(we, dtype=torch.float32, device=bucket.device)
            bucket.flats["server_error"] = torch.zeros(se, dtype=torch.float32, device=bucket.device)
        return bucket.flats["worker_error"], bucket.flats["server_error"]

    def error_ranges(self, bucket: Bucket) -> tuple[tuple[int, int], tuple[int, int]]:
        """The bucket elements ``[lo, hi)`` the worker and the server error cover (their first
        ``hi - lo`` elements): what a per-element rescaling of the errors multiplies."""
        return self.averaging.error_ranges(bucket)

    def compressed_average(self, bucket: Bucket, x: torch.Tensor) -> None:
        """``x`` <- the ranks' 1-bit compressed average of ``x``, with the bucket's error feedback
        (or, where ``path`` says so for the bucket, their exact fp32 average)."""
        self._exchange_requests([(bucket, x, None)])

    def _exchange_requests(self, requests: list) -> list:
        """Each ``(bucket, x, averaging)`` of ``requests`` (``averaging``: ``None`` for the
        optimizer's own, with its path per bucket): the fp32 averages one by one, then each
        averaging's 1-bit exchanges together (the flat one coalesces their collectives). Returns
        per request the result's 1-bit rows where the averaging gives them (else ``None``)."""
        rows: list = [None] * len(requests)
        together: dict[int, tuple] = {}
        for i, (bucket, x, way) in enumerate(requests):
            if way is None:
                if self.path != "1bit" and (self.path == "fp32" or self.exchange_paths.get(bucket.numel) == "fp32"):
                    self.averaging.average(x)
                    continue
                way = self.averaging
            entry = together.setdefault(id(way), (way, [], []))
            entry[1].append((x, *self.error_buffers(bucket)))
            entry[2].append(i)
        for way, items, where in together.values():
            for i, r in zip(where, way.exchange_many(items)):
                rows[i] = r
        return rows

    def _run_exchanges(self, exchanges: list) -> None:
        """Run the buckets' exchanges (generators that yield their one request ``(bucket, x,
        averaging)`` between the passes before and after it, and receive the result's 1-bit rows
        or ``None``) together: every pass before, the requests at once, every pass after."""
        pending = []
        for exchange in exchanges:
            if exchange is None:
                continue
            request = next(exchange, None)
            if request is not None:
                pending.append((exchange, request))
        results = self._exchange_requests([request for _, request in pending])
        for (exchange, _), rows in zip(pending, results):
            try:
                exchange.send(rows)  # (the result's rows, for a layout that keeps them)
            except StopIteration:
                continue
            raise RuntimeError("an exchange asked for a second compressed average")

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (bucket buffers that are not workspace, plus
        per-parameter state that is not a view of them): what ZeRO sharding reduces."""
        total = 0
        for b in self._buckets or ():
            total += sum(t.numel() * t.element_size() for name, t in b.flats.items() if name not in self.scratch_names)
        return total

    def reset_error_buffers(self) -> None:
        for b in self._buckets or ():
            for name in ("worker_error", "server_error"):
                if name in b.flats:
                    b.flats[name].zero_()

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
        most once), then runs the passes after it (:meth:`_run_exchanges`). It must not read the
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

    def observe_mean_square_sums(self, bucket: Bucket, mean: torch.Tensor) -> None:
        """At the end of a full-precision step's backward, the bucket's average as backward made it
        (the variance tracking's calibration; nothing here)."""

    def enter_backward(self) -> None:
        """Called by a DDP hook at the first bucket of a backward that communicates (the
        standalone hooks call :meth:`prepare`): the step's entry agreement (collective), so that
        a rank calling ``step()`` without a backward raises on every rank instead of waiting in a
        collective the others never join."""
        self._ensure_buckets()
        if self._ranks_checked:
            self._agree_on_layout(ENTRY_BACKWARD)
        else:
            self._entered = True
            self._check_ranks(ENTRY_BACKWARD)

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

    # --- the step ------------------------------------------------------------------------------
    def no_sync(self):
        """Context manager: backward passes inside accumulate gradients without communicating
        (gradient accumulation, as ``DistributedDataParallel.no_sync``); the next backward
        outside communicates them all."""
        return self._launcher.suspended()

    def _grad_buffer(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's flat fp32 gradient workspace."""
        return self.layout.grad_buffer(self, bucket)

    def _gather(self, bucket: Bucket, grad: torch.Tensor, step: int) -> None:
        """``grad`` <- this rank's gradients of the bucket (unscaled)."""
        bucket.gather_grads(grad, self._gather_inv_scale)

    def _gathers_local(self) -> bool:
        """Whether a gather now reads this rank's own gradients: not in a full-precision step
        whose average a DDP hook, or this optimizer's backward, wrote into ``p.grad`` already."""
        averaged = self._needs_average(self.global_step + 1)
        return not (averaged and (self._averager is not None or self._regathering))

    def _gathered_finite(self, buckets: list[Bucket]) -> bool:
        """Whether every element of the buckets' gathered gradients is finite (one reduction)."""
        return _finite([self._grad_buffer(b) for b in buckets])

    def _average(self, bucket: Bucket, grad: torch.Tensor) -> None:
        """The full-precision gradient average of a bucket (one collective)."""
        self.layout.average(self, bucket, grad)

    # The launcher's callbacks (compressed_opt.overlap): the life cycle of a step's communication.
    def prepare(self) -> None:
        """At the first gradient of a step's backward: the buckets, and whether buckets may be
        communicated during backward (full-precision steps: always with ``overlap``; compression
        steps: only while the ranks agreed that the loop leaves ``p.grad`` alone, and not under a
        GradScaler, whose skip decision must come first)."""
        self._ensure_buckets()
        self._agree_on_layout(ENTRY_BACKWARD)
        full = self._needs_average(self.global_step + 1)
        ahead = full or (self._speculate and not self._scaler_seen)
        self._launcher.launch_ahead = self.overlap and self._ranks_checked and ahead

    def gather(self, bucket: Bucket) -> None:
        """The bucket's gradients into its flat buffer (the thread that runs backward or step())."""
        self._gather(bucket, self._grad_buffer(bucket), self.global_step + 1)

    def gather_ahead(self, bucket: Bucket) -> bool:
        """:meth:`gather` for a bucket launched from backward; in a compression step, whether its
        gradients are finite (if not, the buffer goes out as zeros: the 1-bit exchange would
        carry inf/NaN into every rank's error buffers, and step() skips the step on every rank)."""
        self.gather(bucket)
        if self._needs_average(self.global_step + 1):
            return True  # the average is checked in step(), the same on every rank
        if self._gathered_finite([bucket]):
            return True
        self._grad_buffer(bucket).zero_()
        return False

    def exchange(self, bucket: Bucket) -> None:
        """The bucket's communication for this step, on its gathered buffer (any thread): the
        full-precision average, or the algorithm's own exchange (:meth:`_bucket_communicate`)."""
        self.exchange_group([bucket])

    def exchange_group(self, buckets: list[Bucket]) -> None:
        """:meth:`exchange` of consecutive buckets (an exchange group, :func:`exchange_groups`):
        their 1-bit exchanges' collectives coalesced, their full-precision averages one by one."""
        step = self.global_step + 1
        if self._needs_average(step):
            if self._averager is None:  # (else the averager averaged the gradients)
                for bucket in buckets:
                    self._average(bucket, self._grad_buffer(bucket))
            return
        self._run_exchanges([self._bucket_communicate(b, self.param_groups[b.group_index], self._grad_buffer(b), step)
                             for b in buckets])

    def finish_backward(self, launched: int) -> None:
        """At the end of the backward that completes the step's gradients: in a full-precision
        step, every bucket averaged (waiting for what is in flight, then the rest in order) and
        the averages written into ``p.grad``, as DDP leaves them."""
        if not self._ranks_checked:
            self._check_ranks(ENTRY_BACKWARD)
        launcher = self._launcher
        full = self._needs_average(self.global_step + 1)
        if not full and not launcher.launch_ahead:
            return  # p.grad keeps the local gradient; step() exchanges it
        if self._averaging is None or self._saved_averaging is not None:
            self._choose_averaging()  # (collective) before the first average: it is the exchange's way
        # every rank waits for its thread, then communicates the rest in order on this thread:
        # the collectives pair up whichever buckets each rank could launch early
        launcher.wait()
        rest = self._buckets[launched:]
        if full:
            launcher.run_inline(range(launched, len(self._buckets)))
            for b in self._buckets:
                self.observe_mean_square_sums(b, self._grad_buffer(b))
                b.scatter_grads(self._grad_buffer(b))
            return
        for b in rest:  # a compression step launched ahead (the loop leaves p.grad alone)
            if not self.gather_ahead(b):
                launcher.nonfinite = True
        for members in launcher.groups_of(b.index for b in rest):
            self.exchange_group([self._buckets[i] for i in members])

    def _agree_on_layout(self, entry: int) -> None:
        """A step's first collective, at whichever entry point communicates first: the first
        gradient hook of its backward (``ENTRY_BACKWARD``, or a DDP hook's first bucket) or
        ``step()`` without a backward since the last step (``ENTRY_STEP``). Once the ranks were
        checked (:meth:`_check_ranks` compares the same at the first step), one all-gather of a
        hash of the bucket layout, the entry and the step: so that every rank raises at once,
        instead of pairing collectives of different kinds or buckets (a hang until the backend's
        timeout, or an abort), when a rank's trainable parameters changed alone (a
        ``requires_grad`` flip, a param group added on one rank) or when one rank called
        ``step()`` while another ran backward."""
        self._entered = True
        if self.backend.world_size == 1 or not self._layout_agreed:
            return
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        world = self.backend.world_size
        mine = torch.tensor([self._layout_hash, entry, self.global_step + 1], dtype=torch.int64, device=device)
        rows = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
        self.backend.all_gather(rows, mine)
        rows = rows.view(world, -1).tolist()
        _raise_on_entry_mismatch(type(self).__name__, [row[1] for row in rows], self.global_step + 1)
        differ = [r for r, row in enumerate(rows) if row[0] != rows[0][0]]
        if differ:
            raise ValueError(
                f"{type(self).__name__}: at step {self.global_step + 1} the trainable parameters of rank(s) "
                f"{differ} differ from rank 0's (requires_grad changed, or a param group was added, on some "
                "ranks only): change them on every rank alike, before the same step"
            )

    def _check_ranks(self, entry: int) -> None:
        with self._traffic.setup():  # (once: not a step's traffic)
            self._check_ranks_once(entry)

    def _check_ranks_once(self, entry: int) -> None:
        for b in self._buckets:
            for p in b.params:
                if p.grad is not None and p.grad.layout != torch.strided:
                    raise TypeError(f"{type(self).__name__} does not support sparse gradients")
        self._check_ranks_agree(entry)
        self._layout_agreed = True
        if self.global_step == 0 and not self._broadcast_done and self._averager is None:  # (else it did)
            self._broadcast_parameters()  # before the first update, once the shapes are known to agree
            self._broadcast_done = True
        if not self._ranks_checked and self._averager is None and self.backend.world_size > 1 and self.global_step == 0:
            logger.info("%s: %d ranks (%s); no DistributedDataParallel wrapper found, so the optimizer "
                        "averages the gradients itself", type(self).__name__, self.backend.world_size,
                        type(self.backend).__name__)
        self._ranks_checked = True

    # Always eager, also when called from code torch.compile traces (torch's own optimizers do
    # the same for what dynamo cannot trace): traced, the counters' Python attribute writes were
    # dropped (OnebitAdam's global_step stayed 0: no freeze, step-1 bias correction forever), and
    # the collectives, threads and C kernels cannot be traced. torch._disable_dynamo imports
    # dynamo at the first call, not at import.
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was closed; make a new optimizer to keep training")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        launcher = self._launcher
        stage = traffic.COMPRESSION if self.compressing else traffic.WARMUP  # (of this step: before it ends)
        self._consolidated = None  # the parts gathered for a checkpoint describe the step before
        if not self._frameworks_checked:
            self._frameworks_checked = True
            frameworks.watch_trainer(self)
        announce = False
        try:
            launcher.wait()  # nothing of ours may be in flight while this thread communicates
            if not self._entered:  # no backward of this step reached our hooks on this rank
                self._ensure_buckets()
                self._agree_on_layout(ENTRY_STEP)
            if not self._ranks_checked:
                self._check_ranks(ENTRY_STEP)
            if self._averaging is None or self._saved_averaging is not None:
                self._choose_averaging()
            step = self.global_step + 1
            full = self._needs_average(step)
            # a compression step whose exchanges all ran from backward (see finish_backward)
            speculated = not full and launcher.finished and launcher.launch_ahead
            touched = launcher.finished and launcher.touched()
            found_inf = getattr(self, "found_inf", None)
            grad_scale = getattr(self, "grad_scale", None) if found_inf is not None else None
            if found_inf is not None:
                self._scaler_seen = True
            self._gather_inv_scale = None if grad_scale is None else 1.0 / float(grad_scale)
            # this step's gradients into the flat buffers, before anything changes state
            done = len(self._buckets) if speculated else 0
            if full and launcher.finished:
                # backward averaged the gradients into p.grad: use them as the loop left them
                self._regathering = True
                try:
                    for b in self._buckets:
                        if touched:
                            self.gather(b)
                        elif self._gather_inv_scale is not None:
                            self._grad_buffer(b).mul_(self._gather_inv_scale)
                finally:
                    self._regathering = False
                checked = self._buckets
            else:
                checked = self._buckets[done:]
                for b in checked:
                    self.gather(b)
            nonfinite = launcher.nonfinite or (found_inf is None
                                               and not self._gathered_finite(checked))
            skip, anyone_touched, anyone_nonfinite = self._agree_on_step(step, found_inf, touched and not full,
                                                                         nonfinite)
            if skip:  # a GradScaler found inf/NaN on some rank: every rank skips the step ...
                if not _flag(found_inf):
                    _tell_grad_scaler_found_inf()  # ... and every rank's scaler backs off alike
                return loss
            if anyone_nonfinite:  # (without a GradScaler) every rank skips, state untouched
                self.nonfinite_steps += 1
                warnings.warn(
                    f"{type(self).__name__}: a non-finite gradient (inf or NaN) on some rank at step {step}; every "
                    f"rank skipped the step (optimizer.nonfinite_steps = {self.nonfinite_steps})",
                    RuntimeWarning, stacklevel=2,
                )
                return loss
            if speculated and anyone_touched:
                raise GradientsChangedAfterLaunch(
                    f"{type(self).__name__}: the training loop changed p.grad between backward() and step() "
                    "after the 1-bit exchange had been launched from backward (earlier steps left p.grad "
                    "alone). Touch the gradients in every step or in none, or pass overlap=False."
                )
            if launcher.finished and not full and not speculated and not self._scaler_seen:
                self._speculate = not anyone_touched  # agreed: the same on every rank
            if not (full and launcher.finished):
                launcher.run_inline(range(done, len(self._buckets)), gather=False)
                if full and self._averager is None:  # averaged here, from the gradients as they were gathered
                    for b in self._buckets:
                        self.observe_mean_square_sums(b, self._grad_buffer(b))
            self._before_update(step, full)
            for b in self._buckets:
                self._bucket_step(b, self.param_groups[b.group_index], self._grad_buffer(b), step, full)
            self.global_step = step
            self._end_step(step)
            ddp.forget(self)  # a DDP wrapper is found at its first forward, before the first step
            announce = True
        finally:
            self._gather_inv_scale = None
            self._entered = False
            launcher.reset()
            self._traffic.end_step(stage)
        if announce:
            self._announce(stage)
        return loss

    def _agree_on_step(self, step: int, found_inf, touched: bool, nonfinite: bool) -> tuple[bool, bool, bool]:
        """One small all-gather per step, before any state changes: every rank's step, stage and
        hyperparameters (a fingerprint: a disagreement raises on every rank at the step it
        appears), whether a GradScaler found inf/NaN (then every rank skips) and whether the loop
        changed ``p.grad`` after backward, and whether its gradients hold inf/NaN. Returns (a
        GradScaler skip, some rank touched, some rank non-finite)."""
        inf = int(_flag(found_inf))
        mine = [step, self._stage_code(), self._hyperparameter_hash(), inf, int(touched), int(nonfinite)]
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        statistics = self._step_statistics(step).to(device=device, dtype=torch.float64)
        if self.backend.world_size == 1:
            self._rank_statistics = statistics.view(1, -1)
            return bool(inf), touched, nonfinite
        # the statistics travel as the bits of their float64 values
        payload = torch.cat([torch.tensor(mine, dtype=torch.int64, device=device), statistics.view(torch.int64)])
        rows = torch.empty(self.backend.world_size * payload.numel(), dtype=torch.int64, device=device)
        self.backend.all_gather(rows, payload)
        rows = rows.view(self.backend.world_size, -1)
        self._rank_statistics = rows[:, len(mine):].contiguous().view(torch.float64)
        rows = rows[:, :len(mine)].tolist()
        problems = []
        for r, row in enumerate(rows[1:], start=1):
            if row[:2] != rows[0][:2]:
                problems.append(f"rank {r} is at step {row[0]} (stage {row[1]}), rank 0 at step {rows[0][0]} "
                                f"(stage {rows[0][1]})")
            elif row[2] != rows[0][2]:
                problems.append(f"rank {r}'s learning rate, betas, eps or weight decay differ from rank 0's")
        if problems:
            raise ValueError(
                f"{type(self).__name__}: the ranks disagree at step {step}: " + "; ".join(problems)
                + ". Change hyperparameters on every rank alike (an LR scheduler on every rank) and resume "
                "every rank from the checkpoint of the same step."
            )
        return any(row[3] for row in rows), any(row[4] for row in rows), any(row[5] for row in rows)

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

    def _hyperparameter_hash(self) -> int:
        """A 63-bit hash of the hyperparameters every rank must share (each group's lr, betas,
        eps and weight decay)."""
        h = hashlib.blake2b(digest_size=8)
        for g in self.param_groups:
            for key in ("lr", "betas", "eps", "weight_decay"):
                value = g.get(key)
                if isinstance(value, torch.Tensor):
                    value = value.item()
                h.update(repr(value).encode())
        return int.from_bytes(h.digest(), "little") >> 1

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Every rank starts from rank 0's parameters, as DDP does (ranks that seeded differently
        would otherwise train different models without a word): once, before the first update,
        after the ranks were found to agree on the shapes. One broadcast per dtype and device."""
        if self.backend.world_size == 1:
            return
        groups: dict = {}
        for p in (p for g in self.param_groups for p in g["params"]):
            groups.setdefault((p.dtype, p.device), []).append(p)
        for params in groups.values():
            flat = torch._utils._flatten_dense_tensors([p.detach() for p in params])
            self.backend.broadcast(flat, src=0)
            torch._foreach_copy_([p.detach() for p in params],
                                 torch._utils._unflatten_dense_tensors(flat, [p.detach() for p in params]))

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's, after what backward launched has landed; the gradients of this step start
        again (the next backward communicates them anew, as under DDP)."""
        launcher = self._launcher
        launcher.wait(late_ok=True)
        if launcher.launched and not self._needs_average(self.global_step + 1):
            self._speculate = False  # a 1-bit exchange went out for gradients the loop threw away
        launcher.reset()
        self._entered = False  # the next backward (or step()) starts the step again
        super().zero_grad(set_to_none)


    # --- what it sends --------------------------------------------------------------------------
    def comm_stats(self) -> traffic.CommReport:
        """This rank's communication so far, by stage: bytes per step in warmup and in the
        compression stage (counted on the backend), against an fp32 all-reduce of the same
        parameters, with the freeze step, the exchange and the path of each bucket
        (:class:`compressed_opt.traffic.CommReport`; ``print()`` it for a summary)."""
        buckets = self._buckets or []
        numel = self._trainable_numel()
        paths: dict[str, int] = {}
        for b in buckets:
            path = self._bucket_path(b)
            paths[path] = paths.get(path, 0) + 1
        meter = self._traffic
        warmup, _ = meter.per_step(traffic.WARMUP)
        compression, inter = meter.per_step(traffic.COMPRESSION)
        return traffic.CommReport(
            optimizer=type(self).__name__, world_size=self.backend.world_size,
            stage=traffic.COMPRESSION if self.compressing else traffic.WARMUP, global_step=self.global_step,
            freeze_step=self._last_warmup_step(), exchange=self._exchange_name(), paths=paths,
            warmup_steps=meter.stages[traffic.WARMUP][0], warmup_bytes_per_step=warmup,
            compression_steps=meter.stages[traffic.COMPRESSION][0], compression_bytes_per_step=compression,
            compression_inter_node_bytes_per_step=inter if self._exchange_is_hierarchical() else None,
            fp32_allreduce_bytes_per_step=traffic.fp32_allreduce_bytes(numel, self.backend.world_size),
            setup_bytes=meter.setup_bytes,
        )

    def _trainable_numel(self) -> int:
        if self._buckets:
            return sum(b.numel for b in self._buckets)
        return sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)

    def _bucket_path(self, bucket: Bucket) -> str:
        """``"fp32"`` where the bucket's compressed exchange is replaced by the fp32 average."""
        if self.path == "fp32" or (self.path == "measure" and self.exchange_paths.get(bucket.numel) == "fp32"):
            return "fp32"
        return "1bit"

    def _exchange_name(self) -> str | None:
        if self.backend.world_size == 1:
            return "none (one rank)"
        if self._averaging is None:
            return None
        key = self._averaging.key
        if key[0] == "node":
            return f"hierarchical: fp32 inside {key[2]} nodes of {key[1]} ranks, 1-bit between them"
        return f"flat 1-bit over {key[1]} ranks"

    def _exchange_is_hierarchical(self) -> bool:
        return self._averaging is not None and self._averaging.key[0] == "node"

    def _last_warmup_step(self) -> int | None:
        """The last full-precision step (``None``: not decided yet)."""
        return getattr(self, "freeze_step", None)

    def _schedule(self) -> str:
        """When the optimizer compresses, in words (for the log line at its first step)."""
        step = self._last_warmup_step()
        if step is None:
            return "full precision until the variance settles (freeze_step='auto'), then the 1-bit exchange"
        return f"full precision through step {step}, then the 1-bit exchange"

    def _warmup_left_at_default(self) -> bool:
        """Whether the warmup's length is the constructor's default (a run may never compress)."""
        return False

    def _announce(self, stage: str) -> None:
        """Rank 0's WARNING-level lines (shown by default): at the first step of this optimizer, what
        it will do; at its first compression step, what compression really does, with the bytes
        counted."""
        if self.backend.world_size == 1 or self.backend.rank != 0:
            return
        report = None
        if "start" not in self._announced:
            self._announced.add("start")
            report = self.comm_stats()
            paths = ", ".join(f"{n} on the {'1-bit exchange' if p == '1bit' else 'fp32 average'}"
                              for p, n in sorted(report.paths.items()))
            where = f" (path from {averaging.PATH_ENV})" if self._path_from_env else ""
            message = (f"compressed_opt: {report.optimizer} on {report.world_size} ranks, step {report.global_step}: "
                       f"{self._trainable_numel():,} parameters in {len(self._buckets or [])} bucket(s) "
                       f"({paths}{where}); exchange: {report.exchange}; {self._schedule()}. "
                       "optimizer.comm_stats() has the bytes per step.")
            if self._warmup_left_at_default() and not self.compressing:
                message += (f" NOTE: the warmup length is left at its default ({self._last_warmup_step()} steps): a "
                            "shorter run never compresses. Pass freeze_step=N (about 15-25% of the run's steps) or "
                            "freeze_step='auto'.")
            logger.warning(message)
        if stage == traffic.COMPRESSION and "compression" not in self._announced:
            self._announced.add("compression")
            report = self.comm_stats()
            fp32 = report.paths.get("fp32", 0)
            why = ""
            if fp32:
                why = (" (path='fp32')" if self.path == "fp32" else
                       " (path='measure': the fp32 average measured faster for their size)")
            before = ("no warmup step in this process" if report.warmup_bytes_per_step is None
                      else f"{report.warmup_bytes_per_step:,.0f} bytes per warmup step")
            sent = self._traffic.last_step_bytes
            ratio = "" if not sent else f", {report.fp32_allreduce_bytes_per_step / sent:.1f}x fewer than"
            logger.warning(
                "compressed_opt: %s compresses from step %d: %d bucket(s) on the 1-bit exchange, %d on fp32%s; "
                "exchange: %s. This rank sent %s bytes in this step (%s%s an fp32 all-reduce's %s).",
                report.optimizer, self.global_step, report.paths.get("1bit", 0), fp32, why, report.exchange,
                f"{sent:,}", before, ratio, f"{report.fp32_allreduce_bytes_per_step:,.0f}")

    # --- every rank the same -------------------------------------------------------------------
    def rank0_decides(self, wants: bool) -> bool:
        """Rank 0's ``wants``, on every rank (a one-element broadcast): for decisions computed
        from floats that might differ between ranks in the last bit, such as an auto freeze."""
        if self.backend.world_size == 1:
            return wants
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        flag = torch.tensor([1 if wants else 0], dtype=torch.int32, device=device)
        self.backend.broadcast(flag, src=0)
        return bool(flag.item())

    def _signature(self) -> list[int]:
        shapes = hashlib.sha256()
        hparams = hashlib.sha256()
        n_params = total = 0
        for b in self._buckets:
            for p in b.params:
                shapes.update(repr((b.index, b.group_index, tuple(p.shape), str(p.dtype))).encode())
                n_params += 1
                total += p.numel()
        for g in self.param_groups:
            hparams.update(repr(sorted((k, v) for k, v in g.items() if k != "params" and _plain(v))).encode())
        hparams.update(repr((self._extra_signature(), self.hierarchy, self.path, self.scale_block)).encode())
        as_ints = lambda h: list(struct.unpack("<qq", h.digest()[:16]))  # noqa: E731
        # the bucket cap on its own: different caps lay out different buckets (and collectives)
        return as_ints(shapes) + as_ints(hparams) + [n_params, total, self.bucket_cap_bytes]

    def _extra_signature(self) -> tuple:
        return ()

    def _check_ranks_agree(self, entry: int) -> None:
        world = self.backend.world_size
        if world == 1:
            return
        mine = torch.tensor(self._signature() + [entry], dtype=torch.int64)
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
        self.backend.all_gather(everyone, mine.to(device))
        rows = everyone.view(world, -1).cpu().tolist()
        _raise_on_entry_mismatch(type(self).__name__, [row[7] for row in rows], self.global_step + 1)
        problems = []
        for r, row in enumerate(rows[1:], start=1):
            cap_differs = row[6] != rows[0][6]
            if cap_differs:
                problems.append(
                    f"rank {r} has bucket_cap_mb={row[6] / 2**20:g} unlike rank 0's {rows[0][6] / 2**20:g} "
                    "(the ranks would cut different buckets)"
                )
            if row[4:6] != rows[0][4:6] or (row[:2] != rows[0][:2] and not cap_differs):
                problems.append(
                    f"rank {r} has {row[4]} parameters / {row[5]} elements in buckets unlike rank 0's "
                    f"{rows[0][4]} / {rows[0][5]} (parameter shapes, dtypes, order or requires_grad differ, "
                    "or the buckets: bucket_cap_mb)"
                )
            if row[2:4] != rows[0][2:4]:
                problems.append(f"rank {r}'s hyperparameters differ from rank 0's")
        if problems:
            raise ValueError(
                f"{type(self).__name__}: the ranks disagree, so their collectives would not match: "
                + "; ".join(problems)
                + ". Build the model and optimizer identically on every rank."
            )


CompressedOptimizer._declare(CompressedOptimizer, dict(CompressedOptimizer.buffers))


def exchange_groups(buckets: list[Bucket], cap_bytes: int) -> list[list[int]]:
    """Consecutive buckets whose fp32 bytes together stay within ``cap_bytes``, as runs of their
    indices: their 1-bit exchanges share collectives. Buckets are cut at the cap, so only buckets
    a param group's end cut short merge (a per-layer group's, a no-decay group's): each small
    exchange's time on a link is its collectives' latency. The same on every rank (the layout is)."""
    groups: list[list[int]] = []
    size = 0
    for b in buckets:
        nbytes = 4 * b.numel
        if groups and size + nbytes <= cap_bytes:
            groups[-1].append(b.index)
            size += nbytes
        else:
            groups.append([b.index])
            size = nbytes
    return groups


def _layout_hash(buckets: list[Bucket]) -> int:
    """A 63-bit hash of the buckets' parameter shapes and dtypes, in order (the same on every rank
    whose trainable parameters are the same)."""
    h = hashlib.blake2b(digest_size=8)
    for b in buckets:
        h.update(repr((b.index, b.group_index, [(tuple(p.shape), str(p.dtype)) for p in b.params])).encode())
    return int.from_bytes(h.digest(), "little") >> 1


#: where a rank's step first communicated (compared by the entry agreement)
ENTRY_BACKWARD, ENTRY_STEP = 1, 2


def _raise_on_entry_mismatch(name: str, entries: list[int], step: int) -> None:
    """Raise (on every rank: they all hold ``entries``) if some ranks entered the step from
    backward and others from ``step()`` without a backward."""
    if len(set(entries)) == 1:
        return
    backward = [r for r, e in enumerate(entries) if e == ENTRY_BACKWARD]
    alone = [r for r, e in enumerate(entries) if e != ENTRY_BACKWARD]
    raise RuntimeError(
        f"{name}: at step {step} rank(s) {alone} called step() without a backward since the last step (no "
        f"gradient of this optimizer's parameters reached it), while rank(s) {backward} ran backward: every "
        "rank must run backward before step(). A rank without data for a step still runs a backward (e.g. of "
        "0 * the loss of any batch); a rank that stops early must stop every rank."
    )


def _flag(found_inf) -> bool:
    """A GradScaler's ``found_inf`` tensor as a bool (``None``: no scaler)."""
    return found_inf is not None and found_inf.numel() > 0 and float(found_inf.detach().reshape(-1)[0]) != 0


def _tell_grad_scaler_found_inf() -> None:
    """Another rank's GradScaler found inf/NaN and every rank skips the step: mark it found in
    the GradScaler that called ``step()`` too, so that its ``update()`` lowers the scale as the
    other ranks' do (scales that drift apart would mix in a later full-precision average).
    GradScaler keeps its per-device flags in ``step()``'s ``optimizer_state``, out of the
    optimizer's reach: found in the calling frame."""
    frame = sys._getframe(1)
    while frame is not None:
        scaler, state = frame.f_locals.get("self"), frame.f_locals.get("optimizer_state")
        if isinstance(scaler, torch.amp.GradScaler) and isinstance(state, dict) and "found_inf_per_device" in state:
            for flag in state["found_inf_per_device"].values():
                flag.fill_(1.0)
            return
        frame = frame.f_back
    warnings.warn("compressed_opt: another rank's GradScaler found inf/NaN, but the GradScaler of this rank "
                  "could not be told: call scaler.step(optimizer) so that every rank's scale stays the same",
                  RuntimeWarning, stacklevel=3)


def _finite(buffers: list[torch.Tensor]) -> bool:
    """Whether every element is finite: one reduction pass (a sum is inf/NaN iff an element is)."""
    if not buffers:
        return True
    return bool(torch.stack([b.sum() for b in buffers]).sum().isfinite())


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, tuple, type(None)))
