"""The life cycle of a step: from backward's hooks and from ``step()`` to the update, on every rank alike.

A step has two entry points, and this module is their whole path (docs/design.md 3.5 has the
sequence):

* **backward** (the gradient hooks of :class:`compressed_opt.overlap.BucketLauncher`):
  :meth:`Stepping._backward_started` at its first gradient (the entry agreement, the launch
  policy), :meth:`Stepping._gather_ahead` and :meth:`Stepping._exchange_group` for each bucket (an
  exchange group) whose gradients are complete, :meth:`Stepping._backward_finished` at its end (in
  a full-precision step, every average written into ``p.grad``, as DDP leaves it);
* **step()**: :meth:`Stepping.step` waits for what backward launched, gathers this step's
  gradients as the loop left them, agrees with the other ranks (one all-gather: skip, stage,
  hyperparameters, statistics), communicates what backward did not, and updates every bucket
  (the algorithm's ``_bucket_step``).

Whether a compression step's exchange may start during backward is the :class:`Overlap` state:
the exchange changes state (momentum, error feedback), so it runs from backward only while every
rank's loop leaves ``p.grad`` alone between backward and ``step()`` (a GradScaler's unscaling and
clipping touch it).

A non-finite gradient on one rank in a compression step (each rank keeps its own gradient there)
becomes a non-finite gradient on every rank at the end of backward, as an all-reduce would carry
it in a full-precision step: so whatever decides on ``p.grad`` between backward and ``step()``
decides alike on every rank (a GradScaler skips ``step()`` and backs off its scale on every rank;
without one, ``step()`` skips on every rank).

:class:`Stepping` is a part of :class:`compressed_opt.optimizer.CompressedOptimizer` (a mixin):
it owns the attributes named in :meth:`Stepping._init_stepping` and reaches the algorithm only
through the hooks the optimizer declares (``_needs_average``, ``_bucket_communicate``,
``_bucket_step``, ``_end_step``, ...).
"""
from __future__ import annotations

import enum
import logging
import warnings
import weakref

import torch

from compressed_opt import cuda as kernels

from . import ddp, traffic
from .agreement import ENTRY_BACKWARD, ENTRY_STEP, hyperparameter_hash
from .buckets import Bucket
from .overlap import BucketLauncher, GradientsChangedAfterLaunch

logger = logging.getLogger("compressed_opt")


class Overlap(enum.Enum):
    """Where a compression step's exchange runs (full-precision steps: from backward, with ``overlap``)."""

    #: in ``step()``, and the ranks check whether their loops touched ``p.grad`` after backward
    WATCH = "watch"
    #: launched from backward: the ranks agreed at the last compression step that no loop touched ``p.grad``
    AHEAD = "ahead"


class LauncherCallbacks:
    """What the launcher calls (:class:`compressed_opt.overlap.BucketLauncher`), bound weakly to the
    optimizer: a discarded optimizer's hooks do nothing."""

    __slots__ = ("_ref",)

    def __init__(self, optimizer):
        self._ref = weakref.ref(optimizer)

    def prepare(self) -> None:
        opt = self._ref()
        if opt is not None:
            opt._backward_started()

    def gather(self, bucket: Bucket) -> None:
        opt = self._ref()
        if opt is not None:
            opt._gather_bucket(bucket)

    def gather_ahead(self, bucket: Bucket) -> bool:
        opt = self._ref()
        return True if opt is None else opt._gather_ahead(bucket)

    def exchange_group(self, buckets: list[Bucket]) -> None:
        opt = self._ref()
        if opt is not None:
            opt._exchange_group(buckets)

    def finish_backward(self, launched: int) -> None:
        opt = self._ref()
        if opt is not None:
            opt._backward_finished(launched)


