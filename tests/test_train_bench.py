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

from distributed import child_env, userns_link_possible

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


# --- make demo's link: an emulated link without root, or a modelled one ----------------------------------------
BENCH = os.path.dirname(TRAIN)


def _run_link(tmp_path, emulation: str, methods: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The demo's command on a short run: 2 ranks, ``--link 100mbit --link-emulation EMULATION``."""
    cmd = [sys.executable, "-P", TRAIN, "--model", "tiny", "--link", "100mbit", "--link-emulation", emulation,
           "--methods", methods, "--steps", "5", "--freeze-step", "2", "--batch", "2", "--seq-len", "16",
           "--eval-sequences", "8", "--method-timeout", "40", "--no-plot", "--out-dir", str(tmp_path),
           "--name", "link"]
    done = subprocess.run(cmd, cwd=str(tmp_path), env=child_env(), capture_output=True, text=True, timeout=100)
    path = tmp_path / "link.json"
    assert done.returncode == 0 and path.exists(), done.stdout + done.stderr
    return done, json.loads(path.read_text())


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_link_in_a_user_namespace(tmp_path):
    """What make demo runs for a user without root: the ranks over a 100 Mbit/s veth inside a user
    namespace of the user's own (forced here, so that root runs it too)."""
    ok, why = userns_link_possible()
    if not ok:
        pytest.skip(f"unshare --user --map-root-user --net --mount cannot make the link here: {why}")
    done, rep = _run_link(tmp_path, "userns", "onebit_adam")  # (one method: a link per method takes time)
    cfg = rep["config"]
    assert cfg["mode"] == "link" and cfg["link_emulation"] == "userns" and cfg["link"] == "100mbit"
    for m in rep["methods"]:
        assert m["status"] == "ok", m
        assert m["link"]["isolation"] == "userns" and m["link"]["rate"] == "100mbit"
        assert min(m["link"]["tx_bytes"]) > 0 and m["summary"]["wire_bytes_per_step"] > 0
    title = done.stdout.splitlines()[1]
    assert "emulated 100 Mbit/s link" in title and "user namespace" in title, done.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_modelled_link_is_labelled_and_adds_the_link_time(tmp_path):
    """Where no link can be emulated, the demo's link is modelled: each measured loopback step plus
    its bytes / rate, and the table says MODELLED."""
    done, rep = _run_link(tmp_path, "model", "onebit_adam")  # (one method: the model is the same for each)
    cfg = rep["config"]
    assert cfg["mode"] == "model" and cfg["link_emulation"] == "model"
    for m in rep["methods"]:
        assert m["status"] == "ok", m
        assert m["link"]["isolation"] == "model" and m["link"]["rate_bps"] == 100e6
        curve = m["result"]["curve"]
        for t, measured, link, sent in zip(curve["step_s"], curve["measured_step_s"], curve["link_s"],
                                           curve["bytes"]):
            assert link == pytest.approx(sent * m["link"]["frame_overhead"] * 8 / 100e6, abs=1e-6)  # (kept to 1 us)
            assert t == pytest.approx(measured + link, rel=1e-5)  # (the JSON keeps 6 digits)
    title = done.stdout.splitlines()[1]
    assert title.startswith("# MODELLED 100 Mbit/s link"), done.stdout
    assert "# MODELLED link, not measured on one" in done.stdout


def test_auto_link_falls_back_to_the_model_and_says_why(monkeypatch, capsys):
    """--link-emulation auto (make demo's): where neither root nor a user namespace can make the
    link, the modelled link, with the reason in the table; never plain loopback."""
    sys.path.insert(0, BENCH)
    try:
        import slowlink
        from e2e import cli
    finally:
        sys.path.remove(BENCH)
    monkeypatch.setattr(slowlink, "netns_supported", lambda isolation="auto": (False, "user namespaces are off"))
    cfg = cli.make_config(cli.parse_args(["--link", "100mbit"]))
    cli._resolve_link(cfg)
    assert cfg["mode"] == "model" and cfg["link_emulation"] == "model"
    assert cfg["link_model_reason"] == "user namespaces are off"
    assert cli._where(cfg).startswith("MODELLED 100 Mbit/s link")
    assert "MODELLED instead" in capsys.readouterr().err


def test_the_stdlib_corpus_is_the_standard_librarys_sources_and_is_recorded_by_name():
    """``--corpus stdlib``: every ``.py`` of the standard library but its tests, sorted, so that
    two runs (and the docs' long DiLoCo runs) train on the same bytes; the config records the
    name, not a path."""
    sys.path.insert(0, BENCH)
    try:
        from e2e import cli, data
    finally:
        sys.path.remove(BENCH)
    corpus = data.load_corpus("stdlib")
    assert len(corpus) > 5_000_000 and corpus == data.load_corpus("stdlib")
    assert b"def " in corpus[:200_000]
    assert cli.make_config(cli.parse_args(["--corpus", "stdlib"]))["corpus"] == "stdlib"


@pytest.mark.multiprocess
def test_diloco_methods_beside_the_plain_reference(tmp_path):
    """The benchmark's DiLoCo methods: ours at fp32 trains as DiLoCo written plainly (fp32
    all_reduce, torch's Nesterov SGD) on the same tokens, and sends the same bytes, only at the
    synchronisations; the 1-bit exchange sends a small fraction of them; streamed (fragments,
    delay, on transformers' GPT-2) the bytes are spread over more steps."""
    def run(name, specs, *extra):
        cmd = [sys.executable, "-P", TRAIN, "--model", "tiny", "--launch", "2", "--methods",
               specs, "--steps", "8", "--sync-every", "4", "--batch", "2",
               "--seq-len", "16", "--eval-sequences", "8", "--method-timeout", "90", "--out-dir", str(tmp_path),
               "--name", name, *extra]
        done = subprocess.run(cmd, cwd=str(tmp_path), env=child_env(), capture_output=True, text=True, timeout=150)
        path = tmp_path / f"{name}.json"
        assert path.exists(), done.stdout + done.stderr
        methods = {m["spec"]: m for m in json.loads(path.read_text())["methods"]}
        assert all(m["status"] == "ok" for m in methods.values()), done.stdout + done.stderr
        return {spec: m["result"] for spec, m in methods.items()}

    plain = run("diloco", "diloco_fp32,diloco_reference,diloco_1bit")
    ours, ref, onebit = plain["diloco_fp32"], plain["diloco_reference"], plain["diloco_1bit"]
    assert ours["curve"]["loss"] == pytest.approx(ref["curve"]["loss"], rel=1e-5)
    assert ours["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    synced = [i for i, b in enumerate(ref["curve"]["bytes"]) if b > 0]
    # (and the first local step's one header, which compares the gradients' checksums: a few bytes)
    assert synced == [3, 7] and [i for i, b in enumerate(ours["curve"]["bytes"]) if b > 0] == [0] + synced
    assert ours["curve"]["bytes"][0] < 1000
    assert sum(ours["curve"]["bytes"]) == pytest.approx(sum(ref["curve"]["bytes"]), rel=0.01)
    assert 0 < sum(onebit["curve"]["bytes"]) < sum(ours["curve"]["bytes"]) / 10
    # (and transformers' GPT-2 of the same sizes in place of the benchmark's GPT: --arch gpt2). Ours alone: the
    # reference has no fragments nor delay (plain_diloco.py), and the 1-bit exchange streamed with a delay is
    # test_diloco.py's (fragments 3, delay 2, resumed bit for bit; the loop's own collectives meanwhile)
    streamed = run("streamed", "diloco_fp32", "--fragments", "2", "--delay", "1", "--arch", "gpt2")["diloco_fp32"]
    assert len([b for b in streamed["curve"]["bytes"] if b > 0]) > len(synced)
    assert json.loads((tmp_path / "streamed.json").read_text())["config"]["arch"] == "gpt2"
