"""The base of the compressed optimizers: buckets, gradient averaging, rank agreement, checkpoints.

Subclasses implement the algorithm per bucket in :meth:`CompressedOptimizer._bucket_step`; this
class owns everything around it, in the order of a step:

1. closure (if any), buckets built or rebuilt (after ``add_param_group``);
2. once, before the first step: every rank checks that all ranks have the same parameter shapes
   and hyperparameters (an all-gather of a signature), raising on every rank if not;
3. ``torch.amp.GradScaler``: the optimizer handles scaling itself (``_step_supports_amp_scaling``)
   so that a non-finite gradient on *any* rank makes *every* rank skip the step (a one-element
   all-reduce of the flags), where GradScaler alone would skip only on the overflowing rank and
   leave the others waiting in a collective;
4. per bucket, *communication*: the rank's gradients copied into a flat fp32 buffer; if the
   algorithm wants the full-precision average this step (:meth:`_needs_average`), one all-reduce
   per bucket, else the algorithm's own exchange (:meth:`_bucket_communicate`, e.g. 1-bit Adam's
   momentum update and compressed allreduce). With ``overlap=True`` (the default) this runs during
   backward, launched by hooks as soon as a bucket's gradients are complete
   (:mod:`compressed_opt.overlap`), and ``step()`` only waits for what is still in flight;
   then, per bucket, the *update* (:meth:`_bucket_step`);
5. ``_end_step``: stage changes (freezing), decided identically on every rank.

The rest of the state a resumed run needs (stage, counters, error buffers) goes into
``state_dict()["compressed_opt"]``.
"""
from __future__ import annotations

import hashlib
import logging
import math
import struct
import warnings

import torch
from torch.optim import Optimizer

from compressed_opt.comm import Backend, error_buffer_sizes, get_backend

from . import zero
from .buckets import Bucket, build_buckets
from .overlap import BucketLauncher
from .validation import check_nonneg_float, check_step_count

logger = logging.getLogger("compressed_opt")

_STATE_FORMAT = 1


