"""Bucketed communication launched from backward: same results as the synchronous path, launched
before step(), gradient accumulation that communicates once per step."""
import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam
from distributed import run_ranks, spawn_ranks
from optim_tasks import shard_batches


def deep_mlp(seed=0):
    torch.manual_seed(seed)
    layers = []
    for _ in range(8):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(64, 10))


def _train(rank, world, overlap, steps=8, freeze=4, accumulate=1, mode="plain"):
    model = deep_mlp()
    kwargs = dict(lr=2e-3, freeze_step=freeze, bucket_cap_mb=0.02, overlap=overlap)
    if mode == "accumulation_steps":
        kwargs["accumulation_steps"] = accumulate
    opt = OnebitAdam(model.parameters(), **kwargs)
    launched_before_step = []
    for x, y in shard_batches(rank, world, steps, batch=32 * accumulate):
        opt.zero_grad()
        micro = list(zip(x.chunk(accumulate), y.chunk(accumulate)))
        for i, (mx, my) in enumerate(micro):
            loss = nn.functional.cross_entropy(model(mx), my) / accumulate
            if mode == "no_sync" and i < len(micro) - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        launched_before_step.append(opt.engine._next)  # (the buckets launched from backward)
        opt.step()
    return [p.detach().clone() for p in model.parameters()], launched_before_step, len(opt.engine.buckets)


@pytest.mark.multiprocess
def test_overlapped_equals_synchronous_and_launches_during_backward():
    overlapped = run_ranks(_train, 2, True)
    synchronous = run_ranks(_train, 2, False)
    params, launched, n_buckets = overlapped[0]
    assert n_buckets >= 8
    assert launched[0] == 0  # the first step checks the ranks agree first
    # the first compression step (step 5) exchanges in step(), watching whether the loop touches
    # p.grad after backward; this loop does not, so the later ones launch from backward
    assert launched[4] == 0, launched
    assert all(n == n_buckets for i, n in enumerate(launched) if i not in (0, 4)), launched
    assert synchronous[0][1] == [0] * 8
    for rank in range(2):
        assert all(torch.equal(a, b) for a, b in zip(overlapped[rank][0], synchronous[rank][0]))


@pytest.mark.multiprocess
def test_gradient_accumulation_communicates_once_per_step():
    reference = run_ranks(_train, 2, False, 6, 3, 3, "no_sync")  # synchronous: nothing during backward
    for mode in ("no_sync", "accumulation_steps"):
        params, launched, n_buckets = run_ranks(_train, 2, True, 6, 3, 3, mode)[0]
        # step 1 checks the ranks; step 4, the first of the compression stage, watches the loop
        assert launched[0] == launched[3] == 0, (mode, launched)
        assert all(n == n_buckets for i, n in enumerate(launched) if i not in (0, 3)), (mode, launched)
        for a, b in zip(params, reference[0][0]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _accumulate_without_no_sync(rank, world):
    model = deep_mlp()
    opt = OnebitAdam(model.parameters(), freeze_step=4, bucket_cap_mb=0.02)
    for step, (x, y) in enumerate(shard_batches(rank, world, 3)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 2:
            nn.functional.cross_entropy(model(x), y).backward()  # a second backward, unannounced
        opt.step()


@pytest.mark.multiprocess
def test_unannounced_accumulation_raises_instead_of_sending_partial_gradients():
    for status, value in spawn_ranks(_accumulate_without_no_sync, 2, timeout=60):
        assert status == "error" and "no_sync" in value and "accumulation_steps" in value


def _layout_changes(rank, world):
    """Freezing a layer (requires_grad=False) and adding a param group between steps: buckets are
    rebuilt, what backward launched for the old layout is drained, the ranks stay identical."""
    model = deep_mlp()
    extra = nn.Linear(10, 10)
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, bucket_cap_mb=0.02)
    for step, (x, y) in enumerate(shard_batches(rank, world, 6)):
        if step == 2:
            model[0].weight.requires_grad_(False)
        if step == 4:
            opt.add_param_group({"params": extra.parameters()})
        opt.zero_grad()
        nn.functional.cross_entropy(extra(model(x)) if step >= 4 else model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in [*model.parameters(), *extra.parameters()]]


@pytest.mark.multiprocess
def test_layout_changes_between_steps_keep_ranks_identical():
    results = run_ranks(_layout_changes, 2)
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[1]))
