"""The sharded framework recipes of ``examples/`` against the framework's own AdamW recipe: the
runs and checks described in ``test_sharded_recipes.py`` (its launcher, ``run_example``, and its
constants), in a file of their own so that make test's two workers (``--dist loadfile``: whole files)
can run them beside that file's checkpoint tests.
"""
from __future__ import annotations

import math

import pytest

from test_sharded_recipes import BYTES_RATIO, FREEZE, LOSS_GAP, SCRIPTS, STEPS, TIMEOUT, run_example


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT + 60)
@pytest.mark.parametrize("script", SCRIPTS)
def test_sharded_recipe_onebit_adam_against_the_frameworks_adamw(script, tmp_path):
    ours = run_example(script, "onebitadam", tmp_path, "ours")
    adamw = run_example(script, "adamw", tmp_path, "adamw")
    assert ours["replicas"] == 2 and ours["replicas_identical"], (
        f"{script}: the replicas' shards differ after step {STEPS}: {ours['ranks']}")
    for step, (a, b) in enumerate(zip(ours["loss"][:FREEZE], adamw["loss"][:FREEZE]), 1):
        assert abs(a - b) <= 1e-5 * b, f"{script}: warmup step {step} loss {a} against AdamW's {b}"
    last, base = ours["loss"][-1], adamw["loss"][-1]
    assert math.isfinite(last) and abs(last - base) <= LOSS_GAP * base, (
        f"{script}: step {STEPS} loss {last} against AdamW's {base}: {ours['loss']} / {adamw['loss']}")
    for rank, stats in enumerate(ours["comm_stats"]):
        assert stats["world_size"] == 2, f"{script}, rank {rank}: the exchange is not across the 2 replicas: {stats}"
        assert stats["compression_steps"] == STEPS - FREEZE, stats
        assert stats["compression_bytes_per_step"] * BYTES_RATIO <= stats["fp32_allreduce_bytes_per_step"], (
            f"{script}, rank {rank}: {stats['compression_bytes_per_step']} bytes per compression step, fp32 "
            f"{stats['fp32_allreduce_bytes_per_step']}")
