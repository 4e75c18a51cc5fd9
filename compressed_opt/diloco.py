"""DiLoCo: a local-step outer optimizer around any inner torch optimizer, its pseudo-gradient
exchanged across the replicas at full precision, in bf16 or 1-bit with error feedback.

``R`` replicas (the ranks of ``backend``; inside each, DDP or FSDP2 may run on other groups as
usual) hold the same anchor ``A``. A round is ``H = sync_every`` inner steps of the inner optimizer
on each replica's own data, with no traffic across replicas, reaching ``theta_r``. Then, per
fragment of the parameters (docs/design.md 7):

* the pseudo-gradient ``d_r = A - theta_r`` (this rank's parameters; under FSDP2, its shard);
* the exchange ``D = mean_r C(d_r + beta e_r)``, ``e_r <- d_r + beta e_r - C(d_r + beta e_r)``:
  ``C`` the identity for ``"fp32"``, a bf16 rounding for ``"bf16"``, for ``"4bit"`` block-scaled
  4-bit codes in two stages with worker and server errors (:mod:`compressed_opt.comm.quantized`:
  8x fewer bytes than fp32 where 1-bit sends 32x fewer), and for ``"1bit"`` the block-scaled sign
  of the library's compressed allreduce in its two stages (the engine's exchange, as the 1-bit
  optimizers' momentum: :meth:`compressed_opt.engine.GradientSync.run`) applied to a rotation of
  the pseudo-gradient: ``D = R^T mean_r C(R d_r)`` (errors in the rotated coordinates), with
  ``R = H S`` on each whole run of :data:`ROTATION_BLOCK` elements of the fragment's flat buffer
  (``S`` a diagonal of random signs, the same on every replica, drawn from a fixed seed, ``H`` the
  orthonormal Walsh-Hadamard matrix; the tail past the last whole run is not rotated). Rotated,
  a block's coordinates are sums over 1024 elements, close to Gaussian whatever the layer, so the
  sign and its RMS scale lose less of them (DRIVE, Vargaftik et al. 2021: a rotation before a
  1-bit code); the same bits travel;
* ``beta = error_feedback``, the share of the last round's compression errors (worker and server:
  both are multiplied by ``beta`` before the exchange) carried into this one: 0.5 by default for
  ``"1bit"`` (the errors decayed: ``beta = 0`` drops them, ``D = R^T C_s(mean_r C(R d_r))``, ``C_s``
  the server's code), 1 for ``"4bit"``. With the outer momentum an error fed back is not
  taken back at once: the error ``eps`` of one round's ``D`` and its return ``-eps`` in the next
  move the anchor by
  ``lr eps (1 + mu)`` and then ``-lr eps (1 + mu (1 - mu))``, and the rest of ``eps`` leaves ``u``
  only at the rate ``mu`` per round; and the pseudo-gradients of a decaying inner lr shrink
  round by round, so that the fed-back errors of the early rounds outweigh the later rounds'
  ``d_r``. On the byte-level GPT of docs/benchmarks.md (4 replicas, ``mu = 0.9``) the 1-bit ``D``
  with full error feedback had a cosine of 0.3 with the exact mean by the eighth round and
  2.7-3x its norm; without it (and rotated), 0.76 and 0.9x. Halved each round (SparseLoCo, Sarfi
  et al. 2025, decays its error accumulator) they are within 1% of fp32 DiLoCo there too, and over
  24 rounds closer to it than dropped (docs/benchmarks.md);
* the outer step, Nesterov SGD: ``u <- mu u + D``; ``A <- A - lr (D + mu u)`` (``A <- A - lr u``
  without Nesterov), DiLoCo's defaults ``lr = 0.7``, ``mu = 0.9``;
* every replica sets ``theta <- A`` and runs the next round; the inner optimizer keeps its state.

*Warmup* (``warmup_steps = W``): the first ``W`` inner steps average the gradients over the
replicas before the inner step (the inner optimizer on the replicas' mean gradient, every replica
alike: data parallel training), then ``A <- theta`` and the rounds start, their schedule counted
from ``W``. DiLoCo (Douillard et al. 2023) ran its main experiments from a checkpoint trained
synchronously first; this is that start inside one run, as the 1-bit optimizers' full-precision
warmup before their compression stage.

*Streaming* (Douillard et al. 2025). ``fragments = K`` splits the parameters into ``K`` fragments
(parameter ``i`` in fragment ``i mod K``: strided over the layers) synchronised on staggered
schedules: fragment ``k`` at the inner steps ``t`` with ``t mod H = floor(k H / K)`` (``t > 0``),
so no step moves more than one fragment and the peak bytes drop ``K``-fold. ``delay = tau``
overlaps each fragment's exchange with the next ``tau`` inner steps: the pseudo-gradient is taken
at ``t``, exchanged on a thread while steps ``t + 1 .. t + tau`` run, and the outer step lands at the
end of step ``t + tau``, where the fragment's parameters become ``alpha theta + (1 - alpha) A``
(``alpha = mixing``; the local steps' progress is kept in part; the replicas then differ by
``alpha`` times their local progress). Without a delay the parameters are set to ``A``: equal on
every replica after each synchronisation. With a delay DiLoCo communicates on a duplicate of its
backend (:meth:`compressed_opt.comm.Backend.duplicate`, a process group or communicator of its own),
so that the loop's collectives on the same ranks (a logged loss, an evaluation) never interleave
with the exchange on its thread.

The anchor ``A``, the outer momentum ``u`` and (``"1bit"``) the error buffers are three
parameter-sized fp32 copies per rank (the shard's size under FSDP2); ``state_device="cpu"`` keeps
``A`` and ``u`` in host memory (copied to the parameters' device once per synchronisation).

Every rank must call :meth:`DiLoCo.step` the same number of times: each synchronisation starts
with one small all-gather (:meth:`compressed_opt.agreement.RankAgreement.round`) that raises on
every rank where the replicas are at different inner steps or fragments, or where their outer
hyperparameters or their inner optimizer's (lr, betas, eps, weight decay) differ, and so does
each warmup step
(:meth:`compressed_opt.agreement.RankAgreement.warmup`). A replica whose loop runs a backward and
then ``zero_grad()`` without ``step()`` says so there (a gradient that is another tensor than
the last ``step()`` left, or changed in place since): every replica raises at its next collective,
instead of one running its rounds a step behind the others until the last round, which it would
never reach. A ``torch.amp.GradScaler`` calls ``step()`` on every step (``_step_supports_amp_scaling``)
and leaves its verdict in ``found_inf``: a step with inf/NaN gradients on this rank is counted and
not taken, in a round by this replica alone (the others' steps are their own), in the warmup by
every replica together (the verdict travels in the warmup step's header); gradients the scaler has
not unscaled are unscaled here first (``grad_scale``).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from compressed_opt.comm import DEFAULT_BLOCK, TorchBackend, quantized, resolve_backend

from . import fsdp_replicas, rotation

from .agreement import RankAgreement, hyperparameter_hash, job_position
from .consolidate import gather_objects
from .engine import GradientSync
from .exchange import ErrorFeedback, Request
from .local_shards import LocalShards, backward_since, gradients_seen, is_dtensor, local_tensor as _local
from .torch_state_dict import RankRecord, record_in
from .validation import check_choice, check_scale_block

COMPRESSIONS = ("fp32", "bf16", "4bit", "1bit")
#: elements per rotation of the ``"1bit"`` exchange (a power of 2)
ROTATION_BLOCK = rotation.BLOCK
_ROTATION_SEED = 0x5EED_D1_0C0
#: the state-dict format of :meth:`DiLoCo.state_dict` (``"diloco"`` entry)
FORMAT = 1
#: the key, in the first parameter's state, of the rank's record (torch's state_dict API keeps
#: only ``state`` and ``param_groups``: :meth:`DiLoCo.state_dict`)
CARRIER = "compressed_opt"


@dataclass(eq=False)
class Fragment:
    """One fragment's outer state: the parameters (the rank's local tensors) and their flat fp32
    anchor ``A``, outer momentum ``u``, pseudo-gradient buffer, error feedback, and the exchange in
    flight (``pending``: its future, and the inner step it was launched after)."""

    index: int
    params: list
    offset: int  # the schedule: synchronised where t mod H == offset (t > 0)
    anchor: torch.Tensor
    momentum: torch.Tensor
    delta: torch.Tensor
    feedback: ErrorFeedback
    pending: Future | None = None
    launched_at: int = -1
    signs: torch.Tensor | None = None  # the "1bit" exchange's rotation signs, int8 (made at its first exchange)

    @property
    def numel(self) -> int:
        return self.delta.numel()


class DiLoCo(torch.optim.Optimizer):
    """DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025) around ``inner`` (see the module
    doc).

    Args:
        params: the parameters ``inner`` optimizes (all of them, and none other).
        inner: any torch optimizer on ``params`` (AdamW, fused or not, ...); its param groups and
            LR schedulers work as without DiLoCo.
        sync_every: ``H``, the inner steps per round.
        outer_lr, outer_momentum, nesterov: the outer Nesterov SGD (param group keys ``lr``,
            ``momentum``, ``nesterov``: a scheduler on this optimizer schedules the outer lr).
        compression: the pseudo-gradient's exchange, ``"fp32"``, ``"bf16"``, ``"4bit"`` or
            ``"1bit"`` (4-bit codes or signs, with block scales).
        error_feedback: ``beta`` in ``[0, 1]``, the share of the compression errors carried into
            the next exchange (``"4bit"``, ``"1bit"``); ``None``: 0.5 for ``"1bit"`` (each round's
            errors halved before they are fed back), 1 for ``"4bit"`` (full error feedback). With 0
            no error buffers are kept between the exchanges.
        fragments: ``K``, fragments synchronised on staggered schedules (at most ``sync_every``).
        delay: ``tau``, inner steps each exchange overlaps before its result lands (less than
            ``sync_every``).
        mixing: ``alpha``, the share of the local parameters kept where a delayed result lands.
        warmup_steps: ``W``, inner steps first taken as data parallel training does: each on the
            gradients averaged over the replicas (fp32, one all-reduce per fragment and step), so
            every replica takes the same step; the rounds start from the parameters at step ``W``
            (fragment ``k`` synchronised where ``(t - W) mod H`` is its offset). 0 (the default):
            DiLoCo from the first step.
        backend: the replicas' group: a ``compressed_opt.comm`` backend, one dimension of a
            ``DeviceMesh`` (e.g. ``mesh["replicate"]``), or ``None`` (every rank of the job).
        state_device: where ``A`` and ``u`` live (``None``: with the parameters; ``"cpu"``).
        bucket_cap_mb, scale_block: the 1-bit exchange's buckets and scale blocks.
    """

    #: ``GradScaler.step`` calls ``step()`` on every step, with ``found_inf`` and ``grad_scale`` set,
    #: so that a step it skips still counts and every replica's rounds keep their schedule
    _step_supports_amp_scaling = True

    def __init__(self, params, inner: torch.optim.Optimizer, sync_every: int = 30, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, nesterov: bool = True, compression: str = "1bit", fragments: int = 1,
                 delay: int = 0, backend=None, *, mixing: float = 0.5, error_feedback: float | None = None,
                 warmup_steps: int = 0, state_device=None, bucket_cap_mb: float = 25.0,
                 scale_block: int = DEFAULT_BLOCK):
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo: inner must be a torch.optim.Optimizer, got {type(inner).__name__}")
        for name, value, low in (("sync_every", sync_every, 1), ("fragments", fragments, 1), ("delay", delay, 0),
                                 ("warmup_steps", warmup_steps, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"DiLoCo: {name} must be an int >= {low}, got {value!r}")
        if fragments > sync_every:
            raise ValueError(f"DiLoCo: fragments ({fragments}) must be at most sync_every ({sync_every}): each step "
                             "synchronises at most one fragment")
        if delay >= sync_every:
            raise ValueError(f"DiLoCo: delay ({delay}) must be less than sync_every ({sync_every}): a fragment's "
                             "exchange lands before its next one starts")
        if not 0.0 <= mixing <= 1.0:
            raise ValueError(f"DiLoCo: mixing must be in [0, 1], got {mixing!r}")
        if not (outer_lr >= 0.0 and math.isfinite(outer_lr)):
            raise ValueError(f"DiLoCo: outer_lr must be finite and >= 0, got {outer_lr!r}")
        if not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"DiLoCo: outer_momentum must be in [0, 1), got {outer_momentum!r}")
        check_choice("compression", compression, COMPRESSIONS)
        if error_feedback is None:
            error_feedback = 0.5 if compression == "1bit" else 1.0
        if isinstance(error_feedback, bool) or not 0.0 <= error_feedback <= 1.0:
            raise ValueError(f"DiLoCo: error_feedback must be in [0, 1], got {error_feedback!r}")
        super().__init__(params, dict(lr=outer_lr, momentum=outer_momentum, nesterov=bool(nesterov)))
        if len(self.param_groups) != 1:
            raise ValueError(f"DiLoCo: one param group (the outer lr and momentum apply to every parameter), got "
                             f"{len(self.param_groups)}; give the inner optimizer the groups")
        self.inner, self.sync_every, self.compression = inner, sync_every, compression
        self.delay, self.mixing, self.warmup_steps = delay, float(mixing), warmup_steps
        #: ``beta``: the share of the compression errors carried into the next exchange
        self.error_feedback = float(error_feedback)
        # what every replica's exchange must share besides the group's hyperparameters (fixed here): another
        # compression would send collectives of other sizes, another beta other errors, another warmup
        # an all-reduce where the others start a round
        settings = dict(compression=compression, beta=self.error_feedback, warmup=warmup_steps)
        self._settings = hyperparameter_hash([settings], ("compression", "beta", "warmup"))
        ours = [p for g in self.param_groups for p in g["params"]]
        theirs = [p for g in inner.param_groups for p in g["params"]]
        if {id(p) for p in ours} != {id(p) for p in theirs}:
            raise ValueError("DiLoCo: params must be exactly the inner optimizer's parameters (a parameter the "
                             "inner optimizer steps but DiLoCo does not synchronise would drift apart on the replicas)")
        if any(p.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64) for p in ours):
            raise TypeError("DiLoCo: parameters must be floating point")
        #: FSDP2's own HSDP (a 2-D or 3-D mesh replicated over its first dimension): FSDP's all-reduce
        #: across the replicas is switched off but in the warmup (compressed_opt.fsdp_replicas)
        self._fsdp = self._fsdp_replicas(ours)
        if self._fsdp is not None:
            group = self._fsdp.replicate_group
            if backend is None:
                backend = TorchBackend(group=group)
            elif resolve_backend(backend).world_size != group.size():
                raise ValueError(f"DiLoCo: backend spans {resolve_backend(backend).world_size} ranks, and FSDP2's own "
                                 f"HSDP replicates the parameters over {group.size()}: leave backend=None (the "
                                 "replicate dimension of the parameters' mesh)")
        self.backend = resolve_backend(backend)
        if delay > 0:  # the exchange runs on a thread: a communicator of its own, so that the loop's
            self.backend = self.backend.duplicate()  # collectives on the same ranks never interleave with it
        self.agreement = RankAgreement(self.backend, "DiLoCo")
        self.scale_block = check_scale_block(scale_block)
        #: the 1-bit exchange (and, for "fp32", the exact average) with the library's paths and error feedback
        self.engine = GradientSync("DiLoCo", self.param_groups, self.backend, None, LocalShards("DiLoCo"),
                                   bucket_cap_bytes=int(bucket_cap_mb * 2**20), overlap=False, accumulation_steps=1,
                                   hierarchy="auto", path="fp32" if compression == "fp32" else "1bit",
                                   scale_block=scale_block)
        #: inner steps taken
        self.inner_step = 0
        #: fragment synchronisations landed
        self.syncs = 0
        self._sent = 0  # bytes this rank sent in the exchanges (the backend's count)
        self._thread: ThreadPoolExecutor | None = None
        self._consolidated: tuple[int, list] | None = None  # (inner step, every rank's record): on rank `to`
        self._params = ours
        #: the gradients as the last step() or zero_grad() left them (a backward since, then zero_grad()
        #: without step(): a skipped step, told to the other replicas)
        self._seen = gradients_seen(ours)
        with torch.no_grad():
            self.agreement.broadcast_parameters([_local(p) for p in ours])  # every replica starts from rank 0's
        self.fragments = [self._fragment(k, ours[k::fragments], (k * sync_every) // fragments, state_device)
                          for k in range(fragments)]
        self._hold_carrier()
        self._tell_fsdp()

    @staticmethod
    def _fsdp_replicas(params: list):
        """FSDP2's HSDP groups holding ``params`` on a mesh replicated over its first dimension, or
        ``None`` (plain parameters, FSDP on a 1-D mesh inside each replica, or DTensors of another
        making, which DiLoCo steps on their local tensors)."""
        dtensors = [p for p in params if is_dtensor(p) and p.device_mesh.ndim > 1]
        if not dtensors:
            return None
        from torch.distributed.tensor import Replicate  # (DTensors are there: torch has distributed)

        replicated = [p for p in dtensors if isinstance(p.placements[0], Replicate)]
        return fsdp_replicas.find(replicated, "DiLoCo") if replicated else None

    def _tell_fsdp(self) -> None:
        """Before the next backward (inner step ``inner_step + 1``): FSDP's own HSDP all-reduces the
        gradients across the replicas in a warmup step (the data parallel average), and only
        reduce-scatters over the shard group in a local step, each replica on its own gradients."""
        if self._fsdp is not None:
            self._fsdp.next_step(full_precision=self.inner_step + 1 <= self.warmup_steps)

    def _hold_carrier(self) -> None:
        """``state[first parameter]["compressed_opt"]``: where :meth:`state_dict` puts this rank's
        record. Held in ``optimizer.state`` (the job rank, a number, as the 1-bit optimizers'
        :func:`compressed_opt.torch_state_dict.hold_carrier`), so that the state is never empty:
        torch's ``get/set_optimizer_state_dict`` take a step (at lr 0, on zero gradients) of an
        optimizer whose state is empty, which for DiLoCo would be an inner step at the inner lr; and
        their loads of a flattened state dict keep only the entries the live state names."""
        first = self.param_groups[0]["params"][0]
        self.state.clear()
        self.state[first] = {CARRIER: job_position(self.backend)[0]}

    def _fragment(self, index: int, params: list, offset: int, state_device) -> Fragment:
        local = [_local(p).detach() for p in params]
        device = local[0].device if local else torch.device("cpu")
        numel = sum(t.numel() for t in local)
        flat = torch.empty(numel, dtype=torch.float32, device=device)
        if numel:
            torch._foreach_copy_(self._views(flat, local), local)
        where = device if state_device is None else torch.device(state_device)
        anchor = flat.to(where, copy=True)
        return Fragment(index, params, offset, anchor, torch.zeros_like(anchor), flat, ErrorFeedback())

    @staticmethod
    def _views(flat: torch.Tensor, tensors: list) -> list:
        return [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    # --- the torch.optim surface ------------------------------------------------------------------------
    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "fragments", None) is not None:  # (made: torch.optim's __init__ adds the groups first)
            raise ValueError("DiLoCo: its parameters are fixed when it is made (their anchors and fragments); "
                             "make a new DiLoCo around the inner optimizer")
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As the inner optimizer's; after a backward that no ``step()`` followed, first tells the
        other replicas (collective: every replica raises unless all skipped it alike)."""
        if backward_since(self._params, self._seen):
            for f in self.fragments:  # (the exchange thread's collectives first: one communicator)
                if f.pending is not None:
                    f.pending.exception()
            self.agreement.skipped(self.inner_step + 1, self.fragments[0].delta.device)
        self.inner.zero_grad(set_to_none=set_to_none)
        self._seen = gradients_seen(self._params)

    @torch.no_grad()
    def step(self, closure=None):
        """One inner step, then the synchronisations this step ends: the delayed results that land
        now, and the fragment whose round ends here (launched; with no delay, landed at once)."""
        t = self.inner_step + 1
        found_inf = self.__dict__.get("found_inf")  # (GradScaler's verdict on this rank's gradients)
        skip = found_inf is not None and bool(found_inf.item())
        if t <= self.warmup_steps:
            return self._warmup_step(t, closure, skip)
        if t == self.warmup_steps + 1 and not self.agreement.alone:
            self._check_local_gradients(t)
        loss = None
        if not skip:  # (a skip is this replica's alone: in a round the others' steps are their own)
            if closure is not None:
                with torch.enable_grad():
                    loss = self.inner.step(closure)
            else:
                self._unscale()
                loss = self.inner.step()
        self.inner_step = t
        for f in self.fragments:
            if f.pending is not None and t == f.launched_at + self.delay:
                self._land(f)
        for f in self.fragments:
            if t > self.warmup_steps and (t - self.warmup_steps) % self.sync_every == f.offset:
                self._launch(f, t)
                if self.delay == 0:
                    self._land(f)
        self._tell_fsdp()
        self._seen = gradients_seen(self._params)
        return loss

    def _warmup_step(self, t: int, closure, skip: bool):
        """Inner step ``t <= warmup_steps``: the replicas check they are all at ``t`` and whether
        a GradScaler found inf/NaN on some rank (then every replica skips the step); else the
        gradients averaged over the replicas, at full precision (each fragment's flat buffer carries
        its gradients through one all-reduce: a gradient that is ``None`` on this rank counts as zero
        there and stays ``None``), so that every replica takes the same inner step, as data parallel
        training does; after the last, the anchors are the parameters, and the rounds start."""
        with self._counted():
            skip = self.agreement.warmup(t, self._settings ^ self._inner_hash(), skip, self.fragments[0].delta.device)
        def averaged():
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            self._unscale()
            self._average_gradients()
            return loss
        loss = None
        if not skip:
            if closure is not None:
                loss = self.inner.step(averaged)
            else:
                averaged()
                loss = self.inner.step()
        self.inner_step = t
        self._tell_fsdp()
        self._seen = gradients_seen(self._params)
        if t == self.warmup_steps:
            for f in self.fragments:
                local = [_local(p).detach() for p in f.params]
                if local:
                    torch._foreach_copy_(self._views(f.delta, local), local)
                    f.anchor.copy_(f.delta)
        return loss

    def _inner_hash(self) -> int:
        """The inner optimizer's lr, betas, eps and weight decay (every group's), which every replica
        shares: in the warmup its steps are data parallel ones, and in a round a replica with another
        lr (a scheduler stepped twice, a wrong checkpoint) would be a bug that nothing else shows."""
        return hyperparameter_hash(self.inner.param_groups)

    def _check_local_gradients(self, t: int) -> None:
        """At the first local step: warn where the gradients are bit for bit the same on every
        replica (a checksum compared in one header all-gather): something averages them across the
        replicas every step, so no step is local, and those bytes are not DiLoCo's to count."""
        grads = [_local(p.grad) for p in self._params if p.grad is not None]
        checksum = float(sum(n.double() for n in torch._foreach_norm(grads))) if grads else 0.0
        with self._counted():
            identical = self.agreement.identical(checksum, t, self.fragments[0].delta.device)
        if grads and identical:
            warnings.warn(
                f"DiLoCo: at inner step {t}, the first local step, the gradients are the same on every replica, bit "
                "for bit: something averages them across the replicas every step (DDP over the same ranks, as "
                "accelerate, Lightning's 'ddp' strategy or a DDP-wrapped model do), so no step is local and "
                "comm_stats() does not count those bytes. Give DiLoCo the bare model, with DDP or FSDP inside each "
                "replica only (backend= the replicas' group). (Or every replica was given the same batch.)",
                RuntimeWarning, stacklevel=3)

    @contextlib.contextmanager
    def _counted(self):
        """Adds the bytes the backend counts meanwhile to this rank's ``comm_stats()``."""
        before = self.backend.stats.total
        try:
            yield
        finally:
            self._sent += self.backend.stats.total - before

    def _unscale(self) -> None:
        """The gradients <- gradients / ``grad_scale``, where a GradScaler left them scaled (its
        ``step()`` without ``unscale_()`` first)."""
        scale = self.__dict__.get("grad_scale")
        if scale is None:
            return
        grads = [_local(p.grad) for p in self._params if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.double().reciprocal().float().to(grads[0].device))

    def _average_gradients(self) -> None:
        """The gradients <- their mean over the replicas (one fp32 all-reduce per fragment)."""
        with self._counted():
            if self.backend.world_size > 1 and self._fsdp is None:  # (FSDP's own HSDP averaged them in backward)
                for f in self.fragments:
                    if not f.numel:
                        continue
                    views = self._views(f.delta, [_local(p) for p in f.params])
                    held = [(v, _local(p.grad)) for v, p in zip(views, f.params) if p.grad is not None]
                    if len(held) < len(views):
                        f.delta.zero_()
                    if held:
                        torch._foreach_copy_([v for v, _ in held], [g for _, g in held])
                    self.backend.all_reduce(f.delta)
                    f.delta.div_(self.backend.world_size)
                    if held:
                        torch._foreach_copy_([g for _, g in held], [v for v, _ in held])

    # --- a synchronisation ------------------------------------------------------------------------------
    def _launch(self, f: Fragment, t: int) -> None:
        """``d = A - theta`` into the fragment's buffer, then its exchange (on the thread with a delay)."""
        local = [_local(p).detach() for p in f.params]
        if local:
            torch._foreach_copy_(self._views(f.delta, local), local)
            anchor = f.anchor if f.anchor.device == f.delta.device else f.anchor.to(f.delta.device)
            torch.sub(anchor, f.delta, out=f.delta)
        f.launched_at = t
        hyper = (hyperparameter_hash(self.param_groups, ("lr", "momentum", "nesterov")) ^ self._settings
                 ^ self._inner_hash())
        if self.delay == 0:
            f.pending = Future()
            f.pending.set_result(self._exchange(f, t, hyper))
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compressed_opt_diloco")
        f.pending = self._thread.submit(self._exchange, f, t, hyper)

    def _exchange(self, f: Fragment, t: int, hyper: int) -> torch.Tensor:
        """The replicas' mean of ``f.delta``, in place (collective; on the thread with a delay)."""
        with self._counted():
            self.agreement.round(t, f.index, f.numel, hyper, f.delta.device)
            if self.backend.world_size > 1 and f.numel:
                fb = f.feedback
                if self.error_feedback != 1.0 and fb.worker_error is not None:  # (none before the first exchange,
                    for error in (fb.worker_error, fb.server_error):  # nor any with error_feedback=0)
                        error.mul_(self.error_feedback)
                if self.compression == "4bit":
                    if fb.worker_error is None:  # (made at the first exchange, kept in checkpoints)
                        sizes = quantized.error_sizes(f.numel, self.backend.world_size, self.scale_block)
                        fb.worker_error, fb.server_error = (f.delta.new_zeros(n) for n in sizes)
                    quantized.quantized_allreduce(f.delta, fb.worker_error, fb.server_error, self.backend,
                                                  self.scale_block)
                elif self.compression == "bf16":
                    low = f.delta.to(torch.bfloat16)
                    self.backend.all_reduce(low)
                    f.delta.copy_(low).div_(self.backend.world_size)
                else:
                    rotated = self._rotation(f) if self.compression == "1bit" else None  # ("fp32": the exact mean)
                    rotation.rotate_(f.delta, rotated, forward=True)
                    self.engine.run([Request(f.delta, f.feedback)])
                    rotation.rotate_(f.delta, rotated, forward=False)
                if self.error_feedback == 0.0:  # (zeros at the next exchange: made there, not kept in between)
                    fb.worker_error = fb.server_error = None
        return f.delta

    def _rotation(self, f: Fragment) -> torch.Tensor | None:
        """The fragment's signs ``S`` (``[runs, ROTATION_BLOCK]``, +-1 in int8: a quarter of an fp32
        copy), made once from a fixed seed (the same on every replica); ``None`` under one whole run."""
        runs = f.numel // ROTATION_BLOCK
        if runs == 0:
            return None
        signs = f.signs
        if signs is None or signs.device != f.delta.device:
            g = torch.Generator().manual_seed(_ROTATION_SEED + f.index)
            signs = torch.randint(0, 2, (runs, ROTATION_BLOCK), generator=g, dtype=torch.int8)
            f.signs = signs = signs.mul_(2).sub_(1).to(f.delta.device)
        return signs

    def _land(self, f: Fragment) -> None:
        """The outer step on the fragment's anchor with the exchanged mean ``D``, and the parameters
        set to the new anchor (mixed with the local ones after a delay)."""
        mean = f.pending.result()  # (re-raises the exchange's error on this thread)
        f.pending, self.syncs = None, self.syncs + 1
        group = self.param_groups[0]
        lr, mu = float(group["lr"]), float(group["momentum"])
        if mean.device != f.anchor.device:
            mean = mean.to(f.anchor.device)
        f.momentum.mul_(mu).add_(mean)
        if group["nesterov"]:
            f.anchor.sub_(mean, alpha=lr).sub_(f.momentum, alpha=lr * mu)
        else:
            f.anchor.sub_(f.momentum, alpha=lr)
        local = [_local(p).detach() for p in f.params]
        if not local:
            return
        anchor = f.anchor if f.anchor.device == f.delta.device else f.anchor.to(f.delta.device)
        views = self._views(anchor, local)
        if self.delay == 0 or self.mixing == 0.0:
            torch._foreach_copy_(local, views)
            return
        for p, a in zip(local, views):  # theta <- alpha theta + (1 - alpha) A, in the parameter's dtype
            p.lerp_(a.to(p.dtype), 1.0 - self.mixing)

    def synchronize(self) -> None:
        """Wait for the exchanges in flight and land them now (e.g. before an evaluation that needs
        the replicas' parameters merged). Collective where one is pending on some rank."""
        for f in self.fragments:
            if f.pending is not None:
                self._land(f)

    # --- reporting ----------------------------------------------------------------------------------
    def comm_stats(self) -> dict:
        """This rank's bytes across the replicas (counted by the backend) against DDP's fp32 ring
        all-reduce of the same parameters every inner step."""
        n = sum(f.numel for f in self.fragments)
        world = self.backend.world_size
        fp32 = 2 * (world - 1) / world * 4 * n if world > 1 else 0.0
        per_step = self._sent / self.inner_step if self.inner_step else None
        return {"optimizer": "DiLoCo", "world_size": world, "compression": self.compression,
                "sync_every": self.sync_every, "fragments": len(self.fragments), "delay": self.delay,
                "warmup_steps": self.warmup_steps,
                "inner_steps": self.inner_step, "syncs": self.syncs, "bytes_sent": self._sent,
                "bytes_per_inner_step": per_step, "fp32_allreduce_bytes_per_step": fp32,
                "ratio_to_ddp_fp32": fp32 / per_step if per_step else None}

    def state_bytes(self) -> int:
        """Bytes of outer state this rank holds: the anchors, momenta and error buffers."""
        total = 0
        for f in self.fragments:
            for t in (f.anchor, f.momentum, f.feedback.worker_error, f.feedback.server_error):
                total += 0 if t is None else t.numel() * t.element_size()
        return total

    # --- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``param_groups`` (the outer hyperparameters), ``"inner"`` (the inner optimizer's state
        dict) and ``"diloco"``: the inner step, and per fragment ``A``, ``u``, this rank's error
        buffers and a delayed result not landed yet (waited for, landed at its step after a
        resume). Every rank saves its own (the error buffers are its own).

        For torch's ``get/set_optimizer_state_dict`` (which keep ``state`` and ``param_groups``
        only), ``state`` holds this rank's record, :func:`rank_record`, as
        ``state[0]["compressed_opt"] = {"rank<R>": RankRecord(R, record)}`` (``R`` its rank in the job: no
        other rank writes the key, and DCP saves it whole, also flattened:
        :class:`compressed_opt.torch_state_dict.RankRecord`; the other parameters' states are empty),
        the same objects as above plus this
        rank's parameters (a copy: mid-round the replicas' parameters differ, and a DCP checkpoint
        holds the model's once per shard)."""
        sd = self._plain_state_dict()
        record = _local_inner_state(self, sd)
        consolidated = self._consolidated
        if consolidated is not None and consolidated[0] == self.inner_step:  # (of this step: not a later one)
            sd["diloco"] = dict(sd["diloco"], ranks={r["diloco"]["rank"]: r for r in consolidated[1]})
        # (every parameter has a state, if an empty one: torch's loading refuses a parameter without)
        sd["state"] = {pid: {} for g in sd["param_groups"] for pid in g["params"]}
        # (groups of their own: torch's flattening pops "params" from the groups it is given)
        sd["param_groups"] = [dict(g) for g in sd["param_groups"]]
        rank = job_position(self.backend)[0]
        sd["state"][0][CARRIER] = {f"rank{rank}": RankRecord(rank, record)}
        return sd

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective over the replicas, between steps: every rank's record (:func:`rank_record`:
        its whole state and its parameters, which differ mid-round) onto replica rank ``to``, whose
        ``state_dict()`` carries them all (``"diloco"``'s ``"ranks"``) until the next step, so that
        one file resumes every replica exactly: each rank that loads it takes its own record, its
        parameters included (load the model first). As the 1-bit optimizers' (accelerate's
        ``save_state`` through :func:`compressed_opt.integrations.consolidate_before_save_state`,
        Lightning). Rank ``to`` holds every rank's record in host memory meanwhile. Refused with
        sharded (DTensor) parameters, whose shards are saved by DCP."""
        world = self.backend.world_size
        if isinstance(to, bool) or not isinstance(to, int) or not 0 <= to < world:
            raise ValueError(f"DiLoCo.consolidate_state_dict: to must be a rank in [0, {world}), got {to!r}")
        if any(is_dtensor(p) for p in self._params):
            raise ValueError("DiLoCo.consolidate_state_dict: the parameters are sharded (DTensors): each rank's "
                             "state is its shard's, which one file of one rank cannot hold. Save with DCP "
                             "(compressed_opt.dcp.OptimizerState, or torch's get/set_optimizer_state_dict)")
        records = gather_objects(self.backend, self.fragments[0].delta.device, rank_record(self), to)
        self._consolidated = None if records is None else (self.inner_step, records)

    def _plain_state_dict(self) -> dict:
        sd = super().state_dict()
        sd["state"] = {}
        fragments = []
        for f in self.fragments:
            pending = None if f.pending is None else f.pending.result().clone()
            fragments.append({"anchor": f.anchor.clone(), "momentum": f.momentum.clone(),
                              "worker_error": _copy(f.feedback.worker_error),
                              "server_error": _copy(f.feedback.server_error),
                              "pending": pending, "launched_at": f.launched_at if pending is not None else -1})
        sd["inner"] = self.inner.state_dict()
        sd["diloco"] = {"format": FORMAT, "inner_step": self.inner_step, "syncs": self.syncs, "sent": self._sent,
                        "sync_every": self.sync_every, "delay": self.delay, "compression": self.compression,
                        "warmup_steps": self.warmup_steps, "rank": job_position(self.backend)[0],
                        "world_size": self.backend.world_size, "fragments": fragments}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load :meth:`state_dict`'s output of a DiLoCo with the same parameters, ``sync_every``,
        ``fragments``, ``delay`` and ``compression``; raises, loading nothing, where they differ.
        The error buffers of another number of replicas, or of another rank (one file loaded on
        every rank), start again from zero (with a warning); another rank's state dict is refused
        where the parameters are sharded (each rank's state is its shard's)."""
        theta, here = None, job_position(self.backend)[0]
        if isinstance(state_dict, dict) and "diloco" not in state_dict:  # (through torch's state_dict API)
            state_dict = _own_record(state_dict, here) or state_dict
        ranks = state_dict.get("diloco", {}).get("ranks") if isinstance(state_dict, dict) else None
        if isinstance(ranks, dict) and here in ranks:  # (consolidate_state_dict's)
            state_dict = ranks[here]
        if isinstance(state_dict, dict) and "inner_dtensors" in state_dict:  # (a record: rank_record)
            state_dict = _dtensor_inner_state(self, dict(state_dict))
            theta = state_dict.pop("theta")
        extra = state_dict.get("diloco") if isinstance(state_dict, dict) else None
        if not isinstance(extra, dict) or "inner" not in state_dict:
            raise ValueError("DiLoCo.load_state_dict: this state dict has no 'diloco' or 'inner' entry: it was not "
                             "saved by DiLoCo.state_dict()")
        if extra.get("format") != FORMAT:
            raise ValueError(f"DiLoCo.load_state_dict: format {extra.get('format')!r}, this version reads {FORMAT}")
        mine = {"sync_every": self.sync_every, "delay": self.delay, "compression": self.compression,
                "warmup_steps": self.warmup_steps}
        saved_options = {"warmup_steps": 0, **extra}  # (checkpoints from before warmup_steps: none)
        differ = {k: (saved_options.get(k), v) for k, v in mine.items() if saved_options.get(k) != v}
        if differ:
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint's (saved, this) {differ} differ: resume with "
                             "the same options")
        saved_rank = extra.get("rank")  # (None: an earlier version's)
        foreign = saved_rank is not None and saved_rank != here
        if foreign and any(is_dtensor(p) for p in self._params):
            raise ValueError(f"DiLoCo.load_state_dict: this state dict is rank {saved_rank}'s and this is rank {here}: "
                             "with the parameters sharded (DTensors: FSDP2, tensor parallel) each rank's anchor, "
                             "momentum and errors are of its own shard. Load each rank's own: state_dict() saved on "
                             "every rank, or DCP (compressed_opt.dcp.OptimizerState, or torch's "
                             "get/set_optimizer_state_dict)")
        saved = extra["fragments"]
        if len(saved) != len(self.fragments) or any(s["anchor"].numel() != f.numel for s, f in
                                                     zip(saved, self.fragments)):
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint's fragments "
                             f"({[s['anchor'].numel() for s in saved]} elements) do not match this optimizer's "
                             f"({[f.numel for f in self.fragments]}): resume with the same parameters and fragments")
        if theta is not None:
            _check_theta(self, theta)
        self._drop_pending()
        super().load_state_dict({k: v for k, v in state_dict.items() if k not in ("inner", "diloco", "inner_dtensors")}
                                | {"state": {}})
        self._hold_carrier()
        self.inner.load_state_dict(state_dict["inner"])
        same_world = extra["world_size"] == self.backend.world_size
        if not same_world and self.compression in ("1bit", "4bit"):
            warnings.warn(f"DiLoCo: the checkpoint was saved by {extra['world_size']} replicas, this run has "
                          f"{self.backend.world_size}: the error-feedback buffers start again from zero",
                          RuntimeWarning, stacklevel=2)
        elif foreign and self.compression in ("1bit", "4bit"):
            warnings.warn(f"DiLoCo: this state dict is rank {saved_rank}'s, loaded on rank {here} (one file for every "
                          "rank: a framework that saves rank 0's optimizer state): its error-feedback buffers are "
                          f"rank {saved_rank}'s own and start again from zero here; the anchor, the outer momentum "
                          "and a result in flight are every replica's alike, the inner optimizer's state is that "
                          "replica's. Save each rank's own state dict, or use DCP, to resume exactly",
                          RuntimeWarning, stacklevel=2)
        for s, f in zip(saved, self.fragments):
            f.anchor.copy_(s["anchor"])
            f.momentum.copy_(s["momentum"])
            errors = (s["worker_error"], s["server_error"])
            if same_world and not foreign and errors[0] is not None:
                f.feedback.worker_error, f.feedback.server_error = (e.to(f.delta.device, copy=True) for e in errors)
            else:
                f.feedback.worker_error = f.feedback.server_error = None
            if s["pending"] is not None:
                f.delta.copy_(s["pending"])
                f.pending, f.launched_at = Future(), int(s["launched_at"])
                f.pending.set_result(f.delta)
        self.inner_step, self.syncs, self._sent = int(extra["inner_step"]), int(extra["syncs"]), int(extra["sent"])
        if theta is not None:
            _restore_theta(self, theta)
        self._tell_fsdp()

    def _drop_pending(self) -> None:
        """Drop what is in flight (waited for, not landed): a load replaces it."""
        for f in self.fragments:
            if f.pending is not None:
                f.pending.result()
                f.pending = None

    def close(self) -> None:
        """Wait for what is in flight and stop the exchange thread. Idempotent."""
        for f in self.fragments:
            if f.pending is not None:
                f.pending.exception()
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        self.engine.close()

    def __repr__(self) -> str:
        return (f"DiLoCo(sync_every={self.sync_every}, compression={self.compression!r}, "
                f"error_feedback={self.error_feedback}, fragments={len(self.fragments)}, delay={self.delay}, "
                f"inner={type(self.inner).__name__})")


