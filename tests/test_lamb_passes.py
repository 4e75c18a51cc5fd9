"""1-bit LAMB's two native compression-stage passes (compressed_opt.cuda.lamb_passes): against
the PyTorch composition bit for bit (``m``, ``v_fresh``, the parameters), the per-layer maxima
against a float64 reference within their bound, and in the optimizer: the same training as the
composition, deterministic run to run."""
import math

import pytest
import torch

from compressed_opt import OnebitLamb
from compressed_opt.cuda import (CompressedResult, Segments, compress_rows_, cpu, decompress_rows_, harness,
                                 lamb_passes, rows_layout)
from optim_tasks import mlp, run_steps, shard_batches

pytestmark = pytest.mark.skipif(cpu.library() is None or not harness.agrees("lamb_passes"),
                                reason="no native LAMB passes here (no C compiler, or another PyTorch rounding)")

#: segments with and without a vector tail, empty ones, single elements
SIZES = (37, 0, 1000, 5, 8, 64, 1, 0, 4099)
FORMS = ("r", "divisors", "none")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def _case(seed: int, form: str, sizes=SIZES, eps=1e-8):
    """Inputs as the compression stage has them: ``y``, ``R`` (0 where ``v_f == 0`` and elsewhere),
    ``m_{t-1}``, ``v_fresh`` (with zeros), ``denom = sqrt(v_f) + eps`` (``inf`` where ``v_f == 0``)."""
    g = torch.Generator().manual_seed(seed)
    segments = Segments(list(sizes))
    n = segments.numel
    y, m = torch.randn(n, generator=g) * 0.1, torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 1e-3
    root = torch.rand(n, generator=g) * 1e-2 + 1e-6
    denom = root + eps
    dead = torch.zeros(n, dtype=torch.bool)
    dead[::11] = True
    denom[dead] = float("inf")
    r = torch.where(dead, torch.zeros(()), 1.0 / root)
    v[::17] = 0.0
    y[::19] = 0.0
    divisors = [0.5 + 0.25 * i for i in range(len(segments))]
    return segments, y, (r if form == "r" else None), (divisors if form == "divisors" else None), m, v, denom


ARGS = dict(beta1=0.9, beta2=0.999, bc2_sqrt=math.sqrt(1 - 0.999**7), eps=1e-8)


def _both(segments, y, r, divisors, m, v, denom, **kw):
    args = dict(ARGS, **kw)
    mine, theirs = (m.clone(), v.clone()), (m.clone(), v.clone())
    got = lamb_passes.variance_maxima_(y, r, divisors, *mine, denom, segments, **args)
    want = lamb_passes.compose_variance_maxima_(y, r, divisors, *theirs, denom, segments, **args)
    return got, want, mine, theirs


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("bc2_sqrt", [ARGS["bc2_sqrt"], 1.0])
def test_variance_pass_is_the_composition_bit_for_bit(form, seed, bc2_sqrt):
    """``m <- m_t`` and ``v_fresh``: the composition's bits (its FMAs written as fmaf, nothing else
    contracted); the maxima within the module's tolerance of its (PyTorch's sqrt is not correctly
    rounded), 1.0 for the empty layers. A bias correction of 1 (late steps; the pass then skips its
    division by it) too."""
    got, want, mine, theirs = _both(*_case(seed, form), bc2_sqrt=bc2_sqrt)
    assert torch.equal(_bits(mine[0]), _bits(theirs[0])) and torch.equal(_bits(mine[1]), _bits(theirs[1]))
    assert len(got) == len(SIZES)
    for n, a, b in zip(SIZES, got, want):
        assert (a == b == 1.0) if n == 0 else abs(a - b) <= lamb_passes.MAXIMA_TOLERANCE * b


@pytest.mark.parametrize("form", FORMS)
def test_maxima_are_within_their_bound_of_float64(form):
    """Each maximum against the same formula in float64 on the pass's ``v`` (itself exact): within
    ``2^-21`` relative (four fp32 roundings)."""
    segments, y, r, divisors, m, v, denom = _case(7, form)
    got = lamb_passes.variance_maxima_(y, r, divisors, m, v, denom, segments, **ARGS)
    f = denom.double() / (v.double().sqrt() / ARGS["bc2_sqrt"] + ARGS["eps"])
    f = torch.where(torch.isfinite(f), f, torch.zeros(()).double())
    for n, part, a in zip(SIZES, segments.split(f), got):
        if n == 0:
            assert a == 1.0
        else:
            assert abs(a - float(part.max())) <= 2.0**-21 * float(part.max())


