"""torchft's DiLoCo beside ours (issue 44: "a peer, side by side"): the same model, data, inner
optimizer, lr schedule, ``H`` and outer Nesterov SGD, run once under torchft and once in our
end-to-end harness, with the held-out loss and the bytes per step side by side.

    python -P benchmarks/diloco_peer.py --model tiny --steps 240 --sync-every 30 --seed 0 \\
        [--launch 2] [--ours diloco_fp32,diloco_1bit]

The flags are ``benchmarks/train.py``'s (parsed by it, so every one means the same there); this
script adds ``--ours`` (our methods run beside it through ``benchmarks/train.py``, ``none`` for
none). ``--launch R`` is the number of replica groups.

torchft's side (``torchft.local_sgd.DiLoCo`` 0.2.0): a lighthouse (``LighthouseServer``, in this
process) and ``R`` replica groups of one rank each, each a process of its own with its own
``TCPStore`` and ``Manager`` (``ProcessGroupGloo``, synchronous quorum, ``init_sync=False``: every
replica builds the model from the same seed, as ours do). Replica ``r`` trains on the rows the
harness gives rank ``r`` (``e2e.data.Batches``), the inner optimizer is the harness's (torch's
AdamW, fused where torch has it, the same schedule ``e2e.methods.lr_at``), the outer one
``torch.optim.SGD(lr, momentum, nesterov=True)`` on the model's parameters, as torchft documents.

What is counted and how:

* bytes: every ``Manager.allreduce`` DiLoCo issues is counted at the call (its tensor's bytes), and
  reported as the ring volume ``2 (R-1)/R`` times that, per rank per inner step: how the harness
  counts DDP's and the plain reference's. Gloo's own traffic is not seen, nor torchft's control
  plane (the heartbeats and quorum RPCs to the lighthouse and manager servers, the ``should_commit``
  RPC); ours are the bytes our backend counted (``backend.stats``).
* held-out loss: the harness's evaluation (the same 64 held-out sequences, mean cross-entropy),
  computed on every replica over all of them; the replicas must agree (they hold the same anchor
  after the last synchronisation), and the result says by how much they differ.
* with ``--wire``: the whole comparison runs in a network namespace of its own (``unshare --user
  --map-root-user --net``, loopback only), and each method's traffic on its loopback is read from
  ``/proc/net/dev`` (every byte any of its processes sent: IP and TCP headers, Gloo's own
  algorithm, the stores, torchft's lighthouse and manager RPCs and heartbeats, the evaluation and
  the harness's gathering of results), divided by the replicas and the steps. Ours then run one
  ``benchmarks/train.py`` each.
* time: the sum over the steps of the slowest replica's step (forward, backward, inner step with
  DiLoCo's hooks), as the harness sums its steps. On a shared CPU this is noisy.

torchft's pseudo-gradient quantisation (``should_quantize``) needs Triton and a GPU, so on the CPU
only its fp32 exchange runs. Without torchft installed the script says so and exits with 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import child_env, fmt_bytes, write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PROG = "benchmarks/diloco_peer.py"
TORCHFT_DIST = "torchft"


def torchft_missing() -> str | None:
    """Why torchft's DiLoCo cannot be imported here, or ``None`` where it can."""
    try:
        import torchft.coordination  # noqa: F401
        import torchft.local_sgd  # noqa: F401
    except Exception as e:  # (ImportError, or a binary extension that does not load)
        return f"{type(e).__name__}: {e}"
    return None


