"""Convergence on real model families: every compressed optimizer against its uncompressed twin.

    python -P benchmarks/convergence.py                      # every model, optimizer and seed
    python -P benchmarks/convergence.py --models gpt2 --seeds 0 --optimizers onebitadam,adamw

Models (nothing is downloaded; the corpus is the bytes of Python's own help texts):

* ``gpt2``: a GPT-2 from a ``transformers`` config (2 layers, width 64, byte vocabulary), next-byte
  prediction: the model of the key-bias report (docs/design.md, "Numerics");
* ``bert``: a BERT masked LM from a ``transformers`` config (2 layers, width 64; 15% of the bytes
  masked; a padding row and a token type that are never seen);
* ``gpt``: the end-to-end benchmark's GPT (``benchmarks/e2e/model.py``, preset ``tiny``);
* ``digits``: scikit-learn's digits, a 64-64-64-10 tanh MLP.

Optimizers and their uncompressed twins: ``onebitadam`` and ``zerooneadam`` against ``adamw``
(``torch.optim.AdamW`` on the gradient all-reduced at full precision), ``onebitlamb`` against
``lamb`` (``OnebitLamb`` that never freezes: LAMB on the full-precision average). ``--variant``
adds OnebitAdam with ``exchange="momentum"`` (the paper's exchange) as ``onebitadam-momentum``, and
OnebitAdam and ZeroOneAdam with ``variance_tracking=False`` (the paper's frozen variance) as
``onebitadam-frozen`` and ``zerooneadam-frozen``, and ZeroOneAdam refreshing its variance at every
phase-A step (full precision until the freeze) as ``zerooneadam-dense``, and OnebitLamb with the
paper's frozen trust ratio (``trust_ratio="frozen"``) as ``onebitlamb-frozen``;
``--freeze-study`` OnebitAdam frozen at other steps and with ``freeze_step="auto"`` (``onebitadam@F``).

Each (model, optimizer, seed) trains on 2 Gloo ranks (one process pair per model; every run of
that model in it) on the same global batches. Recorded per run: the global training loss of every
step, the held-out loss at the end, the largest ``|p|`` of every parameter tensor every
``--probe`` steps, and, in the compression stage, the time and the bytes (the optimizer's backend
counters) per step. The summary compares each optimizer with its twin at equal steps: the final
loss (mean of the last 10% of steps), each seed's and their mean ratio; the worst parameter
tensor's ``max|p|`` ratio over every probe; for GPT-2 the attention key bias (the middle third of
``c_attn.bias``). Results: ``benchmarks/results/convergence.json`` and ``convergence.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # e2e (the end-to-end benchmark's GPT), also under python -P
RESULTS = os.path.join(HERE, "results")
WORLD = 2
TWIN = {"onebitadam": "adamw", "onebitadam-never": "adamw",
        "onebitadam-momentum": "adamw", "onebitadam-frozen": "adamw", "zerooneadam": "adamw",
        "zerooneadam-frozen": "adamw", "zerooneadam-dense": "adamw", "onebitlamb": "lamb", "onebitlamb-frozen": "lamb"}
VARIANTS = ("onebitadam-momentum", "onebitadam-frozen", "zerooneadam-frozen", "zerooneadam-dense", "onebitlamb-frozen")
FREEZE_STUDY = ("onebitadam@20", "onebitadam@100", "onebitadam@150", "onebitadam@auto")
#: OnebitAdam that never freezes: AdamW's math in our code, so its max|p| ratio to torch's AdamW is
#: what rounding alone does to a tensor (the metric's floor)
FLOOR = "onebitadam-never"
#: a tensor whose max|p| the floor moves by more than this factor, at any probe, either way, is
#: driven by rounding (GPT-2's and BERT's attention key biases, whose gradients are rounding noise):
#: its ratio says nothing about the optimizer, and is reported apart
ROUNDING_TOLERANCE = 1.25
OPTIMIZERS = ("adamw", "onebitadam", "zerooneadam", "lamb", "onebitlamb", FLOOR)
LAMB_LR = 1e-2
PATH = "1bit"  # the 1-bit exchange in every bucket (the default may take fp32 where it is faster)
SEQ_LEN = 64


# --- models and data -------------------------------------------------------------------------------------
def _corpus() -> tuple[torch.Tensor, torch.Tensor]:
    from pydoc_data.topics import topics

    data = torch.frombuffer(bytearray("\n\n".join(topics[k] for k in sorted(topics)).encode()), dtype=torch.uint8)
    data = data.long()
    split = int(len(data) * 0.95)
    return data[:split], data[split:]


class ByteTask:
    """Random windows of the training bytes, the same global batch on every rank (rank ``r`` takes
    its rows); a fixed set of held-out windows for the final loss."""

    batch = 8  # sequences per rank

    def __init__(self, seed: int):
        self.train, self.val = _corpus()
        self.seed = seed

    def windows(self, data, step, count, rank=0, world=1, salt=0):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 7 + salt)
        starts = torch.randint(0, len(data) - SEQ_LEN - 1, (count * world,),
                               generator=g)[rank * count:(rank + 1) * count]
        return data[starts[:, None] + torch.arange(SEQ_LEN)[None, :]]

    def batch_for(self, step, rank, world):
        return self.windows(self.train, step, self.batch, rank, world)

    def eval_batches(self):
        return [self.windows(self.val, -1, 32, salt=i) for i in range(4)]


class GPT2Task(ByteTask):
    lr = 2e-3

    def model(self):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=256, n_positions=SEQ_LEN, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                         eos_token_id=0)
        return GPT2LMHeadModel(cfg)

    def loss(self, model, x):
        return model(input_ids=x, labels=x).loss


class BertTask(ByteTask):
    """Masked-byte prediction: 15% of positions replaced by ``[MASK]`` (id 256); id 257 (padding)
    and token type 1 never occur, so their embedding rows never get a gradient."""

    lr = 2e-3
    MASK = 256

    def model(self):
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(vocab_size=258, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=256, max_position_embeddings=SEQ_LEN, pad_token_id=257)
        return BertForMaskedLM(cfg)

    def _masked(self, x, salt):
        g = torch.Generator().manual_seed(self.seed * 7919 + salt)
        chosen = torch.rand(x.shape, generator=g) < 0.15
        labels = torch.where(chosen, x, torch.full_like(x, -100))
        return torch.where(chosen, torch.full_like(x, self.MASK), x), labels

    def batch_for(self, step, rank, world):
        return self._masked(super().batch_for(step, rank, world), step * WORLD + rank)

    def eval_batches(self):
        return [self._masked(x, -1 - i) for i, x in enumerate(super().eval_batches())]

    def loss(self, model, batch):
        x, labels = batch
        return model(input_ids=x, labels=labels).loss


class GPTTask(ByteTask):
    lr = 2e-3

    def model(self):
        from e2e.model import PRESETS, TinyGPT

        return TinyGPT(PRESETS["tiny"])

    def loss(self, model, x):
        logits = model(x[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


class DigitsTask:
    lr = 3e-3
    batch = 64

    def __init__(self, seed: int):
        from sklearn.datasets import load_digits

        data = load_digits()
        self.x = torch.tensor(data.data, dtype=torch.float32) / 16.0
        self.y = torch.tensor(data.target, dtype=torch.long)
        self.seed = seed

    def model(self):
        return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))

    def batch_for(self, step, rank, world):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        idx = torch.randint(0, len(self.x), (self.batch * world,),
                            generator=g)[rank * self.batch:(rank + 1) * self.batch]
        return self.x[idx], self.y[idx]

    def eval_batches(self):
        return [(self.x, self.y)]

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)


TASKS = {"gpt2": GPT2Task, "bert": BertTask, "gpt": GPTTask, "digits": DigitsTask}
# steps, freeze step: digits as in the report (400, 80); the transformers 300 steps, freeze at 50
SCHEDULE = {"gpt2": (300, 50), "bert": (300, 50), "gpt": (300, 50), "digits": (400, 80)}


def make_optimizer(name: str, params, lr: float, freeze: int, path: str = PATH):
    """The optimizer ``name``; ``name@F`` overrides the freeze step (``F`` an int or ``auto``),
    ``name+P`` the path (``+fp32``: the compression stage's algorithm on the exact average),
    ``name:k=v;k=v`` passes constructor arguments (``zerooneadam:var_update_scaler=32``)."""
    import ast

    from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam

    extra = {}
    if ":" in name:
        name, _, args = name.partition(":")
        extra = {k: ast.literal_eval(v) for k, _, v in (a.partition("=") for a in args.split(";"))}
    if "+" in name:
        name, _, path = name.partition("+")
    if "@" in name:
        name, _, at = name.partition("@")
        freeze = at if at == "auto" else int(at)

    # no weight decay anywhere (the recorded runs'; the optimizers' default is AdamW's 1e-2)
    adam = dict(lr=lr, freeze_step=freeze, path=path, weight_decay=0.0)
    zero_one = dict(lr=lr, var_freeze_step=freeze, path=path, weight_decay=0.0)
    lamb = dict(lr=LAMB_LR, freeze_step=freeze, path=path, weight_decay=0.0)
    made = {
        "adamw": lambda: torch.optim.AdamW(params, lr=lr, weight_decay=0.0, **extra),
        "onebitadam": lambda: OnebitAdam(params, **adam, **extra),
        FLOOR: lambda: OnebitAdam(params, **{**adam, "freeze_step": 10**9}, **extra),
        "onebitadam-frozen": lambda: OnebitAdam(params, **adam, variance_tracking=False, **extra),
        "onebitadam-momentum": lambda: OnebitAdam(params, **adam, exchange="momentum", **extra),
        "zerooneadam": lambda: ZeroOneAdam(params, **zero_one, **extra),
        # var_interval never doubles: every phase-A step refreshes
        "zerooneadam-dense": lambda: ZeroOneAdam(params, **zero_one, var_update_scaler=10**9, **extra),
        "zerooneadam-frozen": lambda: ZeroOneAdam(params, **zero_one, variance_tracking=False, **extra),
        "lamb": lambda: OnebitLamb(params, **{**lamb, "freeze_step": 10**9}, **extra),
        "onebitlamb": lambda: OnebitLamb(params, **lamb, **extra),
        # the paper's frozen trust ratio r_f * factor
        "onebitlamb-frozen": lambda: OnebitLamb(params, **lamb, trust_ratio="frozen", **extra),
    }
    if name not in made:
        raise ValueError(f"unknown optimizer {name!r}")
    return made[name]()


# --- one rank ----------------------------------------------------------------------------------------------
def _max_abs(model) -> dict[str, float]:
    out = {name: float(p.detach().abs().max()) for name, p in model.named_parameters() if p.numel()}
    for name, p in model.named_parameters():  # GPT-2's key bias: the middle third of c_attn.bias
        if name.endswith("attn.c_attn.bias"):
            d = p.numel() // 3
            out[name.replace("c_attn.bias", "key_bias")] = float(p.detach()[d:2 * d].abs().max())
    return out


def run_one(task, model_name: str, name: str, seed: int, steps: int, freeze: int, probe: int, rank: int) -> dict:
    from compressed_opt.comm.torch_backend import hold

    torch.manual_seed(seed)
    model = task.model()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(name, params, task.lr, freeze)
    plain = isinstance(opt, torch.optim.AdamW)
    losses, probes, step_s, step_bytes = [], {}, [], []
    loss_buf = torch.zeros(1)
    for step in range(1, steps + 1):
        batch = task.batch_for(step, rank, WORLD)
        t0 = time.perf_counter()
        sent0 = 0 if plain else opt.backend.stats.total_bytes
        loss = task.loss(model, batch)
        loss.backward()
        if plain:  # AdamW on the full-precision average, as DDP gives it
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            hold(flat)  # the exit waits until torch lets go of it (docs/comm.md)
            dist.all_reduce(flat)
            flat /= WORLD
            pieces = flat.split([p.numel() for p in params])
            torch._foreach_copy_([p.grad for p in params], [g.view_as(p) for g, p in zip(pieces, params)])
        opt.step()
        opt.zero_grad(set_to_none=False)
        elapsed = time.perf_counter() - t0
        if not plain and getattr(opt, "compressing", False):
            step_s.append(elapsed)
            step_bytes.append(opt.backend.stats.total_bytes - sent0)
        loss_buf.fill_(loss.item())
        hold(loss_buf)
        dist.all_reduce(loss_buf)
        losses.append(loss_buf.item() / WORLD)
        if step % probe == 0 or step == steps:
            probes[step] = _max_abs(model)
    model.eval()
    with torch.no_grad():
        held = [task.loss(model, b).item() for b in task.eval_batches()]
    chosen = getattr(opt, "freeze_step", None) if not plain else None
    if hasattr(opt, "close"):
        opt.close()
    tail = max(1, steps // 10)
    return {
        "model": model_name, "optimizer": name, "seed": seed, "losses": losses,
        "final_loss": sum(losses[-tail:]) / tail, "eval_loss": sum(held) / len(held), "max_abs": probes,
        "compression_step_ms": 1e3 * _median(step_s[2:]) if len(step_s) > 2 else None,
        "compression_bytes_per_step": _median(step_bytes[2:]) if len(step_bytes) > 2 else None,
        "finite": all(math.isfinite(v) for v in losses), "freeze_step": chosen,
    }


def _median(values):
    s = sorted(values)
    return s[len(s) // 2] if s else None


def gloo_runs(rank: int, world: int, store_path: str, runs: list, run, path_of, line_of) -> None:
    """On Gloo rank ``rank`` of ``world`` (one thread): ``run(item)`` for each of ``runs`` in
    turn; rank 0 writes each result as JSON to ``path_of(item)`` and prints ``line_of(item, result)``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        for item in runs:
            result = run(item)
            if rank == 0:
                with open(path_of(item), "w") as f:
                    json.dump(result, f)
                print(line_of(item, result), flush=True)
    finally:
        dist.destroy_process_group()


def _worker(rank: int, store_path: str, model_name: str, runs: list, probe: int, out_dir: str):
    steps, freeze = SCHEDULE[model_name]
    def run(item):
        name, seed = item
        return run_one(TASKS[model_name](seed), model_name, name, seed, steps, freeze, probe, rank)

    gloo_runs(rank, WORLD, store_path, runs, run,
              lambda item: os.path.join(out_dir, f"{model_name}-{item[0]}-{item[1]}.json"),
              lambda item, r: f"  {model_name:6s} {item[0]:20s} seed {item[1]}: final {r['final_loss']:.4f} "
                              f"held-out {r['eval_loss']:.4f}")


# --- the summary ---------------------------------------------------------------------------------------------
def _magnitude_ratios(r: dict, t: dict):
    """``(ratio, layer, step)`` of ``r``'s max|p| to its twin ``t``'s, every tensor and probe."""
    for step, layers in r["max_abs"].items():
        for layer, value in layers.items():
            ref = t["max_abs"][step][layer]
            ratio = value / ref if ref > 0 else (math.inf if value > 0 else 1.0)
            yield (ratio if math.isfinite(value) else math.inf), layer, int(step)


def rounding_driven(by: dict, model: str, seed: int) -> set[str] | None:
    """The tensors whose max|p| the floor (:data:`FLOOR`, AdamW's math in our code) moves by more
    than :data:`ROUNDING_TOLERANCE` against torch's AdamW (``None``: no floor run)."""
    floor, adamw = by.get((model, FLOOR, seed)), by.get((model, "adamw", seed))
    if floor is None or adamw is None:
        return None
    return {layer for ratio, layer, _ in _magnitude_ratios(floor, adamw)
            if not 1 / ROUNDING_TOLERANCE <= ratio <= ROUNDING_TOLERANCE}


def _key_bias_peak(run: dict) -> float | None:
    """The largest ``|p|`` of the attention key biases over every probe of ``run`` (``None``: none)."""
    probes = run["max_abs"]
    keys = [k for k in probes[str(max(map(int, probes)))] if _is_key_bias(k)]
    return max(probes[s][k] for s in probes for k in keys) if keys else None


def _is_key_bias(name: str) -> bool:
    return name.endswith("key_bias") or name.endswith("attention.self.key.bias")


def _key_bias_across_seeds(by: dict) -> dict:
    """Each compressed optimizer's key-bias peaks (largest ``|p|`` over the run) over the seeds,
    against its twin's over the same seeds: the report's framing (a range of runs against
    AdamW's). Per seed, the two runs' key biases are independent walks driven by rounding noise
    (their gradient is ~1e-11), so a ratio of one seed's pair measures the noise: AdamW's own
    peak spans 340x over 3 seeds of BERT. ``largest_vs_twin_largest <= 1`` says no run went
    beyond every run of the twin."""
    out = {}
    for model, name in sorted({(m, n) for m, n, _ in by}):
        twin = TWIN.get(name.partition(":")[0].partition("+")[0].partition("@")[0])
        seeds = sorted(s for m, n, s in by if (m, n) == (model, name) and (model, twin, s) in by)
        peaks = {s: _key_bias_peak(by[(model, name, s)]) for s in seeds}
        twins = {s: _key_bias_peak(by[(model, twin, s)]) for s in seeds}
        if not seeds or None in peaks.values() or None in twins.values():
            continue
        out[(model, name)] = {"twin": twin, "peaks": peaks, "twin_peaks": twins,
                              "range": [min(peaks.values()), max(peaks.values())],
                              "twin_range": [min(twins.values()), max(twins.values())],
                              "largest_vs_twin_largest": max(peaks.values()) / max(twins.values()),
                              "seed_peak_ratios": {s: peaks[s] / twins[s] for s in seeds}}
    return out


def summarize(results: list[dict]) -> dict:
    by = {(r["model"], r["optimizer"], r["seed"]): r for r in results}
    summary = {}
    for (model, name, seed), r in sorted(by.items()):
        twin = TWIN.get(name.partition(":")[0].partition("+")[0].partition("@")[0])
        entry = summary.setdefault(model, {}).setdefault(name, {"seeds": {}})
        entry["seeds"][seed] = row = {"final_loss": r["final_loss"], "eval_loss": r["eval_loss"],
                                      "freeze_step": r.get("freeze_step"),
                                      "finite": r["finite"], "compression_step_ms": r["compression_step_ms"],
                                      "compression_bytes_per_step": r["compression_bytes_per_step"]}
        t = by.get((model, twin, seed)) if twin else None
        if t is None:
            continue
        row["loss_ratio"] = r["final_loss"] / t["final_loss"]
        row["eval_ratio"] = r["eval_loss"] / t["eval_loss"]
        ratios = list(_magnitude_ratios(r, t))
        row["worst_magnitude_ratio"], row["worst_layer"], row["worst_step"] = max(ratios, key=lambda x: x[0])
        noisy = rounding_driven(by, model, seed)
        if noisy is not None:
            row["rounding_driven"] = sorted(noisy)
            resolved = [x for x in ratios if x[1] not in noisy] or [(1.0, None, None)]
            row["resolved_magnitude_ratio"], row["resolved_layer"], row["resolved_step"] = max(resolved,
                                                                                               key=lambda x: x[0])
        keys = [k for k in r["max_abs"][str(max(map(int, r["max_abs"])))] if _is_key_bias(k)]
        if keys:
            row["key_bias_ratio"] = max(r["max_abs"][s][k] / t["max_abs"][s][k] for s in r["max_abs"] for k in keys)
            last = str(max(map(int, r["max_abs"])))
            row["key_bias_final"] = max(r["max_abs"][last][k] for k in keys)
            row["key_bias_final_twin"] = max(t["max_abs"][last][k] for k in keys)
    for (model, name), entry in _key_bias_across_seeds(by).items():
        summary[model][name]["key_bias"] = entry
    for _model, names in summary.items():
        for _name, entry in names.items():
            rows = list(entry["seeds"].values())
            for key in ("final_loss", "eval_loss", "loss_ratio", "eval_ratio", "worst_magnitude_ratio",
                        "resolved_magnitude_ratio", "key_bias_ratio"):
                vals = [row[key] for row in rows if row.get(key) is not None]
                if vals:
                    entry[f"mean_{key}"] = sum(vals) / len(vals)
            worst = max(rows, key=lambda row: row.get("worst_magnitude_ratio", 0.0))
            if "worst_layer" in worst:
                entry["worst"] = {k: worst[k] for k in ("worst_magnitude_ratio", "worst_layer", "worst_step")}
            worst = max(rows, key=lambda row: row.get("resolved_magnitude_ratio", 0.0))
            if "resolved_magnitude_ratio" in worst:
                entry["resolved"] = {k: worst[k] for k in ("resolved_magnitude_ratio", "resolved_layer",
                                                           "resolved_step")}
    return summary


def format_summary(summary: dict) -> str:
    lines = [f"{'model':7s} {'optimizer':20s} {'loss (mean)':>11s} {'vs twin':>8s} {'per seed':>24s} "
             f"{'held-out':>9s} {'max|p| ratio (worst layer)':>40s}  {'not rounding-driven':>40s}"]
    for model, names in summary.items():
        for name, e in names.items():
            seeds = " ".join(f"{row['loss_ratio']:.3f}" for row in e["seeds"].values() if "loss_ratio" in row)
            ratio = f"{e['mean_loss_ratio']:.3f}" if "mean_loss_ratio" in e else "-"
            eval_ratio = f"{e['mean_eval_ratio']:.3f}" if "mean_eval_ratio" in e else "-"
            worst = e.get("worst")
            worst_s = f"{worst['worst_magnitude_ratio']:.2f} ({worst['worst_layer']})" if worst else "-"
            resolved = e.get("resolved")
            resolved_s = (f"{resolved['resolved_magnitude_ratio']:.2f} ({resolved['resolved_layer']})"
                          if resolved else "-")
            lines.append(f"{model:7s} {name:20s} {e['mean_final_loss']:11.4f} {ratio:>8s} {seeds:>24s} "
                         f"{eval_ratio:>9s} {worst_s:>40s}  {resolved_s:>40s}")
    lines.append("")
    lines.append(f"{'model':7s} {'optimizer':20s} {'key bias: peak |p| over seeds':>30s} {'twin':>20s} "
                 f"{'largest/twin largest':>21s} {'per seed (peak/twin peak)':>27s}")
    for model, names in summary.items():
        for name, e in names.items():
            kb = e.get("key_bias")
            if kb:
                lo, hi = kb["range"]
                tlo, thi = kb["twin_range"]
                per_seed = " / ".join(f"{v:.2f}" for v in kb["seed_peak_ratios"].values())
                lines.append(f"{model:7s} {name:20s} {f'{lo:.2e} - {hi:.2e}':>30s} {f'{tlo:.2e} - {thi:.2e}':>20s} "
                             f"{kb['largest_vs_twin_largest']:21.2f} {per_seed:>27s}")
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in results})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        names = sorted({r["optimizer"] for r in results if r["model"] == model})
        for name in names:
            runs = [r["losses"] for r in results if r["model"] == model and r["optimizer"] == name]
            mean = [sum(v) / len(v) for v in zip(*runs)]
            k = max(1, len(mean) // 30)
            smooth = [sum(mean[max(0, i - k):i + 1]) / len(mean[max(0, i - k):i + 1]) for i in range(len(mean))]
            ax.plot(range(1, len(smooth) + 1), smooth, label=name, linestyle="--" if name in ("adamw", "lamb") else "-")
        ax.set_title(f"{model} (2 ranks, mean of seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (running mean)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,bert,gpt,digits")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--variant", action="store_true",
                   help="also OnebitAdam with exchange='momentum', OnebitAdam and ZeroOneAdam with "
                        "variance_tracking=False")
    p.add_argument("--freeze-study", action="store_true",
                   help="also OnebitAdam frozen at steps 20, 100, 150 and 'auto' (the default schedule freezes at 50)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--probe", type=int, default=10, help="record max|p| per tensor every this many steps")
    p.add_argument("--out", default=os.path.join(RESULTS, "convergence.json"))
    p.add_argument("--timeout", type=float, default=3600, help="seconds per model")
    p.add_argument("--summarize", metavar="RESULT", help="train nothing: recompute the summary of RESULT's runs "
                                                          "(a result file of this script) and write it back")
    args = p.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            data = json.load(f)
        data["summary"] = summarize(data["runs"])
        print(format_summary(data["summary"]))
        with open(args.summarize, "w") as f:
            json.dump(data, f, indent=1)
        print(f"wrote {args.summarize}")
        return 0
    names = (args.optimizers.split(",") + (list(VARIANTS) if args.variant else [])
             + (list(FREEZE_STUDY) if args.freeze_study else []))
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models.split(","):
            if model_name not in TASKS:
                p.error(f"unknown model {model_name!r} (choose from {', '.join(TASKS)})")
            print(f"{model_name}: {len(names) * len(seeds)} runs on {WORLD} ranks", flush=True)
            runs = [(n, s) for s in seeds for n in names]
            ctx = mp.start_processes(_worker, args=(os.path.join(tmp, f"store-{model_name}"), model_name, runs,
                                                    args.probe, tmp), nprocs=WORLD, join=False, start_method="spawn")
            deadline = time.monotonic() + args.timeout
            while not ctx.join(timeout=5):
                if time.monotonic() > deadline:
                    for proc in ctx.processes:
                        proc.kill()
                    raise SystemExit(f"{model_name}: no result within {args.timeout} s")
            for n, s in runs:
                with open(os.path.join(tmp, f"{model_name}-{n}-{s}.json")) as f:
                    results.append(json.load(f))
    summary = summarize(results)
    print(format_summary(summary))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"config": {"world": WORLD, "schedule": SCHEDULE, "seeds": seeds, "lamb_lr": LAMB_LR,
                              "lr": {m: TASKS[m].lr for m in TASKS}, "seconds": time.perf_counter() - started},
                   "summary": summary, "runs": results}, f, indent=1)
    plot(results, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