def test_layers_without_variance_nan_and_infinite_ratios():
    """A layer whose every coordinate has ``v_f == 0`` (infinite denominators) has maximum 0, as the
    composition's ``nan_to_num`` gives; a NaN variance and a zero ``eps`` (``denom / 0``) count as 0."""
    segments = Segments([16, 9, 3])
    n = segments.numel
    y, m = torch.full((n,), 0.5), torch.full((n,), 0.25)
    v, denom, r = torch.rand(n) * 1e-3, torch.rand(n) + 0.5, torch.full((n,), 2.0)
    denom[:16], r[:16] = float("inf"), 0.0  # layer 0: v_f == 0 everywhere
    v[16:25] = float("nan")  # layer 1: NaN ratios
    y[25:], m[25:] = 0.0, 0.0  # layer 2: v -> 0 where it was 0, with eps 0 an infinite ratio
    v[25:] = 0.0
    got, want, mine, theirs = _both(segments, y, r, None, m, v, denom, eps=0.0)
    assert got == want == [0.0, 0.0, 0.0]
    assert torch.equal(_bits(mine[0]), _bits(theirs[0])) and torch.equal(_bits(mine[1]), _bits(theirs[1]))
    assert (mine[0][:16] == 0).all()  # m_t = y / R is 0 where R == 0


@pytest.mark.parametrize("decayed", [False, True])
@pytest.mark.parametrize("seed", range(2))
def test_descend_is_the_composition_bit_for_bit_through_each_parameter(decayed, seed):
    """``p <- p decay + alpha (m / denom)`` written into each parameter's own memory (shaped, and
    views into one larger tensor whose other elements stay), as torch.div, _foreach_mul_ (twice)
    and _foreach_add_ round it."""
    segments, _, _, _, m, _, denom = _case(seed, "r")
    g = torch.Generator().manual_seed(100 + seed)
    store = torch.randn(segments.numel + 10, generator=g)
    params = [p.view(1, p.numel()) if i % 2 else p for i, p in enumerate(store[5:5 + segments.numel].split(SIZES))]
    copies = [p.clone() for p in params]
    alphas = [-0.01 * (i + 1) for i in range(len(SIZES))]
    decays = [1.0 - 1e-4 * (i + 1) for i in range(len(SIZES))] if decayed else None
    edges = store[:5].clone(), store[-5:].clone()
    lamb_passes.descend_(params, m, denom, segments, decays, alphas)
    lamb_passes.compose_descend_(copies, m, denom, segments, decays, alphas)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(params, copies))
    assert torch.equal(store[:5], edges[0]) and torch.equal(store[-5:], edges[1])


def test_ready_only_for_plain_fp32_cpu_buffers(monkeypatch):
    segments = Segments([4, 3])
    flat = [torch.zeros(7) for _ in range(3)]
    params = [torch.zeros(4), torch.zeros(3)]
    assert lamb_passes.ready(flat + [None], params, segments)
    assert not lamb_passes.ready(flat + [torch.zeros(14)[::2]], params, segments)  # not contiguous
    assert not lamb_passes.ready(flat + [torch.zeros(8)], params, segments)  # not the segments' size
    assert not lamb_passes.ready(flat, [params[0].bfloat16(), params[1]], segments)
    assert not lamb_passes.ready(flat, params[:1], segments)
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    assert not lamb_passes.ready(flat, params, segments)


#: (segment sizes) for the pass from the rows: segments across tiles (256), blocks and chunks,
#: empty ones (first, inside, last), single elements, short segments inside one tile
ROW_SIZES = ([5, 0, 17, 1, 64, 3], [3000, 1, 2047, 0, 999], [0, 1] * 150 + [7], [40_000, 7, 0], [255, 2, 300, 514])


