"""Flat buckets: their layout, the views of their buffers, and the declared buffers an
optimizer's buckets hold."""
import pytest
import torch
from torch import nn

from compressed_opt.buckets import build_buckets
from layouts import legacy


def _bucket():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    [bucket] = build_buckets([{"params": list(model.parameters())}], cap_bytes=1 << 20)
    return model, bucket


def test_reverse_order_and_offsets():
    model, bucket = _bucket()
    params = list(model.parameters())
    assert bucket.params == params[::-1] and bucket.numel == sum(p.numel() for p in params)
    assert bucket.offsets == [0, 2, 10, 14]


def test_views_alias_the_flat_buffer():
    _, bucket = _bucket()
    flat = torch.zeros(bucket.numel)
    views = bucket.views(flat)
    views[1].fill_(3.0)
    assert flat[2:10].eq(3.0).all() and flat[:2].eq(0.0).all() and flat[10:].eq(0.0).all()
    assert [v.shape for v in views] == [tuple(p.shape) for p in bucket.params]


_CONFIGS = [
    ("OnebitAdam", {"freeze_step": 2}),
    ("OnebitAdam", {"freeze_step": 2, "zero_stage": 1}),
    ("OnebitLamb", {"freeze_step": 2}),
    ("OnebitLamb", {"freeze_step": 2, "zero_stage": 2}),
    ("ZeroOneAdam", {"var_freeze_step": 2}),
]


@pytest.mark.parametrize("name,kw", _CONFIGS)
def test_every_bucket_buffer_is_declared_with_its_role_and_dtype(name, kw):
    """After warmup and compression steps, each part of every bucket (the engine's, the exchange's
    error feedback, the algorithm's and ZeRO's) holds only its declared fields, each tensor in its
    declared dtype; nothing of one step (``STEP``) outlives it; the names the checkpoint lists come
    from the declarations."""
    import dataclasses

    import compressed_opt
    from compressed_opt import state
    from compressed_opt.comm import SingleProcessBackend

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))
    opt = getattr(compressed_opt, name)(model.parameters(), backend=SingleProcessBackend(), **kw)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
    seen = set()
    for b in opt.engine.buckets:
        for part in state.parts(b.state) + [b.feedback, b.sync]:
            fields = {f.name: f for f in dataclasses.fields(part)}
            assert set(vars(part)) <= set(fields), (type(part).__name__, set(vars(part)) - set(fields))
            for n, f in fields.items():
                value, role = getattr(part, n), f.metadata.get("role")
                if role == state.STEP:
                    assert value is None, (type(part).__name__, n)
                elif role is not None and isinstance(value, torch.Tensor):
                    declared = f.metadata["dtype"]  # (one dtype, or a tuple: either)
                    assert value.dtype in (declared if isinstance(declared, tuple) else (declared,)), (
                        type(part).__name__, n, value.dtype)
                    seen.add(n)
    assert {"worker_error", "server_error"} <= seen  # (the compression stage made its error feedback)
    names = opt.engine.client.tensor_names()
    if "zero_stage" in kw:
        assert names == ()  # no whole-bucket per-parameter state when sharded
    else:
        assert names == {"OnebitAdam": ("exp_avg", "exp_avg_sq"),
                         "OnebitLamb": ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh"),
                         "ZeroOneAdam": ("exp_avg", "exp_avg_sq", "momentum_accumulator", "sync_params")}[name]


def test_addresses_are_checked_as_they_are_walked():
    from compressed_opt.cuda.cpu import Destinations, Sources, destination_addresses

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
    import compressed_opt
    from compressed_opt.comm import SingleProcessBackend

    # (param_states(opt.state, b) is now b.state.states, made with the bucket from the optimizer's state)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = compressed_opt.OnebitAdam(model.parameters(), backend=SingleProcessBackend())
    [bucket] = opt.engine.buckets
    first = opt.state
    states = bucket.state.states
    assert opt.engine.buckets[0].state.states is states and all(st is first[p] for st, p in zip(states, bucket.params))
    opt.load_state_dict(opt.state_dict())
    second = opt.state
    assert second is not first  # (another mapping)
    [bucket] = opt.engine.buckets
    assert all(st is second[p] for st, p in zip(bucket.state.states, bucket.params))

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
        return legacy(opt.state_dict())["state"]

    a, b = run(), run(reload_at=5)
    factors = [s["exchange_factor"] for s in a.values()]
    assert len(set(factors)) > 1, factors
    for sa, sb in zip(a.values(), b.values()):
        assert sa.keys() == sb.keys()
        for k in sa:
            va, vb = sa[k], sb[k]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, k


def test_a_destination_of_the_wrong_size_is_refused_whatever_its_layout():
    from compressed_opt.cuda.cpu import destination_addresses

    with pytest.raises(ValueError, match="a destination of 6 elements for a segment of 3"):
        destination_addresses([torch.zeros(12)[::2]], [3])  # (not contiguous, and not the segment's size)
