"""Where an optimizer's state lives: replicated on every rank, or sharded ZeRO-style by the
compressed allreduce's server chunks. One object, chosen once when the optimizer is made
(``optimizer.layout``), answers every question whose answer depends on that; ``step()`` and the
optimizers call it and never ask which layout it is.

:class:`Layout` is the interface, :class:`Replicated` (``zero_stage=0``, and every optimizer that
is not sharded) the layout of whole buffers on every rank, :class:`compressed_opt.zero.Sharded`
(``zero_stage=1``) and :class:`compressed_opt.zero.ShardedGradients` (``zero_stage=2``) the sharded
one; :func:`compressed_opt.zero.for_stage` picks one.

What differs between them (the rest of a step is the same code for both):

======================  ===================================  ==========================================
                        replicated                           sharded (rank ``j``: chunk ``j``)
======================  ===================================  ==========================================
warmup ``m``, ``v``     whole buckets (``state[p]`` views)   chunk ``j``; update the chunk, all-gather
gradient average        all-reduce                           all-reduce (1); reduce-scatter (2)
compression momentum    ``exp_avg`` (fp32)                   the last exchange's 1-bit rows
local momentum          formed before the exchange           formed while gathering ``p.grad``
preconditioned update   keeps ``m``; ``A y`` by a division   ``A y`` by a division (the same pass)
bf16/fp16 parameters    updated in place                     and an fp32 master chunk, resynchronised
======================  ===================================  ==========================================

Every method takes the optimizer (the layout keeps nothing of its own, so copies and pickles of
the optimizer carry it as it is) and, where it concerns one bucket, the bucket. The optimizer is
reached through public names only (the layout protocol; docs/design.md 3.5): the preconditioned
exchange's ``exchange_preconditioner``, ``exchange_coefficients``, ``exchange_bounds``, ``exchange_factors``,
``update_factors``, ``preconditioned_descend``, ``momentum_from_exchange``, ``no_variance_indices``,
``bound_exchanged_``, ``exchange_scales`` and ``kept_exchange_factors``; ``keeps_denominator`` and
``keeps_previous_momentum``; the variance tracking's ``gather_observed`` and
``observe_local_gradient``; ``overlay_buffers``, ``comm_device``,
``averaging``, ``param_groups`` and ``state``. Where the two
differ inside one formula, the layout hands the optimizer what differs (this rank's part of a
buffer, a workspace, the values it updates) and the formula is written once.
"""
from __future__ import annotations

import torch

from compressed_opt import cuda as kernels
from compressed_opt.comm import chunk_numel

from .buckets import Bucket
from .moments import descend_
from .reductions import maxima, norms


