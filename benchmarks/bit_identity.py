"""The reference matrix: every optimizer's results, bit for bit, against another revision's.

A refactor that must not change what the optimizers compute is checked here: each configuration
trains a small model on Gloo ranks across the freeze, and its result is the SHA-256 of every
parameter after every step, and of the optimizer's per-parameter state at the end, on every
rank. The matrix (docs/benchmarks.md, "The reference matrix"):

* the three optimizers x ``exchange`` (preconditioned, momentum) x ZeRO stage (0, 1; 0/1 Adam: 0)
  x ``variance_tracking`` (on, off; 1-bit LAMB has none) x ``overlap`` (on, off), on 2 ranks,
  two param groups and small buckets (several exchange groups);
* a few more runs a user makes: gradient clipping (the loop touches ``p.grad``), gradient
  accumulation, ZeRO stage 2, bf16 parameters under ZeRO, ``path="fp32"``, one process, the
  hierarchical exchange (4 ranks as 2 nodes of 2);
* HSDP 2x2 (FSDP2 on ``mesh["shard"]``, the exchange over ``mesh["replicate"]``) and tensor
  parallelism (``mesh["tp"]`` column/row-wise, the exchange over ``mesh["dp"]``), each optimizer;
* DCP round trips (``compressed_opt.dcp.OptimizerState``): saved mid-run, loaded in a fresh
  optimizer, trained on; the resumed run must give the uninterrupted run's bits;
* DiLoCo around AdamW, each compression, and streamed (fragments and a delay), on 2 ranks.

    python -P benchmarks/bit_identity.py                     # this checkout: the hashes, and how many differ
    python -P benchmarks/bit_identity.py --against 9d13228   # this checkout against an install of that revision

``--against`` installs the revision (``git archive``, ``pip install --target``) and runs the same
matrix there; every configuration must give the same hashes in both. The number of distinct
results shows the matrix tells its configurations apart.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FREEZE, STEPS, SAVE_AT = 4, 16, 9
ZERO_ONE = dict(var_freeze_step=8, var_update_scaler=1, local_step_scaler=2, local_step_clipper=4)


def matrix() -> dict[str, tuple[str, dict, dict]]:
    """name -> (optimizer, its arguments, the run's options) of the 2-rank configurations."""
    out = {}
    for exchange in ("preconditioned", "momentum"):
        for overlap in (True, False):
            for zero in (0, 1):
                for tracking in (True, False):
                    out[f"OnebitAdam/{exchange}/zero{zero}/tracking={tracking}/overlap={overlap}"] = (
                        "OnebitAdam", dict(freeze_step=FREEZE, exchange=exchange, zero_stage=zero,
                                           variance_tracking=tracking, overlap=overlap), {})
                out[f"OnebitLamb/{exchange}/zero{zero}/overlap={overlap}"] = (
                    "OnebitLamb", dict(freeze_step=FREEZE, exchange=exchange, zero_stage=zero, overlap=overlap), {})
            for tracking in (True, False):
                out[f"ZeroOneAdam/{exchange}/zero0/tracking={tracking}/overlap={overlap}"] = (
                    "ZeroOneAdam", dict(exchange=exchange, variance_tracking=tracking, overlap=overlap, **ZERO_ONE),
                    {})
    for name, kw in (("OnebitAdam", dict(freeze_step=FREEZE)), ("OnebitLamb", dict(freeze_step=FREEZE)),
                     ("ZeroOneAdam", ZERO_ONE)):
        out[f"{name}/clip"] = (name, kw, dict(clip=True))
        out[f"{name}/accumulation=2"] = (name, dict(kw, accumulation_steps=2), dict(accumulate=2))
        out[f"{name}/path=fp32"] = (name, dict(kw, path="fp32"), {})
    out["OnebitAdam/zero2"] = ("OnebitAdam", dict(freeze_step=FREEZE, zero_stage=2), {})
    out["OnebitLamb/zero2"] = ("OnebitLamb", dict(freeze_step=FREEZE, zero_stage=2), {})
    out["OnebitAdam/zero1/bf16"] = ("OnebitAdam", dict(freeze_step=FREEZE, zero_stage=1, master_resync_interval=3),
                                    dict(dtype="bfloat16"))
    out["OnebitAdam/bf16"] = ("OnebitAdam", dict(freeze_step=FREEZE), dict(dtype="bfloat16"))
    return out


def _model(dtype=torch.float32):
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.LayerNorm(48), nn.Linear(48, 40), nn.Tanh(),
                          nn.Linear(40, 4))
    return model.to(dtype)


