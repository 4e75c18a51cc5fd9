"""Smoke test of the end-to-end training benchmark (``benchmarks/train.py``): it runs, its JSON
has the fields users read, and methods whose ranks crash or hang are reported as failed.

Nothing here asserts a speed (docs/design.md section 4): speed is measured by the benchmark, not tested.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from distributed import child_env

TRAIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "train.py")
STEPS = 6
FREEZE = 3


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("train-bench")
    cmd = [sys.executable, "-P", TRAIN, "--model", "tiny", "--launch", "2",
           "--methods", "ddp_adamw,onebit_adam,ddp_fp16,zero_one_adam,local_adamw", "--steps", str(STEPS),
           "--freeze-step", str(FREEZE), "--batch", "2", "--seq-len", "16", "--eval-sequences", "8", "--breakdown",
           "--inject-failure", "ddp_fp16:crash:2", "--inject-failure", "zero_one_adam:hang:2",
           "--stall-timeout", "10", "--method-timeout", "90", "--grace", "2", "--out-dir", str(out), "--name", "smoke"]
    done = subprocess.run(cmd, cwd=str(out), env=child_env(), capture_output=True, text=True, timeout=120)
    path = out / "smoke.json"
    assert path.exists(), done.stdout + done.stderr
    return done, json.loads(path.read_text()), out


@pytest.mark.multiprocess
def test_json_has_every_field_per_method(report):
    done, rep, _ = report
    cfg = rep["config"]
    assert cfg["steps"] == STEPS and cfg["freeze_step"] == FREEZE and cfg["launch"] == 2
    assert cfg["params"] > 500_000
    methods = {m["spec"]: m for m in rep["methods"]}
    assert list(methods) == ["ddp_adamw", "onebit_adam", "ddp_fp16", "zero_one_adam", "local_adamw"]
    for spec in ("ddp_adamw", "onebit_adam"):
        m = methods[spec]
        assert m["status"] == "ok", m
        curve = m["result"]["curve"]
        assert len(curve["loss"]) == len(curve["step_s"]) == len(curve["bytes"]) == STEPS
        assert all(b > 0 for b in curve["bytes"])
        s = m["summary"]
        for key in ("step_s", "samples_per_s", "bytes_per_step", "final_loss", "eval_loss", "peak_memory_mb",
                    "train_time_s", "speedup_step"):
            assert s[key] > 0, (spec, key, s[key])
        assert "time_to_target_s" in s
        b = s["breakdown"]
        for key in ("compute_s", "comm_paid_s", "update_s", "compression_kernels_s", "collectives_s"):
            assert b[key] is not None and b[key] >= 0, (spec, key, b)
        assert len(m["result"]["peak_memory_bytes"]) == 2
    ours = methods["onebit_adam"]
    assert ours["result"]["curve"]["stage"] == ["warmup"] * FREEZE + ["compression"] * (STEPS - FREEZE)
    s = ours["summary"]
    assert s["step_s_warmup"] > 0 and s["step_s_compression"] > 0
    # the compression stage sends a small fraction of the warmup's full-precision allreduce
    assert s["bytes_per_step_compression"] < s["bytes_per_step_warmup"] / 10
    assert s["bytes_per_step_compression"] < methods["ddp_adamw"]["summary"]["bytes_per_step"] / 10
    assert "ddp_adamw" in done.stdout and "onebit_adam" in done.stdout  # the table
    floor = methods["local_adamw"]  # the compute floor: the same steps, nothing exchanged
    assert floor["status"] == "ok", floor
    assert floor["result"]["curve"]["bytes"] == [0] * STEPS and floor["summary"]["step_s"] > 0


@pytest.mark.multiprocess
def test_crashing_and_hanging_methods_are_reported_as_failed(report):
    done, rep, _ = report
    methods = {m["spec"]: m for m in rep["methods"]}
    crashed, hung = methods["ddp_fp16"], methods["zero_one_adam"]
    assert crashed["status"] == "failed" and "injected failure" in crashed["error"], crashed["error"]
    assert hung["status"] == "failed" and "hung" in hung["error"], hung["error"]
    assert "summary" not in crashed and "summary" not in hung
    assert done.returncode == 1  # not every method succeeded
    assert "FAILED" in done.stdout


@pytest.mark.multiprocess
def test_plot_is_written_when_matplotlib_is_there(report):
    _, _, out = report
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (the bench extra)")
    assert (out / "smoke.png").stat().st_size > 10_000
