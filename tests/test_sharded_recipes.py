"""The sharded framework recipes of ``examples/``: accelerate's FSDP2 plugin with HSDP
(``accelerate_fsdp2.py``: ``ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)``, FSDP2's own
HSDP, the optimizer finding the replicate dimension itself) and Lightning's
``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``
(``lightning_model_parallel.py``: tensor parallel inside each replica, the optimizer's exchange
over ``device_mesh["data_parallel"]``).

Each example runs as users launch it (torchrun for accelerate, Lightning's own launcher for
Lightning), 4 Gloo ranks, 8 steps across a freeze at step 4, in a subprocess with a timeout (a
hang fails fast), with the framework's clipping. Checked against the framework's own AdamW
recipe run the same way (accelerate's FSDP2 HSDP; Lightning's TP + FSDP2 over data_parallel):
exit code 0; finite losses; the warmup's losses AdamW's within fp32 rounding (the optimizer's
warmup is AdamW, and both see the replicas' average gradient before clipping); the last loss
within 2% of AdamW's; the replicas' shards bit-identical after the last step; compression-stage
bytes per step across the replicas at least 20x fewer than an fp32 all-reduce of the same
shards (``opt.comm_stats()``, on every rank). Those runs are in ``test_sharded_recipes_adamw.py``
(a file of their own: make test's two workers take whole files, and this one was the longest).

The save/resume through each framework's own checkpointing (``accelerator.save_state`` /
``load_state``; ``ModelCheckpoint`` / ``fit(ckpt_path=...)``) goes through torch's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` under FSDP2 and the model-parallel
strategy (sharded, DCP: each framework's default), and must resume bit for bit.
"""
from __future__ import annotations

import os
import sys

import pytest

# the frameworks must be importable: a missing one is a failure (collection error), not a skip
import accelerate  # noqa: F401
import pytorch_lightning  # noqa: F401
import transformers  # noqa: F401
from distributed import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import harness  # noqa: E402  (examples/harness.py: the launcher, the JSON)

STEPS, FREEZE, SEED, SAVE_AT = 8, 4, 0, 6
TIMEOUT = 240  # seconds per job: 4 ranks importing the frameworks on 2 busy cores
BYTES_RATIO = 20  # compression stage vs an fp32 all-reduce, counted bytes (1-bit: ~30x here)
LOSS_GAP = 0.02  # the last step's loss against AdamW's, relative (1-bit noise from step 5 on)
SCRIPTS = ("accelerate_fsdp2", "lightning_model_parallel")


def run_example(script: str, optimizer: str, tmp_path, tag: str, extra: tuple[str, ...] = (),
                steps: int = STEPS) -> dict:
    run = harness.launch(script, optimizer, steps=STEPS, freeze=FREEZE, seed=SEED,
                         out=str(tmp_path / f"{script}-{optimizer}-{tag}.json"), timeout=TIMEOUT, env=child_env(),
                         extra=extra)
    what = f"{script} --optimizer {optimizer}"
    if run["timed_out"]:
        pytest.fail(f"{what} hung (killed after {TIMEOUT} s):\n{run['output'][-6000:]}")
    assert run["returncode"] == 0, f"{what} exited {run['returncode']}:\n{run['output'][-6000:]}"
    result = run["result"]
    assert result is not None, f"{what} wrote no results:\n{run['output'][-6000:]}"
    assert result["world_size"] == 4 and result["steps"] == steps, result
    assert result["losses_finite"], result["loss"]
    # quiet where nothing is wrong: each rank saves its own record through torch's state_dict API
    assert "UnconsolidatedCheckpointWarning" not in run["output"], run["output"][-3000:]
    return result


@pytest.mark.multiprocess
@pytest.mark.timeout(2 * TIMEOUT + 60)
@pytest.mark.parametrize("script", SCRIPTS)
def test_sharded_recipe_resumes_from_the_frameworks_checkpoint(script, tmp_path):
    """The framework's own checkpoint after step 6 (the compression stage), resumed in fresh
    processes: the same shards and losses as the run that went through."""
    checkpoint = ("--save-at", str(SAVE_AT), "--checkpoint", str(tmp_path / "checkpoint"))
    first = run_example(script, "onebitadam", tmp_path, "first", extra=checkpoint)
    resumed = run_example(script, "onebitadam", tmp_path, "resumed", extra=checkpoint + ("--resume",),
                          steps=STEPS - SAVE_AT)
    assert [r["sha"] for r in resumed["ranks"]] == [r["sha"] for r in first["ranks"]]
    assert resumed["loss"] == first["loss"][SAVE_AT:]
