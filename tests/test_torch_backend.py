"""The torch.distributed backend holds what it sends until torch lets go of it, and gathers Python
objects the same way (``compressed_opt.comm.torch_backend``: a Gloo worker thread that frees a
collective's tensors after the interpreter began to exit aborts the process)."""
from __future__ import annotations

import pytest
from distributed import run_ranks

pytestmark = pytest.mark.multiprocess


def _held_until_released(rank, world):
    import gc
    import weakref

    import torch

    from compressed_opt.comm import TorchBackend
    from compressed_opt.comm import torch_backend as tb

    backend = TorchBackend()
    sent = torch.full((8,), float(rank))
    backend.all_reduce(sent)
    result = sent.tolist()
    gone = weakref.ref(sent)
    del sent
    gc.collect()
    held_after_call = gone() is not None  # the caller dropped it; the backend has not

    # a tensor some C++ owner still holds (here: the base of a live view) stays held through
    # later calls, while one only Python holds is dropped at the next call
    base = torch.zeros(4)
    view = base[:2]  # noqa: F841 - the other owner
    backend.broadcast(base, src=0)
    kept = weakref.ref(base)
    del base
    for _ in range(3):
        backend.all_reduce(torch.ones(1))
    base_kept = kept() is not None
    # at most the last 16 calls are held: a freed tensor is gone after that many more
    for _ in range(16):
        backend.all_reduce(torch.ones(1))
    gc.collect()
    return result, held_after_call, base_kept, gone() is None, len(tb._HELD) <= 16


def test_sent_tensors_are_held_until_torch_lets_go():
    for result, held_after_call, base_kept, released, bounded in run_ranks(_held_until_released, 2, timeout=120):
        assert result == [1.0] * 8
        assert held_after_call, "a temporary sent by the backend was freed as soon as the caller dropped it"
        assert base_kept, "a tensor torch (or a view) still holds was dropped"
        assert released and bounded


def _gather_objects(rank, world):
    from compressed_opt.comm import TorchBackend

    backend = TorchBackend()
    mine = {"rank": rank, "text": "x" * (10 * rank + 1), "floats": [0.1 * rank, float("inf")]}
    everyone = backend.all_gather_object(mine)
    calls = dict(backend.stats.calls)
    return everyone, calls


def test_all_gather_object_returns_every_rank_in_order():
    outcomes = run_ranks(_gather_objects, 3, timeout=120)
    expected = [{"rank": r, "text": "x" * (10 * r + 1), "floats": [0.1 * r, float("inf")]} for r in range(3)]
    for everyone, calls in outcomes:
        assert everyone == expected  # objects of different sizes, padded and cut back exactly
        assert calls == {"all_gather": 2}  # the sizes, then the bytes
