"""``benchmarks/diloco_peer.py``: torchft's DiLoCo beside ours. Without torchft (this project's
venv never has it) the script says so and exits with 0; with torchft (a venv of its own, see
docs/benchmarks.md) torchft's fp32 DiLoCo trains as ours does on the same tokens and sends the
same bytes."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from distributed import child_env

PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "diloco_peer.py")


def _has_torchft() -> bool:
    try:
        return importlib.util.find_spec("torchft") is not None
    except (ImportError, ValueError):
        return False


def test_skips_cleanly_without_torchft(tmp_path):
    if _has_torchft():
        pytest.skip("torchft is installed here")
    done = subprocess.run([sys.executable, "-P", PEER, "--model", "tiny", "--steps", "8", "--ours", "none",
                           "--out-dir", str(tmp_path)], cwd=str(tmp_path), env=child_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped: torchft's DiLoCo is not importable here" in done.stdout
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.multiprocess
def test_torchft_fp32_diloco_trains_as_ours(tmp_path):
    pytest.importorskip("torchft.local_sgd")
    cmd = [sys.executable, "-P", PEER, "--model", "tiny", "--launch", "2", "--steps", "8", "--sync-every", "4",
           "--batch", "2", "--seq-len", "16", "--eval-sequences", "8", "--method-timeout", "90", "--ours",
           "diloco_fp32", "--out-dir", str(tmp_path), "--name", "peer"]
    done = subprocess.run(cmd, cwd=str(tmp_path), env=child_env(), capture_output=True, text=True, timeout=180)
    path = tmp_path / "peer.json"
    assert done.returncode == 0 and path.exists(), done.stdout + done.stderr
    report = json.loads(path.read_text())
    peer, ours = report["torchft"]["result"], report["ours"][0]["result"]
    assert peer["committed_syncs"] == [2, 2] and peer["param_head_max_abs_diff"] == 0
    assert peer["curve"]["loss"] == pytest.approx(ours["curve"]["loss"], rel=1e-5)
    assert peer["eval_loss"] == pytest.approx(ours["eval_loss"], rel=1e-5)
    assert [i for i, b in enumerate(peer["curve"]["bytes"]) if b > 0] == [3, 7]
    assert sum(peer["curve"]["bytes"]) == pytest.approx(sum(ours["curve"]["bytes"]), rel=0.01)
