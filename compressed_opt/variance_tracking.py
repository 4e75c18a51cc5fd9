"""Per-layer variance tracking for a frozen-variance compression stage (beyond the papers).

1-bit Adam divides by the variance frozen at step ``F``, ``v_f``, for the rest of training. Where
the gradients keep shrinking after ``F`` (a loss that keeps falling at a constant learning rate),
Adam's own ``v`` shrinks with them and the frozen one does not: every step after the freeze is
smaller than Adam's, by ``sqrt(v_f / v(t))``. Measured on scikit-learn's digits (2 ranks, 400
steps, freeze at 80), with the compressed exchange replaced by the exact average: 1.26x AdamW's
final loss, all of it from the frozen variance (docs/design.md, 2.3.2).

The fix keeps ``v_f``'s per-coordinate shape and follows one scalar per layer (parameter tensor)
``l``, ``rho_l(t) ~ mean_l v(t) / mean_l v(F)``, from the ranks' *local* gradients, which every rank
has in the compression stage; their per-layer means of squares are averaged over the ranks in the
step's existing agreement all-gather (``L`` floats per step, no extra collective). A local
gradient's second moment exceeds the average's (it carries ``world`` times the noise), so it is
calibrated once against the averaged gradient, at the same warmup steps::

    warmup:       a_l = EMA_0.9 of mean_l(g^2)     (g: the averaged gradient; bias-corrected)
                  kappa_l = EMA_0.9 of the ranks' mean of mean_l(g_i^2) / EMA_0.9 of mean_l(gbar^2)
                                  (g_i: their local gradients, gbar their average, as backward made
                                   them, at the same steps: local over averaged second moments)
    freeze F:     cal_l = mean_l v(F) / a_l         (v raw, not bias-corrected); rho_l = 1
                  ref_l = kappa_l * mean_l v(F)
    step t > F:   w_l = mean over the ranks of mean_l(g_i^2)
                  rho_l = b2 rho_l + (1 - b2) w_l / ref_l
                  factor_l = clip((rho_l c(t))^(-1/2), 1/B, B),  c(t) = (1 - b2^F) / (1 - b2^t)
                             (c = 1 without bias correction), B = 4
    update:       p <- p - lr factor_l m_hat / (sqrt(v_f) + eps)

``w_l / ref_l = (w_l / kappa_l) / mean_l v(F)`` is the averaged gradient's second moment now in
units of ``v(F)``, so ``rho_l`` follows Adam's recursion ``v = b2 v + (1 - b2) g^2`` for the
layer's mean, and ``factor_l`` is ``sqrt(v_f / v_hat(t))`` for it. The factor scales the step:
0/1 Adam's after its exchange; OnebitAdam's preconditioned exchange carries the last update's
factor inside the exchanged vector (docs/design.md 2.3.3), so each layer reaches the 1-bit
compressor at the size of its step.

``kappa_l`` is measured where the local and the averaged gradients are both at hand, at the same
steps and before the training loop touches the average (clipping, a GradScaler's unscaling: both
sides as backward made them, so any scale cancels): gradients are spiky (a layer's mean square
moves by 10-1000x between windows of ten steps), so a ratio of windows taken at different steps is
off by as much. The sums come from the pass that gathers the local gradients and, for the average,
from where it is written into ``p.grad`` (under a DDP hook, from the hook). Where a warmup step saw
neither (a checkpoint of an older version), ``ref_l`` falls back to ``cal_l`` times the mean of
``w_l`` over the first ``C = 10`` compression steps.

The eight numbers per layer (:data:`COLUMNS`) are one row of a ``(L, 8)`` float64 tensor per
bucket; each parameter's ``optimizer.state[p]["layer_variance"]`` is a view of its row, so
checkpoints carry them exactly. :class:`LayerVarianceTracking` plugs this into an optimizer.
"""
from __future__ import annotations

import torch

from compressed_opt.cuda import segment_sumsq, sumsq_each

from .buffers import LAYER, Buffer
from .reductions import norms