def _groups(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return [dict(params=decay, weight_decay=0.01), dict(params=rest, weight_decay=0.0)]


def _batch(step: int, rank: int, micro: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x = torch.randn(8, 16, generator=g)
    x[:, 3] = 0.0  # an input that is always 0: coordinates without variance
    return x.to(dtype), torch.randn(8, 4, generator=g).to(dtype)


def _digest(h, tensors) -> None:
    for t in tensors:
        t = t.detach()
        if hasattr(t, "to_local"):
            t = t.to_local()
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"-")


def _state_digest(opt) -> str:
    """The per-parameter state's tensors and numbers, but for the entry that names where
    ``state_dict()`` carries the record for torch's state_dict API (the job rank:
    ``compressed_opt.torch_state_dict.hold_carrier``), bookkeeping, not what the optimizer computed."""
    h = hashlib.sha256()
    for p in (p for g in opt.param_groups for p in g["params"]):
        st = opt.state.get(p, {})
        for k in sorted(k for k in st if k != "compressed_opt"):
            v = st[k]
            if torch.is_tensor(v):
                h.update(k.encode())
                _digest(h, [v])
            elif isinstance(v, (int, float)):
                h.update(f"{k}={v!r}".encode())
    return h.hexdigest()


def _train(model, opt, rank, steps, options, trajectory):
    dtype = getattr(torch, options.get("dtype", "float32"))
    for step in steps:
        opt.zero_grad()
        for micro in range(options.get("accumulate", 1)):
            x, y = _batch(step, rank, micro, dtype)
            (model(x) - y).float().square().mean().backward()
        if options.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        _digest(trajectory, model.parameters())


def _run_plain(rank, world, names):
    import compressed_opt

    warnings.simplefilter("ignore")
    out = {}
    table = matrix()
    for name in names:
        cls_name, kw, options = table[name]
        model = _model(getattr(torch, options.get("dtype", "float32")))
        opt = getattr(compressed_opt, cls_name)(_groups(model), lr=1e-2, bucket_cap_mb=0.004, **kw)
        trajectory = hashlib.sha256()
        _train(model, opt, rank, range(1, STEPS + 1), options, trajectory)
        out[name] = (trajectory.hexdigest(), _state_digest(opt))
        opt.close()
    return out


def _run_dcp(rank, world, root):
    """Each optimizer: train to SAVE_AT, save with DCP, train on (uninterrupted); a fresh model and
    optimizer load the checkpoint and train on (resumed)."""
    import torch.distributed.checkpoint as dcp

    import compressed_opt
    from compressed_opt.dcp import OptimizerState

    warnings.simplefilter("ignore")
    out = {}
    for name, kw in (("OnebitAdam", dict(freeze_step=FREEZE)), ("OnebitAdam-zero1", dict(freeze_step=FREEZE,
                                                                                            zero_stage=1)),
                     ("OnebitLamb", dict(freeze_step=FREEZE)), ("ZeroOneAdam", ZERO_ONE)):
        results = []
        for resumed in (False, True):
            model = _model()
            opt = getattr(compressed_opt, name.split("-")[0])(_groups(model), lr=1e-2, bucket_cap_mb=0.004, **kw)
            trajectory = hashlib.sha256()
            path = os.path.join(root, name)
            if not resumed:
                _train(model, opt, rank, range(1, SAVE_AT + 1), {}, hashlib.sha256())
                dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=path)
            else:
                state = {"model": model.state_dict(), "optim": OptimizerState(opt)}
                dcp.load(state, checkpoint_id=path)
                model.load_state_dict(state["model"])
            _train(model, opt, rank, range(SAVE_AT + 1, STEPS + 1), {}, trajectory)
            results.append((trajectory.hexdigest(), _state_digest(opt)))
            opt.close()
        out[f"{name}/dcp"] = results[0] if results[0] == results[1] else ("resume differs", *results)
    return out


