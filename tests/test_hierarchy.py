"""The optimizers on the hierarchical exchange (compressed_opt.exchange): 4 Gloo ranks as 2 nodes of 2
(``COMPRESSED_OPT_RANKS_PER_NODE=2``). Checked, for every optimizer: the exchange chosen is the
hierarchical one (``hierarchy="auto"`` on 2 x 2) and identical on every rank; the ranks' parameters
stay identical; the training loss falls as on the flat exchange (within the flat run's bounds); the
bytes that cross between the nodes are what the hierarchical exchange sends (``inter_node.*`` in
``backend.stats``), a fraction of the flat exchange's, in the compression stage and in the fp32
warmup; a resume from each rank's own checkpoint is bit-exact; a checkpoint of the flat exchange
resumed on the hierarchical one resets the error buffers with a warning; one rank whose environment
says otherwise makes every rank take the flat exchange; ``path="measure"`` takes the flat or the
hierarchical exchange by their timings, and a resume and a rerun (rank 0's cache) keep the choice.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from distributed import run_ranks

import compressed_opt

STEPS, FREEZE = 12, 3
CASES = {
    "onebitadam": (compressed_opt.OnebitAdam, {"freeze_step": FREEZE, "lr": 3e-3}),
    "onebitlamb": (compressed_opt.OnebitLamb, {"freeze_step": FREEZE, "lr": 3e-2}),
    "zerooneadam": (compressed_opt.ZeroOneAdam, {"var_freeze_step": FREEZE, "local_step_scaler": 2,
                                                 "local_step_clipper": 2, "lr": 3e-3}),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(rank, t):
    g = torch.Generator().manual_seed(100 * t + rank)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin() * 2  # a task the model can learn


def _train(model, opt, rank, steps):
    losses = []
    for t in steps:
        x, y = _batch(rank, t)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _compression_bytes(opt, model, rank, steps, calls=None):
    before, calls_before = dict(opt.backend.stats.bytes_sent), dict(opt.backend.stats.calls)
    losses = _train(model, opt, rank, steps)
    after = opt.backend.stats.bytes_sent
    diff = {k: after[k] - before.get(k, 0) for k in after}
    inter = sum(v for k, v in diff.items() if k.startswith("inter_node."))
    if calls is not None:  # the collectives per step, by name
        calls.update({k: (v - calls_before.get(k, 0)) / len(steps) for k, v in opt.backend.stats.calls.items()})
    return losses, sum(diff.values()), inter


def _run_both(rank, world, name):
    """The same training on the hierarchical exchange (``"auto"``) and on the flat one, in one
    job (one spawn of the 4 ranks)."""
    return {h: _run(rank, world, name, h, "2") for h in ("auto", "flat")}


def _run(rank, world, name, hierarchy, per_node_env):
    if per_node_env is not None:
        os.environ["COMPRESSED_OPT_RANKS_PER_NODE"] = per_node_env
    cls, kwargs = CASES[name]
    model = _model()
    opt = cls(model.parameters(), bucket_cap_mb=0.004, hierarchy=hierarchy, **kwargs)
    losses = _train(model, opt, rank, [1])
    warmup, warmup_total, warmup_inter = _compression_bytes(opt, model, rank, range(2, FREEZE + 1))
    losses += warmup + _train(model, opt, rank, [FREEZE + 1])
    calls = {}
    more, total, inter = _compression_bytes(opt, model, rank, range(FREEZE + 2, STEPS + 1), calls)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if name == "zerooneadam":  # between synchronisations each rank's own: the anchors of the last one
        flat = torch.cat([b.state.buffers.sync_params for b in opt.engine.buckets])
    return {"key": opt.engine.exchange.averaging.key, "losses": losses + more, "params": flat,
            "bytes_per_step": total / (STEPS - FREEZE - 1), "inter_per_step": inter / (STEPS - FREEZE - 1),
            "warmup_bytes_per_step": warmup_total / (FREEZE - 1), "warmup_inter_per_step": warmup_inter / (FREEZE - 1),
            "calls_per_step": calls, "buckets": len(opt.engine.buckets)}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_hierarchical_exchange_trains_like_the_flat_one(name):
    both = run_ranks(_run_both, 4, name, timeout=240)
    hier, flat = [r["auto"] for r in both], [r["flat"] for r in both]
    assert {r["key"] for r in hier} == {("node", 2, 2)}
    assert {r["key"] for r in flat} == {("flat", 4)}
    for runs in (hier, flat):
        assert all(torch.equal(r["params"], runs[0]["params"]) for r in runs), "the ranks' parameters differ"
    # a compression step's collectives: per bucket the exchange's own (the ranks agreed on the
    # buckets' sizes at their first exchange, and agree on the layout once per step), no header
    # or agreement per bucket: flat an all-to-all and an all-gather; hierarchical a reduce-scatter
    # and an all-gather inside the node, an all-to-all and an all-gather between the nodes
    h, f = hier[0]["calls_per_step"], flat[0]["calls_per_step"]
    assert h["inter_node.all_gather"] == h["inter_node.all_to_all"] > 0, h
    assert h["intra_node.all_gather"] == h["intra_node.reduce_scatter"] == h["inter_node.all_to_all"], h
    assert f["all_gather"] - f["all_to_all"] == h["all_gather"], (f, h)  # the step's own all-gathers
    if name != "zerooneadam":  # (which synchronises every other step in phase B)
        assert f["all_to_all"] == h["inter_node.all_to_all"] == flat[0]["buckets"] == 2, (f, h)
    mean = lambda runs, i: sum(r["losses"][i] for r in runs) / len(runs)  # noqa: E731
    first, last_h, last_f = mean(flat, 0), mean(hier, -1), mean(flat, -1)
    assert last_h < 0.8 * first and last_f < 0.8 * first, (first, last_h, last_f)
    assert last_h < 1.1 * last_f, f"hierarchical {last_h:.4f} against flat {last_f:.4f}"
    # between the nodes each rank sends the 1-bit exchange of its half of the bucket among 2 nodes;
    # the flat exchange sends every rank's over all 4 ranks (most of it crossing between nodes)
    assert all(r["inter_per_step"] > 0 for r in hier)
    assert max(r["inter_per_step"] for r in hier) < 0.6 * min(r["bytes_per_step"] for r in flat)
    if name != "zerooneadam":  # (its steps before the freeze are 1-bit but for the variance refreshes)
        # the full-precision warmup the hierarchical way too: between the nodes each rank sends the
        # fp32 all-reduce of its half of the bucket among 2 nodes (4 bytes per element of its half:
        # a node sends 4 per element of the bucket), where in the flat ring over all 4 ranks every
        # rank sends 6 per element, and one rank of each node sends them to the other node
        n = hier[0]["params"].numel()
        assert all(0 < r["warmup_inter_per_step"] < 0.4 * r["warmup_bytes_per_step"] for r in hier)
        assert sum(r["warmup_inter_per_step"] for r in hier) == pytest.approx(4 * 2 * n, rel=0.05)
        # (+ the step's agreements: a few headers of 7 int64 and the statistics, all-gathered over 4 ranks; 432
        # bytes here, against the fp32 ring's 8088)
        assert all(6 * n < r["warmup_bytes_per_step"] < 6 * n + 600 for r in flat), [r["warmup_bytes_per_step"]
                                                                                     for r in flat]


def _save_and_resume(rank, folder, make_opt, saved_kwargs, resumed_kwargs, between=None):
    """Train 6 steps with ``make_opt(params, **saved_kwargs)``, save this rank's checkpoint, train
    3 more; then (after ``between()``) resume a fresh model and ``make_opt(params,
    **resumed_kwargs)`` from the checkpoint and train the same 3 steps. ``(optimizer, resumed
    optimizer, saved state dict, whether the parameters ended identical, the resumed run's warnings)``."""
    model = _model()
    opt = make_opt(model.parameters(), **saved_kwargs)
    _train(model, opt, rank, range(1, 7))
    path = os.path.join(folder, f"rank{rank}.pt")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    _train(model, opt, rank, range(7, 10))
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    if between is not None:
        between()
    saved = torch.load(path)
    model2 = _model()
    model2.load_state_dict(saved["model"])
    opt2 = make_opt(model2.parameters(), **resumed_kwargs)
    opt2.load_state_dict(saved["opt"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model2, opt2, rank, range(7, 10))
    same = all(torch.equal(a, b) for a, b in zip(uninterrupted, model2.parameters()))
    return opt, opt2, saved["opt"], same, [str(w.message) for w in caught]


def _onebit_adam(params, **kwargs):
    return compressed_opt.OnebitAdam(params, lr=3e-3, freeze_step=FREEZE, bucket_cap_mb=0.004, **kwargs)


def _resume(rank, world, folder, saved_hierarchy):
    os.environ["COMPRESSED_OPT_RANKS_PER_NODE"] = "2"
    _, _, saved, same, caught = _save_and_resume(rank, folder, _onebit_adam, {"hierarchy": saved_hierarchy},
                                                 {"hierarchy": "node"})
    return {"same": same, "warnings": caught, "key": saved["compressed_opt"]["averaging"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_resume_is_exact_and_another_exchange_resets_the_errors(tmp_path):
    (tmp_path / "a").mkdir()
    exact = run_ranks(_resume, 4, str(tmp_path / "a"), "node", timeout=150)
    assert all(r["same"] and not r["warnings"] for r in exact), exact
    assert exact[0]["key"] == ["node", 2, 2]
    (tmp_path / "b").mkdir()
    other = run_ranks(_resume, 4, str(tmp_path / "b"), "flat", timeout=150)
    assert other[0]["key"] == ["flat", 4]
    assert all(any("belong to another exchange" in w for w in r["warnings"]) for r in other), other
    assert not any(r["same"] for r in other)  # (the errors restarted from zero: another trajectory)


def _measured_exchange(rank, world, folder):
    """path="measure" on 2 x 2 with timings in which the flat exchange is the faster: it is
    chosen over the hierarchical one; a resume keeps it though the timings now say otherwise."""
    import shutil

    import torch.distributed as dist

    import compressed_opt.exchange as exchange
    import compressed_opt.path_cache as path_cache

    os.environ["COMPRESSED_OPT_RANKS_PER_NODE"] = "2"
    cache = os.path.join(folder, "cache")
    os.environ["COMPRESSED_OPT_CACHE_DIR"] = cache  # (rank 0's: the others' are never read)

    def timings(flat_faster):
        def fake(avg, backend, numel, device):  # (1-bit seconds, fp32 seconds), the same on every rank
            flat = isinstance(avg, exchange.FlatAveraging)
            return (1e-3 if flat == flat_faster else 5e-3), 1e-2
        return fake

    path_cache._time_paths = timings(flat_faster=True)
    opt, opt2, _, same, caught = _save_and_resume(
        rank, folder, _onebit_adam, {"path": "measure"}, {"path": "measure"},
        between=lambda: setattr(path_cache, "_time_paths", timings(flat_faster=False)))
    model3 = _model()  # a rerun under the timings that favour the hierarchical exchange: the cached choice
    opt3 = _onebit_adam(model3.parameters(), path="measure")
    _train(model3, opt3, rank, range(1, 2))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(cache)  # ... measured again once the cache is gone
    dist.barrier()
    model4 = _model()
    opt4 = _onebit_adam(model4.parameters(), path="measure")
    _train(model4, opt4, rank, range(1, 2))
    return {"key": opt.engine.exchange.averaging.key, "paths": opt.engine.exchange.paths,
            "resumed_key": opt2.engine.exchange.averaging.key, "rerun_key": opt3.engine.exchange.averaging.key,
            "remeasured_key": opt4.engine.exchange.averaging.key, "same": same, "warnings": caught}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_measured_path_chooses_between_flat_and_hierarchical_and_a_resume_and_a_rerun_keep_it(tmp_path):
    results = run_ranks(_measured_exchange, 4, str(tmp_path), timeout=150)
    assert [r["key"] for r in results] == [("flat", 4)] * 4, results  # measured faster than ("node", 2, 2)
    assert all(set(r["paths"].values()) == {"1bit"} for r in results)  # 1-bit faster than fp32 in these timings
    assert [r["resumed_key"] for r in results] == [("flat", 4)] * 4
    assert [r["rerun_key"] for r in results] == [("flat", 4)] * 4  # rank 0's cache: the same choice
    assert [r["remeasured_key"] for r in results] == [("node", 2, 2)] * 4
    assert all(r["same"] and not r["warnings"] for r in results), results


def _one_rank_disagrees(rank, world):
    os.environ["COMPRESSED_OPT_RANKS_PER_NODE"] = "1" if rank == 3 else "2"
    model = _model()
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=3e-3, freeze_step=1)
    _train(model, opt, rank, range(1, 3))
    return opt.engine.exchange.averaging.key


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_nodes_all_take_the_flat_exchange():
    assert run_ranks(_one_rank_disagrees, 4, timeout=100) == [("flat", 4)] * 4


def test_bad_hierarchy_is_refused():
    params = _model().parameters()
    with pytest.raises(ValueError, match="hierarchy"):
        compressed_opt.OnebitAdam(params, hierarchy="nodes")
    with pytest.raises(ValueError, match="ZeRO"):
        compressed_opt.OnebitAdam(_model().parameters(), hierarchy="node", zero_stage=1)


# --- the path per bucket: 1-bit, fp32, or measured on the link (compressed_opt.path_cache) --------
def _paths(rank, world, path, skewed, cache):
    import compressed_opt.path_cache as path_cache

    os.environ["COMPRESSED_OPT_CACHE_DIR"] = cache

    if skewed and rank == 1:  # this rank's timings say the opposite of the others'
        real = path_cache._time_paths
        path_cache._time_paths = lambda *a: tuple(reversed(real(*a)))
    model = _model()
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=3e-3, freeze_step=2, bucket_cap_mb=0.004, path=path,
                                    hierarchy="flat")
    _train(model, opt, rank, range(1, 3))
    before = dict(opt.backend.stats.bytes_sent)
    _train(model, opt, rank, range(3, 6))
    sent = {k: v - before.get(k, 0) for k, v in opt.backend.stats.bytes_sent.items() if v != before.get(k, 0)}
    return {"paths": opt.engine.exchange.paths, "sizes": sorted({b.numel for b in opt.engine.buckets}),
            "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "sent": sent,
            "saved": opt.state_dict()["compressed_opt"]["paths"]}


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_measured_paths_are_the_same_on_every_rank_and_fp32_sends_no_bits(tmp_path):
    cache = str(tmp_path / "cache")
    measured = run_ranks(_paths, 2, "measure", True, cache, timeout=150)
    assert measured[0]["paths"] == measured[1]["paths"], "the ranks chose different paths"
    assert set(measured[0]["paths"]) == set(measured[0]["sizes"]) and set(measured[0]["paths"].values()) <= {
        "1bit", "fp32"}
    assert measured[0]["saved"] == {str(n): p for n, p in measured[0]["paths"].items()}
    assert torch.equal(measured[0]["params"], measured[1]["params"])
    again = run_ranks(_paths, 2, "measure", True, cache, timeout=150)  # a rerun: rank 0's cached choice
    assert again[0]["paths"] == again[1]["paths"] == measured[0]["paths"]
    assert torch.equal(again[0]["params"], measured[0]["params"]), "a rerun of path='measure' differs"
    kept = sorted(f for f in os.listdir(cache) if f.startswith("path_choice_"))
    assert len(kept) == 1, [open(os.path.join(cache, f)).read() for f in kept]
    fp32 = run_ranks(_paths, 2, "fp32", False, cache, timeout=150)
    assert torch.equal(fp32[0]["params"], fp32[1]["params"])
    assert "all_to_all" not in fp32[0]["sent"] and fp32[0]["sent"].get("all_reduce", 0) > 0, fp32[0]["sent"]
    onebit = run_ranks(_paths, 2, "1bit", False, cache, timeout=150)
    assert onebit[0]["paths"] == {} and onebit[0]["sent"].get("all_to_all", 0) > 0


def test_bad_path_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="path"):
        compressed_opt.OnebitAdam(_model().parameters(), path="fastest")
    with pytest.raises(ValueError, match="ZeRO"):
        compressed_opt.OnebitAdam(_model().parameters(), path="measure", zero_stage=2)
    monkeypatch.setenv("COMPRESSED_OPT_PATH", "fastest")
    with pytest.raises(ValueError, match="COMPRESSED_OPT_PATH"):
        compressed_opt.OnebitAdam(_model().parameters())


def test_the_default_path_is_the_1bit_exchange_whatever_the_timing(monkeypatch):
    from compressed_opt.exchange import resolve_path

    monkeypatch.delenv("COMPRESSED_OPT_PATH", raising=False)
    for sharded in (False, True):
        for world in (1, 2, 8):
            assert resolve_path(None, sharded=sharded, world_size=world) == "1bit"
            assert resolve_path("auto", sharded=sharded, world_size=world) == "1bit"
    assert resolve_path("measure", sharded=False, world_size=2) == "measure"  # only when asked
    assert compressed_opt.OnebitAdam(_model().parameters()).engine.path == "1bit"
    assert compressed_opt.ZeroOneAdam(_model().parameters(), path="auto").engine.path == "1bit"
    monkeypatch.setenv("COMPRESSED_OPT_PATH", "fp32")  # the variable sets the default ...
    assert resolve_path(None, sharded=False, world_size=2) == "fp32"
    assert compressed_opt.OnebitLamb(_model().parameters(), path="1bit").engine.path == "1bit"  # ... an argument wins