class Layout:
    """The operations whose answer depends on where the state lives."""

    #: the ``zero_stage`` this layout stands for
    stage: int
    #: whether each rank holds only its chunk of the state (then the 1-bit exchange is flat: its
    #: server chunks are the shards)
    sharded: bool

    # --- checks, once -----------------------------------------------------------------------------
    def declare_buffers(self, opt) -> None:
        """Set the optimizer's bucket buffers for this layout (:mod:`compressed_opt.buffers`)."""
        raise NotImplementedError

    def check_options(self, opt, path: str, hierarchy: str) -> None:
        """Raise ``ValueError`` for a ``path`` or ``hierarchy`` this layout cannot take."""
        raise NotImplementedError

    def check_rebuild(self, opt) -> None:
        """Raise if the state cannot follow the parameters into new buckets."""
        raise NotImplementedError

    def checkpoint_problem(self, opt, rank: int, world: int, consolidated: bool) -> str | None:
        """Why a checkpoint saved by rank ``rank`` of ``world`` cannot be loaded here (``None``:
        it can)."""
        raise NotImplementedError

    def check_ddp(self, opt) -> None:
        """Raise ``ValueError`` if the optimizer cannot drive a ``DistributedDataParallel`` model."""
        raise NotImplementedError

    # --- the gradients ----------------------------------------------------------------------------
    def grad_buffer(self, opt, bucket: Bucket) -> torch.Tensor:
        """The bucket's flat fp32 gradient workspace (``bucket.numel`` elements)."""
        raise NotImplementedError

    def average(self, opt, bucket: Bucket, grad: torch.Tensor) -> None:
        """The full-precision average of the bucket's gradients, in place (collective)."""
        raise NotImplementedError

    # --- warmup: the update of the part this rank holds --------------------------------------------
    def own(self, opt, bucket: Bucket, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole-bucket tensor (a view)."""
        raise NotImplementedError

    def state(self, opt, bucket: Bucket, name: str) -> torch.Tensor:
        """This rank's part of the per-element state ``name`` (``"exp_avg"``, ``"exp_avg_sq"``,
        ...; zeros when new), a flat fp32 view to update in place."""
        raise NotImplementedError

    def direction_buffer(self, opt, bucket: Bucket, grad: torch.Tensor) -> torch.Tensor:
        """Where the update direction of this rank's part is formed, once the moments have read
        the gradient ``grad``."""
        raise NotImplementedError

    def own_values(self, opt, bucket: Bucket):
        """What this rank updates in place: the parameters (a list) or the fp32 values of its part
        (a flat tensor); read it after the moments (it may reuse the gradient workspace)."""
        raise NotImplementedError

    def step_(self, opt, bucket: Bucket, values, direction: torch.Tensor, decay: float, alpha: float) -> None:
        """``values <- values decay + alpha direction`` (:meth:`own_values`, :meth:`direction_buffer`);
        afterwards every rank holds the whole new parameters."""
        raise NotImplementedError

    def add_values_(self, opt, bucket: Bucket, out: torch.Tensor, values, alpha: float) -> None:
        """``out <- out + alpha values`` (``out``: a :meth:`direction_buffer`, ``values``: :meth:`own_values`)."""
        raise NotImplementedError

    def adamw_(self, opt, bucket: Bucket, grad: torch.Tensor, kernel) -> bool:
        """A warmup step by a multi-tensor AdamW kernel (torch's fused one): ``kernel(values,
        grads, exp_avgs, exp_avg_sqs)``, lists it updates in place (all but ``grads``), over the fp32
        values of the part of the bucket this rank holds and that part of ``grad`` (the average),
        ``m`` and ``v``; afterwards every rank holds the whole new parameters. ``False``, nothing
        done, where the kernel cannot take them (the caller composes the step instead)."""
        raise NotImplementedError

    def layer_norms(self, opt, bucket: Bucket, parts: list) -> list[torch.Tensor]:
        """Per layer of the bucket, the L2 norm of each of ``parts`` (the part this rank holds of a
        per-element quantity: a flat buffer, or :meth:`own_values`) over every rank's part, the
        same on every rank: one float64 tensor per part."""
        raise NotImplementedError

    def step_layers_(self, opt, bucket: Bucket, values, update: torch.Tensor, coeffs: list[float],
                     scale: float) -> None:
        """``values <- values + scale coeff_l update`` on each layer ``l`` (1-bit LAMB's trust
        ratios; ``update`` may be overwritten); afterwards every rank holds the whole new parameters."""
        raise NotImplementedError

    def sum_over_ranks(self, opt, values: list[float]) -> list[float]:
        """Each of ``values`` (sums over the state this rank holds) summed over the state of every
        rank, the same on every rank."""
        raise NotImplementedError

    def freeze(self, opt, bucket: Bucket) -> torch.Tensor:
        """At the end of warmup: make the bucket's compression-stage state from its warmup state,
        and return the whole raw variance ``v`` (the same on every rank; valid until the bucket's
        next collective)."""
        raise NotImplementedError

    # --- compression stage ------------------------------------------------------------------------
    def gather_local(self, opt, bucket: Bucket, grad: torch.Tensor) -> None:
        """A compression step's gather into ``grad``: this rank's gradients, or already its local
        momentum (see :meth:`local_momentum_`)."""
        raise NotImplementedError

    def local_momentum_(self, opt, bucket: Bucket, x: torch.Tensor, beta1: float) -> None:
        """``x`` (as :meth:`gather_local` left it) <- what the 1-bit exchange averages: the local
        momentum ``m_i = b1 m + (1 - b1) g_i``, or with the preconditioned exchange ``clip(s_l R m_i,
        +-c_l K)`` (``s_l``: ``opt.exchange_factors``, called once per exchange), 0 where
        ``v_f == 0`` (:mod:`compressed_opt.onebit_adam`)."""
        raise NotImplementedError

    def local_momentum_pass(self, opt, bucket: Bucket, x: torch.Tensor, beta1: float):
        """:meth:`local_momentum_`, or the pass that forms it not run yet (a kernels pass, e.g.
        :class:`compressed_opt.cuda.LerpScaleClamp`), for :meth:`exchange` to hand on: the 1-bit
        exchange runs it fused with its compression where it can (the local momentum then never
        travels to memory). ``None``: ``x`` holds it already. Only for an algorithm that reads
        ``x`` no more before the exchange."""
        self.local_momentum_(opt, bucket, x, beta1)
        return None

    def exchange(self, opt, bucket: Bucket, x: torch.Tensor, pending=None, keep_result=False):
        """``x`` <- the 1-bit compressed average of the ranks' ``x`` (collective), as a generator
        that yields its one request ``(bucket, x, averaging, pending, expand)`` (``averaging``:
        ``None`` for the optimizer's own; ``pending``: :meth:`local_momentum_pass`'s pass, ``None``
        when ``x`` holds the value to average) and keeps what it needs of the result after it: the
        optimizer runs the requests of an exchange group together
        (:meth:`compressed_opt.exchanges.Exchanges.run`). ``keep_result``: the caller reads the
        result through :meth:`exchanged` (which may leave it in its 1-bit rows), not from ``x``."""
        raise NotImplementedError

    def exchanged(self, opt, bucket: Bucket, x: torch.Tensor):
        """The result of this step's :meth:`exchange` with ``keep_result``: ``x``, or the result
        as its 1-bit rows (a :class:`compressed_opt.cuda.CompressedResult` that decompresses into
        ``x``), once."""
        return x

    def keep_momentum(self, opt, bucket: Bucket, m: torch.Tensor) -> None:
        """Keep the averaged momentum ``m`` (whole) for the next step's local momentum."""
        raise NotImplementedError

    def previous_momentum(self, opt, bucket: Bucket) -> torch.Tensor:
        """This rank's part of the momentum of the step before (1-bit LAMB, before
        :meth:`keep_momentum`), to consume in place."""
        raise NotImplementedError

    def whole_momentum(self, opt, bucket: Bucket) -> torch.Tensor | None:
        """The bucket's whole fp32 momentum, for a pass that writes it in place of
        :meth:`keep_momentum`; ``None`` where the layout keeps none (ZeRO: the exchange's rows)."""
        return None

    def keep_momentum_rows(self, opt, bucket: Bucket, kept) -> None:
        """:meth:`whole_momentum` was just formed from the result's kept rows: ``kept`` (a
        :class:`compressed_opt.cuda.KeptMomentum`, or ``None``) says how, so that the next local
        momentum's pass may form it from them instead of reading it. A layout whose momentum is
        its rows ignores it."""

    def layer_maxima(self, opt, bucket: Bucket, values: torch.Tensor) -> list[float]:
        """Per layer, the maximum of ``values`` (this rank's part of a per-element quantity, >= 0)
        over every rank's part, the same on every rank; 1.0 for an empty layer."""
        raise NotImplementedError

    def keep_exchange_factors(self, opt, bucket: Bucket, root: torch.Tensor, denom: torch.Tensor,
                              coeffs: list[float]) -> None:
        """The preconditioner ``R = c_l / sqrt(v_f)`` was just made (from ``root = sqrt(v_f)``,
        ``denom = sqrt(v_f) + eps`` and the layers' ``c_l``): keep what the compression steps
        need beside it."""
        raise NotImplementedError

    def step_preconditioned_(self, opt, bucket: Bucket, y: torch.Tensor, decay: float, alpha: float,
                             step: int) -> None:
        """1-bit Adam's compression-stage update from the exchanged ``y = avg(s_l R m_i)``:
        ``p <- p decay + alpha f_l m / (sqrt(v_f) + eps)`` (``f_l``: the layer's variance factor;
        ``f_l / s_l`` times ``A y``: ``opt.update_factors``), keeping ``m = y / (s_l R)``."""
        raise NotImplementedError

    def update_masters(self, opt, bucket: Bucket, step: int, decay, delta: torch.Tensor, alpha: float = 1.0) -> None:
        """After a compression-stage update ``p <- p decay + alpha delta`` of the parameters
        (``decay``: a float or one per layer): the same on any fp32 masters of them."""
        raise NotImplementedError


