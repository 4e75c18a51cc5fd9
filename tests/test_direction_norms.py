"""1-bit LAMB's trust-ratio direction sums in one native pass (compressed_opt.cuda.direction_norms)
against the PyTorch composition they replace, bit for bit."""
import pytest
import torch

from compressed_opt.cuda import Segments, cpu, direction_norms, direction_sumsq, harness

SIZES = [37, 0, 1000, 5, 8, 64, 1, 17, 3]


def _case(seed: int):
    g = torch.Generator().manual_seed(seed)
    segments = Segments(SIZES)
    n = segments.numel
    x = torch.randn(n + 3, generator=g) * 2  # (a tail past the segments: never read)
    x[::7] = 0.0
    den = torch.rand(n, generator=g) + 1e-3
    den[::11] = float("inf")  # (where v_f == 0: the direction is 0 there)
    params = [torch.randn(k, generator=g) for k in SIZES]
    scales = [0.25 * (i + 1) for i in range(len(SIZES))]
    return segments, x, den, params, scales


def _calls(monkeypatch) -> list:
    """Each call of the native pass, recorded (it runs as before)."""
    lib, seen = cpu.library(), []
    harness.agrees("direction_sumsq")  # (the check at first use calls the pass itself: made before recording)
    native = lib.co_direction_sumsq

    def recorded(*args):
        seen.append(args)
        return native(*args)

    monkeypatch.setattr(lib, "co_direction_sumsq", recorded)
    return seen


@pytest.mark.parametrize("divided", [False, True])
@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_the_pass_gives_the_compositions_sums_bit_for_bit(divided, decayed, seed, monkeypatch):
    """``sum (wd p + (x / den) a_l)^2`` per layer: the native pass's float64 sums are the
    composition's (``torch.div``, ``_foreach_mul``, ``_foreach_add_`` with alpha, the native sums
    of squares) to the last bit, empty layers 0; and the pass ran, once."""
    if cpu.library() is None:
        pytest.skip("no C compiler here")
    segments, x, den, params, scales = _case(seed)
    den, params = (den if divided else None), (params if decayed else None)
    calls = _calls(monkeypatch)
    got = direction_sumsq(x, den, scales, params, 0.01, segments)
    want = direction_norms.compose_direction_sumsq(x, den, scales, params, 0.01, segments)
    assert len(calls) == 1
    assert torch.equal(got.view(torch.int64), want.view(torch.int64))
    assert got[1] == 0.0 and bool(torch.isfinite(got).all())


def test_what_the_pass_cannot_take_is_composed_with_the_same_bits(monkeypatch):
    """A strided ``x`` or a parameter the C cannot address, and a process whose check at first use
    found the pass differing: composed, the same sums."""
    if cpu.library() is None:
        pytest.skip("no C compiler here")
    segments, x, den, params, scales = _case(3)
    want = direction_norms.compose_direction_sumsq(x, den, scales, params, 0.01, segments)
    calls = _calls(monkeypatch)
    strided = torch.zeros(2 * x.numel())[::2].copy_(x)
    assert torch.equal(direction_sumsq(strided, den, scales, params, 0.01, segments), want)
    strided_params = [torch.zeros(2 * p.numel())[::2].copy_(p) for p in params]
    assert not strided_params[0].is_contiguous()
    assert torch.equal(direction_sumsq(x, den, scales, strided_params, 0.01, segments), want)
    monkeypatch.setitem(harness._agreed, ("direction_sumsq", torch.device("cpu")), False)
    assert torch.equal(direction_sumsq(x, den, scales, params, 0.01, segments), want)
    assert len(calls) == 0
    with pytest.raises(ValueError, match="one scale per segment"):
        direction_sumsq(x, den, scales[:-1], params, 0.01, segments)