def torchft_version() -> str | None:
    from importlib import metadata

    for name in ("torchft", "torchft-nightly"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return f"{name} {metadata.version(name)}"
    return None


# --- one replica group (a process) -------------------------------------------------------------------------
def worker(replica: int, cfg: dict, lighthouse: str, out: str) -> int:
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from e2e.data import Batches, load_corpus
    from e2e.methods import adamw, lr_at
    from e2e.model import ARCHS, ModelConfig

    torch.set_num_threads(cfg["threads"])
    replicas = cfg["launch"]
    torch.manual_seed(cfg["seed"])  # the harness's model, built as each of its ranks builds it
    model = ARCHS[cfg.get("arch", "gpt")](ModelConfig(**cfg["model"]))
    corpus = load_corpus(cfg.get("corpus"))
    data = Batches(corpus, cfg["seq_len"], cfg["batch"], replica, replicas, cfg["seed"])
    hp = dict(lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"], weight_decay=cfg["weight_decay"])
    inner, fused = adamw(model.parameters(), hp)
    outer = torch.optim.SGD(model.parameters(), lr=cfg["outer_lr"], momentum=cfg["outer_momentum"], nesterov=True)

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    timeout = timedelta(seconds=max(60, cfg["method_timeout"]))
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this replica group's store
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=replicas, use_async_quorum=False,
                      load_state_dict=load_state_dict, state_dict=state_dict, replica_id=f"peer{replica}",
                      store_addr="localhost", store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=lighthouse, init_sync=False, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout)
    counted = {"bytes": 0, "calls": 0}
    allreduce = manager.allreduce

    def counting_allreduce(tensor, *args, **kwargs):  # what DiLoCo hands torchft to all-reduce
        counted["bytes"] += tensor.numel() * tensor.element_size()
        counted["calls"] += 1
        return allreduce(tensor, *args, **kwargs)

    manager.allreduce = counting_allreduce
    rec = {"loss": [], "step_s": [], "bytes": []}
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=cfg["sync_every"], backup_device=torch.device("cpu"),
                    pin_memory=False):
            for step in range(1, cfg["steps"] + 1):
                for group in inner.param_groups:
                    group["lr"] = lr_at(step, cfg)
                x, y = data.train_batch(step)
                before = counted["bytes"]
                t0 = time.perf_counter()
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                loss.backward()
                inner.step()  # DiLoCo's hooks: every sync_every steps, the quorum, all-reduce and outer step
                inner.zero_grad(set_to_none=True)
                rec["step_s"].append(time.perf_counter() - t0)
                value = float(loss.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(f"torchft DiLoCo: loss is {value} at step {step}")
                rec["loss"].append(value)
                rec["bytes"].append(counted["bytes"] - before)
        committed = manager.current_step()
        eval_loss = evaluate(model, corpus, cfg)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        write_json(out, {"replica": replica, "rec": rec, "eval_loss": eval_loss, "committed_syncs": committed,
                         "allreduce_calls": counted["calls"], "allreduce_bytes": counted["bytes"],
                         "adamw_fused": fused, "params": flat.numel(),
                         "param_sum": float(flat.double().sum()), "param_abs_sum": float(flat.double().abs().sum()),
                         "param_head": flat[:64].tolist()})
    finally:
        manager.shutdown(wait=False)
    return 0


def evaluate(model, corpus: bytes, cfg: dict) -> float:
    """The harness's held-out loss (``e2e.loop._evaluate``: the same sequences, the same sum of
    cross-entropy over tokens), on this one process over all of the sequences."""
    import torch
    import torch.nn.functional as F

    from e2e.data import Batches

    data = Batches(corpus, cfg["seq_len"], cfg["batch"], 0, 1, cfg["seed"])  # rank 0 of 1: every sequence
    model.eval()
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for x, y in data.val_batches(cfg["eval_sequences"], per_batch=16):
            logits = model(x)
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").double()
            tokens += y.numel()
    model.train()
    return float(total / tokens)


# --- the launcher ------------------------------------------------------------------------------------------
def run_torchft(cfg: dict, tmp: str) -> dict:
    """The lighthouse here, one process per replica group; the replicas' results merged."""
    from torchft.coordination import LighthouseServer

    replicas = cfg["launch"]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=replicas)
    config = os.path.join(tmp, "config.json")
    write_json(config, cfg)
    procs, logs, outs = [], [], []
    started = time.monotonic()
    timed_out = False
    try:
        for r in range(replicas):
            outs.append(os.path.join(tmp, f"replica{r}.json"))
            log = open(os.path.join(tmp, f"replica{r}.log"), "w+")
            logs.append(log)
            cmd = [sys.executable, "-P", os.path.abspath(__file__), "--peer-worker", str(r), "--peer-config", config,
                   "--peer-lighthouse", lighthouse.address(), "--peer-out", outs[-1]]
            procs.append(subprocess.Popen(cmd, env=child_env(cfg["threads"]), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = started + cfg["method_timeout"]
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                timed_out = time.monotonic() > deadline
                time.sleep(cfg["grace"])
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, 9)
            p.wait()
        lighthouse.shutdown()
    elapsed = time.monotonic() - started
    texts = []
    for log in logs:
        log.seek(0)
        texts.append(log.read())
        log.close()
    codes = [p.returncode for p in procs]
    if timed_out or any(c != 0 for c in codes) or not all(os.path.exists(o) for o in outs):
        why = f"timed out after {cfg['method_timeout']:g} s" if timed_out else f"exit codes {codes}"
        tails = "\n".join(f"--- replica {r} ---\n" + "\n".join(t.rstrip().splitlines()[-15:])
                          for r, t in enumerate(texts))
        return {"status": "failed", "error": why, "output_tail": tails, "elapsed_s": elapsed}
    res = []
    for o in outs:
        with open(o) as f:
            res.append(json.load(f))
    per_step = lambda key, how: [how(v) for v in zip(*(e["rec"][key] for e in res))]  # noqa: E731
    evals = [e["eval_loss"] for e in res]
    heads = [e["param_head"] for e in res]
    spread = max(abs(a - b) for h in heads for a, b in zip(h, heads[0]))
    curve = {"loss": per_step("loss", statistics.fmean), "step_s": per_step("step_s", max),
             "bytes_payload": per_step("bytes", statistics.fmean)}
    ring = 2 * (replicas - 1) / replicas
    curve["bytes"] = [b * ring for b in curve["bytes_payload"]]
    steps = cfg["steps"]
    return {"status": "ok", "elapsed_s": elapsed, "version": torchft_version(), "result": {
        "spec": "torchft_diloco", "label": f"torchft.local_sgd.DiLoCo ({torchft_version()}), fp32 all-reduce",
        "world_size": replicas, "params": res[0]["params"], "adamw_fused": res[0]["adamw_fused"],
        "curve": curve, "eval_loss": evals[0], "eval_loss_per_replica": evals,
        "param_head_max_abs_diff": spread,
        "param_sum_per_replica": [e["param_sum"] for e in res],
        "committed_syncs": [e["committed_syncs"] for e in res], "expected_syncs": steps // cfg["sync_every"],
        "allreduce_calls": [e["allreduce_calls"] for e in res],
        "bytes_per_step": statistics.fmean(curve["bytes"]),
        "bytes_counted": "Manager.allreduce payload at the call x 2(R-1)/R (ring volume), per rank",
    }}


def run_ours(methods: str, harness_argv: list[str], tmp: str) -> tuple[list[dict], str]:
    """Our methods through ``benchmarks/train.py`` with the same flags; its entries and command."""
    cmd = [sys.executable, "-P", os.path.join(HERE, "train.py"), *harness_argv, "--methods", methods,
           "--out-dir", tmp, "--name", "ours", "--no-plot", "--quiet"]
    proc = subprocess.run(cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = os.path.join(tmp, "ours.json")
    if not os.path.exists(path):
        raise SystemExit(f"{PROG}: benchmarks/train.py wrote no result (exit {proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}")
    with open(path) as f:
        return json.load(f)["methods"], " ".join(shlex.quote(c) for c in cmd[1:])


NETNS_ENV = "CO_PEER_NETNS"


def loopback_sent() -> int:
    """Bytes sent on this network namespace's loopback (``/proc/net/dev``, the interface ``lo``)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def in_own_netns(argv: list[str]) -> int:
    """Run this script again (``argv``) in a network namespace of its own with its loopback up."""
    import shutil

    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise SystemExit(f"{PROG}: --wire needs unshare and ip (util-linux, iproute2)")
    inner = " ".join(shlex.quote(a) for a in [sys.executable, "-P", os.path.abspath(__file__), *argv])
    cmd = ["unshare", "--user", "--map-root-user", "--net", "sh", "-c", f"ip link set lo up && exec {inner}"]
    return subprocess.call(cmd, env=dict(os.environ, **{NETNS_ENV: "1"}))


def summary(entry: dict, steps: int) -> dict:
    if entry["status"] != "ok":
        return {"spec": entry.get("spec", "torchft_diloco"), "status": entry["status"], "error": entry.get("error")}
    r = entry["result"]
    c = r["curve"]
    tail = max(1, steps // 10)
    return {"spec": r["spec"], "status": "ok", "bytes_per_step": statistics.fmean(c["bytes"]),
            "train_loss": statistics.fmean(c["loss"][-tail:]), "eval_loss": r["eval_loss"],
            "train_time_s": sum(c["step_s"]), "wire_bytes_per_step": entry.get("wire_bytes_per_step")}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argparse.ArgumentParser(add_help=False)
    own.add_argument("--ours", default="diloco_fp32,diloco_1bit")
    own.add_argument("--wire", action="store_true")
    own.add_argument("--out-dir", default="results")  # (this report's; ours' go to a temporary folder)
    own.add_argument("--name")
    for flag in ("--peer-worker", "--peer-config", "--peer-lighthouse", "--peer-out"):
        own.add_argument(flag, help=argparse.SUPPRESS)
    mine, rest = own.parse_known_args(argv)
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and manager servers: no log line per quorum
    if mine.peer_worker is not None:
        with open(mine.peer_config) as f:
            return worker(int(mine.peer_worker), json.load(f), mine.peer_lighthouse, mine.peer_out)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        print("--wire           also count every method's loopback bytes in a network namespace of its own\n"
              "--ours METHODS   ours beside it, through benchmarks/train.py (default diloco_fp32,diloco_1bit; "
              "'none': none)\nthe other flags: benchmarks/train.py's (python -P benchmarks/train.py --help)")
        return 0
    missing = torchft_missing()  # (first: without torchft, torch is not even imported)
    if missing:
        print(f"{PROG}: skipped: torchft's DiLoCo is not importable here ({missing}); install it with "
              f"`pip install torchft==0.2.0 \"torch==$(python -c 'import torch; print(torch.__version__)')\"` "
              "in a venv of its own", flush=True)
        return 0
    from e2e.cli import make_config, parse_args

    args = parse_args(rest)
    cfg = make_config(args)
    if cfg["mode"] != "local" or cfg["device"] != "cpu" or cfg["fragments"] != 1 or cfg["delay"] != 0:
        raise SystemExit(f"{PROG}: compares local CPU replicas with --fragments 1 --delay 0 only")
    if cfg["launch"] < 2:
        raise SystemExit(f"{PROG}: --launch must be at least 2 (replica groups)")
    if mine.wire and os.environ.get(NETNS_ENV) != "1":
        return in_own_netns(argv)
    out_dir, name = mine.out_dir, mine.name or f"diloco-peer-{cfg['model_preset']}-seed{cfg['seed']}-r{cfg['launch']}"
    print(f"# {PROG}: torchft's DiLoCo ({torchft_version()}) against ours: {cfg['params'] / 1e6:.2f}M-parameter "
          f"{cfg.get('arch', 'gpt')}, {cfg['launch']} replicas, {cfg['steps']} steps, H={cfg['sync_every']}, outer "
          f"SGD lr {cfg['outer_lr']} momentum {cfg['outer_momentum']} Nesterov, seed {cfg['seed']}", flush=True)
    with tempfile.TemporaryDirectory(prefix="co-peer-") as tmp:
        per_rank_step = cfg["launch"] * cfg["steps"]
        before = loopback_sent() if mine.wire else 0
        peer = run_torchft(cfg, tmp)
        if mine.wire:
            peer["wire_bytes_per_step"] = (loopback_sent() - before) / per_rank_step
        if peer["status"] != "ok":
            print(f"torchft_diloco: FAILED ({peer['error']})\n{peer['output_tail']}", flush=True)
        ours, cmd = [], None
        if mine.ours != "none" and not mine.wire:
            ours, cmd = run_ours(mine.ours, rest, tmp)
        elif mine.ours != "none":  # one harness run per method, its loopback bytes its own
            cmd = []
            for spec in mine.ours.split(","):
                before = loopback_sent()
                entries, one = run_ours(spec, rest, tmp)
                for e in entries:
                    e["wire_bytes_per_step"] = (loopback_sent() - before) / per_rank_step
                ours += entries
                cmd.append(one)
    rows = [summary(e, cfg["steps"]) for e in ours] + [summary(peer, cfg["steps"])]
    base = next((r for r in rows if r["spec"] == "diloco_fp32" and r["status"] == "ok"), None)
    wire = " loopback bytes / step / rank |" if mine.wire else ""
    print(f"| method | bytes / step / rank |{wire} train loss (last 10%) | held-out loss | train time |")
    print("| --- | --- |" + (" --- |" if mine.wire else "") + " --- | --- | --- |")
    for r in rows:
        if r["status"] != "ok":
            print(f"| {r['spec']} | FAILED: {r['error']} |" + " |" * (4 if mine.wire else 3))
            continue
        rel = t = ""
        if base and r is not base:
            rel = f" ({(r['eval_loss'] / base['eval_loss'] - 1) * 100:+.2f}% vs diloco_fp32)"
            t = f" ({r['train_time_s'] / base['train_time_s']:.2f}x)"
        w = f" {fmt_bytes(r['wire_bytes_per_step'])} |" if mine.wire else ""
        print(f"| {r['spec']} | {fmt_bytes(r['bytes_per_step'])} |{w} {r['train_loss']:.4f} | "
              f"{r['eval_loss']:.4f}{rel} | {r['train_time_s']:.1f} s{t} |")
    if peer["status"] == "ok":
        p = peer["result"]
        print(f"# torchft: held-out loss per replica {p['eval_loss_per_replica']}, parameters' max |diff| across "
              f"replicas {p['param_head_max_abs_diff']:.3g} (first 64), committed syncs {p['committed_syncs']} of "
              f"{p['expected_syncs']}, all-reduce calls {p['allreduce_calls']}; bytes: {p['bytes_counted']}",
              flush=True)
    report = {"config": cfg, "argv": " ".join(shlex.quote(a) for a in [PROG, *argv]), "ours_command": cmd,
              "torchft": peer, "ours": ours, "summary": rows}
    path = os.path.join(out_dir, name + ".json")
    write_json(path, report)
    print(f"# wrote {path}", flush=True)
    return 0 if peer["status"] == "ok" and all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
