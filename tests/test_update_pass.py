"""The exchanges' last passes (``compressed_opt.cuda.divide_descend_``, ``keep_descend_``): the
preconditioned exchange's momentum taken back from the exchanged average and the update (``A y``
formed from ``R`` by a division, as ZeRO forms it), in one pass, bit for bit as the two passes in
turn; the momentum exchange's update from the result's rows, bit for bit its PyTorch composition."""
import pytest
import torch

from compressed_opt.cuda import (CompressedResult, Descend, Segments, compress_rows_, cpu, decompress_rows_,
                                 divide_descend_, divide_where_nonzero_, harness, keep_descend_, reference, registry,
                                 rows_layout)

_KEEP_DESCEND = ("keep_descend", torch.device("cpu"))  # (the harness's verdict on the C pass, cached)

CASES = [  # (segment sizes, elements past the segments)
    ([5, 0, 17, 1, 64, 3], 4),
    ([3000, 1, 2047, 0, 999], 0),
    ([1] * 300, 5),
    ([40_000, 7], 13),
]


def _inputs(g, sizes, past):
    segs = Segments(sizes)
    n = segs.numel + past
    y = torch.randn(n, generator=g) * 10.0 ** torch.randint(-4, 2, (n,), generator=g)
    y[::7], y[3::11] = 0.0, -0.0
    r = torch.rand(n, generator=g) * 3
    r[::5] = 0.0  # no variance: the momentum is 0 there
    a = torch.rand(n, generator=g)
    params = [torch.randn(k, generator=g) for k in sizes]
    out = torch.full((n,), 7.0)  # elements past the segments: not written
    return segs, y, r, a, params, out


def _bits(ts):
    return [t.view(torch.int32).clone() for t in ts]


def _descend(dests, decay, scale=1.0):
    """The update of ``dests`` with a coefficient and a factor per segment (``eps`` 1e-3: its term
    matters), ``alpha`` ``-1e-3 scale``."""
    k = len(dests)
    return Descend(dests, 1e-3, [0.5 + 0.25 * i for i in range(k)], [1.0 - 0.01 * i for i in range(k)], decay,
                   -1e-3 * scale)


def _compose(y, r, out, segs, divisors, descend, zero_index=None):
    """The two passes in turn (PyTorch's ops), on a copy of ``y``."""
    y, n = y.clone(), segs.numel
    divide_where_nonzero_(y[:n], r[:n], out[:n], zero_index, *(() if divisors is None else (segs, divisors)))
    reference.compose_descend_(y, r, descend.eps, descend.coeffs, descend.factors, descend.dests, segs, descend.decay,
                            descend.alpha, zero_index)


def _shifted(t, shift):
    """A copy of ``t`` that starts ``shift`` elements into its storage (not 32-byte aligned for a
    shift that is not a multiple of 8: the non-temporal stores' scalar head)."""
    out = torch.empty(t.numel() + shift)[shift:]
    return out.copy_(t)


@pytest.mark.parametrize("sizes,past", CASES)
@pytest.mark.parametrize("decay", [1.0, 0.999])
@pytest.mark.parametrize("divided", [False, True])
@pytest.mark.parametrize("shift", [0, 3])
def test_divide_descend_is_the_two_passes_bit_for_bit(sizes, past, decay, divided, shift):
    assert cpu.library() is not None  # (the native pass is what this compares)
    g = torch.Generator().manual_seed(len(sizes) + past)
    segs, y, r, _, params, out = _inputs(g, sizes, past)
    divisors = [0.5 + 0.25 * (i % 5) for i in range(len(sizes))] if divided else None
    y0 = y.clone()

    fused_p, fused_m = [_shifted(p, shift) for p in params], _shifted(out, shift)
    divide_descend_(y, r, fused_m, segs, divisors, _descend(fused_p, decay))

    two_p, two_m = [p.clone() for p in params], out.clone()
    n = segs.numel
    _compose(y, r, two_m, segs, divisors, _descend(two_p, decay))

    assert torch.equal(y.view(torch.int32), y0.view(torch.int32))  # y is only read
    assert torch.equal(fused_m.view(torch.int32), two_m.view(torch.int32))
    assert all(torch.equal(f, t) for f, t in zip(_bits(fused_p), _bits(two_p)))
    assert torch.all(fused_m[n:] == 7.0)
    assert torch.all(fused_m[:n][r[:n] == 0] == 0)
    want = torch.where(r[:n] == 0, torch.zeros(()), y[:n] / r[:n])
    if divided:
        want = torch.cat([w / d for w, d in zip(segs.split(want), divisors)])
    torch.testing.assert_close(fused_m[:n], want, rtol=0, atol=0)


