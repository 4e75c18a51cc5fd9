"""Flat buckets: layout, and the per-parameter views kept for the bucket's own buffers (made once,
let go with the buffer)."""
import gc
import weakref

import pytest
import torch
from torch import nn

from compressed_opt.buckets import build_buckets


def _bucket():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    [bucket] = build_buckets([{"params": list(model.parameters())}], cap_bytes=1 << 20)
    return model, bucket


def test_reverse_order_and_offsets():
    model, bucket = _bucket()
    params = list(model.parameters())
    assert bucket.params == params[::-1] and bucket.numel == sum(p.numel() for p in params)
    assert bucket.offsets == [0, 2, 10, 14]


def test_views_of_own_buffers_are_made_once_and_alias_them():
    _, bucket = _bucket()
    flat = bucket.flat("exp_avg")
    views = bucket.views(flat)
    assert bucket.views(flat) is views
    padded = bucket.flats["padded"] = torch.zeros(bucket.numel + 7)
    assert bucket.views(padded[: bucket.numel]) is bucket.views(padded)  # a prefix: the same views
    views[1].fill_(3.0)
    assert flat[2:10].eq(3.0).all() and [v.shape for v in views] == [tuple(p.shape) for p in bucket.params]


def test_views_of_other_tensors_are_not_kept():
    _, bucket = _bucket()
    other = torch.zeros(bucket.numel)
    assert bucket.views(other) is not bucket.views(other)
    assert not bucket._views


def test_a_dropped_buffer_is_let_go():
    _, bucket = _bucket()
    flat = bucket.flat("exp_avg")
    bucket.views(flat)
    gone = weakref.ref(flat)
    del bucket.flats["exp_avg"], flat
    bucket.views(bucket.flat("grad"))  # the next call forgets the dropped buffer's views
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("how", ["assign", "pop", "update", "setdefault", "clear"])
def test_a_replaced_buffer_is_let_go_and_its_successor_viewed(how):
    """The kept views follow which tensor each name holds, however the name changed hands (the
    bucket looks again only when its buffers changed)."""
    _, bucket = _bucket()
    flat = bucket.flat("exp_avg")
    bucket.views(flat)
    gone = weakref.ref(flat)
    new = torch.full((bucket.numel,), 2.0)
    if how == "assign":
        bucket.flats["exp_avg"] = new
    elif how == "pop":
        bucket.flats.pop("exp_avg")
        bucket.flats["exp_avg"] = new
    elif how == "update":
        bucket.flats.update(exp_avg=new)
    elif how == "setdefault":
        bucket.flats.clear()
        assert bucket.flats.setdefault("exp_avg", new) is new
    else:
        bucket.flats.clear()
        bucket.flats["exp_avg"] = new
    del flat
    views = bucket.views(new)
    assert bucket.views(new) is views and all(v.eq(2.0).all() for v in views)
    views[0].fill_(5.0)
    assert new[: bucket.params[0].numel()].eq(5.0).all()
    gc.collect()
    assert gone() is None


def test_an_optimizers_buckets_hold_only_declared_buffers():
    """Every bucket buffer is declared once with its role and dtype (compressed_opt.buffers): an
    undeclared name, or a tensor of another dtype, raises; the lists the library reads come from
    the declarations, and ZeRO's sharded layout overlays its own."""
    import compressed_opt
    from compressed_opt.buffers import SAVED, SCRATCH
    from compressed_opt.comm import SingleProcessBackend

    model = torch.nn.Linear(4, 3)
    opt = compressed_opt.OnebitAdam(model.parameters(), freeze_step=1, backend=SingleProcessBackend())
    bucket = opt.buckets[0]
    with pytest.raises(KeyError, match="'exp_avg_typo' is not declared"):
        bucket.flat("exp_avg_typo")
    with pytest.raises(KeyError, match="not declared"):
        bucket.flats.get("grad_padded")  # ZeRO's, not this layout's
    with pytest.raises(TypeError, match="declared torch.float32"):
        bucket.flats["worker_error"] = torch.zeros(3, dtype=torch.float64)
    assert compressed_opt.OnebitAdam.bucket_state_names == ("exp_avg", "exp_avg_sq")
    assert compressed_opt.OnebitLamb.bucket_state_names == ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")
    assert compressed_opt.ZeroOneAdam.saved_bucket_buffers == ("worker_error", "server_error")
    assert "no_variance" in compressed_opt.ZeroOneAdam.scratch_names

    sharded = compressed_opt.OnebitLamb(torch.nn.Linear(4, 3).parameters(), freeze_step=1, zero_stage=1,
                                        backend=SingleProcessBackend())
    assert sharded.bucket_state_names == ()  # no whole-bucket per-parameter state when sharded
    assert "exp_avg_sq" not in sharded.declared and sharded.declared["exp_avg"].role == SAVED
    assert {"exp_avg_shard", "momentum_rows", "exp_avg_sq_fresh_shard"} <= set(sharded.saved_bucket_buffers)
    assert sharded.declared["layer_ids"].role == SCRATCH and sharded.declared["layer_ids"].dtype == torch.int64
    assert type(sharded).saved_bucket_buffers == ("worker_error", "server_error")  # the class keeps its own


