"""The 1-bit Adam optimizer: a ``torch.optim.Optimizer`` made of param groups, the gradient-sync
engine (:mod:`compressed_opt.engine`, through :class:`compressed_opt.optimizer.CompressedOptimizer`)
and 1-bit Adam's algorithm (:class:`compressed_opt.adam.AdamAlgorithm`; the algorithm's math is in
:mod:`compressed_opt.adam`'s docstring), with ZeRO's shards (:mod:`compressed_opt.zero`) where
``zero_stage`` asks for them.
"""
from __future__ import annotations

from compressed_opt.comm import DEFAULT_BLOCK

from .adam import DEFAULT_FREEZE_STEP, AdamAlgorithm
from .optimizer import CompressedOptimizer, common_args
from .zero import sharding


@common_args
class OnebitAdam(CompressedOptimizer):
    """1-bit Adam: AdamW during warmup, then 1-bit compressed momentum with a frozen variance.

    Warmup, steps ``1..freeze_step`` (gradients averaged at full precision): AdamW exactly::

        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
        p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)

    Compression stage (``v_f = v / (1 - b2^F)`` frozen at step ``F = freeze_step``): each rank's
    momentum ``m_i = b1 m + (1 - b1) g_i`` goes through the 1-bit exchange with error feedback,
    ``m = avg_1bit(m_i)``, and ``p = p (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v_f) + eps)``
    (the exchange preconditioned and each layer's step tracked: the module docstring).

    Example::

        torch.distributed.init_process_group("nccl")      # under torchrun
        opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2000)
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        print(opt.comm_stats())                            # bytes per step, warmup and compression

    Args:
        params: parameters or param groups, as for ``torch.optim.AdamW``.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (decoupled weight decay).
        freeze_step: warmup length in steps (>= 1), or ``"auto"`` to freeze when the variance has
            stabilised (:class:`compressed_opt.freeze.VarianceStabilityRule`; pass an instance
            to tune it). The step chosen is in ``optimizer.freeze_step`` and in checkpoints.
        bias_correction: Adam's bias correction (``False``: DeepSpeed's update).
        {common_args}
        zero_stage: 0, or 1 / 2 to shard the optimizer state ZeRO-style by the compressed
            allreduce's server chunks (:mod:`compressed_opt.zero`; 2 also reduce-scatters the
            warmup gradients). Checkpoints then hold this rank's shards: save one per rank and
            resume on the same world size.
        master_resync_interval: with ZeRO and bf16/fp16 parameters, every this many
            compression-stage steps the parameters are replaced by the gathered fp32 master
            chunks (:mod:`compressed_opt.zero`).
        exchange: ``"preconditioned"`` (default): the compression stage exchanges
            ``c_l m / sqrt(v_f)``, bounded, so no coordinate's 1-bit noise exceeds its layer's
            Adam step; ``"momentum"``: the paper's exchange of ``m`` (see the module doc).
        variance_tracking: ``True`` (default): in the compression stage each layer's step follows
            the change of its gradients' second moment since the freeze, measured on the ranks'
            local gradients (:mod:`compressed_opt.variance_tracking`; ``L`` floats per step in
            the step's existing all-gather); ``False``: the paper's frozen variance.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 freeze_step=DEFAULT_FREEZE_STEP, *,
                 bias_correction=True, backend=None, bucket_cap_mb=25.0, overlap=True, accumulation_steps=1,
                 zero_stage=0, master_resync_interval=100, exchange="preconditioned", variance_tracking=True,
                 hierarchy="auto", path=None, scale_block=DEFAULT_BLOCK):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bool(bias_correction))
        name = type(self).__name__
        algorithm = AdamAlgorithm(name, freeze_step, exchange, variance_tracking,
                                  sharding(name, zero_stage, master_resync_interval))
        super().__init__(params, defaults, algorithm, backend=backend, bucket_cap_mb=bucket_cap_mb, overlap=overlap,
                         accumulation_steps=accumulation_steps, hierarchy=hierarchy, path=path,
                         scale_block=scale_block)

    @property
    def freeze_step(self) -> int | None:
        """The last full-precision step (``None`` with ``freeze_step="auto"`` until the rule decides)."""
        return self._algorithm.schedule_.freeze_step