def _run_meshes(rank, world):
    """HSDP 2x2 and TP (dp 2 x tp 2), each optimizer, on 4 ranks."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import compressed_opt

    warnings.simplefilter("ignore")
    out = {}
    for name, kw in (("OnebitAdam", dict(freeze_step=FREEZE)), ("OnebitLamb", dict(freeze_step=FREEZE)),
                     ("ZeroOneAdam", ZERO_ONE)):
        for kind in ("hsdp", "tp"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))
            if kind == "hsdp":
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
                for m in model:
                    if isinstance(m, nn.Linear):
                        fully_shard(m, mesh=mesh["shard"])
                fully_shard(model, mesh=mesh["shard"])
                backend, replica = mesh["replicate"], mesh.get_coordinate()[0]
            else:
                mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
                parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
                backend, replica = mesh["dp"], mesh.get_coordinate()[0]
            opt = getattr(compressed_opt, name)(model.parameters(), lr=1e-2, backend=backend, **kw)
            trajectory = hashlib.sha256()
            for step in range(1, STEPS + 1):
                x, y = _batch(step, replica)
                opt.zero_grad()
                (model(x) - y).square().mean().backward()
                opt.step()
                _digest(trajectory, model.parameters())
            out[f"{name}/{kind}"] = (trajectory.hexdigest(), _state_digest(opt))
            opt.close()
    return out


DILOCO = {"fp32": dict(compression="fp32"), "bf16": dict(compression="bf16"), "4bit": dict(compression="4bit"),
          "1bit": dict(compression="1bit"), "1bit/fragments=2/delay=1": dict(compression="1bit", fragments=2, delay=1)}


def _run_diloco(rank, world):
    """DiLoCo around torch's AdamW, H = 4, each compression (and streamed), on 2 ranks: the
    parameters after every inner step, and the anchors and outer momenta at the end."""
    import compressed_opt

    warnings.simplefilter("ignore")
    out = {}
    for name, kw in DILOCO.items():
        model = _model()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            opt = compressed_opt.DiLoCo(model.parameters(), inner, sync_every=4, **kw)
        except (AttributeError, ValueError) as exc:  # (a revision without DiLoCo, or without this compression)
            out[f"DiLoCo/{name}"] = (f"unsupported: {type(exc).__name__}", "")
            continue
        trajectory = hashlib.sha256()
        _train(model, opt, rank, range(1, STEPS + 1), {}, trajectory)
        opt.synchronize()
        state = hashlib.sha256()
        _digest(state, [t for f in opt.fragments for t in (f.anchor, f.momentum)])
        out[f"DiLoCo/{name}"] = (trajectory.hexdigest(), state.hexdigest())
        opt.close()
    return out


def _rank_main(rank, world, store, fn, args, out_dir, env):
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(result, f)


def _spawn(fn, world, *args, env=None) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank_main, args=(world, os.path.join(tmp, "store"), fn, args, tmp, env or {}),
                           nprocs=world, start_method="spawn")
        return [json.load(open(os.path.join(tmp, f"{r}.json"))) for r in range(world)]


def _single(names):
    import compressed_opt

    warnings.simplefilter("ignore")
    out = {}
    table = matrix()
    for name in names:
        cls_name, kw, options = table[name]
        model = _model()
        opt = getattr(compressed_opt, cls_name)(_groups(model), lr=1e-2, bucket_cap_mb=0.004, **kw)
        trajectory = hashlib.sha256()
        _train(model, opt, 0, range(1, STEPS + 1), options, trajectory)
        out[f"{name}/one process"] = (trajectory.hexdigest(), _state_digest(opt))
        opt.close()
    return out


def run_matrix() -> dict[str, list]:
    """Every configuration's result: per rank, (the trajectory's hash, the final state's)."""
    results: dict[str, list] = {}
    names = list(matrix())
    for out in _spawn(_run_plain, 2, names):
        for name, value in out.items():
            results.setdefault(name, []).append(value)
    hier = [n for n in names if n.endswith("overlap=False") and "zero0" in n and "tracking=False" not in n]
    for out in _spawn(_run_plain, 4, hier, env={"COMPRESSED_OPT_RANKS_PER_NODE": "2"}):
        for name, value in out.items():
            results.setdefault(f"{name}/hierarchical 2x2", []).append(value)
    for name, value in _single([n for n in names if n.endswith("overlap=True") and "zero0" in n]).items():
        results[name] = [value]
    with tempfile.TemporaryDirectory() as root:
        for out in _spawn(_run_dcp, 2, root):
            for name, value in out.items():
                results.setdefault(name, []).append(value)
    for out in _spawn(_run_meshes, 4):
        for name, value in out.items():
            results.setdefault(name, []).append(value)
    for out in _spawn(_run_diloco, 2):
        for name, value in out.items():
            results.setdefault(name, []).append(value)
    return results


def _install(rev: str, tmp: str) -> str:
    root = os.path.dirname(HERE)
    src, site = os.path.join(tmp, "src"), os.path.join(tmp, "site")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", root, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", site, src], check=True, capture_output=True)
    return site


def _child(path: str | None, out: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    if path:
        env["PYTHONPATH"] = path
    subprocess.run([sys.executable, "-P", "-W", "ignore", os.path.abspath(__file__), "--child", out], env=env,
                   check=True, cwd=tempfile.gettempdir())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", metavar="REV", help="also run the matrix on an install of git revision REV")
    p.add_argument("--child", metavar="OUT", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write both matrices' results here")
    args = p.parse_args()
    if args.child:
        with open(args.child, "w") as f:
            json.dump(run_matrix(), f)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        mine = os.path.join(tmp, "this.json")
        _child(None, mine)
        this = json.load(open(mine))
        other = None
        if args.against:
            theirs = os.path.join(tmp, "rev.json")
            _child(_install(args.against, tmp), theirs)
            other = json.load(open(theirs))
    failures = [n for n, v in this.items() if any(isinstance(r[0], str) and r[0] == "resume differs" for r in v)]
    distinct = len({json.dumps(v) for v in this.values()})
    print(f"{len(this)} configurations, {distinct} distinct results")
    for name in failures:
        print(f"  {name}: the resumed run differs from the uninterrupted one")
    differ = []
    if other is not None:
        differ = [n for n in this if this[n] != other.get(n)]
        missing = [n for n in other if n not in this]
        print(f"against {args.against}: {len(this) - len(differ)} of {len(this)} identical")
        for name in differ + missing:
            print(f"  differs: {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"this": this, "against": args.against, "rev": other}, f, indent=1)
    return 1 if failures or differ else 0


if __name__ == "__main__":
    sys.exit(main())