def test_step_destinations_are_checked_once_per_step_and_dropped_at_its_end():
    from compressed_opt.cuda.addresses import Destinations, destination_addresses

    model, bucket = _bucket()
    dests = bucket.step_destinations()
    assert isinstance(dests, Destinations) and list(dests) == bucket.params
    assert bucket.step_destinations() is dests  # (the same step: not walked again)
    assert destination_addresses(dests, bucket.segments.sizes) is dests.addresses
    assert dests.addresses.tolist() == [p.data_ptr() for p in bucket.params]
    with pytest.raises(ValueError, match="one destination per segment"):
        destination_addresses(dests, bucket.segments.sizes[:-1])
    bucket.forget_step()
    with torch.no_grad():
        model[0].weight.data = model[0].weight.data.t().contiguous().t()  # (between steps: not contiguous now)
    plain = bucket.step_destinations()
    assert not isinstance(plain, Destinations) and plain is bucket.params  # a C pass cannot write it
    assert destination_addresses(plain, bucket.segments.sizes) is None


def test_addresses_are_checked_as_they_are_walked():
    from compressed_opt.cuda.addresses import Destinations, Sources, destination_addresses

    ts = [torch.zeros(3), torch.zeros(0), torch.zeros(5)]
    assert destination_addresses(ts, [3, 0, 5]).tolist() == [ts[0].data_ptr(), 0, ts[2].data_ptr()]
    assert Sources.of(ts, [3, 0, 5]).addresses.tolist() == [ts[0].data_ptr(), 0, ts[2].data_ptr()]
    with pytest.raises(ValueError, match="a destination of 5 elements for a segment of 4"):
        destination_addresses(ts, [3, 0, 4])
    with pytest.raises(ValueError, match="a source of 5 elements for a segment of 4"):
        Sources.of(ts, [3, 0, 4])
    for bad in (torch.zeros(3, dtype=torch.float64), torch.zeros(6)[::2], None):
        assert Destinations.of([ts[0], bad], [3, 3]) is None and Sources.of([ts[0], bad], [3, 3]) is None


def test_trained_ids_are_the_parameters_that_require_a_gradient():
    from compressed_opt.buckets import trained_ids

    params = [nn.Parameter(torch.zeros(2)) for _ in range(4)]
    assert trained_ids(params) == tuple(id(p) for p in params)
    params[2].requires_grad_(False)
    assert trained_ids(params) == (id(params[0]), id(params[1]), id(params[3]))
    assert trained_ids([]) == ()


def test_param_states_follow_the_optimizers_state_mapping():
    """The per-layer scalars a step writes land in the state a checkpoint saves, also after
    ``load_state_dict`` made a new mapping: a run resumed from its own state in the compression
    stage saves what the uninterrupted run saves, bit for bit."""
    from collections import defaultdict

    import compressed_opt
    from compressed_opt.buckets import param_states
    from compressed_opt.comm import SingleProcessBackend

    _, bucket = _bucket()
    first, second = defaultdict(dict), defaultdict(dict)
    states = param_states(first, bucket)
    assert param_states(first, bucket) is states and all(st is first[p] for st, p in zip(states, bucket.params))
    assert all(st is second[p] for st, p in zip(param_states(second, bucket), bucket.params))  # (another mapping)

    def run(reload_at=None):
        g = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=g)) for s in [(7, 5), (5,), (300,)]]
        opt = compressed_opt.OnebitAdam(params, lr=1e-3, freeze_step=3, backend=SingleProcessBackend())
        for step in range(1, 10):
            for i, p in enumerate(params):  # (growing gradients: the tracking factors move every step)
                p.grad = torch.randn(p.shape, generator=g) * 0.01 * step ** (i + 1)
            opt.step()
            if step == reload_at:
                opt.load_state_dict(opt.state_dict())
        return opt.state_dict()["state"]

    a, b = run(), run(reload_at=5)
    factors = [s["exchange_factor"] for s in a.values()]
    assert len(set(factors)) > 1, factors
    for sa, sb in zip(a.values(), b.values()):
        assert sa.keys() == sb.keys()
        for k in sa:
            va, vb = sa[k], sb[k]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, k


def test_a_destination_of_the_wrong_size_is_refused_whatever_its_layout():
    from compressed_opt.cuda.addresses import destination_addresses

    with pytest.raises(ValueError, match="a destination of 6 elements for a segment of 3"):
        destination_addresses([torch.zeros(12)[::2]], [3])  # (not contiguous, and not the segment's size)
