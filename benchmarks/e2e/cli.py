"""The command line: arguments, the run's configuration, every method in turn, the report."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shlex
import signal
import socket
import sys
import tempfile
import threading
import time

import torch

from common import check_link_possible, slowlink

from . import __doc__ as PACKAGE_DOC
from .methods import DEFAULT_METHODS, METHODS, parse_spec
from .model import ARCHS, PRESETS, ModelConfig, count_params
from .report import compare, format_table, plot, write_json
from .runner import Display, run_in_process, run_link, run_local, run_modelled, worker_main

PROG = "benchmarks/train.py"
LINK_EMULATIONS = ("auto", "netns", "userns", "model")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"python -P {PROG}",
                                description=PACKAGE_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="methods: " + ", ".join(METHODS)
                                + " (ours may take +ddp, +overlap, +nooverlap, +flat, +node, +measure)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated (default: %(default)s)")
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny", help="model preset (default tiny)")
    p.add_argument("--arch", choices=sorted(ARCHS), default="gpt",
                   help="gpt: the benchmark's own GPT (default); gpt2: transformers' GPT2LMHeadModel of the same sizes")
    p.add_argument("--layers", type=int, help="override the preset's layers")
    p.add_argument("--width", type=int, help="override the preset's width (d_model)")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--context", type=int, help="override the preset's context (positions)")
    p.add_argument("--seq-len", type=int, help="training sequence length (default: the context)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--steps", type=int, default=200, help="training steps, the same for every method (default 200)")
    p.add_argument("--freeze-step", type=int, help="warmup steps of ours and PowerSGD's start (default steps/4)")
    p.add_argument("--sync-every", type=int, default=30, help="DiLoCo's inner steps per round (default 30)")
    p.add_argument("--fragments", type=int, default=1,
                   help="DiLoCo's fragments, each synchronised on its own staggered schedule (default 1)")
    p.add_argument("--delay", type=int, default=0,
                   help="DiLoCo's delay: inner steps each exchange overlaps before it lands (default 0)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo's outer Nesterov momentum (default 0.9)")
    p.add_argument("--error-feedback", type=float, default=None,
                   help="DiLoCo's error_feedback: the share of the 4-bit or 1-bit compression errors carried into the "
                        "next exchange (default: DiLoCo's, 1 for 4-bit, 0.5 for 1-bit)")
    p.add_argument("--diloco-warmup", type=int, default=0,
                   help="DiLoCo's warmup_steps: inner steps on gradients averaged over the replicas every step, as "
                        "data parallel training, before the rounds start (default 0)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    p.add_argument("--lamb-lr", type=float, default=1e-2,
                   help="peak learning rate of onebit_lamb (default 1e-2: LAMB's trust ratio scales each layer's "
                        "step by ||p||/||update||, so it takes a larger lr than Adam)")
    p.add_argument("--lr-warmup", type=int, help="linear learning-rate warmup steps (default steps/10)")
    p.add_argument("--betas", default="0.9,0.99", help="Adam betas (default 0.9,0.99)")
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="ours: bucket_cap_mb (one collective and one compression scale per bucket; default 25)")
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default 25)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="PowerSGD matrix approximation rank (default 4)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="ours: communicate during backward (default) or in step()")
    p.add_argument("--ddp-hook", action="store_true", help="ours: run under DDP with register_ddp_comm_hook")
    p.add_argument("--breakdown", action="store_true",
                   help="time compute, compression kernels and collectives per step (small overhead)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus", help="a text file to train on instead of Python's help texts, or 'stdlib': the "
                                    "standard library's .py sources (12.6 MB)")
    p.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences for the final loss (default 64)")
    p.add_argument("--target-loss", type=float, help="loss for time-to-target (default 1.05 x ddp_adamw's final loss)")
    p.add_argument("--launch", type=int, default=None, metavar="N", help="local ranks per method (default 2)")
    p.add_argument("--link", default=None, metavar="RATE",
                   help="2 ranks over a rate-limited veth pair: 1gbit, 100mbit, any tc rate, or none (root not needed: "
                        "see --link-emulation)")
    p.add_argument("--link-emulation", choices=LINK_EMULATIONS, default="auto",
                   help="how --link is made: netns (network namespaces, as root), userns (the same inside a user "
                        "namespace of your own: no root needed), model (2 local ranks over loopback, each step's "
                        "time + its bytes / RATE: a model, said so in the table); auto (default): netns as root, "
                        "else userns, else model")
    p.add_argument("--ranks-per-node", type=int, default=1, metavar="L",
                   help="with --link: each side of the link is a node of L ranks, started by torchrun "
                        "(--nnodes 2, c10d rendezvous); ours' +flat / +node pick the exchange (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "1") or 1),
                   help="torch threads per rank (default $OMP_NUM_THREADS or 1)")
    p.add_argument("--method-timeout", type=float, default=900.0,
                   help="seconds before a method's ranks are killed and it is reported failed (default 900)")
    p.add_argument("--stall-timeout", type=float, default=120.0,
                   help="a rank that completes no step for this many seconds reports a hang and exits (default 120)")
    p.add_argument("--grace", type=float, default=5.0, help="seconds the other ranks get after one fails (default 5)")
    p.add_argument("--inject-failure", metavar="METHOD:crash|hang[:STEP]", action="append",
                   help="testing: make the last rank of METHOD crash or hang at STEP (default 3); repeatable")
    p.add_argument("--out-dir", default="results", help="where NAME.json and NAME.png go (default ./results)")
    p.add_argument("--name", help="file name stem (default train-MODEL-LINK)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    # internal: one rank of one method
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--init-method", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def make_config(args) -> dict:
    base = PRESETS[args.model]
    model = ModelConfig(n_layers=args.layers or base.n_layers, d_model=args.width or base.d_model,
                        n_heads=args.heads or base.n_heads, context=args.context or base.context)
    seq_len = args.seq_len or model.context
    if seq_len > model.context:
        raise SystemExit(f"--seq-len {seq_len} is longer than the context {model.context}")
    if args.steps < 1 or args.batch < 1:
        raise SystemExit("--steps and --batch must be >= 1")
    freeze = args.freeze_step if args.freeze_step is not None else max(2, args.steps // 4)
    if not 1 <= freeze < args.steps:
        raise SystemExit(f"--freeze-step must be in [1, --steps), got {freeze}")
    betas = [float(b) for b in args.betas.split(",")]
    if len(betas) != 2:
        raise SystemExit("--betas takes two numbers, e.g. 0.9,0.99")
    inject = []
    for text in args.inject_failure or ():
        parts = text.split(":")
        if len(parts) not in (2, 3) or parts[1] not in ("crash", "hang") or not parts[-1]:
            raise SystemExit("--inject-failure takes METHOD:crash or METHOD:hang, optionally :STEP")
        inject.append({"method": parts[0], "mode": parts[1], "step": int(parts[2]) if len(parts) == 3 else 3})
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ and args.launch is None and not args.link
    if args.ranks_per_node < 1 or (args.ranks_per_node > 1 and not args.link):
        raise SystemExit("--ranks-per-node must be >= 1, and > 1 only with --link (2 nodes of L ranks)")
    if args.link:
        if args.launch not in (None, 2 * args.ranks_per_node):
            raise SystemExit("--link runs 2 nodes of --ranks-per-node ranks; leave out --launch")
        launch = 2 * args.ranks_per_node
    else:
        launch = args.launch if args.launch is not None else 2
    if launch < 1:
        raise SystemExit("--launch must be >= 1")
    return {
        "model": dataclasses.asdict(model),
        "model_preset": args.model,
        "arch": args.arch,
        "params": (count_params(model) if args.arch == "gpt"
                   else sum(p.numel() for p in ARCHS[args.arch](model).parameters())),
        "seq_len": seq_len,
        "batch": args.batch,
        "steps": args.steps,
        "freeze_step": freeze,
        "sync_every": args.sync_every,
        "fragments": args.fragments,
        "delay": args.delay,
        "outer_lr": args.outer_lr,
        "outer_momentum": args.outer_momentum,
        "error_feedback": args.error_feedback,
        "diloco_warmup": args.diloco_warmup,
        "lr": args.lr,
        "lamb_lr": args.lamb_lr,
        "lr_warmup": args.lr_warmup if args.lr_warmup is not None else max(1, args.steps // 10),
        "betas": betas,
        "eps": args.eps,
        "weight_decay": args.weight_decay,
        "bucket_mb": args.bucket_mb,
        "ddp_bucket_mb": args.ddp_bucket_mb,
        "powersgd_rank": args.powersgd_rank,
        "overlap": args.overlap,
        "ddp_hook": args.ddp_hook,
        "breakdown": args.breakdown,
        "seed": args.seed,
        "corpus": (args.corpus if args.corpus == "stdlib" else os.path.abspath(args.corpus)) if args.corpus else None,
        "eval_sequences": args.eval_sequences,
        "target_loss": args.target_loss,
        "launch": launch,
        "link": args.link,
        "link_emulation": args.link_emulation if args.link else None,  # resolved in main()
        "ranks_per_node": args.ranks_per_node,
        "device": args.device,
        "threads": args.threads,
        "method_timeout": args.method_timeout,
        "stall_timeout": args.stall_timeout,
        "grace": args.grace,
        "inject_failure": inject,
        "mode": "link" if args.link else ("torchrun" if under_torchrun else "local"),
    }


def _resolve_link(cfg: dict) -> None:
    """``cfg['link_emulation']``: how ``--link`` is made here (``auto`` resolved); a modelled
    link runs ``cfg['launch']`` = 2 local ranks (``cfg['mode']`` ``"model"``)."""
    how = cfg["link_emulation"]
    if how == "auto":
        ok, why = slowlink().netns_supported("auto")
        if ok:
            how = slowlink().check_tools("auto")
        else:
            how = "model"
            cfg["link_model_reason"] = why
            print(f"# --link {cfg['link']}: no emulated link can be made here ({why}); the link is MODELLED "
                  f"instead (--link-emulation model), and the table says so", file=sys.stderr, flush=True)
    elif how != "model":
        how = check_link_possible(isolation=how)
    if how == "model":
        if slowlink().parse_rate(cfg["link"]) is None:
            raise SystemExit(f"--link {cfg['link']} with the modelled link: give a rate to model (e.g. 100mbit)")
        if cfg["ranks_per_node"] > 1:
            raise SystemExit("--ranks-per-node > 1 needs an emulated link (--link-emulation netns or userns)")
        cfg["mode"] = "model"
    cfg["link_emulation"] = how


def _where(cfg: dict) -> str:
    """Where the ranks run, in words (the header and the table's title)."""
    if cfg["mode"] == "torchrun":
        return "torchrun ranks"
    if cfg["mode"] == "local":
        return f"{cfg['launch']} local ranks over loopback (no network bottleneck)"
    rate = slowlink().format_rate(cfg["link"])
    if cfg["mode"] == "model":
        return (f"MODELLED {rate} link, not an emulated one: 2 local ranks over loopback, each step's time "
                f"+ its bytes / {rate}")
    nodes = f"2 nodes of {cfg['ranks_per_node']} ranks" if cfg["ranks_per_node"] > 1 else "2 ranks"
    return (f"{nodes} over an emulated {rate} link each way (tbf; "
            f"{slowlink().ISOLATION_TEXT[cfg['link_emulation']]})")


def _environment() -> dict:
    return {
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "argv": " ".join(shlex.quote(a) for a in sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):  # stop the ranks and delete the link, as for Ctrl-C
            signal.signal(sig, _raise_interrupt)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background by a shell
            signal.signal(signal.SIGINT, signal.default_int_handler)
    cfg = make_config(args)
    specs = [s.strip() for s in args.methods.split(",") if s.strip()]
    for s in specs:
        try:
            parse_spec(s, cfg["overlap"], cfg["ddp_hook"])
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if cfg["batch"] * cfg["launch"] > 0 and cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no usable CUDA device")
    if cfg["link"]:
        _resolve_link(cfg)
    display = Display(enabled=not args.quiet)
    where = cfg["where"] = _where(cfg)
    model = cfg["model"]
    arch = "GPT-2 (transformers)" if cfg.get("arch") == "gpt2" else "GPT"
    header = (f"# {PROG}: {cfg['params'] / 1e6:.2f}M-parameter {arch} ({model['n_layers']} layers, width "
              f"{model['d_model']}, {model['n_heads']} heads), batch {cfg['batch']} x {cfg['seq_len']} bytes per rank, "
              f"{cfg['steps']} steps (warmup {cfg['freeze_step']}), {where}, {cfg['device']}, "
              f"{cfg['threads']} thread(s) per rank")
    leader = cfg["mode"] != "torchrun" or os.environ.get("RANK") == "0"
    if leader:
        print(header, flush=True)
    else:
        display.enabled = False
    started = time.monotonic()
    if cfg["mode"] == "torchrun":
        entries = run_in_process(specs, cfg, display)
        if not entries:
            return 0
    else:
        entries = []
        for i, spec in enumerate(specs, 1):
            load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
            with tempfile.TemporaryDirectory(prefix="co-train-") as tmp:
                if cfg["mode"] == "link":
                    entry = run_link(spec, cfg, tmp, display, i, len(specs))
                elif cfg["mode"] == "model":
                    entry = run_modelled(spec, cfg, tmp, display, i, len(specs))
                else:
                    entry = run_local(spec, cfg, tmp, display, i, len(specs))
            entry["load_average_before"] = load_before
            entry["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
            status = "ok" if entry["status"] == "ok" else f"FAILED ({entry['error']})"
            display.done(f"[{i}/{len(specs)}] {spec}: {status} in {entry['elapsed_s']:.0f} s")
            entries.append(entry)
    comparison = compare(entries, cfg)
    print(format_table(entries, comparison, cfg), flush=True)
    name = args.name or (f"train-{cfg['model_preset']}-"
                         f"{cfg['link'] or ('torchrun' if cfg['mode'] == 'torchrun' else 'local')}")
    os.makedirs(args.out_dir, exist_ok=True)
    report = {"config": cfg, "environment": _environment(), "comparison": comparison,
              "wall_time_s": time.monotonic() - started, "methods": entries}
    json_path = os.path.join(args.out_dir, name + ".json")
    write_json(json_path, report)
    print(f"# wrote {json_path}", flush=True)
    if not args.no_plot:
        png = plot(entries, comparison, os.path.join(args.out_dir, name + ".png"), header.lstrip("# "))
        if png:
            print(f"# wrote {png}", flush=True)
    return 0 if all(e["status"] == "ok" for e in entries) else 1


def cli() -> int:
    try:
        return main()
    except KeyboardInterrupt as e:
        print(f"\n{PROG}: interrupted ({e or 'Ctrl-C'}); the ranks were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(cli())
