"""Flat buckets: layout, and the per-parameter views kept for the bucket's own buffers (made once,
let go with the buffer)."""
import gc
import weakref

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
