"""Exchange groups (compressed_opt.buckets.exchange_groups): consecutive buckets that a param
group's end cut short share their 1-bit exchange's collectives (comm.coalesced_compressed_allreduce),
bit for bit the exchanges one by one, on 2 Gloo ranks, from backward and from step(), replicated
and ZeRO."""
import pytest
import torch

import compressed_opt
from compressed_opt.buckets import Bucket
from compressed_opt.comm import (
    SingleProcessBackend,
    coalesced_compressed_allreduce,
    compressed_allreduce,
    compressed_allreduce_plan,
    error_buffer_sizes,
    result_rows,
)
from compressed_opt.buckets import exchange_groups
from distributed import run_ranks

STEPS, FREEZE = 8, 3
CASES = {
    "onebitadam": (compressed_opt.OnebitAdam, {"freeze_step": FREEZE}),
    "onebitadam-zero": (compressed_opt.OnebitAdam, {"freeze_step": FREEZE, "zero_stage": 1}),
    "onebitlamb": (compressed_opt.OnebitLamb, {"freeze_step": FREEZE, "lr": 1e-2}),
    "onebitadam-nodes": (compressed_opt.OnebitAdam, {"freeze_step": FREEZE, "hierarchy": "node"}),  # 2 x 2 ranks
    # phase A to the end: refreshes at steps 1, 2, 4 and 8, the 1-bit exchange at the others
    "zerooneadam": (compressed_opt.ZeroOneAdam, {"var_freeze_step": STEPS, "var_update_scaler": 1}),
}


def _bucket(index, numel):
    return Bucket(index=index, group_index=index, params=[torch.zeros(numel)], offsets=[0], numel=numel,
                  device=torch.device("cpu"))


def test_groups_are_runs_of_buckets_within_the_cap():
    sizes = [1000, 1000, 5000, 200, 300, 6000, 10]
    groups = exchange_groups([_bucket(i, n) for i, n in enumerate(sizes)], cap_bytes=4 * 6000)
    assert groups == [[0, 1], [2, 3, 4], [5], [6]]
    assert exchange_groups([], 100) == []
    assert exchange_groups([_bucket(0, 50)], 4) == [[0]]  # a bucket over the cap stands alone


def test_coalesced_exchanges_are_each_exchange_bit_for_bit():
    backend, other = SingleProcessBackend(), SingleProcessBackend()
    sizes = [5, 1000, 4099, 0, 33, 1000]  # (two exchanges of one plan)
    g = torch.Generator().manual_seed(0)
    alone = [[torch.zeros(k) for k in error_buffer_sizes(n, 1)] for n in sizes]
    together = [[e.clone() for e in pair] for pair in alone]
    plans = [compressed_allreduce_plan(n, backend, torch.device("cpu")) for n in sizes]
    for _ in range(3):
        xs = [torch.randn(n, generator=g) for n in sizes]
        want, want_rows = [], []
        for x, errors in zip(xs, alone):
            want.append(compressed_allreduce(x.clone(), *errors, other))
            want_rows.append(result_rows(x.numel(), other, "cpu").clone() if x.numel() else None)
        got = [x.clone() for x in xs]
        before = dict(backend.stats.calls)
        rows = coalesced_compressed_allreduce(plans, got, [e[0] for e in together], [e[1] for e in together])
        calls = {k: v - before.get(k, 0) for k, v in backend.stats.calls.items()}
        assert calls == {"all_to_all": 1, "all_gather": 1}  # for all six
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert all(torch.equal(a, b) for pa, pb in zip(together, alone) for a, b in zip(pa, pb))
        for r, w in zip(rows, want_rows):  # each exchange's result rows, as after its own call
            assert w is None or torch.equal(r.reshape(-1), w)


def _train(rank, world, name, coalesce, overlap):
    cls, kwargs = CASES[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(12, 12) for _ in range(4)])
    groups = [{"params": [p], "lr": 1e-3 * (i + 1)} for i, p in enumerate(model.parameters())]  # a bucket each
    import compressed_opt.engine as engine  # (where the engine looks the groups up)

    grouped = engine.exchange_groups
    if not coalesce:
        engine.exchange_groups = lambda buckets, cap: [[b.index] for b in buckets]
    try:
        return _steps(rank, model, cls(groups, path="1bit", overlap=overlap, **kwargs))
    finally:
        engine.exchange_groups = grouped


def _steps(rank, model, opt):
    calls = []
    for t in range(STEPS):
        g = torch.Generator().manual_seed(100 * t + rank)
        x = torch.randn(16, 12, generator=g)
        before = dict(opt.backend.stats.calls)
        torch.nn.functional.mse_loss(model(x), x.flip(1)).backward()
        opt.step()
        opt.zero_grad()
        calls.append({k: v - before.get(k, 0) for k, v in opt.backend.stats.calls.items()})
    out = {"params": [p.detach().clone() for p in model.parameters()], "calls": calls,
           "buckets": len(opt.engine.buckets)}
    opt.close()
    return out


def _both(rank, world, name, overlap):
    import os

    os.environ["COMPRESSED_OPT_RANKS_PER_NODE"] = "2"  # (4 ranks: two emulated nodes)
    return {c: _train(rank, world, name, c, overlap) for c in (False, True)}  # (False first: it patches)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, overlap", [("onebitadam", True), ("onebitadam", False), ("onebitadam-zero", True),
                                           ("onebitlamb", True), ("zerooneadam", False), ("onebitadam-nodes", True)])
def test_exchange_groups_train_bit_for_bit_as_bucket_by_bucket(name, overlap):
    results = run_ranks(_both, 4 if name.endswith("nodes") else 2, name, overlap, timeout=240)
    a2a = "inter_node.all_to_all" if name.endswith("nodes") else "all_to_all"  # (between the nodes)
    for r in results:
        alone, together = r[False], r[True]
        assert all(torch.equal(a, b) for a, b in zip(together["params"], alone["params"]))
        # a compression step after the first (whose exchanges also agree on the sizes): the 8
        # buckets' 1-bit exchanges in one all-to-all, not one each
        last = -2 if name == "zerooneadam" else -1  # (0/1 Adam's step 8 refreshes its variance: fp32)
        last_alone, last_together = alone["calls"][last], together["calls"][last]
        assert alone["buckets"] == together["buckets"] == 8
        # (between the nodes a rank exchanges only the buckets it holds a shard of: 4 or 8 here)
        assert last_alone[a2a] in ((4, 8) if a2a.startswith("inter") else (8,)), last_alone
        assert last_together[a2a] == 1, last_together
    assert all(torch.equal(a, b) for a, b in zip(results[0][True]["params"], results[1][True]["params"]))
