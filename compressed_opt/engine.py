"""The gradient-sync engine: a model's parameters in flat buckets, their gradients communicated
as backward produces them, and every rank taking the same decisions, for any optimizer to drive.

:class:`GradientSync` owns the buckets (:mod:`compressed_opt.buckets`), the gradient hooks and
the communication thread, the rank agreement (:mod:`compressed_opt.agreement`), the exchange
(:mod:`compressed_opt.exchange`: flat or hierarchical, fp32 or 1-bit with error feedback) and the
byte counts per step. It exchanges whatever flat buffers it is handed: a bucket's gradients at
full precision, a 1-bit momentum, a pseudo-gradient; what goes out of a bucket in a compression
step is its *client*'s (the algorithm's) to say. The life cycle of a step (Horovod's: launch, keep
computing, wait):

* **idle**, between steps;
* **launched**, once backward's first gradient reaches the hooks (the step's entry agreement, one
  small all-gather): each bucket (an exchange group, :func:`compressed_opt.buckets.exchange_groups`)
  whose gradients are complete is gathered on the autograd thread and communicated on the
  communication thread, in bucket order on every rank. At the end of backward, a full-precision
  step's averages are in ``p.grad``, as ``DistributedDataParallel`` leaves them;
* **exchanged**, after :meth:`GradientSync.synchronize`: what backward did not launch is gathered
  and communicated, the ranks agreed on the step (one all-gather: skip, stage, hyperparameters,
  the client's statistics), and each bucket's result is ready for the update. ``step()`` calls
  it; a loop that clips after synchronising calls it first and steps inside
  :meth:`GradientSync.skip_synchronize`.

After the last ``backward()`` of a step, ``p.grad`` holds the rank average in a full-precision step
(warmup) and this rank's own gradient in a compression step, and the step uses ``p.grad`` as the
loop left it (clipped, unscaled). A compression step's exchange changes state (momentum, error
feedback), so it goes out from backward only while the ranks agree that their loops leave
``p.grad`` alone between backward and ``step()`` (:class:`Overlap`). A non-finite gradient on one
rank in a compression step becomes a non-finite gradient on every rank at the end of backward, as
an all-reduce would carry it in a full-precision step, so a GradScaler, or ``step()``, skips on
every rank alike.

The client (the optimizer's algorithm) says what each step is and what a bucket sends:
``full_precision(step)``, ``stage`` and ``compressing`` (attributes), ``outgoing(bucket, gradients,
step)`` (a :class:`compressed_opt.exchange.Request`, or ``None``), ``reads_in_place(bucket, step,
inline, native)``, ``statistics(step, buckets)``, ``signature()``, ``observe_average(bucket, mean, stepped)``,
``observe_hooked_sums(indices, sums, averaged)`` and ``buckets_built(buckets, rebuilt)``.
"""
from __future__ import annotations

import contextlib
import enum
import functools
import operator
import logging
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel, observe

from . import agreement, ddp
from .agreement import ENTRY_BACKWARD, ENTRY_SKIPPED, ENTRY_STEP, RankAgreement, hyperparameter_hash
from .buckets import Bucket, build_buckets, exchange_groups
from .exchange import ErrorFeedback, Exchange, Request
from .state import SCRATCH, STEP, buffer

logger = logging.getLogger("compressed_opt")

WARMUP, COMPRESSION = "warmup", "compression"

_requires_grad = operator.attrgetter("requires_grad")
_checked = operator.attrgetter("sync.checked")  # (a bucket's gradients' sums, this step's)
_NO_SPAN = contextlib.nullcontext()  # (observe.span where nobody observes)
_NO_STATISTICS = torch.zeros(0, dtype=torch.float64)  # (the shards' agreement: the replicas' carried them)
_grad = operator.attrgetter("grad")

#: which open engine holds each parameter (by id; the engine holds the parameter)
_OWNERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class GradientsAccumulatedWithoutNoSync(RuntimeError):
    pass


class GradientsChangedAfterLaunch(RuntimeError):
    pass


class Overlap(enum.Enum):
    """Where a compression step's exchange runs (full-precision steps: from backward, with ``overlap``)."""

    #: in ``step()``, and the ranks check whether their loops touched ``p.grad`` after backward
    WATCH = "watch"
    #: launched from backward: the ranks agreed at the last compression step that no loop touched ``p.grad``
    AHEAD = "ahead"


@dataclass(eq=False)
class BucketSync:
    """The engine's buffers of one bucket (:mod:`compressed_opt.state`)."""

    #: the gradients, then what the step averaged: padded to ``world`` equal chunks (ZeRO's
    #: reduce-scatter and its scratch), the bucket's elements first
    padded: torch.Tensor | None = buffer(SCRATCH)
    #: per layer, the float64 sums of squares of this rank's own gradients, of step ``local_step``
    local: torch.Tensor | None = buffer(SCRATCH, torch.float64)
    #: the same of an average the step gathered back from ``p.grad`` (backward's, or a DDP hook's)
    averaged: torch.Tensor | None = buffer(SCRATCH, torch.float64)
    #: per parameter, a view of ``padded`` (the gathered gradients, for the passes that take one each)
    views: list | None = buffer(SCRATCH)
    #: this rank's chunk of a full-precision average (ZeRO stage 2's reduce-scatter)
    shard: torch.Tensor | None = buffer(SCRATCH)
    #: the bucket's 1-bit result rows, copied out of the exchange's reused buffers
    rows: torch.Tensor | None = buffer(SCRATCH, torch.uint8)
    #: ``rows`` as a :class:`compressed_opt.cuda.CompressedResult` over the request's buffer (made with them)
    compressed: object = buffer(SCRATCH)
    #: this step's request of the client (a compression step's; made when its gradients were gathered)
    request: object = buffer(STEP)
    #: this step's 1-bit result as its rows (a :class:`compressed_opt.cuda.CompressedResult`)
    result: object = buffer(STEP)
    #: the sums of the last gather (``local`` or ``averaged``): whether it was finite
    checked: torch.Tensor | None = buffer(STEP)
    #: the step of the sums in ``local``
    local_step: int = -1


