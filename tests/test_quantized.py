"""The 4-bit allreduce with error feedback (compressed_opt.comm.quantized), DiLoCo's
``compression="4bit"``: its codes and their packing, one exchange against the exact mean, the same
result on every rank, error feedback taking the rounding back over repeated exchanges, and the
bytes against an fp32 ring allreduce."""
from __future__ import annotations

import pytest
import torch

from compressed_opt.comm import SingleProcessBackend, quantized
from distributed import run_ranks


def test_codes_round_trip_through_the_packing_and_stay_within_half_a_step():
    u = torch.randn(3, 1000) * torch.logspace(-3, 2, 1000)  # (blocks of very different sizes)
    chunk, blk, nb = quantized.layout(3000, 3, 256)
    assert (chunk, blk, nb) == (1000, 256, 4)
    codes, scales = quantized.quantize(u, blk, nb)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == quantized.LEVELS
    back = quantized.dequantize(codes, scales, blk, nb)
    step = quantized._blocks(torch.ones_like(u), blk, nb) * scales.unsqueeze(2)
    assert bool(((back - u).abs() <= step.view(3, -1)[:, :1000] / 2 * (1 + 1e-6)).all())
    every = torch.arange(-7, 8, dtype=torch.int8).repeat(2, 4)  # each code, both nibbles of a byte
    rows = quantized._rows(every, torch.ones(2, 1))
    assert rows.dtype == torch.uint8 and rows.shape == (2, 30 + 4)
    again, ones = quantized._unrows(rows, 60)
    assert torch.equal(again, every) and torch.equal(ones, torch.ones(2, 1))


def test_one_process_is_the_quantised_value_with_its_error_kept():
    x = torch.randn(777)
    we, se = (torch.zeros(n) for n in quantized.error_sizes(777, 1, 1024))
    y = quantized.quantized_allreduce(x.clone(), we, se, SingleProcessBackend())
    assert torch.allclose(y + we[:777] + se[:777], x, atol=1e-6)  # (both stages' rounding, kept)
    with pytest.raises(ValueError, match="worker_error"):
        quantized.quantized_allreduce(x.clone(), torch.zeros(3), se, SingleProcessBackend())
    with pytest.raises(ValueError, match="1-D float32"):
        quantized.quantized_allreduce(x.double(), we, se, SingleProcessBackend())


def _exchange(rank, world, numel, rounds):
    from compressed_opt.comm import TorchBackend

    backend = TorchBackend()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=gen) * (rank + 1)
    everyone = [torch.empty(numel) for _ in range(world)]
    torch.distributed.all_gather(everyone, x)
    mean = torch.stack(everyone).mean(dim=0)
    we, se = (torch.zeros(n) for n in quantized.error_sizes(numel, world, 1024))
    outputs, sent = [], []
    for _ in range(rounds):
        before = backend.stats.total_bytes
        outputs.append(quantized.quantized_allreduce(x.clone(), we, se, backend).clone())
        sent.append(backend.stats.total_bytes - before)
    return mean, outputs, sent


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_three_ranks_get_the_same_mean_within_the_rounding_and_error_feedback_takes_it_back():
    numel, rounds = 10_000, 40
    out = run_ranks(_exchange, 3, numel, rounds, timeout=90)
    mean, outputs, sent = out[0]
    for _, theirs, _ in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outputs, theirs))  # the same on every rank
    first = (outputs[0] - mean).abs().max() / mean.abs().max()
    assert 0 < first < 0.25  # one exchange: two 4-bit roundings of blocks up to ~3 sigma
    # the same inputs every round: the running mean of the results converges to the exact mean
    running = torch.stack(outputs).mean(dim=0)
    assert (running - mean).abs().max() < first * mean.abs().max() / 8
    fp32_ring = 2 * (3 - 1) / 3 * 4 * numel
    assert all(b == sent[0] for b in sent) and fp32_ring / sent[0] > 7.5
