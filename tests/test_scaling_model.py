"""The scaling model (benchmarks/scaling_model.py) against the bytes counted on a veth between
two emulated nodes (``benchmarks/results/multinode_2x{2,4}.json``: a 3.2M-parameter MLP, Gloo,
OnebitAdam), against the compressed allreduce's own byte count, and its closed forms."""
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


RESULTS = os.path.join(os.path.dirname(PATH), "results")


def _measured(name):
    """``{hierarchy: (params, compression bytes, warmup bytes)}`` per step and node, the mean of the
    two nodes, from a ``benchmarks/multinode.py`` result file."""
    with open(os.path.join(RESULTS, name)) as f:
        runs = json.load(f)["results"]
    mean = lambda key, r: sum(n[key] for n in r["per_node"]) / len(r["per_node"])  # noqa: E731
    return {r["hierarchy"]: (r["params"], mean("compression_bytes_per_step", r), mean("warmup_bytes_per_step", r))
            for r in runs}


@pytest.mark.parametrize("name, per_node, headers", [("multinode_2x1.json", 1, 0.02), ("multinode_2x2.json", 2, 0.04),
                                                     ("multinode_2x4.json", 4, 0.07)])
def test_the_bytes_counted_between_two_emulated_nodes(name, per_node, headers):
    # what the veth counted (payload and TCP/IP headers) is the model's payload plus a few percent
    measured = _measured(name)
    assert "flat" in measured and ("node" in measured) == (per_node > 1)
    for hierarchy, method in (("flat", "flat_1bit"), ("node", "hier_1bit")):
        if hierarchy not in measured:
            continue
        n, compression, warmup = measured[hierarchy]
        assert 1.0 <= compression / inter(method, 2, per_node, n) <= 1 + headers, hierarchy
        fp32 = "hier_fp32" if hierarchy == "node" else "ddp_fp32"  # (the warmup's average follows the exchange)
        assert 1.0 <= warmup / inter(fp32, 2, per_node, n) <= 1.02, hierarchy


def test_the_one_bit_bytes_are_the_compressed_allreduces():
    # one node of 4 ranks, the flat exchange: what a rank sends is comm.wire_bytes but its headers
    from compressed_opt import comm

    assert model.DEFAULT_BLOCK == comm.DEFAULT_BLOCK
    for n, block in ((2 ** 20, 1024), (2 ** 20, 256), (2 ** 22, 4096)):
        sent = model.bytes_per_step("flat_1bit", n, 1, 4, block)["intra_rank"]
        assert sent == comm.wire_bytes(n, 4, block) - 3 * 16
    assert model.onebit_bytes(1024 * 8, 1024) == 1024 + 8 * 4


def test_closed_forms():
    n = 64e6
    c = 1 + 32 / 1024  # the scales: 4 bytes per block of 1024 elements
    assert inter("flat_1bit", 2, 2, n) == pytest.approx(7 * n / 32 * c)
    assert inter("flat_1bit", 2, 4, n) == pytest.approx(23 * n / 64 * c)
    assert inter("hier_1bit", 2, 2, n) == pytest.approx(n / 8 * c) == inter("hier_1bit", 2, 4, n)
    assert inter("hier_1bit", 2, 2, n) / inter("flat_1bit", 2, 2, n) == pytest.approx(4 / 7)
    assert inter("hier_fp32", 2, 2, n) == pytest.approx(4 * n) == inter("hier_fp32", 2, 8, n)
    assert inter("hier_fp32", 2, 2, n) / inter("ddp_fp32", 2, 2, n) == pytest.approx(2 / 3)
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