@dataclass(eq=False)
class Gradients:
    """A bucket's gradients as a compression step hands them to the client's ``outgoing``: the
    bucket's flat buffer (``buffer``, the bucket's elements), one tensor per parameter (``sources``:
    ``p.grad`` where they lie, as a :class:`compressed_opt.cuda.Sources` where the C passes can read
    them, or views of ``buffer``), whether ``buffer`` holds them (``gathered``; else its values are
    free), and whether the exchange runs next on this thread (``inline``: ``p.grad`` may be read
    until then; else the loop may change it, and what reads it must read it now)."""

    buffer: torch.Tensor
    sources: list
    gathered: bool
    inline: bool


class TrafficMeter:
    """Bytes per step of an engine's backend, by stage (warmup or compression), from the backend's
    counters (:class:`compressed_opt.comm.CommStats`, bytes this rank sent, as each collective's
    algorithm sends them; ``inter_node`` the part that crossed between nodes). One-time work (the
    first step's agreement and parameter broadcast, choosing the exchange) is booked apart as setup.
    The counters are the backend's: an engine that shares its backend with other code books their
    bytes too."""

    def __init__(self, backend):
        self._stats = backend.stats
        self._mark = (self._stats.total, self._stats.inter_node)
        self._excluded = (0, 0)  # setup bytes since the mark
        self.setup_bytes = 0
        #: stage -> [steps, bytes, bytes between nodes]
        self.stages = {WARMUP: [0, 0, 0], COMPRESSION: [0, 0, 0]}
        self.last_step_bytes = 0

    @contextlib.contextmanager
    def setup(self):
        """Bytes sent inside the block are one-time setup, not a step's."""
        stats = self._stats
        before = (stats.total, stats.inter_node)
        try:
            yield
        finally:
            sent = (max(0, stats.total - before[0]), max(0, stats.inter_node - before[1]))
            self.setup_bytes += sent[0]
            self._excluded = (self._excluded[0] + sent[0], self._excluded[1] + sent[1])

    def end_step(self, stage: str) -> int:
        """Book what was sent since the last step (setup aside) to ``stage``; returns the step's bytes."""
        now = (self._stats.total, self._stats.inter_node)
        if now[0] < self._mark[0]:  # the counters were reset (stats.reset()): count from zero
            self._mark = (0, 0)
        sent = max(0, now[0] - self._mark[0] - self._excluded[0])
        inter = max(0, now[1] - self._mark[1] - self._excluded[1])
        self._mark, self._excluded = now, (0, 0)
        entry = self.stages[stage]
        entry[0] += 1
        entry[1] += sent
        entry[2] += inter
        self.last_step_bytes = sent
        return sent

    def per_step(self, stage: str) -> tuple[float | None, float | None]:
        """(bytes, bytes between nodes) per step of ``stage``, mean over its steps (``None``: none)."""
        steps, sent, inter = self.stages[stage]
        return (sent / steps, inter / steps) if steps else (None, None)


def _release(handles: list, pool: dict) -> None:
    """Remove the hooks and stop the thread (``close()`` or garbage collection)."""
    for h in handles:
        h.remove()
    handles.clear()
    executor = pool.pop("executor", None)
    if executor is not None:
        executor.shutdown(wait=False)


@torch._disable_dynamo
def _hook(ref: weakref.ref, param: torch.Tensor) -> None:
    engine = ref()
    if engine is not None:
        engine._on_gradient(param)