#: the columns of a layer's row: the warmup EMA of the sum of squares of the averaged gradient
#: (whole on every rank in every mode, ZeRO included), the EMA's number of updates, rho, the
#: reference ``ref_l``, the calibration ``cal_l``, the warmup EMAs of the ranks' mean sum of squares
#: of their local gradients and of their average's, both as backward made them (NaN once a warmup
#: step had none), and 1 where ``ref_l`` was made from them at the freeze (0: from the first
#: compression steps)
COLUMNS = ("grad_sq_ema", "ema_updates", "ratio", "reference", "calibration", "local_sq_ema", "mean_sq_ema",
           "reference_fixed")
EMA, UPDATES, RATIO, REFERENCE, CALIBRATION, LOCAL_EMA, MEAN_EMA, FIXED = range(len(COLUMNS))
#: the columns of version 1 (checkpoint format 1), which a load extends (:func:`upgrade_rows`)
LEGACY_COLUMNS = 5
#: the EMA's coefficient for ``a_l``: about the last 10 warmup steps
EMA_BETA = 0.9
#: compression steps whose local second moments are averaged into the reference
CALIBRATION_STEPS = 10
#: the factor stays within [1/FACTOR_BOUND, FACTOR_BOUND]
FACTOR_BOUND = 4.0


def new_rows(n_layers: int, device) -> torch.Tensor:
    """The rows of a bucket's layers before any step: no EMA yet, ``rho = 1``."""
    rows = torch.zeros(n_layers, len(COLUMNS), dtype=torch.float64, device=device)
    rows[:, RATIO] = 1.0
    return rows