def _rows_of(g, n, world, block):
    """1-bit rows of a random buffer of ``n`` elements over ``world`` rows (chunks of a multiple
    of 32 elements: the last row may be short of elements)."""
    chunk = -(-max(-(-n // world), 1) // 32) * 32
    rows = torch.zeros(world, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g) * 0.1, torch.zeros(n), rows, chunk, block)
    return rows, chunk


@pytest.mark.parametrize("sizes", ROW_SIZES)
@pytest.mark.parametrize("world,block", [(1, 256), (2, 256), (3, 512), (2, 512), (3, 256)])
@pytest.mark.parametrize("form", FORMS)
def test_variance_pass_from_the_rows_is_decompression_then_the_pass(sizes, world, block, form):
    """With ``y`` as the 1-bit rows it travelled as, pass 1 decompresses it tile by tile into the
    stack and gives what decompressing it then pass 1 on ``y`` give, bit for bit: ``m``, ``v`` and
    every maximum (``R == 0`` and ``v_f == 0`` coordinates, ``v == 0``, empty layers: 1.0); nothing
    is written into the result's buffer."""
    segments, _, r, divisors, m, v, denom = _case(world * 10 + len(sizes), form, sizes)
    n = segments.numel
    g = torch.Generator().manual_seed(block + world)
    rows, chunk = _rows_of(g, n, world, block)
    buffer = torch.full((n,), 3.0)
    mine, theirs = (m.clone(), v.clone()), (m.clone(), v.clone())
    got = lamb_passes.variance_maxima_(CompressedResult(rows, chunk, block, buffer), r, divisors, *mine, denom,
                                       segments, **ARGS)
    y = torch.empty(n)
    decompress_rows_(rows, y, chunk, block)
    want = lamb_passes.variance_maxima_(y, r, divisors, *theirs, denom, segments, **ARGS)
    assert got == want
    assert all(a == 1.0 for k, a in zip(sizes, got) if k == 0)
    assert torch.equal(_bits(mine[0]), _bits(theirs[0])) and torch.equal(_bits(mine[1]), _bits(theirs[1]))
    assert torch.all(buffer == 3.0)


def test_variance_pass_from_the_rows_with_infinite_and_nan_ratios():
    """A layer with ``v_f == 0`` everywhere, one with a NaN variance, one with ``eps == 0`` and ``v
    == 0`` (``denom / 0``): the maxima (0) and the state as from the decompressed ``y``."""
    segments = Segments([300, 9, 260])
    n = segments.numel
    rows, chunk = _rows_of(torch.Generator().manual_seed(3), n, 2, 256)
    m, v, denom, r = torch.full((n,), 0.25), torch.rand(n) * 1e-3, torch.rand(n) + 0.5, torch.full((n,), 2.0)
    denom[:300], r[:300] = float("inf"), 0.0
    v[300:309] = float("nan")
    m[309:], v[309:] = 0.0, 0.0
    y = torch.empty(n)
    decompress_rows_(rows, y, chunk, 256)
    r[309:] = float("inf")  # m_t = y / R = 0 there: v stays 0, q = 0
    mine, theirs = (m.clone(), v.clone()), (m.clone(), v.clone())
    args = dict(ARGS, eps=0.0)
    got = lamb_passes.variance_maxima_(CompressedResult(rows, chunk, 256, torch.empty(n)), r, None, *mine, denom,
                                       segments, **args)
    want = lamb_passes.variance_maxima_(y, r, None, *theirs, denom, segments, **args)
    assert got == want == [0.0, 0.0, 0.0]
    assert torch.equal(_bits(mine[0]), _bits(theirs[0])) and torch.equal(_bits(mine[1]), _bits(theirs[1]))


def test_ready_takes_cpu_rows_of_enough_elements():
    segments = Segments([40, 30])
    flat = [torch.zeros(70) for _ in range(3)]
    params = [torch.zeros(40), torch.zeros(30)]
    rows = torch.zeros(2, rows_layout(64, 256)[1], dtype=torch.uint8)
    assert lamb_passes.ready([CompressedResult(rows, 64, 256, torch.zeros(70))] + flat, params, segments)
    assert not lamb_passes.ready([CompressedResult(rows[:1], 64, 256, torch.zeros(70))] + flat, params, segments)
    assert not lamb_passes.ready([CompressedResult(rows, 64, 256, torch.zeros(71))] + flat, params, segments)
    with pytest.raises(ValueError, match="1 rows of 64 elements for 70"):
        lamb_passes.variance_maxima_(CompressedResult(rows[:1], 64, 256, torch.zeros(70)), None, None, *flat,
                                     segments, **ARGS)


def _train(fused: bool, monkeypatch, exchange="preconditioned", trust_ratio="live", wd=0.01, calls=None):
    """A seeded single-process job through the freeze and 9 compression steps (the live ratio
    measured at steps 5, 8, 11): the parameters and the optimizer's state at the end."""
    with monkeypatch.context() as patch:
        original = lamb_passes.ready
        if not fused:
            patch.setattr(lamb_passes, "ready", lambda *a: False)
        elif calls is not None:
            def counted(*a):
                calls.append(1)
                return original(*a)
            patch.setattr(lamb_passes, "ready", counted)
        model = mlp(0, hidden=16)
        opt = OnebitLamb(model.parameters(), lr=0.02, weight_decay=wd, freeze_step=4, exchange=exchange,
                         trust_ratio=trust_ratio, trust_ratio_interval=3, max_coeff=0.3)
        run_steps(model, opt, list(shard_batches(0, 1, 13, batch=32)))
        assert opt.compressing
    state = [(opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq_fresh"].clone()) for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()], state


@pytest.mark.parametrize("exchange,trust_ratio,wd", [("preconditioned", "live", 0.01), ("preconditioned", "live", 0.0),
                                                     ("momentum", "live", 0.01), ("preconditioned", "frozen", 0.01)])
def test_the_optimizer_trains_as_the_composition_and_repeats_bit_for_bit(exchange, trust_ratio, wd, monkeypatch):
    """The fused passes in OnebitLamb's compression stage: twice the same job, the same bits; against
    the composition in PyTorch, the same training up to the maxima's last bits (which reach the
    factor, and the parameters through it)."""
    calls = []
    fused = _train(True, monkeypatch, exchange, trust_ratio, wd, calls)
    assert calls  # the native passes ran
    again = _train(True, monkeypatch, exchange, trust_ratio, wd)
    composed = _train(False, monkeypatch, exchange, trust_ratio, wd)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(fused[0], again[0]))
    assert all(torch.equal(_bits(a), _bits(b)) for s, t in zip(fused[1], again[1]) for a, b in zip(s, t))
    for a, b in zip(fused[0], composed[0]):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for s, t in zip(fused[1], composed[1]):
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-9) for a, b in zip(s, t))


CONFIGS = [("preconditioned", "live", 0.01), ("preconditioned", "live", 0.0), ("momentum", "live", 0.01),
           ("preconditioned", "frozen", 0.01)]


@pytest.mark.parametrize("exchange,trust_ratio,wd", CONFIGS)
def test_the_optimizer_reads_the_exchange_rows_as_it_read_y(exchange, trust_ratio, wd, monkeypatch):
    """Stage 0's exchange leaves its result in its 1-bit rows and pass 1 reads them (every
    compression step, those that measure the live ratio too): the same parameters and state, bit for
    bit, as decompressing them first and running pass 1 on ``y``."""
    seen = []
    original = lamb_passes.variance_maxima_

    def rows_seen(y, *a):
        seen.append(isinstance(y, CompressedResult))
        return original(y, *a)

    with monkeypatch.context() as patch:
        patch.setattr(lamb_passes, "variance_maxima_", rows_seen)
        from_rows = _train(True, monkeypatch, exchange, trust_ratio, wd)
    assert seen and all(seen)
    with monkeypatch.context() as patch:
        patch.setattr(lamb_passes, "variance_maxima_",
                      lambda y, *a: original(y.expand_() if isinstance(y, CompressedResult) else y, *a))
        from_y = _train(True, monkeypatch, exchange, trust_ratio, wd)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(from_rows[0], from_y[0]))
    assert all(torch.equal(_bits(a), _bits(b)) for s, t in zip(from_rows[1], from_y[1]) for a, b in zip(s, t))


