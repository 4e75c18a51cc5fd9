"""Per-layer scaling coefficients (compressed_opt.scaling): the formula, and what they are for:
a small layer in a bucket with large ones keeps its own size through the 1-bit exchange."""
import math

import pytest
import torch
from torch import nn

from compressed_opt import ZeroOneAdam, scaling
from compressed_opt.comm import SingleProcessBackend, compressed_allreduce, error_buffer_sizes


def test_coefficients_bring_every_layer_to_the_mean_rms():
    rms, sizes = [1.0, 4.0, 0.0, 0.0], [2, 3, 5, 0]
    mean = (1.0 + 4.0 + 0.0) / 3  # over the non-empty layers
    assert scaling.coefficients(rms, sizes) == pytest.approx([mean / 1.0, mean / 4.0, 1.0, 1.0])
    assert scaling.coefficients([0.0, 0.0], [3, 3]) == [1.0, 1.0]
    assert scaling.coefficients([], []) == []


def test_rms_from_variance_and_norms():
    v = [torch.full((4,), 9.0), torch.tensor([1.0, 3.0]), torch.zeros(0)]
    assert scaling.rms_from_variance(v) == pytest.approx([3.0, math.sqrt(2.0), 0.0])
    assert scaling.rms_from_norms([6.0, 0.0], [4, 0]) == [3.0, 0.0]


def _exchange(x, coeffs, views):
    be = SingleProcessBackend()
    we, se = (torch.zeros(n) for n in error_buffer_sizes(x.numel(), 1))
    scaling.scale_(views, coeffs)
    compressed_allreduce(x, we, se, be)
    scaling.unscale_(views, coeffs)
    return x


def test_a_small_layer_keeps_its_size_through_the_exchange():
    g = torch.Generator().manual_seed(0)
    small, large = 1e-3 * torch.randn(1000, generator=g), torch.randn(1000, generator=g)
    sizes = [1000, 1000]
    coeffs = scaling.coefficients([small.pow(2).mean().sqrt().item(), large.pow(2).mean().sqrt().item()], sizes)
    for use, bound in ((False, None), (True, 2.0)):
        x = torch.cat([small, large])
        out = _exchange(x, coeffs if use else [1.0, 1.0], list(x.split(sizes)))
        rel = ((out[:1000] - small).norm() / small.norm()).item()
        if use:
            assert rel < bound  # sign compression of the layer itself: error of its own size
        else:
            assert rel > 100  # +-the bucket's scale: ~1000x the layer's values


def test_errors_move_with_the_coefficients():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = ZeroOneAdam(model.parameters(), backend=SingleProcessBackend())
    [bucket] = opt.engine.buckets
    feedback = opt.engine.exchange.feedback_for(bucket.feedback, bucket.numel, bucket.device)  # (zeros, made here)
    we, se = feedback.worker_error, feedback.server_error
    we.copy_(torch.arange(we.numel(), dtype=torch.float32))
    se.copy_(torch.arange(se.numel(), dtype=torch.float32))
    old = [1.0, 2.0, 4.0, 8.0]
    new = [2.0, 2.0, 1.0, 4.0]
    before_we, before_se = we.clone(), se.clone()
    scaling.rescale_errors(bucket, opt.engine.exchange.error_ranges(bucket), old, new)
    ratio = torch.cat([torch.full((p.numel(),), n / o) for p, n, o in zip(bucket.params, new, old)])
    torch.testing.assert_close(we, before_we * ratio)
    torch.testing.assert_close(se[: bucket.numel], before_se[: bucket.numel] * ratio)