def test_divide_descend_falls_back_to_the_two_passes(monkeypatch):
    """Where the C pass cannot run (the reference kernels forced; a destination not contiguous):
    the same results from the two passes in turn, bit for bit (every operation rounded as PyTorch
    rounds it, its add-with-alpha one FMA: checked at first use, and agreeing here), so a rank that composes
    keeps its replica equal to the others'."""
    g = torch.Generator().manual_seed(3)
    segs, y, r, _, params, out = _inputs(g, [6, 0, 9], 2)
    divisors = [2.0, 1.0, 0.5]
    native_p, native_m = [p.clone() for p in params], out.clone()
    divide_descend_(y.clone(), r, native_m, segs, divisors, _descend(native_p, 0.9))
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    ref_p, ref_m = [p.clone() for p in params], out.clone()
    divide_descend_(y.clone(), r, ref_m, segs, divisors, _descend(ref_p, 0.9))
    assert harness.agrees("divide_descend")
    assert torch.equal(*_bits([ref_m, native_m]))
    assert all(torch.equal(p, q) for p, q in zip(_bits(ref_p), _bits(native_p)))
    monkeypatch.delenv("COMPRESSED_OPT_KERNELS")
    strided = [torch.randn(2 * p.numel(), generator=g)[::2] for p in params]
    expect = [p.contiguous() for p in strided]
    divide_descend_(y.clone(), r, out.clone(), segs, None, _descend(strided, 0.99))  # (composed: strided)
    divide_descend_(y.clone(), r, out.clone(), segs, None, _descend(expect, 0.99))  # (the C pass)
    assert all(torch.equal(p, q) for p, q in zip(_bits(strided), _bits(expect)))


@pytest.mark.parametrize("name,kw", [("OnebitAdam", {}), ("OnebitAdam", {"exchange": "momentum"}),
                                     ("OnebitAdam", {"zero_stage": 1}), ("OnebitLamb", {}),
                                     ("ZeroOneAdam", {"local_step_scaler": 1})])
def test_a_parameter_the_c_passes_cannot_write_changes_no_bit(name, kw):
    """A loop that makes a parameter non-contiguous mid-run (the same values): that step's update
    composes in PyTorch for the whole bucket, and the run stays bit for bit the run that did not
    (a rank that composes computes what the others compute)."""
    import compressed_opt
    from compressed_opt.comm import SingleProcessBackend

    def run(twist):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in [(33, 17), (17,), (5, 300), (4097,)]]
        freeze = {"var_freeze_step" if name == "ZeroOneAdam" else "freeze_step": 3}
        opt = getattr(compressed_opt, name)(params, lr=1e-3, backend=SingleProcessBackend(), **freeze, **kw)
        for step in range(1, 10):
            if twist and step == 6:
                with torch.no_grad():
                    params[2].data = params[2].data.t().contiguous().t()
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 0.01
            opt.step()
        assert not params[2].is_contiguous() if twist else params[2].is_contiguous()
        return [p.detach().contiguous() for p in params]

    assert all(torch.equal(a, b) for a, b in zip(_bits(run(False)), _bits(run(True))))


def test_divide_descend_refuses_bad_input():
    g = torch.Generator().manual_seed(4)
    segs, y, r, _, params, out = _inputs(g, [6, 3], 0)
    with pytest.raises(ValueError, match="one destination per segment"):
        divide_descend_(y, r, out, segs, None, _descend(params[:1], 1.0))
    with pytest.raises(ValueError, match="a destination of 4 elements"):
        divide_descend_(y, r, out, segs, None, _descend([params[0], torch.zeros(4)], 1.0))
    with pytest.raises(ValueError, match="flat buffer"):
        divide_descend_(y[:4], r, out, segs, None, _descend(params, 1.0))
    with pytest.raises(ValueError, match="one value per segment"):
        divide_descend_(y, r, out, segs, None, Descend(params, 1e-8, [1.0], [1.0, 1.0], 1.0, -1e-3))