class CompressedOptimizer(Optimizer):
    _step_supports_amp_scaling = True
    #: per-bucket fp32 buffers shown per parameter in ``optimizer.state[p][name]``
    bucket_state_names: tuple[str, ...] = ()
    #: further per-bucket buffers (any size) saved in ``state_dict()["compressed_opt"]["buckets"]``
    saved_bucket_buffers: tuple[str, ...] = ()

    def __init__(self, params, defaults: dict, backend: Backend | None = None, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, accumulation_steps: int = 1):
        self._buckets: list[Bucket] | None = None
        super().__init__(params, defaults)
        if backend is None:
            backend = get_backend("auto")
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a compressed_opt.comm.Backend or None, got {type(backend).__name__}")
        self.backend = backend
        cap = check_nonneg_float("bucket_cap_mb", bucket_cap_mb)
        if cap == 0:
            raise ValueError("Invalid bucket_cap_mb: 0 (must be > 0)")
        self.bucket_cap_bytes = max(4, int(cap * 2**20))
        self.global_step = 0
        self._layout_key = None
        self._ranks_checked = False
        self._pending_bucket_state: list[dict] | None = None
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap must be True or False, got {overlap!r}")
        self.overlap = overlap
        self.accumulation_steps = check_step_count("accumulation_steps", accumulation_steps, minimum=1)
        self._launcher = BucketLauncher(self._communicate_bucket, self.accumulation_steps)
        self._scaler_seen = False
        self._gather_inv_scale: float | None = None  # 1/scale of a GradScaler, applied when gathering
        self._ddp = None  # a compressed_opt.ddp.DDPHookState once a DDP hook drives the exchange
        self._ddp_errors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._ddp_scratch: dict[str, torch.Tensor] = {}  # DDP buckets laid out in our order

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
            self._launcher.enabled = False  # ... before anything is launched for them

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
        self._layout_key = key
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
        self._launcher.attach(self._buckets, hooks=self.overlap)
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

    def _check_rebuild(self) -> None:
        """Raise if this optimizer cannot carry its state over to new buckets."""

    def error_buffers(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's (worker_error, server_error), zero on first use."""
        if "worker_error" not in bucket.flats:
            we, se = error_buffer_sizes(bucket.numel, self.backend.world_size)
            bucket.flats["worker_error"] = torch.zeros(we, dtype=torch.float32, device=bucket.device)
            bucket.flats["server_error"] = torch.zeros(se, dtype=torch.float32, device=bucket.device)
        return bucket.flats["worker_error"], bucket.flats["server_error"]

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (bucket buffers that are not workspace, plus
        per-parameter state that is not a view of them): what ZeRO sharding reduces."""
        total = 0
        for b in self._buckets or ():
            total += sum(t.numel() * t.element_size() for name, t in b.flats.items() if name not in self.scratch_names)
        for w, e in self._ddp_errors.values():
            total += (w.numel() + e.numel()) * 4
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

    def _bucket_communicate(self, bucket: Bucket, group: dict, grad: torch.Tensor, step: int) -> None:
        """The algorithm's exchange for a step that does not average gradients at full precision,
        run as soon as the bucket's gradients are ready (possibly on the communication thread,
        during backward). It must not read the learning rate (schedulers change it after
        ``step()``, not before). By default there is none here: ``_bucket_step`` communicates."""

    def ddp_exchange(self, bucket_index: int, params, grads, buffer: torch.Tensor) -> bool:
        """Under DDP: the compression-stage exchange for one DDP bucket, inside the comm hook.
        ``buffer`` holds the bucket's local gradients (``grads`` are views into it, matching
        ``params``); on return it must hold what ``_bucket_receive`` expects in ``p.grad``.
        ``False``: this algorithm exchanges in ``step()`` instead."""
        return False

    def _bucket_receive(self, bucket: Bucket, group: dict, grad: torch.Tensor, step: int) -> None:
        """Under DDP, after ``ddp_exchange``: ``grad`` holds what the hook produced."""
        raise NotImplementedError

    def ddp_error_buffers(self, key: str, numel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Error-feedback buffers of a DDP bucket, by ``key`` (its parameters' indices in the
        canonical order, so a bucket DDP rebuilds with the same parameters keeps them); zeros
        when new or resized."""
        we_n, se_n = error_buffer_sizes(numel, self.backend.world_size)
        bufs = self._ddp_errors.get(key)
        if bufs is None or bufs[0].numel() != we_n or bufs[0].device != torch.device(device):
            bufs = (torch.zeros(we_n, device=device), torch.zeros(se_n, device=device))
            self._ddp_errors[key] = bufs
        return bufs

    def _place(self, param) -> tuple[int, int]:
        """``(index in state_dict() order, index of its param group)``; made once per set of
        groups (``add_param_group`` and ``load_state_dict`` start it again)."""
        places = getattr(self, "_param_places", None)
        if places is None:
            places = self._param_places = {
                p: (i, gi) for i, (gi, p) in enumerate((gi, p) for gi, g in enumerate(self.param_groups) for p in g["params"])
            }
        return places[param]

    def param_index(self, param) -> int:
        """A parameter's index in ``state_dict()`` order (all groups' params, in order)."""
        return self._place(param)[0]

    def group_of(self, param) -> dict:
        """The param group holding ``param`` (the current dict: ``load_state_dict`` replaces them)."""
        return self.param_groups[self._place(param)[1]]

    def _attach_ddp(self, state) -> None:
        self._ddp = state
        self.overlap = False  # DDP's reducer launches the communication
        self._launcher.detach()
        self._launcher.enabled = False

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

    #: bucket buffers that are workspace, not state (not saved, not counted in state_bytes)
    scratch_names = frozenset({"grad"}) | zero.SCRATCH

    def _grad_buffer(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's flat fp32 gradient workspace."""
        return bucket.flat("grad")

    def _gather(self, bucket: Bucket, grad: torch.Tensor, step: int) -> None:
        """``grad`` <- this rank's gradients of the bucket (unscaled)."""
        bucket.gather_grads(grad, self._gather_inv_scale)

    def _average(self, bucket: Bucket, grad: torch.Tensor) -> None:
        """The full-precision gradient average of a bucket (one collective)."""
        self.backend.all_reduce(grad, op="avg")

    def _communicate_bucket(self, bucket: Bucket) -> None:
        step = self.global_step + 1
        grad = self._grad_buffer(bucket)
        self._gather(bucket, grad, step)
        group = self.param_groups[bucket.group_index]
        if self._needs_average(step):
            if self._ddp is None:  # (under DDP its hook averaged the gradients)
                self._average(bucket, grad)
        elif self._ddp is not None and self._ddp.exchanged_step == step:
            self._bucket_receive(bucket, group, grad, step)  # the hook exchanged already
        else:
            self._bucket_communicate(bucket, group, grad, step)

    def _arm_launcher(self) -> None:
        """Whether the coming backward may launch communication: after the ranks were checked,
        and not for a compression-stage step under a GradScaler (that exchange changes state, so
        it waits until every rank knows whether the step is skipped)."""
        upcoming = self.global_step + 1
        deferred = self._scaler_seen and not self._needs_average(upcoming)
        self._launcher.enabled = self.overlap and self._ranks_checked and not deferred

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._ensure_buckets()
        if not self._ranks_checked:
            for b in self._buckets:
                for p in b.params:
                    if p.grad is not None and p.grad.layout != torch.strided:
                        raise TypeError(f"{type(self).__name__} does not support sparse gradients")
            self._check_ranks_agree()
            self._ranks_checked = True
        step = self.global_step + 1
        averaged = self._needs_average(step)
        launched = self._launcher.wait()
        todo = list(range(len(launched), len(self._buckets)))  # backward launches a prefix, in order
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:
            self._scaler_seen = True
            grad_scale = getattr(self, "grad_scale", None)
            inv_scale = None if grad_scale is None else 1.0 / float(grad_scale)
            # backward gathered with the previous step's scale; a rank whose scale changed since
            # must gather again, and then every rank must (the collectives have to match)
            stale = bool(launched) and inv_scale != self._gather_inv_scale
            skip, redo = self._agree_on_scaler(found_inf, stale)
            self._gather_inv_scale = inv_scale
            if skip:  # a non-finite gradient on some rank: every rank skips the step
                self._launcher.reset()
                self._arm_launcher()
                return loss
            if redo:
                todo = list(range(len(self._buckets)))
        try:
            self._launcher.run_inline(todo)
        finally:
            self._launcher.reset()
        for b in self._buckets:
            self._bucket_step(b, self.param_groups[b.group_index], self._grad_buffer(b), step, averaged)
        self.global_step = step
        self._end_step(step)
        self._arm_launcher()
        return loss

    def _agree_on_scaler(self, found_inf: torch.Tensor, stale: bool) -> tuple[bool, bool]:
        """One 2-element all-reduce: (some rank found inf/NaN, some rank must gather again)."""
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        flags = torch.zeros(2, dtype=torch.float32, device=device)
        if found_inf.numel():
            flags[0] = found_inf.detach().reshape(-1)[0].float().to(device)
        flags[1] = float(stale)
        self.backend.all_reduce(flags, op="sum")
        skip, redo = flags.tolist()
        return skip > 0, redo > 0

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
        hparams.update(repr(self._extra_signature()).encode())
        as_ints = lambda h: list(struct.unpack("<qq", h.digest()[:16]))  # noqa: E731
        return as_ints(shapes) + as_ints(hparams) + [n_params, total]

    def _extra_signature(self) -> tuple:
        return ()

    def _check_ranks_agree(self) -> None:
        world = self.backend.world_size
        if world == 1:
            return
        mine = torch.tensor(self._signature(), dtype=torch.int64)
        device = self._buckets[0].device if self._buckets else torch.device("cpu")
        everyone = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
        self.backend.all_gather(everyone, mine.to(device))
        rows = everyone.view(world, -1).cpu().tolist()
        problems = []
        for r, row in enumerate(rows[1:], start=1):
            if row[:2] != rows[0][:2] or row[4:] != rows[0][4:]:
                problems.append(
                    f"rank {r} has {row[4]} parameters / {row[5]} elements in buckets unlike rank 0's "
                    f"{rows[0][4]} / {rows[0][5]} (parameter shapes, dtypes or order differ)"
                )
            if row[2:4] != rows[0][2:4]:
                problems.append(f"rank {r}'s hyperparameters differ from rank 0's")
        if problems:
            raise ValueError(
                f"{type(self).__name__}: the ranks disagree, so their collectives would not match: "
                + "; ".join(problems)
                + ". Build the model and optimizer identically on every rank."
            )

    # --- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        buckets = []
        for b in self._buckets or ():
            entry = {"numel": b.numel}
            for name in ("worker_error", "server_error", *self.saved_bucket_buffers):
                if name in b.flats:
                    entry[name] = b.flats[name]
            buckets.append(entry)
        sd["compressed_opt"] = {
            "format": _STATE_FORMAT,
            "algorithm": type(self).__name__,
            "global_step": self.global_step,
            "rank": self.backend.rank,
            "world_size": self.backend.world_size,
            "buckets": buckets,
            "ddp_errors": {i: {"worker_error": w, "server_error": e} for i, (w, e) in self._ddp_errors.items()},
            **self._extra_state(),
        }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
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
        # torch casts floating state to each parameter's dtype; our buffers stay fp32
        index_to_param = [p for g in self.param_groups for p in g["params"]]
        for idx, saved in originals.items():
            p = index_to_param[int(idx)]
            for name in self.bucket_state_names:
                if name in saved:
                    self.state[p][name] = saved[name].to(device=p.device, dtype=torch.float32).clone()
        self.global_step = int(extra["global_step"])
        self._load_extra_state(extra)
        self._buckets = None
        self._param_places = None
        self._layout_key = None
        self._ranks_checked = False
        self._launcher.enabled = False
        same_layout = extra["world_size"] == self.backend.world_size and extra["rank"] == self.backend.rank
        if same_layout:
            self._pending_bucket_state = list(extra["buckets"])
            self._ddp_errors = {
                str(k): (e["worker_error"].clone(), e["server_error"].clone()) for k, e in extra.get("ddp_errors", {}).items()
            }
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
        if len(saved) != len(self._buckets) or any(s["numel"] != b.numel for s, b in zip(saved, self._buckets)):
            warnings.warn(
                "the checkpoint's buckets do not match this optimizer's (different parameters or "
                "bucket_cap_mb): the error-feedback buffers were reset to zero",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        for s, b in zip(saved, self._buckets):
            if "worker_error" in s:
                we, se = self.error_buffers(b)
                we.copy_(s["worker_error"])
                se.copy_(s["server_error"])
            for name in self.saved_bucket_buffers:
                if name in s:
                    b.flats[name] = s[name].to(b.device).clone()


def _plain(value) -> bool:
    return isinstance(value, (int, float, str, bool, tuple, type(None)))


def frozen_denominator_of(v: torch.Tensor, group: dict, freeze_step: int) -> torch.Tensor:
    """``sqrt(v / (1 - b2^freeze_step)) + eps`` (a new tensor), ``inf`` where ``v == 0``: the
    compression stage's divisor; an infinite one keeps a coordinate without variance in place."""
    _, bc2_sqrt = bias_corrections(*group["betas"], freeze_step, group["bias_correction"])
    return torch.sqrt(v).div_(bc2_sqrt).add_(group["eps"]).masked_fill_(v == 0, float("inf"))


def bias_corrections(beta1: float, beta2: float, step: int, enabled: bool) -> tuple[float, float]:
    """``(1 - beta1^t, sqrt(1 - beta2^t))``, or ``(1, 1)`` without bias correction."""
    if not enabled:
        return 1.0, 1.0
    return 1.0 - beta1**step, math.sqrt(1.0 - beta2**step)