class Stepping:
    """The step of a :class:`~compressed_opt.optimizer.CompressedOptimizer` (see the module docstring)."""

    def _init_stepping(self) -> None:
        #: the gradient hooks and the communication thread
        self._launcher = self._new_launcher()
        #: where compression steps exchange (:class:`Overlap`)
        self._overlap = Overlap.WATCH
        self._entered = False  # this step's first collective (the entry agreement) happened on this rank
        self._ranks_checked = False  # the first step's signature agreement ran (again after a change)
        self._layout_agreed = False  # the ranks checked a layout once: agree on it every step after
        self._broadcast_done = False
        self._regathering = False  # step() gathers the averages backward wrote into p.grad
        #: step() gathers a compression step's buckets, whose exchanges it runs next, on this thread
        self._gathering_for_inline = False
        #: a compression step's gradients' norms at the end of backward (step() sees whether the
        #: loop changed them: a GradScaler unscales in place without a version bump)
        self._backward_norms: torch.Tensor | None = None

    def _new_launcher(self) -> BucketLauncher:
        return BucketLauncher(LauncherCallbacks(self), self.accumulation_steps)

    # --- from backward ------------------------------------------------------------------------------
    def _backward_started(self) -> None:
        """At the first gradient of a step's backward: the buckets, the entry agreement, and whether
        buckets may be communicated during backward (full-precision steps: with ``overlap``;
        compression steps: in the ``AHEAD`` state)."""
        self._ensure_buckets()
        self._agree_on_entry(ENTRY_BACKWARD)
        full = self._needs_average(self.global_step + 1)
        ahead = full or self._overlap is Overlap.AHEAD
        self._launcher.launch_ahead = self.overlap and self._ranks_checked and ahead

    def _gather_bucket(self, bucket: Bucket) -> None:
        """The bucket's gradients into its flat buffer (the thread that runs backward or step())."""
        self._gather(bucket, self._grad_buffer(bucket), self.global_step + 1)

    def _gather_ahead(self, bucket: Bucket) -> bool:
        """:meth:`_gather_bucket` for a bucket launched from backward; in a compression step, whether
        its gradients are finite (if not, the buffer goes out as zeros: the 1-bit exchange would
        carry inf/NaN into every rank's error buffers, and step() skips the step on every rank)."""
        self._gather_bucket(bucket)
        if self._needs_average(self.global_step + 1):
            return True  # the average is checked in step(), the same on every rank
        if self._gathered_finite([bucket]):
            return True
        self._grad_buffer(bucket).zero_()
        return False

    def _exchange_group(self, buckets: list[Bucket]) -> None:
        """The communication of consecutive buckets (an exchange group) for this step, on their
        gathered buffers (any thread): the full-precision averages one by one, or the algorithm's
        exchanges (:meth:`_bucket_communicate`) with their collectives coalesced."""
        step = self.global_step + 1
        if self._needs_average(step):
            if self._averager is None:  # (else the averager averaged them)
                for bucket in buckets:
                    self.layout.average(self, bucket, self._grad_buffer(bucket))
            return
        self.exchanges.run([self._bucket_communicate(b, self.param_groups[b.group_index], self._grad_buffer(b), step)
                            for b in buckets])

    def _backward_finished(self, launched: int) -> None:
        """At the end of the backward that completes the step's gradients: in a full-precision
        step, every bucket averaged (waiting for what is in flight, then the rest in order) and
        the averages written into ``p.grad``, as DDP leaves them; in a compression step launched
        ahead, the rest of its exchanges."""
        if not self._ranks_checked:
            self._check_ranks(ENTRY_BACKWARD)
        launcher = self._launcher
        full = self._needs_average(self.global_step + 1)
        if not full and not launcher.launch_ahead:
            self._share_nonfinite([p.grad for b in self._buckets for p in b.params])
            return  # p.grad keeps the local gradient; step() exchanges it
        if self.exchanges.needs_choice:
            self._choose_exchange()  # (collective) before the first average: it is the exchange's way
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
            if not self._gather_ahead(b):
                launcher.nonfinite = True
        for members in launcher.groups_of(b.index for b in rest):
            self._exchange_group([self._buckets[i] for i in members])

    def enter_backward(self) -> None:
        """Called by a DDP hook at the first bucket of a backward (the standalone hooks call
        :meth:`_backward_started`): the step's entry agreement (collective), so that a rank calling
        ``step()`` without a backward raises on every rank instead of waiting in a collective the
        others never join."""
        self._ensure_buckets()
        if self._ranks_checked:
            self._agree_on_entry(ENTRY_BACKWARD)
        else:
            self._entered = True
            self._check_ranks(ENTRY_BACKWARD)

    def _share_nonfinite(self, grads: list) -> None:
        """A compression step's gradients at the end of backward (not launched ahead: no bucket
        was checked yet): if some rank's hold inf/NaN, every rank's do (a NaN in the first
        element of the first), so every rank's GradScaler, or ``step()``, skips alike. One
        read-only pass (each tensor's norm) and one all-gather of a flag."""
        norms = _largest_magnitudes(grads)
        mine = norms is not None and not bool(norms.isfinite().all())
        if self.any_rank_nonfinite(mine) and not mine and norms is not None:
            first = next(g for g in grads if g is not None and g.numel())
            first[(0,) * first.dim()] = float("nan")
            norms = _largest_magnitudes(grads)
        self._backward_norms = norms

    def any_rank_nonfinite(self, mine: bool) -> bool:
        """Whether some rank's gradients hold inf/NaN (collective; a DDP hook asks it at the last
        bucket of a compression step and marks its bucket: :mod:`compressed_opt.ddp`)."""
        return self._agreement.any_rank(mine, self.comm_device)

    # --- the ranks agree ------------------------------------------------------------------------------
    def _agree_on_entry(self, entry: int) -> None:
        """A step's first collective (:meth:`compressed_opt.agreement.RankAgreement.entry`), once
        the ranks were checked (the first step's signature agreement carries the entry instead)."""
        self._entered = True
        if self._layout_agreed:
            self._agreement.entry(self._layout_hash, entry, self.global_step + 1, self.comm_device)

    def _check_ranks(self, entry: int) -> None:
        """Once (again after the parameters changed): every rank has the same parameters, buckets
        and hyperparameters and entered the step alike; rank 0's parameters on every rank."""
        with self._traffic.setup():  # (once: not a step's traffic)
            for b in self._buckets:
                for p in b.params:
                    if p.grad is not None and p.grad.layout != torch.strided:
                        raise TypeError(f"{type(self).__name__} does not support sparse gradients")
            self._agreement.signatures(self._signature(), entry, self.global_step + 1, self.comm_device)
            self._layout_agreed = True
            if self.global_step == 0 and not self._broadcast_done and self._averager is None:  # (else it did)
                # before the first update, once the shapes are known to agree
                self._agreement.broadcast_parameters(p for g in self.param_groups for p in g["params"])
                self._broadcast_done = True
            if self._averager is None and self.backend.world_size > 1 and self.global_step == 0:
                logger.info("%s: %d ranks (%s); no DistributedDataParallel wrapper found, so the optimizer "
                            "averages the gradients itself", type(self).__name__, self.backend.world_size,
                            type(self.backend).__name__)
            self._ranks_checked = True

    def _choose_exchange(self) -> None:
        with self._traffic.setup():  # (once: not a step's traffic)
            self.exchanges.choose(self._buckets or [], self.comm_device)

    # --- step() ----------------------------------------------------------------------------------------
    # Always eager, also when called from code torch.compile traces (torch's own optimizers do
    # the same for what dynamo cannot trace): traced, the counters' Python attribute writes were
    # dropped (OnebitAdam's global_step stayed 0: no freeze, step-1 bias correction forever), and
    # the collectives, threads and C kernels cannot be traced. torch._disable_dynamo imports
    # dynamo at the first call, not at import.
    @torch._disable_dynamo
    @torch.no_grad()
    def step(self, closure=None):
        """One step on every rank alike: the gradients as the loop left them, averaged at full
        precision (warmup) or exchanged 1-bit (compression stage), then the update. Returns the
        closure's loss, if a closure was given."""
        if self._closed:
            raise RuntimeError(f"this {type(self).__name__} was closed; make a new optimizer to keep training")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._before_step()
        stage = traffic.COMPRESSION if self.compressing else traffic.WARMUP  # (of this step: before it ends)
        took = False
        try:
            took = self._step()
        finally:
            self._entered = False
            self._backward_norms = None
            self._launcher.reset()
            self._traffic.end_step(stage)
            for b in self._buckets or ():  # (taken, skipped or failed: none of its gradients stay referenced)
                b.forget_step()
        if took:
            self._announce(stage)
        return loss

    def _step(self) -> bool:
        """:meth:`step`'s communication and update; whether the step was taken (not skipped)."""
        launcher = self._launcher
        launcher.wait()  # nothing of ours may be in flight while this thread communicates
        if not self._entered:  # no backward of this step reached our hooks on this rank
            self._ensure_buckets()
            self._agree_on_entry(ENTRY_STEP)
        if not self._ranks_checked:
            self._check_ranks(ENTRY_STEP)
        if self.exchanges.needs_choice:
            self._choose_exchange()
        step = self.global_step + 1
        full = self._needs_average(step)
        averaged_in_backward = full and launcher.finished
        # a compression step whose exchanges all ran from backward (see _backward_finished)
        speculated = not full and launcher.finished and launcher.launch_ahead
        touched = launcher.finished and launcher.touched()
        # this step's gradients into the flat buffers, before anything changes state
        done = len(self._buckets) if speculated else 0
        if not full and launcher.finished and not speculated and not touched and self._backward_norms is not None:
            # (a GradScaler's unscale_ changes p.grad in place without bumping its version)
            now = _largest_magnitudes([p.grad for b in self._buckets for p in b.params])
            touched = now is None or not torch.equal(now, self._backward_norms)
        if averaged_in_backward:
            # backward averaged the gradients into p.grad: use them as the loop left them (a
            # GradScaler unscales them in place, unseen by their version counters: always gathered)
            self._regathering = True
            try:
                for b in self._buckets:
                    self._gather_bucket(b)
            finally:
                self._regathering = False
            checked = self._buckets
        else:
            checked = self._buckets[done:]
            self._gathering_for_inline = not full
            try:
                for b in checked:
                    self._gather_bucket(b)
            finally:
                self._gathering_for_inline = False
        nonfinite = launcher.nonfinite or not self._gathered_finite(checked)
        verdict = self._agreement.step(step, self._stage_code(), hyperparameter_hash(self.param_groups),
                                       touched and not full, nonfinite, self._step_statistics(step), self.comm_device)
        self._rank_statistics = verdict.statistics
        if verdict.nonfinite:  # every rank skips, state untouched
            self.nonfinite_steps += 1
            warnings.warn(
                f"{type(self).__name__}: a non-finite gradient (inf or NaN) on some rank at step {step}; every "
                f"rank skipped the step (optimizer.nonfinite_steps = {self.nonfinite_steps})",
                RuntimeWarning, stacklevel=3,
            )
            return False
        if speculated and verdict.touched:
            raise GradientsChangedAfterLaunch(
                f"{type(self).__name__}: the training loop changed p.grad between backward() and step() "
                "after the 1-bit exchange had been launched from backward (earlier steps left p.grad "
                "alone). Touch the gradients in every step or in none, or pass overlap=False."
            )
        if launcher.finished and not full and not speculated:
            self._overlap = Overlap.WATCH if verdict.touched else Overlap.AHEAD  # agreed: the same on every rank
        if not averaged_in_backward:
            launcher.run_inline(range(done, len(self._buckets)), gather=False)
            if full and self._averager is None:
                for b in self._buckets:  # averaged here, from the gradients as they were gathered
                    self.observe_mean_square_sums(b, self._grad_buffer(b), stepped=True)
        self._before_update(step, full)
        for b in self._buckets:
            self._bucket_step(b, self.param_groups[b.group_index], self._grad_buffer(b), step, full)
        self.global_step = step
        self._end_step(step)
        ddp.forget(self)  # a DDP wrapper is found at its first forward, before the first step
        return True

    def leave_gradients_in_place(self, bucket: Bucket, grad) -> bool:
        """A compression step's gather that leaves the bucket's gradients in ``p.grad`` for the
        exchange's passes to read there (the gather's copy, two streams of the bucket's bytes, is
        not made), where it may: ``step()`` gathers the bucket and runs its exchange next, on this
        thread (no loop code and no other thread between: the gradients read are the ones summed
        and checked), the algorithm's passes read them (:meth:`_reads_gradients_in_place`) and the
        kernels can. Then only their sums are taken (``observe_in_place``), they are kept as
        ``bucket.derived["step.gradients_in_place"]`` (:class:`compressed_opt.cuda.Sources`, for this
        step's passes to take), and ``True``; else nothing is done, ``False`` (the caller gathers)."""
        bucket.derived.pop("step.gradients_in_place", None)
        if not (self._gathering_for_inline and self._reads_gradients_in_place(self.global_step + 1)):
            return False
        sources = kernels.Sources.of([p.grad for p in bucket.params], bucket.segments.sizes)
        if sources is None:
            return False
        self.observe_in_place(bucket, grad, sources)
        bucket.derived["step.gradients_in_place"] = sources
        return True

    def _reads_gradients_in_place(self, step: int) -> bool:
        """Whether compression step ``step``'s exchange starts with a pass that can read the
        gradients where they lie (the algorithm's: the preconditioned local momentum's)."""
        return False

    def _gathered_finite(self, buckets: list[Bucket]) -> bool:
        """Whether every element of the buckets' gathered gradients is finite (one reduction)."""
        buffers = [self._grad_buffer(b) for b in buckets]
        if not buffers:
            return True
        return bool(torch.stack([b.sum() for b in buffers]).sum().isfinite())

    def _gathers_local(self) -> bool:
        """Whether a gather now reads this rank's own gradients: not in a full-precision step
        whose average a DDP hook, or this optimizer's backward, wrote into ``p.grad`` already."""
        averaged = self._needs_average(self.global_step + 1)
        return not (averaged and (self._averager is not None or self._regathering))

    # --- between steps ----------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's, after what backward launched has landed; the gradients of this step start
        again (the next backward communicates them anew, as under DDP)."""
        launcher = self._launcher
        launcher.wait(late_ok=True)
        if launcher.launched and not self._needs_average(self.global_step + 1) and self._overlap is Overlap.AHEAD:
            self._overlap = Overlap.WATCH  # a 1-bit exchange went out for gradients the loop threw away
        launcher.reset()
        self._entered = False  # the next backward (or step()) starts the step again
        self._backward_norms = None
        super().zero_grad(set_to_none)
        self._local_shards.clear_grads(set_to_none)

    def no_sync(self):
        """Context manager: backward passes inside accumulate gradients without communicating
        (gradient accumulation, as ``DistributedDataParallel.no_sync``); the next backward
        outside communicates them all."""
        return self._launcher.suspended()

    def _watch_again(self) -> None:
        """After a load or in a copy: the first compression step watches the loop again before
        exchanging from backward, and the ranks are checked again."""
        if self._overlap is Overlap.AHEAD:
            self._overlap = Overlap.WATCH
        self._ranks_checked = False


def _largest_magnitudes(grads: list) -> torch.Tensor | None:
    """Each non-empty tensor's L2 norm as one fp32 tensor (inf/NaN where it holds one); ``None``
    for none. fp32 and narrower gradients are accumulated in fp32, float64 ones in float64 and
    then narrowed. One read-only pass (a third of a copy's time on a CPU core: the infinity norm
    there takes 4x a copy). A norm that overflowed from finite elements is made finite again (an
    exact check of that tensor, on that rare path)."""
    grads = [g for g in grads if g is not None and g.numel()]
    if not grads:
        return None
    if all(g.dtype != torch.float64 for g in grads):
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32))
    else:
        norms = torch.stack([
            torch.linalg.vector_norm(g, 2, dtype=None if g.dtype == torch.float64
                                     else torch.float32).float() for g in grads])
    bad = (~norms.isfinite()).nonzero().view(-1).tolist()
    for i in bad:
        if bool(grads[i].isfinite().all()):
            norms[i] = torch.finfo(torch.float32).max
    return norms
