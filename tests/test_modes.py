"""1-bit LAMB and 0/1 Adam in every mode they run in (OnebitAdam's are in test_onebit_adam.py):
standalone overlapped and synchronous, ZeRO 1 and 2 (1-bit LAMB), under DDP's comm hook. In each,
the final loss on the digits task stays within 5% of the uncompressed optimizer's, and a run
resumed from a checkpoint is bit-exact. Two Gloo ranks, different data on each."""
import pytest
import torch
from torch import nn

from compressed_opt import OnebitLamb, ZeroOneAdam
from distributed import run_ranks
from optim_tasks import MODES, full_loss, in_mode, mlp, resume_diff, run_steps, shard_batches

LAMB_MODES = MODES
ZERO_ONE_MODES = ("overlap", "sync", "ddp")  # 0/1 Adam is not sharded (see compressed_opt.zero)
LAMB = dict(lr=0.02, max_coeff=0.25)
ZERO_ONE = dict(lr=3e-3, var_freeze_step=30, var_update_scaler=8, local_step_scaler=10, local_step_clipper=4)
STEPS = 150


def _lamb(rank, world):
    batches = list(shard_batches(rank, world, STEPS))
    losses = {}
    for mode in (*LAMB_MODES, "uncompressed"):
        model = mlp()
        freeze = 10**9 if mode == "uncompressed" else 75
        net, opt = in_mode(OnebitLamb, model, "overlap" if mode == "uncompressed" else mode, freeze_step=freeze, **LAMB)
        run_steps(net, opt, batches)
        losses[mode] = full_loss(model)

    def fresh(mode):
        model = mlp()
        return (model, *in_mode(OnebitLamb, model, mode, freeze_step=4, **LAMB))

    # checkpoints before the freeze and in the compression stage
    resumed = {mode: [resume_diff(lambda: fresh(mode), batches[:10], cut) for cut in (3, 7)] for mode in LAMB_MODES}
    return losses, resumed


def _zero_one(rank, world):
    batches = list(shard_batches(rank, world, 78))
    losses, kinds = {}, {}
    for mode in ZERO_ONE_MODES:
        model = mlp()
        net, opt = in_mode(ZeroOneAdam, model, mode, **ZERO_ONE)
        run_steps(net, opt, batches)
        losses[mode], kinds[mode] = full_loss(model), opt.schedule.last_step_kind
    fast = dict(lr=1e-2, weight_decay=0.01, var_freeze_step=10, var_update_scaler=2, local_step_scaler=3,
                local_step_clipper=4)

    def fresh(mode):
        model = mlp()
        return (model, *in_mode(ZeroOneAdam, model, mode, **fast))

    # checkpoints in phase A (1-bit steps) and in phase B inside a local-step interval
    resumed = {mode: [resume_diff(lambda: fresh(mode), batches[:26], cut) for cut in (7, 20)]
               for mode in ZERO_ONE_MODES}
    return losses, kinds, resumed


@pytest.mark.multiprocess
def test_onebit_lamb_in_every_mode():
    results = run_ranks(_lamb, 2, timeout=300)
    assert results[0][0] == results[1][0]  # the same parameters on both ranks
    losses = results[0][0]
    assert losses["uncompressed"] < 0.2 * full_loss(mlp())
    for mode in LAMB_MODES:
        assert losses[mode] / losses["uncompressed"] < 1.05, (mode, losses)
    for _, resumed in results:
        assert resumed == {mode: [0.0, 0.0] for mode in LAMB_MODES}


@pytest.mark.multiprocess
def test_zero_one_adam_in_every_mode():
    results = run_ranks(_zero_one, 2, timeout=300)
    assert results[0][0] == results[1][0]
    losses, kinds = results[0][0], results[0][1]
    assert set(kinds.values()) == {"sync"}  # measured on synchronised parameters
    model = mlp()
    adamw = torch.optim.AdamW(model.parameters(), lr=ZERO_ONE["lr"], fused=True)
    run_steps(model, adamw, shard_batches(0, 1, 78, batch=128))  # the same global batches, one process
    reference = full_loss(model)
    for mode in ZERO_ONE_MODES:
        assert losses[mode] <= 1.05 * reference, (mode, losses, reference)
    for _, _, resumed in results:
        assert resumed == {mode: [0.0, 0.0] for mode in ZERO_ONE_MODES}


def test_zero_one_adam_refuses_zero_stages_and_says_why():
    with pytest.raises(ValueError, match="zero_stage.*not sharded"):
        ZeroOneAdam(nn.Linear(2, 2).parameters(), zero_stage=1)