class Replicated(Layout):
    """Every rank holds the whole state of every bucket."""

    stage = 0
    sharded = False

    def declare_buffers(self, opt):
        pass  # the optimizer class's own table

    def check_options(self, opt, path, hierarchy):
        pass

    def check_rebuild(self, opt):
        pass

    def checkpoint_problem(self, opt, rank, world, consolidated):
        return None  # another rank's or world size's error feedback is dropped on load (warned)

    def check_ddp(self, opt):
        pass

    def grad_buffer(self, opt, bucket):
        return bucket.flat("grad")

    def average(self, opt, bucket, grad):
        opt.averaging.average(grad)  # (the hierarchical exchange averages fp32 the hierarchical way too)

    def own(self, opt, bucket, whole):
        return whole

    def state(self, opt, bucket, name):
        return bucket.flat(name)

    def direction_buffer(self, opt, bucket, grad):
        return grad  # free once the moments have read it

    def own_values(self, opt, bucket):
        return bucket.step_destinations()  # (the parameters, checked and addressed once for the step's C passes)

    def step_(self, opt, bucket, values, direction, decay, alpha):
        descend_(values, bucket.views(direction), decay, alpha)

    def add_values_(self, opt, bucket, out, values, alpha):
        torch._foreach_add_(bucket.views(out), values, alpha=alpha)

    def adamw_(self, opt, bucket, grad, kernel):
        """On the parameters themselves, where each is a plain fp32 tensor on ``grad``'s device."""
        device, f32 = grad.device, torch.float32
        if not all(kernels.plain_memory(p) and p.dtype is f32 and p.device == device for p in bucket.params):
            return False
        kernel(bucket.params, bucket.views(grad), bucket.views(bucket.flat("exp_avg")),
               bucket.views(bucket.flat("exp_avg_sq")))
        return True

    def layer_norms(self, opt, bucket, parts):
        segments = bucket.segments
        return [norms(part if isinstance(part, list) else bucket.views(part), segments=segments) for part in parts]

    def step_layers_(self, opt, bucket, values, update, coeffs, scale):
        scales = [scale * c for c in coeffs]  # (one native pass where it runs: the same bits)
        if not kernels.lamb_warmup.step_layers_(values, update, bucket.segments, scales):
            views = bucket.views(update)
            torch._foreach_mul_(views, scales)
            torch._foreach_add_(values, views)

    def sum_over_ranks(self, opt, values):
        return values

    def freeze(self, opt, bucket):
        return bucket.flat("exp_avg_sq")  # v stays where it is; v_f is made from it when first needed

    def gather_local(self, opt, bucket, grad):
        """Into ``grad``, or (where the step allows it: ``opt.leave_gradients_in_place``) left in
        ``p.grad`` and only summed: the local momentum's pass then reads them there, and whatever
        reads ``grad`` first gathers them (:meth:`_gradients_left`)."""
        if not opt.leave_gradients_in_place(bucket, grad):
            opt.gather_observed(bucket, grad)

    @staticmethod
    def _gradients_left(bucket) -> list | None:
        """The gradients :meth:`gather_local` left in ``p.grad`` this step (``None``: it gathered
        them into the buffer), taken once: the caller reads them there, or gathers them."""
        return bucket.derived.pop("step.gradients_in_place", None)

    def local_momentum_(self, opt, bucket, x, beta1):
        sources = self._gradients_left(bucket)
        if sources is not None:
            kernels.gather_(sources, x, bucket.segments)
        m = bucket.flat("exp_avg")
        r = opt.exchange_preconditioner(bucket)
        if r is None:
            torch.lerp(m, x, 1 - beta1, out=x)
        else:  # one pass: clip(s_l R m_i, +-c_l K)
            kernels.lerp_scale_clamp_(x, m, 1 - beta1, r, opt.exchange_bounds(bucket), bucket.segments,
                                      opt.exchange_factors(bucket))

    def local_momentum_pass(self, opt, bucket, x, beta1):
        """The pass :meth:`local_momentum_` runs, not run yet: the preconditioned exchange's
        ``clip(s_l R m_i, +-c_l K)`` (its scalars taken now: ``exchange_factors`` is called once per
        exchange), or the momentum exchange's ``torch.lerp``."""
        m = bucket.flat("exp_avg")
        r = opt.exchange_preconditioner(bucket)
        sources = self._gradients_left(bucket)
        if r is None:
            return kernels.Lerp(x, m, 1 - beta1, sources=sources, segments=bucket.segments)
        return kernels.LerpScaleClamp(x, m, 1 - beta1, r, opt.exchange_bounds(bucket), bucket.segments,
                                      opt.exchange_factors(bucket), sources=sources,
                                      kept=bucket.derived.get("kept_momentum"))

    def exchange(self, opt, bucket, x, pending=None, keep_result=False):
        """With ``keep_result``, a flat 1-bit exchange leaves ``x`` as it is and its result rows are
        kept (copied: the exchange's buffers are reused), for :meth:`exchanged`; another averaging
        (hierarchical, fp32) writes the result into ``x`` as always."""
        rows = yield bucket, x, None, pending, not keep_result
        if not keep_result:
            return
        bucket.derived.pop("kept_momentum", None)  # (the kept rows change: m is read again until an update keeps them)
        bucket.derived["result_kept"] = rows is not None  # (None: the result is in x)
        if rows is not None:  # (into a buffer made once, kept across steps)
            kept = bucket.derived.get("result_rows")
            if kept is None or kept.shape != rows.shape or kept.device != rows.device:
                kept = bucket.derived["result_rows"] = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
            kept.copy_(rows)

    def exchanged(self, opt, bucket, x):
        if not bucket.derived.pop("result_kept", False):
            return x
        rows = bucket.derived["result_rows"]
        return kernels.CompressedResult(rows, chunk_numel(bucket.numel, rows.shape[0]), opt.scale_block, x)

    def keep_momentum(self, opt, bucket, m):
        bucket.flat("exp_avg").copy_(m)

    def previous_momentum(self, opt, bucket):
        return bucket.flat("exp_avg")

    def whole_momentum(self, opt, bucket):
        return bucket.flat("exp_avg")

    def layer_maxima(self, opt, bucket, values):
        raw = [1.0] * len(bucket.params)
        nonempty = [i for i, p in enumerate(bucket.params) if p.numel()]
        if nonempty:
            views = bucket.views(values)
            for i, f in zip(nonempty, torch.stack(maxima([views[i] for i in nonempty])).tolist()):
                raw[i] = f
        return raw

    def keep_exchange_factors(self, opt, bucket, root, denom, coeffs):
        """Only ``R`` is kept, unless the optimizer still divides by ``sqrt(v_f) + eps`` itself: the
        direction ``m / (sqrt(v_f) + eps)`` is ``A y``, ``A = 1 / (c_l + eps R)`` (0 where ``v_f ==
        0``), formed by a division in the update's pass (:meth:`step_preconditioned_`), as ZeRO forms it."""
        if not opt.keeps_denominator:
            bucket.flats.pop("frozen_denominator", None)

    def step_preconditioned_(self, opt, bucket, y, decay, alpha, step):
        """``m = y / (s_l R)`` into ``exp_avg`` and ``p <- p decay + alpha (f_l / s_l) y / (c_l + eps
        R)``, in one pass over memory (no direction buffer written; ZeRO's update, the momentum beside it).
        Where that pass read the result's kept rows, they are kept as ``m``'s source too: the next
        local momentum's pass forms ``m`` from them (:meth:`local_momentum_pass`; the same bits, 1/32
        of the bytes) unless ``m`` or the rows changed since."""
        kept = opt.momentum_from_exchange(bucket, self.exchanged(opt, bucket, y), out=bucket.flat("exp_avg"),
                                          descend=opt.preconditioned_descend(bucket, decay, alpha))
        self.keep_momentum_rows(opt, bucket, kept)

    def keep_momentum_rows(self, opt, bucket, kept):
        if kept is None:
            bucket.derived.pop("kept_momentum", None)
        else:
            bucket.derived["kept_momentum"] = kept

    def update_masters(self, opt, bucket, step, decay, delta, alpha=1.0):
        pass  # the parameters are the truth
