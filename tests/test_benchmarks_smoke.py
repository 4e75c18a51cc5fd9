"""Smoke tests of the benchmark scripts: they run, and what they write has the expected shape.

Nothing here asserts a speed (docs/design.md section 4: speed only as ratios inside benchmarks).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import torch

from distributed import child_env, userns_link_possible

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
OPS = ("fp32", "bf16", "compressed")


def _run_script(tmp_path, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -P benchmarks/<script> args...`` in ``tmp_path``, as a job of its own."""
    cmd = [sys.executable, "-P", os.path.join(BENCH, script), *args]
    return subprocess.run(cmd, cwd=str(tmp_path), env=child_env(), capture_output=True, text=True, timeout=timeout)


@pytest.mark.multiprocess
def test_comm_bandwidth_launch_2_writes_json(tmp_path):
    out = tmp_path / "bw.json"
    done = _run_script(tmp_path, "comm_bandwidth.py", "--launch", "2", "--sizes-mb", "1", "--iters", "2",
                       "--warmup", "1", "--timeout", "50", "--json", str(out), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["config"]["world_size"] == 2
    assert report["config"]["iters"] == 2
    [entry] = report["results"]
    assert entry["numel"] == (1 << 20) // 4
    assert entry["fp32_bytes"] == 1 << 20
    for op in OPS:
        r = entry["ops"][op]
        for key in ("time_s", "time_min_s", "algbw_GBps", "busbw_GBps", "bytes_sent_per_rank", "speedup_vs_fp32"):
            assert r[key] > 0, (op, key, r[key])
        assert len(r["times_s"]) == 2
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2 (N-1)/N = 1 for N = 2
    assert entry["ops"]["fp32"]["bytes_sent_per_rank"] == 1 << 20  # ring volume, N = 2
    assert entry["ops"]["bf16"]["bytes_sent_per_rank"] == 1 << 19
    compressed = entry["ops"]["compressed"]
    assert compressed["bytes_sent_per_rank"] == compressed["model_wire_bytes"]
    assert compressed["bytes_sent_per_rank"] < entry["ops"]["fp32"]["bytes_sent_per_rank"] / 25
    assert "fp32" in done.stdout and "compressed" in done.stdout  # rank 0's table


def _netns_usable() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return False, "needs root to create network namespaces"
    sys.path.insert(0, BENCH)
    try:
        import slowlink
    finally:
        sys.path.remove(BENCH)
    return slowlink.netns_supported()


def _slowlink_prefix() -> str:
    """A fresh namespace prefix for a slowlink test (skips it where namespaces cannot be made)."""
    ok, why = _netns_usable()
    if not ok:
        pytest.skip(why)
    return f"cotest{uuid.uuid4().hex[:6]}"


def _namespaces(prefix: str) -> list[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(prefix + "-")]


@pytest.mark.multiprocess
def test_slowlink_runs_two_ranks_and_cleans_up(tmp_path):
    prefix = _slowlink_prefix()
    probe = ("import os, socket; "
             "tx = open('/sys/class/net/' + os.environ['SLOWLINK_IFNAME'] + '/statistics/tx_bytes').read().strip(); "
             "print('RANK', os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_ADDR'], "
             "os.environ['GLOO_SOCKET_IFNAME'], tx); "
             # rank 1 sends 10 x 1000 bytes over the link (UDP to the discard port of rank 0)
             "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
             "[s.sendto(b'x' * 1000, (os.environ['MASTER_ADDR'], 9)) for _ in range(10 * (os.environ['RANK'] == '1'))]")
    out = tmp_path / "slowlink.json"
    done = _run_script(tmp_path, "slowlink.py", "--rate", "1gbit", "--timeout", "30", "--prefix", prefix,
                       "--json", str(out), "--", sys.executable, "-P", "-c", probe, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["returncodes"] == [0, 0]
    assert result["rate"] == "1gbit" and result["tbf"][0] == "tbf"
    master = result["addresses"][0]
    assert master.startswith("10.")
    for rank in range(2):
        line = next(ln for ln in result["outputs"][rank].splitlines() if ln.startswith("RANK"))
        assert line.split()[1:5] == [str(rank), "2", master, result["ifname"]]
    # the bytes each rank's veth end sent during the run: rank 1's 10 datagrams (and their headers)
    assert result["tx_bytes"][1] >= 10 * 1000
    assert _namespaces(prefix) == [], "slowlink left its namespaces behind"


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_slowlink_in_a_user_namespace_needs_no_root(tmp_path):
    """--isolation userns (what a user without root gets): the same rate-limited veth between 2
    network namespaces, made inside unshare --user --map-root-user --net --mount; nothing named
    outside. Skipped where user namespaces cannot be made (the reason says why)."""
    ok, why = userns_link_possible()
    if not ok:
        pytest.skip(f"no user namespace with a veth pair here: {why}")
    before = _namespaces("cosl")
    # rank 1 sends 2 MB over TCP to rank 0, which times it: on a 100 Mbit/s link that is >= 0.15 s
    probe = ("import os, socket, time; r = int(os.environ['RANK']); a = os.environ['MASTER_ADDR']\n"
             "if r == 0:\n"
             "    s = socket.create_server((a, 5555)); c, _ = s.accept(); t = time.monotonic(); n = 0\n"
             "    while (b := c.recv(1 << 16)): n += len(b)\n"
             "    print('GOT', n, time.monotonic() - t, os.environ['GLOO_SOCKET_IFNAME'])\n"
             "else:\n"
             "    time.sleep(0.3); c = socket.create_connection((a, 5555)); c.sendall(b'x' * 2_000_000); c.close()\n")
    out = tmp_path / "slowlink.json"
    done = _run_script(tmp_path, "slowlink.py", "--isolation", "userns", "--rate", "100mbit", "--timeout", "30",
                       "--json", str(out), "--", sys.executable, "-P", "-c", probe, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["isolation"] == "userns" and result["rate"] == "100mbit" and result["tbf"][0] == "tbf"
    got = next(ln for ln in result["outputs"][0].splitlines() if ln.startswith("GOT")).split()
    assert int(got[1]) == 2_000_000 and got[3] == result["ifname"]
    assert float(got[2]) > 0.8 * 2_000_000 * 8 / 100e6  # the link's rate, not loopback's
    assert result["tx_bytes"][1] >= 2_000_000  # counted on rank 1's veth end
    assert _namespaces("cosl") == before  # nothing named on this machine


@pytest.mark.multiprocess
def test_slowlink_cleans_up_after_a_failing_rank(tmp_path):
    prefix = _slowlink_prefix()
    fail_rank_1 = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '1' else time.sleep(60)"
    done = _run_script(tmp_path, "slowlink.py", "--rate", "none", "--timeout", "30", "--prefix", prefix,
                       "--grace", "1", "--quiet", "--", sys.executable, "-P", "-c", fail_rank_1, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert _namespaces(prefix) == []


@pytest.mark.multiprocess
@pytest.mark.parametrize("optimizer, modes", [
    ("onebit_lamb", ["sync", "overlap", "ddp_hook", "zero1", "zero2"]),
    ("zero_one_adam", ["sync", "overlap", "ddp_hook"]),  # not sharded: no ZeRO modes
])
def test_optimizer_modes_memory_reports_every_mode(tmp_path, optimizer, modes):
    out = tmp_path / "modes.json"
    done = _run_script(tmp_path, "optimizer_modes.py", "memory", "--launch", "2", "--optimizer", optimizer,
                       "--width", "64", "--depth", "3", "--steps", "6", "--freeze", "3", "--bucket-cap-mb", "0.01",
                       "--rounds", "2", "--json", str(out), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["optimizer"] == optimizer and report["world_size"] == 2
    assert [r["mode"] for r in report["results"]] == modes
    by_mode = {r["mode"]: r for r in report["results"]}
    for r in report["results"]:
        assert len(r["step_time_s_rounds"]) == 2
        assert r["bytes_per_step"]["compression"] * 10 <= r["ddp_adamw_bytes_per_step"]  # tiny model: headers weigh
        assert r["state_bytes"]["compression"] > 0
    if "zero1" in by_mode:
        for stage in ("warmup", "compression"):
            assert by_mode["zero1"]["state_bytes"][stage] < by_mode["sync"]["state_bytes"][stage]


def test_step_overhead_reports_every_optimizer(tmp_path):
    out = tmp_path / "overhead.json"
    done = _run_script(tmp_path, "step_overhead.py", "--tensors", "20", "--elements", "20000", "--steps", "4",
                       "--groups", "one,each", "--json", str(out), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["optimizer"] for r in results] == [f"{name}[groups: {g}]" for g in ("one", "each")
                                                 for name in ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")]
    for r in results:
        assert r["few"]["tensors"] == 2 and r["many"]["tensors"] == 20
        assert r["few"]["step_s"] > 0 and r["many_over_few"] > 0


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["torchrun", "mpiexec"])
def test_multinode_launches_two_nodes_of_two_ranks(tmp_path, launcher):
    """Two namespaces as two nodes, started as on a cluster (torchrun with c10d rendezvous;
    MPICH's mpiexec with a proxy per node): the ranks find the nodes themselves, and the
    hierarchical exchange sends fewer bytes between them than the flat one (counted on the veth)."""
    _slowlink_prefix()  # skips where namespaces cannot be made
    if launcher == "mpiexec":
        pytest.importorskip("mpi4py")
    out = tmp_path / "multinode.json"
    done = _run_script(tmp_path, "multinode.py", "--launcher", launcher, "--link",
                       "none", "--params", "100000", "--warmup", "3", "--steps", "2", "--timeout", "200",
                       "--out", str(out), timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    results = {r["hierarchy"]: r for r in report["results"]}
    assert results["node"]["exchange"] == ["node", 2, 2]  # found from the launcher / MPI, not told
    assert results["flat"]["exchange"] == ["flat", 4]
    for r in results.values():
        assert len(r["per_node"]) == 2
        for node in r["per_node"]:
            assert 0 < node["compression_bytes_per_step"] < node["warmup_bytes_per_step"] / 8
    flat, node = (max(n["compression_bytes_per_step"] for n in results[h]["per_node"]) for h in ("flat", "node"))
    assert node < 0.8 * flat, (node, flat)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_multinode_hsdp_counts_the_bytes_between_the_nodes(tmp_path):
    """``--hsdp``: FSDP2's own HSDP + fused AdamW against FSDP2 inside each node + OnebitAdam over
    the replicas, two nodes of two ranks; the 1-bit exchange sends a fraction of HSDP's fp32
    all-reduce between the nodes (counted on the veth)."""
    _slowlink_prefix()  # skips where namespaces cannot be made
    out = tmp_path / "hsdp.json"
    done = _run_script(tmp_path, "multinode.py", "--hsdp", "--link", "none", "--params", "100000", "--warmup", "2",
                       "--steps", "2", "--timeout", "200", "--out", str(out), timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    native, onebit = json.loads(out.read_text())["results"]
    assert native["optimizer"] == "AdamW(fused=True)" and onebit["optimizer"] == "OnebitAdam"
    for node in range(2):
        fp32, sent = native["per_node_bytes_per_step"][node], onebit["per_node_bytes_per_step"][node]
        assert 0 < sent < fp32 / 10, (sent, fp32)


@pytest.mark.timeout(120)
def test_step_vs_fused_reports_a_ratio_per_row(tmp_path):
    """``benchmarks/step_vs_fused.py``: each row times the optimizer and fused AdamW in turn."""
    out = tmp_path / "svf.json"
    done = _run_script(tmp_path, "step_vs_fused.py", "--shapes", "200000x3", "--optimizers",
                       "OnebitAdam,OnebitLamb,ZeroOneAdam", "--exchanges", "preconditioned", "--zero-stages", "0,1",
                       "--steps", "2", "--out", str(out), timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["optimizer"], r["zero_stage"]) for r in rows] == [
        ("OnebitAdam", 0), ("OnebitAdam", 1), ("OnebitLamb", 0), ("OnebitLamb", 1),
        ("ZeroOneAdam", 0)]  # (0/1 Adam: stage 0 only)
    for r in rows:
        assert r["step_ms"] > 0 and r["fused_adamw_ms"] > 0 and r["copy_bandwidth"] > 0
        assert abs(r["ratio"] - r["step_ms"] / r["fused_adamw_ms"]) < 1e-9
        assert r["stage"] == "compression" and r["mean_ms"] > 0 and r["mean_ratio"] > 0
        # 1-bit LAMB: a whole trust-ratio interval (10 steps), so that its mean counts a measuring step
        assert len(r["step_kinds"]) == (10 if r["optimizer"] == "OnebitLamb" else 2)


@pytest.mark.timeout(120)
def test_step_vs_fused_times_warmup_steps_when_asked(tmp_path):
    """``--stage warmup``: the rows time full-precision steps (the script asserts the freeze never
    came), one per optimizer."""
    out = tmp_path / "svf.json"
    done = _run_script(tmp_path, "step_vs_fused.py", "--shapes", "200000x3", "--exchanges", "preconditioned",
                       "--zero-stages", "0", "--steps", "2", "--stage", "warmup", "--out", str(out), timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["optimizer"], r["stage"]) for r in rows] == [("OnebitAdam", "warmup"), ("OnebitLamb", "warmup"),
                                                             ("ZeroOneAdam", "warmup")]
    assert all(r["step_ms"] > 0 and r["fused_adamw_ms"] > 0 for r in rows)


@pytest.mark.timeout(120)
def test_step_vs_fused_times_zero_one_adams_phase_a_steps_when_asked(tmp_path):
    """``--stage phase-a``: one row, ZeroOneAdam's, timing only its phase-A 1-bit gradient steps."""
    out = tmp_path / "svf.json"
    done = _run_script(tmp_path, "step_vs_fused.py", "--shapes", "200000x3", "--exchanges", "preconditioned",
                       "--zero-stages", "0", "--steps", "3", "--stage", "phase-a", "--out", str(out), timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["optimizer"], r["stage"], r["step_kinds"]) for r in rows] == [
        ("ZeroOneAdam", "phase-a", ["compressed"] * 3)]
    assert rows[0]["step_ms"] > 0 and rows[0]["fused_adamw_ms"] > 0


@pytest.mark.timeout(120)
def test_stream_floor_loops_move_the_streams_they_count():
    """``benchmarks/stream_floor.py``: a floor loop reads every input (the sum of squares of their
    sum, with no output), writes its in-place outputs and its written-only ones, and refuses loops
    it cannot run."""
    import shutil

    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here: no floor loops")
    sys.path.insert(0, BENCH)
    try:
        import stream_floor
    finally:
        sys.path.remove(BENCH)
    n = 1000  # (not a multiple of the tile or of 8: the tails)
    reads_only = stream_floor.FloorLoop(3, 0, n)
    total = sum(b.double() for b in reads_only.buffers)
    summed = torch.cat([total[k:k + (min(256, n - k) & ~63)] for k in range(0, n, 256)])  # whole 64s of each tile
    assert reads_only() == pytest.approx(float((summed ** 2).sum()), rel=1e-5)
    loop = stream_floor.FloorLoop(2, 3, n)
    a, b, c = (t.clone() for t in loop.buffers)
    loop()
    s = a + b
    assert torch.allclose(loop.buffers[0], s * 0.5) and torch.allclose(loop.buffers[1], s * 1.5)
    assert torch.allclose(loop.buffers[2], s * 2.5) and not torch.equal(loop.buffers[2], c)
    times = stream_floor.time_floors({"x": (1, 1), "y": (1, 1), "z": (2, 0)}, n, baseline=lambda: None, repeats=2)
    assert set(times) == {"x", "y", "z", None} and times["x"] == times["y"] and min(times.values()) >= 0
    for bad in ((0, 1), (9, 1), (1, -1)):
        with pytest.raises(ValueError, match="floor loop"):
            stream_floor.FloorLoop(*bad, n)


def test_step_vs_fused_times_each_native_pass_when_asked(tmp_path):
    """``--passes``: per row, the native passes of steps of the same kind, each with its time and,
    where the stream table knows it, the bandwidth its bytes needed; a default OnebitAdam step
    runs the sums, the compression with the local momentum (formed from ``p.grad`` read where it
    lies), the server's pass and the update."""
    from compressed_opt.cuda import cpu

    if cpu.library() is None:
        pytest.skip("no C compiler here: no native passes to time")
    out = tmp_path / "svf.json"
    done = _run_script(tmp_path, "step_vs_fused.py", "--shapes", "200000x3", "--optimizers", "OnebitAdam",
                       "--exchanges", "preconditioned", "--zero-stages", "0", "--steps", "2", "--passes",
                       "--out", str(out), timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    [row] = json.loads(out.read_text())["rows"]
    passes = {p["pass"]: p for p in row["passes"]["rows"]}
    assert row["passes"]["step_ms"] > sum(p["ms"] for p in passes.values())
    assert set(passes) == {"co_sumsq_each", "co_lerp_scale_clamp_compress_sources", "co_average_compress_rows",
                           "co_rows_divide_zero_descend"}
    for p in passes.values():
        assert p["calls"] == 1 and p["ms"] > 0 and p["streams"] > 0
        assert p["of_copy"] == pytest.approx(p["bandwidth"] / row["copy_bandwidth"])
        assert p["floor_ms"] > 0 and p["over_floor"] == pytest.approx(p["ms"] / p["floor_ms"])
    floor = row["passes"]["floor"]
    assert floor["complete"] and floor["ms"] == pytest.approx(sum(p["floor_ms"] for p in passes.values()))
    assert floor["ratio"] == pytest.approx(floor["ms"] / floor["fused_adamw_ms"])
    assert "outside the native passes" in done.stdout and "stream floor of the passes" in done.stdout


@pytest.mark.timeout(300)
def test_step_overhead_against_a_revision_in_one_process(tmp_path):
    """``--against REV --in-process``: REV installed and renamed beside this checkout, both timed
    in one process per round; every optimizer and size has a time of each."""
    out = tmp_path / "against.json"
    done = _run_script(tmp_path, "step_overhead.py", "--against", "HEAD", "--in-process", "--rounds", "1",
                       "--optimizers", "OnebitLamb,ZeroOneAdam", "--tensors", "20", "--elements", "20000",
                       "--steps", "4", "--json", str(out), timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())["results"]
    assert [(r["optimizer"], r["tensors"]) for r in results] == [
        (name, n) for name in ("OnebitLamb", "ZeroOneAdam") for n in (2, 20)]
    for r in results:
        assert len(r["rev_runs"]) == len(r["this_runs"]) == 1
        assert r["rev_step_s"] > 0 and r["this_step_s"] > 0 and r["ratio"] > 0


def _convergence_run(model: str, optimizer: str, seed: int, key_bias: list[float]) -> dict:
    """A run as ``convergence.py`` records it, its GPT-2 key bias at the probes given."""
    probes = {str(10 * (i + 1)): {"transformer.h.0.attn.key_bias": kb, "transformer.h.0.attn.c_attn.bias": 1.0}
              for i, kb in enumerate(key_bias)}
    return {"model": model, "optimizer": optimizer, "seed": seed, "losses": [2.0, 1.0], "final_loss": 1.0,
            "eval_loss": 1.0, "max_abs": probes, "compression_step_ms": None, "compression_bytes_per_step": None,
            "finite": True, "freeze_step": 50}


def test_convergence_summarize_reports_key_bias_peaks_over_seeds(tmp_path):
    """``--summarize`` recomputes a result's summary without training; the key bias is compared as
    peaks over the seeds (the report's framing) and per seed."""
    runs = [_convergence_run("gpt2", "adamw", 0, [1e-5, 4e-4, 2e-4]),
            _convergence_run("gpt2", "adamw", 1, [1e-5, 1e-4, 1e-3]),
            _convergence_run("gpt2", "onebitadam", 0, [3e-5, 2e-4, 1e-4]),
            _convergence_run("gpt2", "onebitadam", 1, [2e-5, 5e-4, 1e-4])]
    path = tmp_path / "convergence.json"
    path.write_text(json.dumps({"config": {}, "summary": {}, "runs": runs}))
    done = _run_script(tmp_path, "convergence.py", "--summarize", str(path), timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    kb = json.loads(path.read_text())["summary"]["gpt2"]["onebitadam"]["key_bias"]
    assert kb["twin"] == "adamw"
    assert kb["range"] == [2e-4, 5e-4] and kb["twin_range"] == [4e-4, 1e-3]
    assert kb["largest_vs_twin_largest"] == pytest.approx(0.5)
    assert kb["seed_peak_ratios"] == {"0": pytest.approx(0.5), "1": pytest.approx(0.5)}
    row = json.loads(path.read_text())["summary"]["gpt2"]["onebitadam"]["seeds"]["0"]
    assert row["key_bias_ratio"] == pytest.approx(3.0)  # the per-probe ratio: 3e-5 / 1e-5 at step 10
    assert "largest/twin largest" in done.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_exchange_groups_reports_every_mode(tmp_path):
    out = tmp_path / "groups.json"
    done = _run_script(tmp_path, "exchange_groups.py", "--tensors", "6", "--steps", "6", "--json", str(out),
                       timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["one group", "a group each", "a group each, bucket by bucket"]
    assert rows["one group"]["buckets"] == 1 and rows["a group each"]["buckets"] == 6
    assert rows["one group"]["per_extra_bucket_s"] is None
    assert all(r["step_s"] > 0 for r in rows.values()) and "per extra bucket" in done.stdout


def test_checkpoint_cost_measures_a_way_of_saving(tmp_path):
    """``benchmarks/checkpoint_cost.py`` on small layers, this checkout only, DCP flattened (the
    other ways run the same code with another save and load): saved, loaded and measured, the
    bytes written counted."""
    out = tmp_path / "cost.json"
    proc = _run_script(tmp_path, "checkpoint_cost.py", "--width", "64", "--repeats", "1", "--modes", "dcp-flat",
                       "--json", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]["this"]
    assert sorted(runs) == ["dcp-flat"]
    for mode, (run,) in runs.items():
        assert "refused" not in run, (mode, run)
        assert run["params"] == 6 * (64 * 64 + 64) and run["bytes"] > 8 * run["params"], (mode, run)
        assert run["save_s"] > 0 and run["load_s"] > 0 and "save_peak" in run and "load_peak" in run, (mode, run)