@pytest.mark.parametrize("sizes,past", CASES)
@pytest.mark.parametrize("world,block", [(1, 256), (2, 256), (3, 512)])
@pytest.mark.parametrize("divided", [False, True])
def test_the_pass_from_the_compressed_rows_is_decompression_then_the_pass(sizes, past, world, block, divided):
    """With ``y`` as the 1-bit rows it travelled as, the C pass decompresses it tile by tile
    (tiles across segments, blocks and chunks) and gives what decompression then the pass give,
    bit for bit; the other path (the reference kernels) decompresses into the scratch buffer."""
    g = torch.Generator().manual_seed(world * 7 + len(sizes))
    segs, _, r, _, params, out = _inputs(g, sizes, past)
    n = segs.numel
    chunk = -(-max(-(-n // world), 1) // 32) * 32
    rows = torch.zeros(world, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    result = CompressedResult(rows, chunk, block, torch.empty(n))
    divisors = [1.5 - 0.125 * (i % 4) for i in range(len(sizes))] if divided else None

    fused_p, fused_m = [p.clone() for p in params], out.clone()
    divide_descend_(result, r, fused_m, segs, divisors, _descend(fused_p, 0.99))

    y = torch.empty(n)
    decompress_rows_(rows, y, chunk, block)
    two_p, two_m = [p.clone() for p in params], out.clone()
    divide_descend_(y, r, two_m, segs, divisors, _descend(two_p, 0.99))
    assert torch.equal(fused_m.view(torch.int32), two_m.view(torch.int32))
    assert all(torch.equal(f, t) for f, t in zip(_bits(fused_p), _bits(two_p)))


def test_a_compressed_result_without_the_c_pass_is_decompressed_into_its_buffer(monkeypatch):
    g = torch.Generator().manual_seed(11)
    segs, _, r, _, params, out = _inputs(g, [300, 0, 45], 3)
    n, chunk, block = segs.numel, 352, 256
    rows = torch.zeros(1, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    native_p, native_m, untouched = [p.clone() for p in params], out.clone(), torch.full((n + 5,), 3.0)
    divide_descend_(CompressedResult(rows, chunk, block, untouched), r, native_m, segs, None, _descend(native_p, 1.0))
    assert torch.all(untouched == 3.0)  # (the C pass decompressed nothing into the buffer)
    monkeypatch.setenv("COMPRESSED_OPT_KERNELS", "reference")
    ref_p, ref_m, buffer = [p.clone() for p in params], out.clone(), torch.full((n,), 3.0)
    divide_descend_(CompressedResult(rows, chunk, block, buffer), r, ref_m, segs, None, _descend(ref_p, 1.0))
    direction = torch.empty(n)
    decompress_rows_(rows, direction, chunk, block)
    d = _descend([p.clone() for p in params], 1.0)
    reference.compose_descend_(direction, r, d.eps, d.coeffs, d.factors, d.dests, segs, d.decay, d.alpha)
    assert torch.equal(buffer, direction)  # (decompressed into the buffer, the direction written over it)
    assert torch.equal(*_bits([ref_m, native_m]))
    assert all(torch.equal(p, q) for p, q in zip(_bits(ref_p), _bits(native_p)))
    with pytest.raises(ValueError, match="rows of"):
        CompressedResult(rows[:, :10].contiguous(), chunk, block, torch.empty(n))


def _result(g, n, world, block):
    chunk = -(-max(-(-n // world), 1) // 32) * 32
    rows = torch.zeros(world, rows_layout(chunk, block)[1], dtype=torch.uint8)
    compress_rows_(torch.randn(n, generator=g), torch.zeros(n), rows, chunk, block)
    y = torch.empty(n)
    decompress_rows_(rows, y, chunk, block)
    return CompressedResult(rows, chunk, block, torch.empty(n)), y


@pytest.mark.parametrize("sizes,past", CASES)
@pytest.mark.parametrize("world,block", [(1, 256), (3, 512)])
@pytest.mark.parametrize("decay,factored,kept", [(1.0, False, True), (0.999, True, True), (0.99, False, False)])
def test_the_momentum_exchanges_update_from_the_rows_is_its_composition(sizes, past, world, block, decay, factored,
                                                                         kept):
    """``m <- y`` (not under ZeRO: ``kept``) and ``p <- p decay + alpha (y / den) f_l``, from the rows
    tile by tile by the C pass (nothing decompressed into the result's buffer): the decompression then
    the composition (``reference.keep_descend_``) bit for bit, ``den == inf`` (``v_f == 0``) included;
    ``m``'s elements past the segments are not written."""
    assert cpu.library() is not None and harness.agrees("keep_descend")
    g = torch.Generator().manual_seed(world * 5 + len(sizes))
    segs, _, _, a, params, out = _inputs(g, sizes, past)
    n = segs.numel
    result, y = _result(g, n, world, block)
    result.buffer.fill_(3.0)
    den = a + 1e-8
    den[::9] = float("inf")
    factors = [1.0 + 0.1 * (i % 5) - 0.2 for i in range(len(sizes))] if factored else None
    fused_p, fused_m = [p.clone() for p in params], out.clone()
    keep_descend_(result, den, fused_m if kept else None, factors, fused_p, segs, decay, -1e-3)
    assert torch.all(result.buffer == 3.0)  # (the C pass ran: it decompressed nothing into the buffer)
    composed_p, composed_m = [p.clone() for p in params], out.clone()
    reference.keep_descend_(y, den, composed_m if kept else None, factors, composed_p, segs, decay, -1e-3)
    assert torch.equal(fused_m.view(torch.int32), composed_m.view(torch.int32))
    assert all(torch.equal(f, c) for f, c in zip(_bits(fused_p), _bits(composed_p)))
    assert torch.all(fused_m[n:] == 7.0)


def test_the_momentum_exchanges_update_composes_where_the_c_pass_cannot_run(monkeypatch):
    """Where the C pass cannot run (a parameter it cannot address, not contiguous; a denominator of
    another dtype; the harness's check at first use failed) the update still completes: the result
    decompressed into its buffer, then the composition, bit for bit the C pass's results (``m``, the
    parameters). Rows too short for the segments: ``ValueError``, with nothing written."""
    assert cpu.library() is not None and harness.agrees("keep_descend")
    g = torch.Generator().manual_seed(3)
    segs, _, _, a, params, out = _inputs(g, [300, 45], 0)
    n = segs.numel
    result, y = _result(g, n, 2, 256)
    den = a + 1e-8
    native_p, native_m = [p.clone() for p in params], out.clone()
    result.buffer.fill_(3.0)
    keep_descend_(result, den, native_m, None, native_p, segs, 0.999, -1e-3)
    assert torch.all(result.buffer == 3.0)  # (the C pass)
    direction = y.clone()
    reference.keep_descend_(direction, den, out.clone(), None, [p.clone() for p in params], segs, 0.999, -1e-3)

    def composed(dests, d):
        m = out.clone()
        result.buffer.fill_(3.0)
        keep_descend_(result, d, m, None, dests, segs, 0.999, -1e-3)
        assert torch.equal(result.buffer, direction)  # (decompressed into the buffer, the direction over it)
        assert torch.equal(*_bits([m, native_m]))
        assert all(torch.equal(p, q) for p, q in zip(_bits([p.contiguous() for p in dests]), _bits(native_p)))

    strided = [params[0].clone(), torch.empty(45, 2).t()[0].copy_(params[1])]
    assert not strided[1].is_contiguous()
    composed(strided, den)
    composed([p.clone() for p in params], den.double())
    before = [p.clone() for p in params] + [out.clone()]
    with pytest.raises(ValueError, match="rows of"):  # (one row of 192 elements for 345)
        keep_descend_(CompressedResult(result.rows[:1], result.chunk, result.block, result.buffer), den, out, None,
                      params, segs, 1.0, -1e-3)
    assert all(torch.equal(x, b) for x, b in zip(params + [out], before))
    monkeypatch.setitem(harness._agreed, _KEEP_DESCEND, False)  # (the check at first use failed)
    monkeypatch.setattr(registry, "_bound", {})  # (the kernels bound again, from that verdict)
    assert registry.kernels_for("cpu").keep_descend_ is reference.keep_descend_
    composed([p.clone() for p in params], den)


def _momentum_run(native: bool, monkeypatch) -> tuple[list, tuple[int, int]]:
    import compressed_opt
    from compressed_opt.comm import SingleProcessBackend

    with monkeypatch.context() as patched:
        if native:
            assert harness.agrees("keep_descend")
        else:  # (as where the check at first use failed: the reference is bound)
            patched.setitem(harness._agreed, _KEEP_DESCEND, False)
        patched.setattr(registry, "_bound", {})  # (the buckets' kernels bound afresh, from the harness's verdict)
        c_ran, composed = [], []
        c_pass, composition = cpu.keep_descend_, reference.keep_descend_

        def counted_c(*args):  # (the C pass, where it ran: it falls back to the composition, counted there)
            c_ran.append(1)
            return c_pass(*args)

        def counted_composition(*args):
            composed.append(1)
            return composition(*args)

        patched.setattr(cpu, "keep_descend_", counted_c)
        patched.setattr(reference, "keep_descend_", counted_composition)
        g = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in ((33, 17), (17,), (0,), (4097,))]
        opt = compressed_opt.OnebitAdam(params, lr=1e-3, freeze_step=3, exchange="momentum", bucket_cap_mb=0.01,
                                        backend=SingleProcessBackend())
        for _ in range(10):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 0.01
            opt.step()
    state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [t.detach().clone() for t in params + state], (len(c_ran), len(composed))


def test_onebit_adams_momentum_exchange_steps_as_its_composition(monkeypatch):
    """OnebitAdam with the paper's exchange (weight decay, variance tracking: its defaults) steps
    through the C pass from the rows, and to the bit as where the check at first use failed
    and the update is composed."""
    fused, ran = _momentum_run(True, monkeypatch)
    composed, ran_composed = _momentum_run(False, monkeypatch)
    # (every bucket of the 7 compression steps: natively, none composed; then composed, none natively)
    assert ran[0] >= 7 and ran[1] == 0 and ran_composed[0] == 0 and ran_composed[1] == ran[0]
    for a, b in zip(fused, composed):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.float32 else a,
                           b.view(torch.int32) if b.dtype == torch.float32 else b)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_the_momentum_exchange_resumes_bit_for_bit(zero_stage):
    """A checkpoint saved in the compression stage of the momentum exchange (its update from the
    rows, its local momentum from ``p.grad``) and loaded into a new model and optimizer: the run
    ends where the uninterrupted one does, to the bit."""
    import compressed_opt
    from compressed_opt.comm import SingleProcessBackend
    from optim_tasks import mlp, resume_diff
    from test_onebit_adam import gaussian_batches

    def fresh():
        model = mlp()
        opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-3, freeze_step=3, exchange="momentum",
                                        zero_stage=zero_stage, overlap=False, bucket_cap_mb=0.01,
                                        backend=SingleProcessBackend())
        return model, model, opt

    assert resume_diff(fresh, list(gaussian_batches(0, 1, 10)), 6) == 0.0


def _one_rank_composes(rank, world):
    """OnebitAdam with its defaults on 2 Gloo ranks; on rank 1 a parameter turns non-contiguous at
    step 6 (the same values), so from there its update composes in PyTorch where rank 0's runs the
    C pass. The replicas, bit for bit."""
    import compressed_opt

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.1) for s in [(33, 17), (17,), (5, 300), (4097,)]]
    opt = compressed_opt.OnebitAdam(params, lr=1e-3, freeze_step=3)
    g = torch.Generator().manual_seed(100 + rank)  # (each rank its own gradients)
    for step in range(1, 11):
        if rank == 1 and step == 6:
            with torch.no_grad():
                params[2].data = params[2].data.t().contiguous().t()
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        opt.step()
    assert opt.compressing and params[2].is_contiguous() == (rank == 0)
    opt.close()
    return [p.detach().contiguous().view(torch.int32) for p in params]


@pytest.mark.multiprocess
def test_a_rank_whose_update_composes_keeps_the_others_bits():
    from distributed import run_ranks

    p0, p1 = run_ranks(_one_rank_composes, 2, timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
