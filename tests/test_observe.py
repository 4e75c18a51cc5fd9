"""The observer hook (``compressed_opt.comm.observe``): a real 2-rank compressed step reports its
compression kernels and the launcher's waits, with sane durations; nothing once the observer is
removed; and nothing is made per call while no observer is registered."""
import threading

import pytest
import torch
from torch import nn

from compressed_opt import OnebitAdam
from compressed_opt.comm import add_observer, observe, observing, remove_observer
from distributed import run_ranks
from optim_tasks import shard_batches

KERNELS = {"compress_rows_", "average_compress_rows_", "decompress_rows_"}


def _observed_training(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = OnebitAdam(model.parameters(), lr=1e-3, freeze_step=2, bucket_cap_mb=0.01)
    lock = threading.Lock()
    events = []

    def observer(kind, name, start, end):
        with lock:
            events.append((kind, name, start, end, threading.get_ident() == threading.main_thread().ident))

    batches = list(shard_batches(rank, world, 7, batch=16))
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if i == 2:  # steps 3-5: the compression stage, observed (steps 1-2: the warmup)
            add_observer(observer)
        opt.step()
        if i == 4:
            remove_observer(observer)
            with lock:
                seen = list(events)
    with lock:
        after = events[len(seen):]
    return {"seen": seen, "after": after, "compressing": opt.compressing}


@pytest.mark.multiprocess
def test_a_compressed_step_reports_kernels_and_waits_then_nothing_after_removal():
    for result in run_ranks(_observed_training, 2):
        assert result["compressing"]
        seen = result["seen"]
        kernels = {name for kind, name, *_ in seen if kind == "kernel"}
        waits = {name for kind, name, *_ in seen if kind == "wait"}
        assert kernels == KERNELS, seen
        assert waits == {"wait", "run_inline"}, seen
        assert all(end - start >= 0 for _, _, start, end, _ in seen)
        # step() on the training thread waited for (or ran) communication
        assert any(kind == "wait" and on_main for kind, _, _, _, on_main in seen)
        assert result["after"] == []


def test_observing_adds_and_removes():
    events = []

    def observer(*event):
        events.append(event)

    with observing(observer):
        assert observer in observe.OBSERVERS
        with observe.span("kernel", "compress_"):
            pass
    assert observer not in observe.OBSERVERS
    with observe.span("kernel", "compress_"):
        pass
    assert [(k, n) for k, n, _, _ in events] == [("kernel", "compress_")]
    assert events[0][3] >= events[0][2]
    remove_observer(observer)  # not registered: nothing happens


def test_no_observer_means_a_shared_do_nothing_span():
    assert observe.OBSERVERS == ()
    first, second = observe.span("kernel", "compress_"), observe.span("wait", "wait")
    assert first is second  # nothing allocated per call


def test_an_observer_must_be_callable():
    with pytest.raises(TypeError, match="callable"):
        add_observer("not a function")