def sums(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """Per tensor of non-negative values, their sum in float64 on ``device``."""
    return norms(tensors, 1, device)


def upgrade_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows of version 1 (5 columns) with this version's columns: no local EMA (NaN: the fallback
    reference), no reference fixed at the freeze."""
    if rows.shape[-1] == len(COLUMNS):
        return rows
    extra = rows.new_zeros(*rows.shape[:-1], len(COLUMNS) - rows.shape[-1])
    extra[..., LOCAL_EMA - LEGACY_COLUMNS] = float("nan")
    extra[..., MEAN_EMA - LEGACY_COLUMNS] = float("nan")
    return torch.cat([rows, extra], dim=-1)


def observe_warmup(rows: torch.Tensor, sums: torch.Tensor, raw: tuple | None) -> None:
    """One warmup step: ``sums`` (per layer, the averaged gradient's sum of squares, as the step
    uses it) into the EMA; ``raw``, ``(local, mean)``: the ranks' mean of their local gradients'
    sums of squares and their average's, as backward made both, into the local and mean EMAs
    (``None``: this step's were not seen, which makes them NaN)."""
    rows[:, EMA].mul_(EMA_BETA).add_(sums.to(rows), alpha=1 - EMA_BETA)
    for column, values in zip((LOCAL_EMA, MEAN_EMA), raw if raw is not None else (None, None)):
        if values is None:
            rows[:, column] = float("nan")
        else:
            rows[:, column].mul_(EMA_BETA).add_(values.to(rows), alpha=1 - EMA_BETA)
    rows[:, UPDATES].add_(1.0)


def start(rows: torch.Tensor, variance_sums: torch.Tensor, numels: torch.Tensor) -> None:
    """At the freeze: ``cal_l`` from the EMA and the layers' sums of the raw variance ``v(F)``;
    ``rho = 1``; ``ref_l = kappa_l mean_l v(F)`` where the local and mean EMAs were kept through
    the warmup (else 0, made from the first compression steps). A layer that never had a gradient
    gets ``cal = 0`` (its ``v_f`` is 0: it does not move anyway)."""
    numels = numels.to(rows)
    debias = 1.0 - EMA_BETA ** rows[:, UPDATES].clamp(min=1.0)
    a = rows[:, EMA] / numels / debias
    rows[:, CALIBRATION] = torch.where(a > 0, variance_sums.to(rows) / numels / a, torch.zeros_like(a))
    rows[:, RATIO] = 1.0
    kappa = rows[:, LOCAL_EMA] / rows[:, MEAN_EMA]
    fixed = torch.isfinite(kappa) & (kappa > 0) & (rows[:, CALIBRATION] > 0)
    v_mean = variance_sums.to(rows) / numels
    rows[:, REFERENCE] = torch.where(fixed, kappa * v_mean, torch.zeros_like(kappa))
    rows[:, FIXED] = fixed.to(rows)


def track(rows: torch.Tensor, local_means: torch.Tensor, since_freeze: int, beta2: float) -> None:
    """Compression step ``F + since_freeze``: ``local_means`` (per layer, the ranks' mean of
    ``mean_l(g_i^2)``, identical on every rank) into the reference (the first
    :data:`CALIBRATION_STEPS` steps) and into ``rho``."""
    w = local_means.to(rows)
    if since_freeze <= CALIBRATION_STEPS:  # (where the warmup did not fix the reference)
        target = w * rows[:, CALIBRATION]
        update = (target - rows[:, REFERENCE]) / since_freeze
        rows[:, REFERENCE].add_(torch.where(rows[:, FIXED] > 0, torch.zeros_like(update), update))
    ref = rows[:, REFERENCE]
    ratio = torch.where(ref > 0, w / ref, torch.ones_like(w))
    rows[:, RATIO].mul_(beta2).add_(ratio, alpha=1 - beta2)


def factors(rows: torch.Tensor, step: int, freeze_step: int, beta2: float, bias_correction: bool) -> list[float]:
    """Per layer, ``factor_l`` for the update of step ``step`` (``step`` and ``freeze_step``: the
    numbers of updates in ``v`` then and at the freeze, for ``c(t)``)."""
    c = (1.0 - beta2 ** freeze_step) / (1.0 - beta2 ** step) if bias_correction else 1.0
    f = (rows[:, RATIO] * c).rsqrt().clamp_(1.0 / FACTOR_BOUND, FACTOR_BOUND)
    return f.tolist()


class LayerVarianceTracking:
    """The tracking in an optimizer (a mixin of :class:`~compressed_opt.optimizer.CompressedOptimizer`
    with a ``frozen`` flag): it calls :meth:`_observe_averaged_gradient` with each warmup (or
    refresh) step's averaged gradient, :meth:`_start_variance_tracking` at the freeze,
    :meth:`gather_observed` to gather a compression step's gradients (ZeRO, which reads
    ``p.grad`` itself: :meth:`observe_local_gradient`), applies :meth:`_variance_factors_of`
    (or :meth:`_variance_factors_`) to each compression-stage update, and says where the frozen
    variance's updates are counted (:meth:`_tracking_clock`). The per-step all-gather and
    the update of ``rho`` come through the base class's hooks."""

    buffers = {"layer_variance": Buffer(LAYER, torch.float64)}  # the rows of state[p]["layer_variance"]

    def _init_variance_tracking(self, enabled) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"variance_tracking must be True or False, got {enabled!r}")
        self.variance_tracking = enabled
        self.layer_state = {"layer_variance": len(COLUMNS)} if enabled else {}
        self._local_square_sums = {}  # bucket index -> this step's per-layer sums of g_i^2
        self._summed_buffers = {}  # bucket index -> (address, version) of the buffer they were summed from
        self._summed_step = {}  # bucket index -> the step whose local gradients they are
        #: bucket index -> (step, per-layer sums of squares of the raw average, the address of the
        #: buffer the update reads where step() averaged it, else None)
        self._mean_sums = {}
        #: from a DDP hook, by whether they are of the average: (per parameter in state_dict order,
        #: its last sum of squares, the step it is of)
        self._hooked = {}
        self._warmup_local = {}  # bucket index -> a warmup step's ranks' mean of those sums
        self._layer_factors = {}  # bucket index -> this step's per-layer factors

    @property
    def observes_square_sums(self) -> bool:
        return self.variance_tracking

    def _load_tracking_of(self, extra: dict) -> None:
        """A checkpoint saved in the compression stage must have been tracked as this optimizer
        tracks (older checkpoints: not tracked). The factors of the steps before the load are
        forgotten (:meth:`_last_variance_factors` makes them again from the loaded rows)."""
        self._layer_factors.clear()
        tracked = extra.get("variance_tracking", False)
        if extra["frozen"] and tracked != self.variance_tracking:
            name = type(self).__name__
            raise ValueError(
                f"this checkpoint was saved in the compression stage of {name}(variance_tracking={tracked}); its "
                f"per-layer variance tracking cannot be {'made up' if self.variance_tracking else 'dropped'} "
                f"mid-run. Resume it with {name}(..., variance_tracking={tracked})"
            )

    def _tracking_clock(self, step: int) -> tuple[int, int, int]:
        """``(t - F, t', F')`` at step ``t``: the compression steps so far, and the number of
        updates in Adam's ``v`` now and at the freeze (``c(t) = (1 - b2^F') / (1 - b2^t')``)."""
        raise NotImplementedError

    def _new_layer_rows(self, name, bucket):
        return new_rows(len(bucket.params), bucket.device)

    def _observe_averaged_gradient(self, bucket, grad) -> None:
        """Warmup: the averaged gradient's per-layer sums of squares into the EMA, and the ranks'
        local ones of the same step (when the gather saw them) into the local EMA."""
        if self.variance_tracking:  # (the C pass where it runs: a fifth of PyTorch's float64 norm's time)
            kept = self._mean_sums.get(bucket.index)
            if kept is not None and kept[0] == self.global_step + 1 and kept[2] == grad.data_ptr():
                sums = kept[1]  # step() averaged this very buffer for this update and took its sums then
            else:
                sums = segment_sumsq(grad, bucket.segments,
                                     torch.empty(len(bucket.params), dtype=torch.float64, device=grad.device))
            observe_warmup(bucket.flats["layer_variance"], sums, self._warmup_local.get(bucket.index))

    def _start_variance_tracking(self, bucket, v) -> None:
        """At the freeze, from the bucket's whole raw variance ``v`` (not bias-corrected), the
        same on every rank."""
        if self.variance_tracking:
            rows = bucket.flats["layer_variance"]
            start(rows, sums(bucket.views(v[: bucket.numel]), bucket.device), bucket.layer_numels)

    def observe_local_gradient(self, bucket) -> None:
        """Compression stage, ZeRO (the local momentum is formed from ``p.grad`` directly): this
        rank's per-layer sums of ``g_i^2`` from ``p.grad`` as the loop left it, unscaled."""
        if self.variance_tracking and self.frozen:  # (summed as the gather's sums: kernels.gather_)
            self._local_square_sums[bucket.index] = sumsq_each(
                [p.grad for p in bucket.params], bucket.segments,
                torch.empty(len(bucket.params), dtype=torch.float64, device=bucket.device))
            self._summed_step[bucket.index] = self.global_step + 1

    def gather_observed(self, bucket, grad: torch.Tensor) -> None:
        """The bucket's gradients into ``grad`` (unscaled); where they are this rank's own (not
        an average a DDP hook or this step's full-precision average wrote into ``p.grad``), their
        per-layer sums of ``g_i^2`` in the same pass."""
        if not (self.variance_tracking and self._gathers_local()):
            bucket.gather_grads(grad)
            if self.variance_tracking:
                self._take_hooked_sums(bucket, grad.device)
            return
        out = self._local_sums_buffer(bucket, grad.device)
        bucket.gather_grads(grad, square_sums=out)
        self._summed_buffers[bucket.index] = (grad.data_ptr(), grad._version)
        self._summed_step[bucket.index] = self.global_step + 1

    def observe_in_place(self, bucket, grad: torch.Tensor, sources: list) -> None:
        """A compression step's gather that leaves the bucket's gradients (``sources``) in ``p.grad``
        (the exchange's passes read them there; ``grad`` is not written): their per-layer sums of
        ``g_i^2`` only, as :meth:`gather_observed` sums them, for the step's finiteness check and
        (with tracking) its statistics."""
        out = self._local_sums_buffer(bucket, grad.device)
        sumsq_each(sources, bucket.segments, out)
        self._summed_buffers[bucket.index] = (grad.data_ptr(), grad._version)
        if self.variance_tracking:
            self._summed_step[bucket.index] = self.global_step + 1

    def _local_sums_buffer(self, bucket, device) -> torch.Tensor:
        out = self._local_square_sums.get(bucket.index)
        if out is None or out.numel() != len(bucket.params) or out.device != device:
            out = torch.empty(len(bucket.params), dtype=torch.float64, device=device)
            self._local_square_sums[bucket.index] = out
        return out

    def observe_local_square_sums(self, indices: torch.Tensor, sums: torch.Tensor, averaged: bool = False) -> None:
        """From a DDP hook, during a full-precision step's backward: the sums of squares (float64,
        one per parameter, as the gather computes them) of the local gradients of the parameters
        ``indices`` before DDP averages them (``averaged``: of the average, before the loop sees
        it)."""
        count = sum(len(g["params"]) for g in self.param_groups)
        values, steps = self._hooked.get(averaged, (None, None))
        if values is None or values.numel() != count or values.device != sums.device:
            values = torch.zeros(count, dtype=torch.float64, device=sums.device)
            steps = torch.zeros(count, dtype=torch.int64, device=sums.device)
            self._hooked[averaged] = (values, steps)
        values.index_copy_(0, indices, sums)
        steps.index_fill_(0, indices, self.global_step + 1)

    def observe_mean_square_sums(self, bucket, mean: torch.Tensor, stepped: bool = False) -> None:
        """End of a full-precision step's backward: the bucket's average ``mean`` as backward made
        it, before it goes into ``p.grad`` (and before the loop clips or unscales it). ``stepped``:
        step() averaged it, and the update reads this buffer next, as it is (its sums serve both)."""
        if self.variance_tracking:
            sums = torch.empty(len(bucket.params), dtype=torch.float64, device=mean.device)
            segment_sumsq(mean, bucket.segments, sums)
            self._mean_sums[bucket.index] = (self.global_step + 1, sums, mean.data_ptr() if stepped else None)

    def _take_hooked_sums(self, bucket, device) -> None:
        """The bucket's sums of this step from a DDP hook, where it saw every parameter."""
        if len(self._hooked) != 2 or not bucket.params:
            return
        indices = bucket.derived.get("param_indices")
        (local, local_steps), (mean, mean_steps) = self._hooked[False], self._hooked[True]
        if indices is None or indices.device != local.device:
            indices = bucket.derived["param_indices"] = torch.tensor(
                [self.param_index(p) for p in bucket.params], dtype=torch.int64, device=local.device)
        step = self.global_step + 1
        if not bool(torch.cat([local_steps[indices], mean_steps[indices]]).eq(step).all()):
            return
        self._local_sums_buffer(bucket, device).copy_(local[indices])
        self._summed_step[bucket.index] = step
        self._mean_sums[bucket.index] = (step, mean[indices].to(device), None)

    def _gathered_finite(self, buckets):
        """From the sums of squares where they were taken of the buffers as they are now: float64
        sums of fp32 squares are finite exactly when every element is (no extra pass)."""
        sums = []
        for b in buckets:
            grad = self._grad_buffer(b)
            if self._summed_buffers.get(b.index) != (grad.data_ptr(), grad._version):
                return super()._gathered_finite(buckets)
            sums.append(self._local_square_sums[b.index])
        return not sums or bool(torch.cat(sums).sum().isfinite())

    def _step_statistics(self, step):
        """The per-layer sums of this step's local ``g_i^2``: every compression step, and the
        full-precision steps whose local gradients the gather saw (every rank alike: the same
        mode everywhere)."""
        if not self.variance_tracking or not self._buckets:
            return super()._step_statistics(step)
        local = all(self._summed_step.get(b.index) == step for b in self._buckets)
        if self.frozen or (local and self._needs_average(step)):
            return torch.cat([self._local_square_sums[b.index].to(b.device) for b in self._buckets])
        return super()._step_statistics(step)

    def _before_update(self, step, averaged):
        """Compression stage: every rank's per-layer sums into ``rho``, and this step's factors.
        A full-precision step: the ranks' mean of their sums, for :meth:`_observe_averaged_gradient`."""
        super()._before_update(step, averaged)
        if not self.variance_tracking:
            return
        if not self.frozen:
            self._warmup_local.clear()
            if averaged and self._rank_statistics.numel():
                local, offset = self._rank_statistics.mean(dim=0), 0
                for b in self._buckets:
                    mean = self._mean_sums.get(b.index)
                    if mean is not None and mean[0] == step:
                        self._warmup_local[b.index] = (local[offset: offset + len(b.params)], mean[1])
                    offset += len(b.params)
            return
        means = self._rank_statistics.mean(dim=0)  # (the same rows, in rank order, on every rank)
        since, now, then = self._tracking_clock(step)
        # the buckets of one (beta2, bias_correction) at once: the same element-wise math on their
        # layers' rows stacked (a few small ops per step, not per bucket), written back after
        for (beta2, bias_correction, _), (buckets, layers, numels) in self._tracking_batches().items():
            rows = buckets[0].flats["layer_variance"] if len(buckets) == 1 else torch.cat(
                [b.flats["layer_variance"] for b in buckets])
            w = means.to(rows) if layers is None else means.to(rows.device)[layers].to(rows)
            track(rows, w / numels, since, beta2)
            f = factors(rows, now, then, beta2, bias_correction)
            if len(buckets) > 1:
                torch._foreach_copy_([b.flats["layer_variance"] for b in buckets],
                                     list(rows.split([len(b.params) for b in buckets])))
            offset = 0
            for b in buckets:
                self._layer_factors[b.index] = f[offset: offset + len(b.params)]
                offset += len(b.params)

    def _tracking_batches(self) -> dict:
        """``{(beta2, bias_correction, device): (buckets, layers, numels)}``: the buckets whose rows one
        update serves, the positions of their layers in the step's per-layer statistics (``None``:
        all of them, in order) and the layers' numels; made again when the buckets or the groups'
        ``betas`` change."""
        # (the cache holds the buckets, so their ids cannot be reused while it is kept)
        key = (tuple(map(id, self._buckets)), tuple((g["betas"][1], g["bias_correction"]) for g in self.param_groups))
        cached = getattr(self, "_tracking_batches_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        batches, offset = {}, 0
        for b in self._buckets:
            group = self.param_groups[b.group_index]
            members = batches.setdefault((group["betas"][1], group["bias_correction"], b.device), ([], []))
            members[0].append(b)
            members[1].extend(range(offset, offset + len(b.params)))
            offset += len(b.params)
        out = {}
        for k, (buckets, layers) in batches.items():
            device = buckets[0].device
            numels = torch.cat([b.layer_numels for b in buckets]) if len(buckets) > 1 else buckets[0].layer_numels
            whole = layers == list(range(offset))
            out[k] = (buckets, None if whole else torch.tensor(layers, dtype=torch.int64, device=device), numels)
        self._tracking_batches_cache = (key, out)
        return out

    def _last_variance_factors(self, bucket) -> list[float] | None:
        """Compression stage: the per-layer factors of the last update (``None``: not tracked, or
        still warming up), for the bound of the next exchange, which runs before this step's
        factors exist. 1 before the first compressed update; after a load, made again from the
        rows, which are the last update's."""
        if not (self.variance_tracking and self.frozen):
            return None
        f = self._layer_factors.get(bucket.index)
        if f is None:
            group = self.param_groups[bucket.group_index]
            _, now, then = self._tracking_clock(self.global_step)
            f = factors(bucket.flats["layer_variance"], now, then, group["betas"][1], group["bias_correction"])
            self._layer_factors[bucket.index] = f
        return f

    def _variance_factors_of(self, bucket) -> list[float] | None:
        """This compression step's per-layer factors of the bucket (``None``: not tracked)."""
        return self._layer_factors[bucket.index] if self.variance_tracking else None

    def _variance_factors_(self, bucket, direction) -> None:
        """Compression stage: each layer's part of ``direction`` times its factor."""
        if self.variance_tracking:
            views = bucket.views(direction[: bucket.numel])
            if views:
                torch._foreach_mul_(views, self._layer_factors[bucket.index])
