"""The scaling model (benchmarks/scaling_model.py) against the bytes measured on a veth between
two emulated nodes (issue figures: 2 nodes x 2 ranks, a 3.2M-parameter MLP, Gloo), and its own
closed forms."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from distributed import child_env

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "scaling_model.py")
spec = importlib.util.spec_from_file_location("scaling_model", PATH)
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)

N = 3.2e6


def inter(method, nodes, per_node, n=N):
    return model.bytes_per_step(method, n, nodes, per_node)["inter_node"]


def test_measured_points_of_two_nodes_of_two_ranks():
    # measured on the veth per step and node: DDP + AdamW 19.0 MB, flat 1-bit 0.70 MB
    assert inter("ddp_fp32", 2, 2) == pytest.approx(19.0e6, rel=0.02)
    assert inter("flat_1bit", 2, 2) == pytest.approx(0.70e6, rel=0.02)


def test_closed_forms():
    n = 64e6
    assert inter("flat_1bit", 2, 2, n) == pytest.approx(7 * n / 32)
    assert inter("flat_1bit", 2, 4, n) == pytest.approx(23 * n / 64)
    assert inter("hier_1bit", 2, 2, n) == pytest.approx(n / 8) == inter("hier_1bit", 2, 4, n)
    assert inter("hier_1bit", 2, 2, n) / inter("flat_1bit", 2, 2, n) == pytest.approx(4 / 7)
    assert inter("ddp_bf16", 4, 8, n) == pytest.approx(inter("ddp_fp32", 4, 8, n) / 2)
    for m in model.METHODS:  # one rank: nothing to send
        b = model.bytes_per_step(m, n, 1, 1)
        assert b["inter_node"] == b["intra_rank"] == 0.0
    with pytest.raises(ValueError, match="unknown method"):
        model.bytes_per_step("powersgd", n, 2, 2)


def test_the_hierarchy_sends_less_between_nodes_and_more_inside():
    for nodes in (2, 8, 1024):
        for per_node in (2, 8):
            hier, flat = inter("hier_1bit", nodes, per_node), inter("flat_1bit", nodes, per_node)
            assert hier < flat < inter("ddp_bf16", nodes, per_node)
            assert (model.bytes_per_step("hier_1bit", N, nodes, per_node)["intra_rank"]
                    > model.bytes_per_step("flat_1bit", N, nodes, per_node)["intra_rank"])


def test_script_prints_and_writes_the_table(tmp_path):
    out = tmp_path / "scaling.json"
    done = subprocess.run([sys.executable, "-P", PATH, "--params", "1e6", "--nodes", "2,4", "--ranks-per-node", "1,8",
                           "--inter-gbit", "1", "--json", str(out)], env=child_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["nodes"], r["ranks_per_node"]) for r in rows] == [(2, 1), (4, 1), (2, 8), (4, 8)]
    assert all(r[m]["comm_s"] > 0 for r in rows for m in model.METHODS)
    assert "hier_1bit MB" in done.stdout
