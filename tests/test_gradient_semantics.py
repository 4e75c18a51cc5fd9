"""One gradient rule in every mode: what the loop does to ``p.grad`` between ``backward()`` and
``step()`` is what the optimizer uses.

After backward, ``p.grad`` holds the rank average in a full-precision step (as DDP leaves it) and
the rank's own gradient in a compression-stage step. Loops that clip (global norm), unscale a
GradScaler and clip, scale the gradients in place, or leave the unscaling to ``scaler.step`` must
give, bit for bit, the same parameters
in every mode (overlapped, synchronous, a DDP-wrapped model found automatically, ZeRO 1 and 2) as
in the synchronous mode, and the same twice for the same seed; 1-bit Adam's warmup with clipping
must match DDP + AdamW + ``clip_grad_norm_``. Two Gloo ranks, different data on each."""
import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam
from distributed import run_ranks
from optim_tasks import mlp, shard_batches

STEPS, FREEZE = 7, 4  # warmup 1-4; step 5 watches the loop; 6-7 launch from backward (if allowed)
OPTIMIZERS = {
    "adam": (OnebitAdam, dict(lr=3e-3, freeze_step=FREEZE)),
    "lamb": (OnebitLamb, dict(lr=2e-2, freeze_step=FREEZE, max_coeff=0.25)),
    "zero_one": (ZeroOneAdam, dict(lr=3e-3, var_freeze_step=FREEZE, var_update_scaler=1, local_step_scaler=2,
                                   local_step_clipper=2)),
}
_SHARDED = ("zero1", "zero1_sync", "zero2", "zero2_sync")
MODES = {"adam": ("sync", "overlap", "ddp", *_SHARDED), "lamb": ("sync", "overlap", "ddp", *_SHARDED),
         "zero_one": ("sync", "overlap", "ddp")}
LOOPS = ("clip", "unscale_clip", "scale_in_place", "scaler")


def _make(name, mode):
    cls, kwargs = OPTIMIZERS[name]
    model = mlp(hidden=32)
    kwargs = dict(kwargs, bucket_cap_mb=0.004, overlap=not mode.endswith("sync"))  # several buckets
    if mode.startswith("zero"):
        kwargs["zero_stage"] = int(mode[4])
    net = nn.parallel.DistributedDataParallel(model) if mode == "ddp" else model
    return model, net, cls(model.parameters(), **kwargs)  # no register_ddp_comm_hook: found by itself


def _train(model, net, opt, loop, batches):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if loop in ("unscale_clip", "scaler") else None
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        (scaler.scale(loss) if scaler else loss).backward()
        if loop == "unscale_clip":
            scaler.unscale_(opt)
        if loop == "scale_in_place":
            for p in model.parameters():
                p.grad.mul_(0.5)
        elif loop != "scaler":  # (scaler: the optimizer unscales, as scaler.step hands it the scale)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    # with the variance tracking's rows (its calibration made from this warmup's local gradients)
    rows = [opt.state[p]["layer_variance"].clone() for p in model.parameters() if "layer_variance" in opt.state[p]]
    return [p.detach().clone() for p in model.parameters()] + rows


def _every_mode(rank, world, name):
    batches = list(shard_batches(rank, world, STEPS, batch=16))
    out = {}
    for loop in LOOPS:
        for mode in MODES[name]:
            out[loop, mode] = _train(*_make(name, mode), loop, batches)
        out[loop, "overlap", "again"] = _train(*_make(name, "overlap"), loop, batches)
    return out


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_mode_uses_the_gradients_the_loop_left(name):
    runs = run_ranks(_every_mode, 2, name, timeout=240)
    for loop in LOOPS:
        sync = runs[0][loop, "sync"]
        # (0/1 Adam's phase B steps each rank locally between synchronisations: ranks differ there)
        same_ranks = name != "zero_one"
        assert _same(sync, runs[1][loop, "sync"]) or not same_ranks, "ranks differ"
        assert not _same(sync, [p.detach() for p in mlp(hidden=32).parameters()]), "nothing trained"
        for mode in MODES[name]:
            for rank in range(2):
                got = runs[rank][loop, mode]
                # ZeRO against ZeRO without overlap (sharded arithmetic rounds differently)
                reference = runs[rank][loop, mode[:5] + "_sync" if mode.startswith("zero") else "sync"]
                assert _same(got, reference), (loop, mode, rank)
                assert _same(got, runs[0][loop, mode]) or not same_ranks, (loop, mode, "ranks differ")
        assert _same(runs[0][loop, "overlap", "again"], runs[0][loop, "overlap"]), (loop, "two runs differ")
        if name != "lamb":  # the tracking's calibration: local over averaged second moments, as backward made
            n = len(list(mlp(hidden=32).parameters()))  # them (whatever the loop does to p.grad after)
            for mode in MODES[name]:
                for rows in runs[0][loop, mode][n:]:
                    # (a mean of squares is at least the square of the mean; a GradScaler's scale on one side
                    # only would make it 65536x, the loop's clipping of the average alone ~100x)
                    kappa = (rows[5] / rows[6]).item()
                    assert 1.0 <= kappa < 4, (loop, mode, kappa)
        for stage in ("zero1", "zero2") if "zero1" in MODES[name] else ():
            # ... but uses the same gradients
            diff = max((a - b).abs().max().item() for a, b in zip(runs[0][loop, stage], sync))
            assert diff < 1e-4, (loop, stage, diff)  # an ignored clip or scale moves them by ~lr


def _warmup_against_adamw(rank, world):
    batches = list(shard_batches(rank, world, FREEZE, batch=16))
    out = {}
    model = mlp(hidden=32)
    net = nn.parallel.DistributedDataParallel(model)
    _train(model, net, torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True), "clip", batches)
    out["ddp_adamw"] = [p.detach().clone() for p in model.parameters()]
    for mode in MODES["adam"]:
        model, net, opt = _make("adam", mode)
        _train(model, net, opt, "clip", batches)
        out[mode] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.mark.multiprocess
def test_warmup_with_clipping_is_ddp_adamw_with_clipping():
    runs = run_ranks(_warmup_against_adamw, 2, timeout=120)
    for rank in range(2):
        for mode in MODES["adam"]:
            diff = max((a - b).abs().max().item() for a, b in zip(runs[rank][mode], runs[rank]["ddp_adamw"]))
            assert diff < 1e-6, (mode, diff)


def _loop_changes_mid_run(rank, world):
    model, net, opt = _make("adam", "overlap")
    for i, (x, y) in enumerate(shard_batches(rank, world, FREEZE + 3, batch=16)):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        if i == FREEZE + 2:  # the compression stage launched from backward: the loop starts clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()


@pytest.mark.multiprocess
def test_a_loop_that_starts_touching_gradients_after_a_launch_raises_on_every_rank():
    from distributed import spawn_ranks

    outcomes = spawn_ranks(_loop_changes_mid_run, 2, timeout=120)
    assert all(s == "error" and "GradientsChangedAfterLaunch" in v for s, v in outcomes), outcomes