class GradientSync:
    """The gradient-sync engine of one optimizer (see the module docstring).

    Args:
        name: the optimizer's name, which starts every error message.
        param_groups: the optimizer's param groups (:meth:`bind` points it at new ones).
        backend: a resolved :class:`compressed_opt.comm.Backend`.
        client: the algorithm (see the module docstring).
        local_shards: the DTensor parameters' local shards (:mod:`compressed_opt.local_shards`).
        bucket_cap_bytes, overlap, accumulation_steps, hierarchy, path, scale_block: the
            optimizer's arguments of those names (``path`` resolved).
        sharded: the client keeps ZeRO's shards (the exchange is flat); ``shard_gradients``: the
            full-precision averages are reduce-scattered (ZeRO stage 2).
    """

    def __init__(self, name: str, param_groups: list, backend, client, local_shards, *, bucket_cap_bytes: int,
                 overlap: bool, accumulation_steps: int, hierarchy: str, path: str, scale_block: int,
                 sharded: bool = False, shard_gradients: bool = False):
        self.name, self.backend, self.local_shards = name, backend, local_shards
        self.bind(param_groups)
        self.bucket_cap_bytes, self.overlap, self.accumulation_steps = bucket_cap_bytes, overlap, accumulation_steps
        self.hierarchy, self.path, self.scale_block = hierarchy, path, scale_block
        self.sharded, self.shard_gradients = sharded, shard_gradients
        self._client = weakref.ref(client) if client is not None else (lambda: None)
        self.path_from_env = False  # (the path came from COMPRESSED_OPT_PATH: rank 0's first line says so)
        #: steps taken (not skipped)
        self.global_step = 0
        #: steps skipped on every rank because some rank's gradients held inf/NaN (no GradScaler)
        self.nonfinite_steps = 0
        self._buckets: list[Bucket] | None = None
        self._params: list = []  # every bucket's parameters, in bucket order
        self._groups: list[list[Bucket]] = []  # the exchange groups
        self._layout_key = None
        self._layout_hash = 0
        self._param_places = None
        self._pending_bucket_state: list[dict] | None = None
        self.averager = None  # what averages the warmup gradients in our place (attach_averager)
        #: closed: it communicates no more (``close()``)
        self.closed = False
        self._watched = False  # a DDP wrapper is watched for (until the first step)
        self._overlap = Overlap.WATCH
        self._entered = False  # this step's first collective (the entry agreement) happened on this rank
        self._ranks_checked = False  # the first step's signature agreement ran (again after a change)
        self._layout_agreed = False  # the ranks checked a layout once: agree on it every step after
        self._broadcast_done = False
        self._regathering = False  # synchronize() gathers the averages backward wrote into p.grad
        self._inline = False  # synchronize() gathers a compression step's buckets, whose exchanges run next here
        self._backward_norms: torch.Tensor | None = None  # a compression step's gradients' norms after backward
        self._synchronized = False  # this step's synchronize() ran (exchanged)
        self._shard_agreements: list[RankAgreement] | None = None  # over the groups layers are split over
        self._skip_sync = 0
        self.statistics = torch.zeros(1, 0, dtype=torch.float64)  # the last step's statistics, one row per rank
        self._start_runtime()
        self._init_launcher()

    # --- the runtime parts (a copy makes them anew) -----------------------------------------------------
    def _start_runtime(self, carried: dict | None = None) -> None:
        self.agreement = RankAgreement(self.backend, self.name)
        self.exchange = Exchange(self.backend, self.hierarchy, self.path, self.sharded, self.scale_block, self.name)
        if carried:
            self.exchange.paths = dict(carried.get("paths") or {})
            self.exchange.saved_key = carried.get("saved_key")
        self.traffic = TrafficMeter(self.backend)

    def _init_launcher(self) -> None:
        self.enabled = True  # False while a DDP hook carries the communication, or after close()
        self.launch_ahead = False  # per step: buckets may go out during backward
        self._suspended = 0
        self._handles: list = []
        self._hooked: set[int] = set()
        self._pool: dict = {}
        self._index: dict[int, int] = {}
        self._group_last: dict[int, int] = {}
        self._finalizer = weakref.finalize(self, _release, self._handles, self._pool)
        self._reset_launch()

    @property
    def client(self):
        """The algorithm that drives this engine (its client; see the module docstring)."""
        return self._client()

    def carried(self) -> dict:
        """What a copy of the optimizer carries of its engine: its configuration, its counters and
        the exchange's choice (its buckets' saved buffers go apart)."""
        return {"config": dict(bucket_cap_bytes=self.bucket_cap_bytes, overlap=self.overlap,
                               accumulation_steps=self.accumulation_steps, hierarchy=self.hierarchy, path=self.path,
                               scale_block=self.scale_block, sharded=self.sharded,
                               shard_gradients=self.shard_gradients),
                "global_step": self.global_step, "nonfinite_steps": self.nonfinite_steps,
                "broadcast_done": self._broadcast_done, "closed": self.closed,
                "path_from_env": self.path_from_env, "exchange": self.exchange.carried()}

    @classmethod
    def from_carried(cls, name: str, param_groups: list, backend, client, local_shards, carried: dict):
        """A copy's engine, made anew from what the original's :meth:`carried` (it watches the loop
        and checks the ranks again, as after a load)."""
        engine = cls(name, param_groups, backend, client, local_shards, **carried["config"])
        engine.global_step, engine.nonfinite_steps = carried["global_step"], carried["nonfinite_steps"]
        engine._broadcast_done, engine.path_from_env = carried["broadcast_done"], carried["path_from_env"]
        engine._start_runtime(carried["exchange"])
        if carried["closed"]:
            engine.close()
        return engine

    def forget_buckets(self) -> None:
        """After a load: the buckets are made again at the next step (with the checkpoint's bucket
        entries); the first compression step watches the loop again, and the ranks are checked again."""
        self._buckets = self._layout_key = self._param_places = None
        self.watch_again()

    def bind(self, param_groups: list) -> None:
        """Follow the optimizer's param groups (``load_state_dict`` replaces them)."""
        self.param_groups = param_groups
        self._param_places = None
        #: the device of the engine's collectives (its parameters')
        self.device = next((p.device for g in param_groups for p in g["params"]), torch.device("cpu"))

    def start(self) -> None:
        """Own the parameters (an older engine on them is closed), hook their gradients, and, before
        the first step in a multi-rank job, watch for a DDP wrapper (:func:`compressed_opt.ddp.watch_for_ddp`)."""
        for p in (p for g in self.param_groups for p in g["params"]):
            old = _OWNERS.get(id(p))
            if old is not None and old is not self and not old.closed:
                warnings.warn(
                    f"a new {self.name} took the parameters of an existing {old.name}; the old one was closed "
                    "(call optimizer.close() when you replace an optimizer)", RuntimeWarning, stacklevel=4,
                )
                old.close()
            _OWNERS[id(p)] = self
        self.watch(p for g in self.param_groups for p in g["params"])
        if self.global_step == 0 and torch.distributed.is_available() and torch.distributed.is_initialized():
            self._watched = ddp.watch_for_ddp(self)

    # --- parameters and buckets ---------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        """The flat buckets of the trainable parameters (made at the first step, again after the
        trainable parameters changed)."""
        return self.ensure_buckets()

    def ensure_buckets(self) -> list[Bucket]:
        """The buckets as the trainable parameters are now: made at the first step, again after
        they changed (``add_param_group``, a ``requires_grad`` changed; checked every step)."""
        key = []
        for g in self.param_groups:
            key.append(tuple(map(id, filter(_requires_grad, g["params"]))))
        if self._buckets is not None and key == self._layout_key:
            return self._buckets
        rebuilt = self._buckets is not None
        client = self._client()
        if rebuilt:
            client.check_rebuild()
            self.wait()  # what backward launched belongs to the old layout: let it land, then drop it
            self._reset_launch()
        shards = self.local_shards
        for g in self.param_groups:  # (views of the groups map the registered DTensors to their shards)
            for p in g["params"]:
                shards.check_registered(p)
        buckets = build_buckets(self.param_groups, self.bucket_cap_bytes, shards.numel_for_buckets,
                                shards.bucket_kind if shards.pairs else None)
        world = self.backend.world_size
        for b in buckets:
            padded = b.zeros(world * chunk_numel(b.numel, world))
            b.sync = BucketSync(padded=padded, views=b.views(padded[: b.numel]),
                                local=torch.zeros(len(b.params), dtype=torch.float64, device=b.device))
            b.feedback = ErrorFeedback()
        self._buckets = buckets
        self._layout_key = key
        self._layout_hash = agreement.layout_hash(buckets)
        client.buckets_built(buckets, rebuilt)
        self._attach(buckets, exchange_groups(buckets, self.bucket_cap_bytes))
        #: every bucket's parameters, in bucket order
        self._params = [p for b in buckets for p in b.params]
        self._ranks_checked = False if rebuilt else self._ranks_checked
        pending, self._pending_bucket_state = self._pending_bucket_state, None
        if pending is not None:
            client.restore_buckets(pending)
        elif rebuilt and client.compressing:
            warnings.warn("parameters changed during the compression stage: the error-feedback buffers "
                          "start again from zero", RuntimeWarning, stacklevel=4)
        return buckets

    def param_index(self, param) -> int:
        """A parameter's index in ``state_dict()`` order (all groups' params, in order)."""
        places = self._param_places
        if places is None:
            places = self._param_places = {
                p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return places[param]


    def numel(self) -> int:
        """The trainable parameters' elements (the buckets', once made)."""
        if self._buckets:
            return sum(b.numel for b in self._buckets)
        return sum(p.numel() for g in self.param_groups for p in g["params"] if p.requires_grad)

    # --- hooks ------------------------------------------------------------------------------------------
    def watch(self, params) -> None:
        """Hook every parameter of ``params`` that requires grad and has no hook yet."""
        if not self._finalizer.alive:
            return  # closed
        hook = functools.partial(_hook, weakref.ref(self))
        for p in params:
            if p.requires_grad and id(p) not in self._hooked:
                self._handles.append(p.register_post_accumulate_grad_hook(hook))
                self._hooked.add(id(p))

    def _attach(self, buckets: list[Bucket], groups: list[list[int]]) -> None:
        self._group_last = {i: g[-1] for g in groups for i in g}
        #: the exchange groups, as lists of buckets
        self._groups = [[buckets[i] for i in g] for g in groups]
        self._index = {id(p): b.index for b in buckets for p in b.params}
        self.watch(p for b in buckets for p in b.params)
        self._reset_launch()

    def _reset_launch(self) -> None:
        n = len(self._buckets or ())
        self._fired = [0] * n
        self._ready = [False] * n
        self._next = 0
        self._futures: list[Future | None] = [None] * n
        self._late = False
        self._in_backward = False
        self._passes = 0
        #: the step's gradients were completed by backward (and, in a full-precision step, averaged)
        self.finished = False
        #: a bucket launched ahead held inf/NaN (it went out as zeros; the step skips on every rank)
        self._launched_nonfinite = False
        #: per parameter of the buckets: (grad tensor, version) when backward left it
        self._left: dict[int, tuple[torch.Tensor, int]] = {}

    def no_sync(self):
        """Context manager: backward passes inside accumulate gradients without communicating
        (gradient accumulation, as ``DistributedDataParallel.no_sync``); the next backward outside
        communicates them all."""
        return self._suspend()

    @contextlib.contextmanager
    def _suspend(self):
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self.enabled or self._suspended:
            return
        if not self._in_backward:
            if self._passes == 0 and not self.finished:
                # the step's first gradient: the buckets (rebuilt where the parameters changed:
                # nothing is in flight yet), the entry agreement, and whether buckets may go out
                # during backward (full-precision steps: with ``overlap``; compression steps: in
                # the ``AHEAD`` state)
                self.ensure_buckets()
                self._entered = True
                if self._layout_agreed:
                    self.agreement.entry(self._layout_hash, ENTRY_BACKWARD, self.global_step + 1, self.device)
                ahead = self._client().full_precision(self.global_step + 1) or self._overlap is Overlap.AHEAD
                self.launch_ahead = self.overlap and self._ranks_checked and ahead
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        index = self._index.get(id(param))
        if index is None:
            return  # not in the current buckets (its requires_grad changed: the next step rebuilds)
        if self.finished:
            self._late = True  # a gradient arrived after its bucket had been communicated
            return
        self._fired[index] += 1
        if self._fired[index] == len(self._buckets[index].params) * self.accumulation_steps:
            self._ready[index] = True
            if self.launch_ahead:
                while self._next < len(self._buckets) and all(self._ready[self._next: self._last(self._next) + 1]):
                    self._submit(self._next)

    def _last(self, index: int) -> int:
        return self._group_last.get(index, index)

    def _submit(self, index: int) -> None:
        """Launch the exchange group that starts at bucket ``index``: gathered on the autograd thread
        (the communication thread never reads ``p.grad``), communicated on the communication thread."""
        buckets = self._buckets[index: self._last(index) + 1]
        full = self._client().full_precision(self.global_step + 1)
        for bucket in buckets:
            self._gather(bucket)
            if not full and not bool(bucket.sync.checked.sum().isfinite()):  # (averages: checked in synchronize())
                bucket.sync.padded.zero_()  # (the 1-bit exchange would carry inf/NaN into every rank's errors)
                self._launched_nonfinite = True
        executor = self._pool.get("executor")
        if executor is None:
            executor = self._pool["executor"] = ThreadPoolExecutor(max_workers=1,
                                                                    thread_name_prefix="compressed_opt_comm")
        self._futures[index] = executor.submit(self._exchange_group, buckets)
        self._next = index + len(buckets)

    @torch._disable_dynamo
    def _end_of_backward(self) -> None:
        """At the end of each backward; the one that completes the step's gradients (the last of
        ``accumulation_steps``) finishes them: in a full-precision step, every bucket averaged
        (waiting for what is in flight, then the rest in order) and the averages written into
        ``p.grad``, as DDP leaves them; in a compression step launched ahead, the rest of its
        exchanges. A compression step not launched ahead: if some rank's gradients hold inf/NaN,
        every rank's do (a NaN in the first element of the first), so every rank's GradScaler, or
        ``step()``, skips alike (one read-only pass, each tensor's norm, and one all-gather of a
        flag). Then each ``p.grad`` as backward left it is noted (what :meth:`_touched` compares)."""
        self._in_backward = False
        self._passes += 1
        if self._passes < self.accumulation_steps or self.finished:
            return
        self.finished = True
        if not self._ranks_checked:
            self._check_ranks(ENTRY_BACKWARD)
        client, launched = self._client(), self._next
        full = client.full_precision(self.global_step + 1)
        if not full and not self.launch_ahead:  # (p.grad keeps the local gradient; synchronize() exchanges it)
            grads = list(map(_grad, self._params))
            norms = _largest_magnitudes(grads)
            mine = norms is not None and not bool(norms.isfinite().all())
            if self.agreement.any_rank(mine, self.global_step + 1, self.device) and not mine and norms is not None:
                first = next(g for g in grads if g is not None and g.numel())
                first[(0,) * first.dim()] = float("nan")
                norms = _largest_magnitudes(grads)
            self._backward_norms = norms
        else:
            if self.exchange.chosen is None or self.exchange.saved_key is not None:
                self._choose_exchange()  # (collective) before the first average: it is the exchange's way
            # every rank waits for its thread, then communicates the rest in order on this thread: the
            # collectives pair up whichever buckets each rank could launch early
            self.wait()
            if full:
                self._run_inline(launched, gather=True)
                for b in self._buckets:
                    client.observe_average(b, b.sync.padded[: b.numel], False)
                    b.scatter_grads(b.sync.padded[: b.numel])
            else:
                for b in self._buckets[launched:]:  # a compression step launched ahead (the loop leaves p.grad alone)
                    self._gather(b)
                    if not bool(b.sync.checked.sum().isfinite()):
                        b.sync.padded.zero_()
                        self._launched_nonfinite = True
                self._run_inline(launched, gather=False)
        left = self._left
        for p in self._params:
            g = p.grad
            if g is not None:
                left[id(p)] = (g, g._version)

    def enter_backward(self) -> None:
        """Called by a DDP hook at the first bucket of a backward (the engine's hooks call it
        themselves): the step's entry agreement (collective), so that a rank calling ``step()``
        without a backward raises on every rank instead of waiting in a collective the others
        never join."""
        self.ensure_buckets()
        if self._ranks_checked:
            self._entered = True
            if self._layout_agreed:
                self.agreement.entry(self._layout_hash, ENTRY_BACKWARD, self.global_step + 1, self.device)
        else:
            self._entered = True
            self._check_ranks(ENTRY_BACKWARD)

    def full_precision_next(self) -> bool:
        """Whether the next step averages its gradients at full precision."""
        return self._client().full_precision(self.global_step + 1)

    def any_rank_nonfinite(self, mine: bool) -> bool:
        """Whether some rank's gradients hold inf/NaN (collective; a DDP hook asks it at the last
        bucket of a compression step and marks its bucket: :mod:`compressed_opt.ddp`)."""
        return self.agreement.any_rank(mine, self.global_step + 1, self.device)

    def attach_averager(self, averager) -> None:
        """From now on ``averager`` averages the warmup gradients into ``p.grad`` during backward
        (DDP's reducer through the hook of :mod:`compressed_opt.ddp`, which owns its own state;
        FSDP2's own HSDP, :mod:`compressed_opt.fsdp_replicas`): the engine launches no averaging of
        its own, and broadcasts rank 0's parameters only where the averager did not make them
        equal (its ``equal_start``, ``True`` where it has none). The compression stage's exchange
        stays the engine's; an averager with ``next_step(full_precision)`` is told before each
        backward which kind it is."""
        self.averager = averager
        self.enabled = False
        self.prepare_backward()

    def prepare_backward(self) -> None:
        """Tell the averager what the next backward is (a full-precision step's, whose averaging is
        its own, or a compression step's): at the end of each step, after a load, and when it is
        attached."""
        tell = getattr(self.averager, "next_step", None)  # (an averager that sets nothing ahead has none)
        if tell is not None:
            tell(self.full_precision_next())

    # --- the ranks agree ----------------------------------------------------------------------------------
    def _check_ranks(self, entry: int) -> None:
        """Once (again after the parameters changed): every rank has the same parameters, buckets
        and hyperparameters and entered the step alike; rank 0's parameters on every rank."""
        with self.traffic.setup():  # (once: not a step's traffic)
            for b in self._buckets:
                for p in b.params:
                    if p.grad is not None and p.grad.layout != torch.strided:
                        raise TypeError(f"{self.name} does not support sparse gradients")
            signature = agreement.signature(self._buckets, self.param_groups,
                                            (self._client().signature(), self.hierarchy, self.path,
                                             self.scale_block), self.bucket_cap_bytes)
            self.agreement.signatures(signature, entry, self.global_step + 1, self.device)
            self._layout_agreed = True
            equal = self.averager is not None and getattr(self.averager, "equal_start", True)  # (else broadcast)
            if self.global_step == 0 and not self._broadcast_done and not equal:
                # before the first update, once the shapes are known to agree
                self.agreement.broadcast_parameters(p for g in self.param_groups for p in g["params"])
                self._broadcast_done = True
            if self.averager is None and self.backend.world_size > 1 and self.global_step == 0:
                logger.info("%s: %d ranks (%s); no DistributedDataParallel wrapper found, so the optimizer "
                            "averages the gradients itself", self.name, self.backend.world_size,
                            type(self.backend).__name__)
            self._ranks_checked = True

    def _choose_exchange(self) -> None:
        with self.traffic.setup():  # (once: not a step's traffic)
            self.exchange.choose(self._buckets or [], self.device)

    # --- gathering and exchanging ------------------------------------------------------------------------
    def _gather(self, bucket: Bucket) -> None:
        """The bucket's gradients of this step, as the loop left them (unscaled), with their
        per-layer float64 sums of squares (the finiteness check, the client's statistics): copied
        into the bucket's flat buffer in the same pass, or, where the client reads them where they
        lie (its ``reads_in_place``: a compression step whose exchange runs next on this thread, or
        a client that forms its buffer from them at once), only summed. In a compression step the
        client's request is made here (``outgoing``), while the gradients are as the sums saw them."""
        sync, step, client = bucket.sync, self.global_step + 1, self._client()
        full = client.full_precision(step)
        grads = list(map(_grad, bucket.params))
        sync.request = None
        if not full:
            native = bucket.kernels.sources(grads, bucket.segments.sizes)
            if client.reads_in_place(bucket, step, self._inline, native is not None):
                sources = grads if native is None else native
                sync.checked = bucket.kernels.sumsq_each(sources, bucket.segments, sync.local)
                sync.local_step = step
                sync.request = client.outgoing(bucket, Gradients(sync.padded[: bucket.numel], sources, False,
                                                                 self._inline), step)
                return
        if self._regathering or (full and self.averager is not None):
            if sync.averaged is None:  # (an average, not this rank's own gradients)
                sync.averaged = torch.empty_like(sync.local)
            bucket.kernels.gather_(grads, sync.padded, bucket.segments, None, sync.averaged)
            sync.checked = sync.averaged
            return
        bucket.kernels.gather_(grads, sync.padded, bucket.segments, None, sync.local)
        sync.checked, sync.local_step = sync.local, step
        if not full:
            sync.request = client.outgoing(bucket, Gradients(sync.padded[: bucket.numel], sync.views, True,
                                                             self._inline), step)

    def _exchange_group(self, buckets: list[Bucket]) -> None:
        """The communication of an exchange group for this step (any thread): the full-precision
        averages of the gathered buffers one by one, or the client's requests (made when the
        gradients were gathered), coalesced; a request's result rows, where its client keeps them,
        copied into the bucket's own (out of the exchange's reused buffers)."""
        if self._client().full_precision(self.global_step + 1):
            if self.averager is None:  # (else the averager averaged them)
                for b in buckets:
                    self._average(b)
            return
        owners, requests = [], []
        for b in buckets:
            if b.sync.request is not None:
                owners.append(b)
                requests.append(b.sync.request)
        for b, request, rows in zip(owners, requests, self.exchange.run(requests)):
            sync = b.sync
            sync.result = None
            if not request.keep_rows or rows is None:
                continue
            if sync.rows is None or sync.rows.shape != rows.shape or sync.rows.device != rows.device:
                sync.rows = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
            sync.rows.copy_(rows)
            result, x = sync.compressed, request.x
            if (result is None or result.rows is not sync.rows or result.buffer.data_ptr() != x.data_ptr()
                    or result.buffer.numel() != x.numel()):  # (else the one of the steps before: the same)
                result = sync.compressed = kernels.CompressedResult(sync.rows, chunk_numel(b.numel, rows.shape[0]),
                                                                    self.scale_block, x)
            sync.result = result

    def _average(self, bucket: Bucket) -> None:
        """The full-precision average of the bucket's gradients, in place (collective): an
        all-reduce, or (ZeRO stage 2) a reduce-scatter then an all-gather of the averaged chunks, so
        that ``p.grad`` can hold the whole average after backward without one rank's chunk being
        summed differently on another."""
        padded = bucket.sync.padded
        if not self.shard_gradients:
            if self.sharded:
                self.backend.all_reduce(padded[: bucket.numel], op="avg")
            else:
                self.exchange.average(padded[: bucket.numel])
            return
        sync, world = bucket.sync, self.backend.world_size
        if sync.shard is None:
            sync.shard = bucket.zeros(chunk_numel(bucket.numel, world))
        self.backend.reduce_scatter(sync.shard, padded, op="avg")
        self.backend.all_gather(padded, sync.shard)

    def _run_inline(self, start: int, gather: bool) -> None:
        """Communicate the buckets from ``start`` on now, on the calling thread, in bucket order,
        each exchange group's together (``gather``: gathered first)."""
        with observe.span("wait", "run_inline") if observe.OBSERVERS else _NO_SPAN:
            for group in self._groups:
                if group[0].index < start:
                    if group[-1].index < start:
                        continue
                    group = group[start - group[0].index:]  # (a group the backward launched in part)
                if gather:
                    for b in group:
                        self._gather(b)
                self._exchange_group(group)

    def wait(self, late_ok: bool = False) -> None:
        """Wait for the buckets backward launched, in order. Re-raises the first error of the
        communication thread (after all of them ended); raises if gradients arrived after their
        bucket left."""
        errors = []
        with observe.span("wait", "wait") if observe.OBSERVERS else _NO_SPAN:  # (blocks until it is done)
            for fut in self._futures:
                if fut is not None and fut.exception() is not None:
                    errors.append(fut.exception())
        if errors:
            self._futures = [None] * len(self._futures)
            raise errors[0]
        if self._late and not late_ok:
            raise GradientsAccumulatedWithoutNoSync(
                "gradients arrived after their bucket had been communicated: several backward "
                "passes ran before step(). For gradient accumulation wrap all but the last in "
                "`with optimizer.no_sync():`, or pass accumulation_steps=N to the optimizer."
            )

    def _touched(self) -> bool:
        """Whether the loop changed some ``p.grad`` since backward left it (in place, replaced,
        set or removed). Only meaningful when :attr:`finished`."""
        left = self._left
        for b in self._buckets:
            for p in b.params:
                g = p.grad
                seen = left.get(id(p))
                if seen is None:
                    if g is not None:
                        return True
                elif g is not seen[0] or g._version != seen[1]:
                    return True
        return False

    @property
    def idle(self) -> bool:
        """Between steps: no backward of the coming step has reached the hooks yet."""
        return not (self.finished or self._passes or self._in_backward or self._next or any(self._fired))

    # --- a step -------------------------------------------------------------------------------------------
    def synchronize(self) -> bool:
        """Finish this step's communication on every rank alike: wait for what backward launched,
        gather the gradients as the loop left them, agree with the other ranks (one all-gather:
        skip, stage, hyperparameters, the client's statistics), and communicate what backward did
        not (a full-precision average, or the client's requests). Returns whether the step goes
        ahead (``False``: some rank's gradients held inf/NaN, and every rank skips). Once per step:
        a second call returns the first's answer (``step()`` inside :meth:`skip_synchronize`
        requires that it ran)."""
        if self._synchronized:
            return self._took
        if self._skip_sync:
            raise RuntimeError(f"{self.name}.step() inside engine.skip_synchronize() without "
                               "engine.synchronize() before it: synchronize first, then step")
        self.wait()  # nothing of ours may be in flight while this thread communicates
        if not self._entered:  # no backward of this step reached our hooks on this rank
            self.ensure_buckets()
            self._entered = True
            if self._layout_agreed:
                self.agreement.entry(self._layout_hash, ENTRY_STEP, self.global_step + 1, self.device)
        if not self._ranks_checked:
            self._check_ranks(ENTRY_STEP)
        if self.exchange.chosen is None or self.exchange.saved_key is not None:
            self._choose_exchange()
        client, buckets, step = self._client(), self._buckets, self.global_step + 1
        full = client.full_precision(step)
        finished = self.finished
        averaged_in_backward = full and finished
        # a compression step whose exchanges all ran from backward (see _end_of_backward)
        speculated = not full and finished and self.launch_ahead
        touched = finished and self._touched()
        done = len(buckets) if speculated else 0
        if not full and finished and not speculated and not touched and self._backward_norms is not None:
            # (a GradScaler's unscale_ changes p.grad in place without bumping its version)
            now = _largest_magnitudes(list(map(_grad, self._params)))
            touched = now is None or not torch.equal(now, self._backward_norms)
        # this step's gradients into the flat buffers, before anything changes state (backward's
        # averages as the loop left them in p.grad: a GradScaler unscales in place, unseen)
        self._regathering, self._inline = averaged_in_backward, not full
        try:
            for b in buckets[done:]:
                self._gather(b)
        finally:
            self._regathering = self._inline = False
        # (float64 sums of fp32 squares are finite exactly when every element is: no extra pass)
        sums = list(map(_checked, buckets[done:]))
        nonfinite = self._launched_nonfinite or (bool(sums) and not bool(torch.cat(sums).sum().isfinite()))
        hyperparameters = hyperparameter_hash(self.param_groups)
        verdict = self.agreement.step(step, client.stage, hyperparameters, touched and not full, nonfinite,
                                      client.statistics(step, buckets), self.device)
        self.statistics = verdict.statistics
        nonfinite = verdict.nonfinite
        if self.local_shards.pairs:  # the replicas agreed; a model split over other groups agrees over them too
            nonfinite = self._shards_agree(step, client.stage, hyperparameters, nonfinite)
        self._synchronized, self._took = True, not nonfinite
        if nonfinite:  # every rank skips, state untouched
            self.nonfinite_steps += 1
            warnings.warn(
                f"{self.name}: a non-finite gradient (inf or NaN) on some rank at step {step}; every "
                f"rank skipped the step (optimizer.engine.nonfinite_steps = {self.nonfinite_steps})",
                RuntimeWarning, stacklevel=3,
            )
            return False
        if speculated and verdict.touched:
            raise GradientsChangedAfterLaunch(
                f"{self.name}: the training loop changed p.grad between backward() and step() "
                "after the 1-bit exchange had been launched from backward (earlier steps left p.grad "
                "alone). Touch the gradients in every step or in none, or pass overlap=False."
            )
        if finished and not full and not speculated:
            self._overlap = Overlap.WATCH if verdict.touched else Overlap.AHEAD  # agreed: the same on every rank
        if not averaged_in_backward:
            self._run_inline(done, gather=False)
            if full and self.averager is None:
                for b in buckets:  # averaged here, from the gradients as they were gathered
                    client.observe_average(b, b.sync.padded[: b.numel], True)
        return True

    def _shards_agree(self, step: int, stage: int, hyperparameters: int, nonfinite: bool) -> bool:
        """Over each group the layers are split over (FSDP's shard group, tensor parallelism's), what
        the replicas agreed on (the step, the stage, the hyperparameters; one header all-gather per
        group): every shard of the model takes the step, or skips it, alike. Returns whether some
        rank's gradients held inf/NaN."""
        if self._shard_agreements is None:
            self._shard_agreements = [RankAgreement(b, self.name) for b in self.local_shards.split_backends()]
        for shards in self._shard_agreements:
            verdict = shards.step(step, stage, hyperparameters, False, nonfinite, _NO_STATISTICS, self.device)
            nonfinite = verdict.nonfinite
        return nonfinite

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Inside, ``optimizer.step()`` does not synchronize again: for a loop that called
        :meth:`synchronize` itself (Horovod's pattern, e.g. to clip a full-precision step's
        averaged gradients in ``p.grad`` after it). A step inside that nothing synchronized
        raises."""
        self._skip_sync += 1
        try:
            yield
        finally:
            self._skip_sync -= 1

    def end_step(self, stage: str, took: bool) -> int:
        """After ``step()``'s update (or its skip): the step counted, its bytes booked to ``stage``,
        and everything it kept let go. Returns the step's bytes."""
        if took:
            self.global_step += 1
            if self._watched:  # (a DDP wrapper is found at its first forward, before the first step)
                ddp.forget(self)
                self._watched = False
        self._entered = self._synchronized = False
        self._backward_norms = None
        self._reset_launch()
        for b in self._buckets or ():  # (taken, skipped or failed: none of its gradients stay referenced)
            sync = b.sync  # (its STEP fields; the client drops its own in its end of the step)
            sync.request = sync.result = sync.checked = None
        self.prepare_backward()
        return self.traffic.end_step(stage)

    def zero_grad(self, unseen_backward: bool = False) -> None:
        """``zero_grad``'s part: what backward launched has landed; the gradients of this step start
        again (the next backward communicates them anew, as under DDP). ``unseen_backward``: a
        backward that no hook of ours saw gave gradients since the last step (FSDP assigns them
        itself: :meth:`compressed_opt.local_shards.LocalShards.backward_since_step`)."""
        self.wait(late_ok=True)
        if (self.finished or unseen_backward) and not self._synchronized:
            # this rank ran the step's backward and no step(): where the others did not skip too,
            # they are in step() and every rank raises here (agreement.RankAgreement.skipped); before
            # the first step's agreement (the others are in it), in that agreement
            if self._ranks_checked:
                self.agreement.skipped(self.global_step + 1, self.device)
            elif unseen_backward:
                self.ensure_buckets()
                self._check_ranks(ENTRY_SKIPPED)
        if self._next and not self.full_precision_next() and self._overlap is Overlap.AHEAD:
            self._overlap = Overlap.WATCH  # a 1-bit exchange went out for gradients the loop threw away
        self._reset_launch()
        self._entered = self._synchronized = False
        self._backward_norms = None

    def watch_again(self) -> None:
        """After a load or in a copy: the first compression step watches the loop again before
        exchanging from backward, and the ranks are checked again."""
        if self._overlap is Overlap.AHEAD:
            self._overlap = Overlap.WATCH
        self._ranks_checked = False

    # --- exchanges for other clients ------------------------------------------------------------------------
    def run(self, requests: list[Request]) -> list:
        """Run ``requests`` (collective: every rank the same ones, in the same order) through the
        exchange: the same paths, error feedback and byte counting as the buckets' (the exchange is
        chosen first where it was not). Returns per request its result rows or ``None``
        (:meth:`compressed_opt.exchange.Exchange.run`)."""
        if self.exchange.chosen is None or self.exchange.saved_key is not None:
            self._choose_exchange()
        return self.exchange.run(requests)

    # --- closing ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop communicating: wait for what is in flight, remove the gradient hooks and the
        communication thread. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for fut in self._futures:
            if fut is not None:
                with contextlib.suppress(Exception):
                    fut.result()
        self.enabled = False
        executor = self._pool.get("executor")
        self._finalizer()
        if executor is not None:
            executor.shutdown(wait=True)
        self._hooked.clear()
        ddp.forget(self)


def _largest_magnitudes(grads: list) -> torch.Tensor | None:
    """Each non-empty tensor's L2 norm as one fp32 tensor (inf/NaN where it holds one); ``None``
    for none. fp32 and narrower gradients are accumulated in fp32, float64 ones in float64 and
    then narrowed. One read-only pass. A norm that overflowed from finite elements is made finite
    again (an exact check of that tensor, on that rare path)."""
    present, wide = [], False
    for g in grads:
        if g is not None and g.numel():
            present.append(g)
            wide = wide or g.dtype == torch.float64
    if not present:
        return None
    if not wide:
        norms = torch.stack(torch._foreach_norm(present, 2, dtype=torch.float32))
    else:
        norms = torch.stack([torch.linalg.vector_norm(g, 2, dtype=None if g.dtype == torch.float64
                                                      else torch.float32).float() for g in present])
    if not bool(norms.isfinite().all()):
        for i in (~norms.isfinite()).nonzero().view(-1).tolist():
            if bool(present[i].isfinite().all()):
                norms[i] = torch.finfo(torch.float32).max
    return norms