def _copy(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.clone()


# --- a rank's whole state, as one record (DCP through compressed_opt.dcp.OptimizerState, and torch's
# state_dict API through the carrier) ---------------------------------------------------------------
def rank_record(diloco: DiLoCo) -> dict:
    """This rank's whole state: :meth:`DiLoCo.state_dict` with the inner optimizer's DTensor state
    as local tensors and this rank's parameters (see :func:`_local_inner_state`)."""
    return _local_inner_state(diloco, diloco._plain_state_dict())


def _own_record(state_dict: dict, rank: int) -> dict | None:
    """The record of rank ``rank`` in a state dict that went through torch's state_dict API, or
    ``None`` where it holds no carrier; raises where it holds one without this rank's record."""
    state = state_dict.get("state")
    if not isinstance(state, dict):
        return None
    carrier = next((st[CARRIER] for st in state.values() if isinstance(st, dict) and CARRIER in st), None)
    if carrier is None:
        return None
    records = {k: record_in(v) for k, v in carrier.items()} if isinstance(carrier, dict) else {}
    if any(not isinstance(v, dict) for v in records.values()):
        raise ValueError(f"DiLoCo.load_state_dict: the state dict's carrier holds {sorted(records)}, not records "
                         "DiLoCo wrote")
    mine = records.get(f"rank{rank}")
    if mine is None:
        raise ValueError(f"DiLoCo.load_state_dict: this state dict holds the records of {sorted(records)} and not "
                         f"rank {rank}'s: a DiLoCo checkpoint through torch's state_dict API resumes on the same "
                         "ranks, each its own record")
    return mine


def _check_theta(diloco: DiLoCo, theta: list) -> None:
    """Raise where the saved parameters ``theta`` are not shaped as this rank's."""
    params = [_local(p) for g in diloco.param_groups for p in g["params"]]
    if [tuple(t.shape) for t in theta] != [tuple(p.shape) for p in params]:
        raise ValueError("DiLoCo.load_state_dict: the parameters here are shaped or sharded otherwise than when this "
                         "checkpoint was saved: resume it on the same ranks and mesh")


def _inner_params(diloco: DiLoCo) -> list[torch.Tensor]:
    return [p for g in diloco.inner.param_groups for p in g["params"]]


def _local_inner_state(diloco, sd: dict) -> dict:
    """DiLoCo's state dict with the inner optimizer's DTensor state (FSDP2 inside a replica: AdamW's
    moments of a sharded parameter) as this rank's local tensors, named in ``"inner_dtensors"``,
    and this rank's parameters (``"theta"``). The outer state is already local (one rank's anchor,
    momentum and error buffers).

    Mid-round the replicas' parameters differ, and DCP writes a model's state once per shard (one
    replica's): the entry carries each rank's own, which :func:`_restore_theta` puts back."""
    inner, named = sd["inner"], []
    position = {pid: i for i, pid in enumerate(pid for g in inner["param_groups"] for pid in g["params"])}
    state = {}
    for pid, st in inner["state"].items():
        state[pid] = dict(st)
        for name, value in st.items():
            if is_dtensor(value):
                state[pid][name] = value.to_local()
                named.append((position[pid], name))
    theta = [_local(p).detach().clone() for g in diloco.param_groups for p in g["params"]]
    return dict(sd, inner=dict(inner, state=state), inner_dtensors=named, theta=theta)


@torch.no_grad()
def _restore_theta(diloco, theta: list) -> None:
    """This rank's parameters as saved, in place (the model's state dict, which DCP fills with one
    replica's, shares their memory: a ``model.load_state_dict`` of it after ``dcp.load`` keeps them)."""
    params = [_local(p) for g in diloco.param_groups for p in g["params"]]  # (shapes: _check_theta)
    torch._foreach_copy_(params, [t.to(p.device) for t, p in zip(theta, params)])


def _dtensor_inner_state(diloco, part: dict) -> dict:
    """The inverse of :func:`_local_inner_state` on this rank's parameters."""
    inner = part["inner"]
    positions = [pid for g in inner["param_groups"] for pid in g["params"]]
    params = _inner_params(diloco)
    if len(positions) != len(params):
        raise ValueError(f"this checkpoint's inner optimizer had {len(positions)} parameters, this one has "
                         f"{len(params)}")
    state = {pid: dict(st) for pid, st in inner["state"].items()}
    for i, name in part.pop("inner_dtensors"):
        p, value = params[i], state[positions[i]][name]
        if not is_dtensor(p) or tuple(value.shape) != tuple(p.to_local().shape):
            raise ValueError("the parameters here are sharded otherwise than when this DiLoCo checkpoint was saved: "
                             "resume it on the same ranks and mesh")
        from torch.distributed.tensor import DTensor  # (here p is one: torch has distributed)

        state[positions[i]][name] = DTensor.from_local(value.to(p.device), p.device_mesh, p.placements,
                                                       run_check=False, shape=p.shape, stride=p.stride())
    return dict(part, inner=dict(inner, state=state))



