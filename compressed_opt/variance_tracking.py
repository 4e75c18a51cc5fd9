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
checkpoints carry them exactly. :class:`VarianceTracking` is the transform an algorithm holds:
its per-bucket state is a :class:`TrackedLayers`, and it reads the per-layer sums of squares of
the local gradients that the engine takes while it gathers them
(:class:`compressed_opt.engine.BucketSync`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compressed_opt.cuda import segment_sumsq

from .reductions import norms
from .state import DERIVED, LAYER, STEP, buffer

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




@dataclass(eq=False)
class TrackedLayers:
    """A bucket's tracking state (:mod:`compressed_opt.state`)."""

    #: one row of :data:`COLUMNS` per layer; ``optimizer.state[p]["layer_variance"]`` are its rows
    layer_variance: torch.Tensor | None = buffer(LAYER, torch.float64)
    #: per layer, the factors of the latest update (made again from the rows after a load)
    factors: list | None = buffer(DERIVED)
    #: ``(step, per-layer sums of squares of the raw average, the address of the buffer the update
    #: reads where the step averaged it, else None)``
    mean: tuple | None = buffer(STEP)
    #: a full-precision step's ``(ranks' mean of their local sums, the average's sums)``
    warmup_local: tuple | None = buffer(STEP)


def _betas(param_groups: list) -> list:
    """What the rows' update depends on in the param groups: each one's ``beta2`` and bias correction."""
    out = []
    for g in param_groups:
        out.append((g["betas"][1], g["bias_correction"]))
    return out


def check_checkpoint(name: str, enabled: bool, extra: dict) -> None:
    """A checkpoint saved in the compression stage must have been tracked as this optimizer tracks
    (older checkpoints: not tracked)."""
    tracked = extra.get("variance_tracking", False)
    if extra["frozen"] and tracked != enabled:
        raise ValueError(
            f"this checkpoint was saved in the compression stage of {name}(variance_tracking={tracked}); its "
            f"per-layer variance tracking cannot be {'made up' if enabled else 'dropped'} "
            f"mid-run. Resume it with {name}(..., variance_tracking={tracked})"
        )


class VarianceTracking:
    """The tracking of an algorithm's buckets (see the module doc). ``clock(step)`` gives ``(t - F,
    t', F')``: the compression steps so far, and the number of updates in Adam's ``v`` now and at
    the freeze (``c(t) = (1 - b2^F') / (1 - b2^t')``). The algorithm calls
    :meth:`observe_average` with each full-precision step's average as backward (or ``step()``)
    made it, :meth:`observe_update` with the average its update reads, :meth:`start` at the freeze,
    :meth:`statistics` for the step's agreement all-gather and :meth:`before_update` with every
    rank's, then applies :meth:`last_factors` (before the exchange) and ``tracked.factors`` (after it)."""

    def __init__(self, clock):
        self.clock = clock
        #: from a DDP hook, by whether they are of the average: (per parameter in state_dict order,
        #: its last sum of squares, the step it is of)
        self._hooked: dict = {}
        self._batches = None  # the buckets one update of the rows serves at once (see _batches_of)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_batches": None}

    @staticmethod
    def layers(bucket) -> TrackedLayers:
        """A new bucket's state: no EMA yet, ``rho = 1``."""
        return TrackedLayers(layer_variance=new_rows(len(bucket.params), bucket.device))

    # --- the sums of squares -----------------------------------------------------------------------
    def observe_average(self, bucket, tracked: TrackedLayers, mean: torch.Tensor, stepped: bool, step: int) -> None:
        """End of a full-precision step's backward: the bucket's average ``mean`` as backward made
        it, before it goes into ``p.grad`` (and before the loop clips or unscales it). ``stepped``:
        ``step()`` averaged it, and the update reads this buffer next, as it is (its sums serve both)."""
        sums = torch.empty(len(bucket.params), dtype=torch.float64, device=mean.device)
        segment_sumsq(mean, bucket.segments, sums)
        tracked.mean = (step, sums, mean.data_ptr() if stepped else None)

    def observe_hooked(self, indices: torch.Tensor, sums: torch.Tensor, averaged: bool, count: int,
                       step: int) -> None:
        """From a DDP hook, during a full-precision step's backward: the sums of squares (float64,
        one per parameter, as the gather computes them) of the local gradients of the parameters
        ``indices`` before DDP averages them (``averaged``: of the average, before the loop sees
        it); ``count`` parameters in all."""
        values, steps = self._hooked.get(averaged, (None, None))
        if values is None or values.numel() != count or values.device != sums.device:
            values = torch.zeros(count, dtype=torch.float64, device=sums.device)
            steps = torch.zeros(count, dtype=torch.int64, device=sums.device)
            self._hooked[averaged] = (values, steps)
        values.index_copy_(0, indices, sums)
        steps.index_fill_(0, indices, step)

    def _hooked_sums(self, bucket, tracked: TrackedLayers, step: int, index_of) -> torch.Tensor | None:
        """This rank's per-layer sums of its own gradients of ``step`` from a DDP hook (which also
        gave the average's), where it saw every parameter of ``bucket``; else ``None``."""
        if len(self._hooked) != 2 or not bucket.params:
            return None
        (local, local_steps), (mean, mean_steps) = self._hooked[False], self._hooked[True]
        indices = torch.tensor([index_of(p) for p in bucket.params], dtype=torch.int64, device=local.device)
        if not bool(torch.cat([local_steps[indices], mean_steps[indices]]).eq(step).all()):
            return None
        sync = bucket.sync
        sync.local.copy_(local[indices])
        sync.local_step = step
        tracked.mean = (step, mean[indices].to(bucket.device), None)
        return sync.local

    def statistics(self, buckets: list, step: int, frozen: bool, full: bool, index_of) -> torch.Tensor:
        """The per-layer sums of this step's local ``g_i^2`` (the engine's, where its gather read them,
        else a DDP hook's): every compression step, and the full-precision steps whose local gradients
        were seen (every rank alike: the same mode everywhere); else none."""
        found = []
        if not (frozen or full):
            return torch.zeros(0, dtype=torch.float64)
        for b in buckets:
            sync = b.sync
            sums = sync.local if sync.local_step == step else self._hooked_sums(b, b.state.tracked, step, index_of)
            if sums is None and not frozen:
                return torch.zeros(0, dtype=torch.float64)
            found.append(sums)
        return torch.cat(found) if found else torch.zeros(0, dtype=torch.float64)

    # --- the update ----------------------------------------------------------------------------------
    def observe_update(self, bucket, tracked: TrackedLayers, grad: torch.Tensor, step: int) -> None:
        """A full-precision step's update reads the average ``grad``: its per-layer sums of squares
        into the EMA, and the ranks' local ones of the same step (where they were seen) into the
        local EMA."""
        kept = tracked.mean
        if kept is not None and kept[0] == step and kept[2] == grad.data_ptr():
            sums = kept[1]  # step() averaged this very buffer for this update and took its sums then
        else:  # (the C pass where it runs: a fifth of PyTorch's float64 norm's time)
            sums = segment_sumsq(grad, bucket.segments,
                                 torch.empty(len(bucket.params), dtype=torch.float64, device=grad.device))
        observe_warmup(tracked.layer_variance, sums, tracked.warmup_local)

    def start(self, bucket, tracked: TrackedLayers, v: torch.Tensor) -> None:
        """At the freeze, from the bucket's whole raw variance ``v`` (not bias-corrected), the same
        on every rank."""
        start(tracked.layer_variance, sums(bucket.views(v[: bucket.numel]), bucket.device), bucket.layer_numels)

    def before_update(self, buckets: list, step: int, full: bool, frozen: bool, statistics: torch.Tensor,
                      param_groups: list) -> None:
        """Compression stage: every rank's per-layer sums (``statistics``, one row per rank) into
        ``rho``, and this step's factors (each bucket's ``tracked.factors``). A full-precision step:
        the ranks' mean of their sums, for :meth:`observe_update`."""
        if not frozen:
            if full and statistics.numel():
                local, offset = statistics.mean(dim=0), 0
                for b in buckets:
                    tracked = b.state.tracked
                    mean = tracked.mean
                    if mean is not None and mean[0] == step:
                        tracked.warmup_local = (local[offset: offset + len(b.params)], mean[1])
                    offset += len(b.params)
            return
        means = statistics.mean(dim=0)  # (the same rows, in rank order, on every rank)
        since, now, then = self.clock(step)
        batches = self._batches
        if batches is None or batches[1] is not buckets or batches[3] != _betas(param_groups):
            batches = self._batches_of(buckets, param_groups)
        # the buckets of one (beta2, bias_correction) at once: the same element-wise math on their
        # layers' rows stacked (a few small ops per step, not per bucket), written back after
        for (beta2, bias_correction, _), (members, layers, numels) in batches[2].items():
            if len(members) == 1:
                rows = buckets[members[0]].state.tracked.layer_variance
            else:
                rows = torch.cat([buckets[i].state.tracked.layer_variance for i in members])
            w = means.to(rows) if layers is None else means.to(rows.device)[layers].to(rows)
            track(rows, w / numels, since, beta2)
            f = factors(rows, now, then, beta2, bias_correction)
            if len(members) > 1:
                torch._foreach_copy_([buckets[i].state.tracked.layer_variance for i in members],
                                     list(rows.split([len(buckets[i].params) for i in members])))
            offset = 0
            for i in members:
                n = len(buckets[i].params)
                buckets[i].state.tracked.factors = f[offset: offset + n]
                offset += n

    def _batches_of(self, buckets: list, param_groups: list) -> tuple:
        """``(None, buckets, {(beta2, bias_correction, device): (bucket positions, layers, numels)},
        the groups' betas)``: the buckets whose rows one update serves, the positions of their layers
        in the step's per-layer statistics (``None``: all of them, in order) and the layers' numels;
        kept until the buckets or the groups' ``betas`` change."""
        batches, offset = {}, 0
        for i, b in enumerate(buckets):
            group = param_groups[b.group_index]
            members = batches.setdefault((group["betas"][1], group["bias_correction"], b.device), ([], []))
            members[0].append(i)
            members[1].extend(range(offset, offset + len(b.params)))
            offset += len(b.params)
        out = {}
        for k, (members, layers) in batches.items():
            device = buckets[members[0]].device
            numels = (torch.cat([buckets[i].layer_numels for i in members]) if len(members) > 1
                      else buckets[members[0]].layer_numels)
            whole = layers == list(range(offset))
            out[k] = (members, None if whole else torch.tensor(layers, dtype=torch.int64, device=device), numels)
        self._batches = (None, buckets, out, _betas(param_groups))
        return self._batches

    def last_factors(self, bucket, tracked: TrackedLayers, group: dict, global_step: int) -> list[float]:
        """Compression stage: the per-layer factors of the last update, for the bound of the next
        exchange, which runs before this step's factors exist. 1 before the first compressed update;
        after a load, made again from the rows, which are the last update's."""
        f = tracked.factors
        if f is None:
            _, now, then = self.clock(global_step)
            beta2 = group["betas"][1]
            f = tracked.factors = factors(tracked.layer_variance, now, then, beta2, group["bias_correction"])
        return f