def test_rows_the_step_cannot_pass_are_decompressed_for_the_composition(monkeypatch):
    """Where the rows were kept but the step does not run the native passes, it decompresses them
    into the bucket and composes: the bits of the composition from the exchange's own ``y``."""
    from compressed_opt.onebit_lamb import LambAlgorithm  # (OnebitLamb's algorithm: opt.engine.client)

    original = LambAlgorithm._passes_ready
    expanded = []

    def not_from_rows(self, bucket, y, params=None):
        if isinstance(y, CompressedResult):
            expanded.append(1)
            return False
        return original(self, bucket, y, params)

    with monkeypatch.context() as patch:
        patch.setattr(LambAlgorithm, "_passes_ready", not_from_rows)
        from_rows = _train(True, monkeypatch)
    assert expanded
    composed = _train(False, monkeypatch)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(from_rows[0], composed[0]))
    assert all(torch.equal(_bits(a), _bits(b)) for s, t in zip(from_rows[1], composed[1]) for a, b in zip(s, t))


def test_an_empty_parameter_takes_the_passes_as_the_composition(monkeypatch):
    """An fp32 parameter without elements in a bucket the passes serve: its factor's maximum is 1
    (as the composition's empty layer), its coefficients as the composition's, nothing written."""
    from torch import nn

    finals = []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(lamb_passes, "ready", lambda *a: False)
            ran = []
            original = lamb_passes.descend_
            patch.setattr(lamb_passes, "descend_", lambda *a: ran.append(1) or original(*a))
            model, empty = mlp(0, hidden=16), nn.Parameter(torch.zeros(0))
            opt = OnebitLamb(list(model.parameters()) + [empty], freeze_step=3, lr=0.02)
            run_steps(model, opt, list(shard_batches(0, 1, 8, batch=32)))
            assert bool(ran) == fused and opt.compressing
        st = opt.state[empty]
        finals.append((st["lamb_coeff"], st["last_factor"], [p.detach().clone() for p in model.parameters()]))
    assert finals[0][:2] == finals[1][:2] == (1.0, 1.0)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(finals[0][2], finals[1][2]))
