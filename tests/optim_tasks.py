"""A real small task for optimizer tests: scikit-learn's bundled digits (8x8 images, 10 classes;
shipped with the package, nothing downloaded), an MLP, and a data-parallel training loop in which
every rank sees a different shard of each batch."""
from __future__ import annotations

import contextlib

import torch
from torch import nn


def digits(dtype=torch.float32):
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x.to(dtype), y


def mlp(seed: int = 0, hidden: int = 64, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                         nn.Linear(hidden, 10)).to(dtype)


def shard_batches(rank: int, world: int, steps: int, batch: int = 64, seed: int = 1):
    """For each step, this rank's part of a global batch of ``batch * world`` examples."""
    x, y = digits()
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch * world,), generator=g)
        mine = idx[rank * batch : (rank + 1) * batch]
        yield x[mine], y[mine]


def full_loss(model: nn.Module) -> float:
    x, y = digits()
    with torch.no_grad():
        return nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y).item()


def train(model, optimizer, rank, world, steps, batch=64, seed=1):
    """Train on this rank's shards; the losses (full data set) at the end."""
    run_steps(model, optimizer, shard_batches(rank, world, steps, batch, seed))
    return full_loss(model)


#: the ways to run a compressed optimizer: standalone overlapped (the default) or synchronous,
#: ZeRO stage 1 or 2, and under DDP with the comm hook
MODES = ("overlap", "sync", "zero1", "zero2", "ddp")


def in_mode(cls, model: nn.Module, mode: str, **kwargs):
    """``cls`` on ``model``'s parameters, run in ``mode``: ``(module to call, optimizer)``."""
    if mode not in MODES:
        raise ValueError(mode)
    kwargs.setdefault("overlap", mode != "sync")
    if mode.startswith("zero"):
        kwargs["zero_stage"] = int(mode[-1])
    if mode != "ddp":
        return model, cls(model.parameters(), **kwargs)
    from compressed_opt import register_ddp_comm_hook

    net = nn.parallel.DistributedDataParallel(model)
    opt = cls(net.parameters(), **kwargs)
    register_ddp_comm_hook(net, opt)
    return net, opt


def run_steps(net, opt, batches) -> None:
    """One optimizer step per ``(x, y)`` batch: cross-entropy of ``net(x)`` (``x`` in the
    parameters' dtype, the loss in fp32)."""
    dtype = next(net.parameters()).dtype
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x.to(dtype)).float(), y).backward()
        opt.step()


def checkpoint_round_trip(model, opt) -> dict:
    """``{"model", "opt"}`` state dicts through ``torch.save`` and ``torch.load(weights_only=True)``."""
    import io

    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def resume_diff(fresh, batches, cut: int) -> float:
    """The largest parameter difference of :func:`resume_run`."""
    return resume_run(fresh, batches, cut)[0]


def resume_run(fresh, batches, cut: int) -> tuple[float, dict]:
    """Train ``fresh()`` (a function giving ``(model, module to call, optimizer)``) on
    ``batches`` uninterrupted; again, checkpointing after ``cut`` steps (``torch.save``, loaded
    with ``weights_only=True``) and resuming in a new model and optimizer: the largest parameter
    difference between the two at the end, and the optimizer's checkpoint."""
    model, net, opt = fresh()
    run_steps(net, opt, batches)
    uninterrupted = [p.detach().clone() for p in model.parameters()]
    model, net, opt = fresh()
    run_steps(net, opt, batches[:cut])
    ckpt = checkpoint_round_trip(model, opt)
    model, net, opt = fresh()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    run_steps(net, opt, batches[cut:])
    return max((a - b).abs().max().item() for a, b in zip(uninterrupted, model.parameters())), ckpt["opt"]


def steps_with_overflow(model, opt, rank: int, batches, overflow_steps=(2, 5), overflow_rank: int = 1):
    """Train under a ``GradScaler``; on rank ``overflow_rank`` backward overflows (an inf in the
    input makes its gradients non-finite) at the steps ``overflow_steps`` (0-based). Per step
    whether it was taken (1 or 0), and the final parameters."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    taken = []
    for step, (x, y) in enumerate(batches):
        opt.zero_grad()
        if step in overflow_steps and rank == overflow_rank:
            x = x.clone()
            x[0, 0] = float("inf")
        scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
        before = opt.global_step
        scaler.step(opt)
        scaler.update()
        taken.append(opt.global_step - before)
    return taken, [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def fusion(passes, on: bool, ran: list):
    """Within: the classes the CPU buckets bind for ``passes`` (a name or names of
    :class:`compressed_opt.cuda.Kernels`' producer classes, ``"LerpScaleClamp"``, ``"ScaleClamp"``,
    ``"Lerp"``: ``compressed_opt.cuda.kernels_for("cpu")``'s, which an optimizer's buckets on CPU
    use) with their ``compress_rows_`` (the pass run fused into the exchange's compression)
    counting in ``ran[0]`` the compressions it fused when ``on``, refusing to fuse when not (the
    compression then runs the pass alone, ``apply_``, and compresses its result)."""
    from compressed_opt.cuda import kernels_for

    bound = kernels_for(torch.device("cpu"))
    classes = {getattr(bound, name) for name in ((passes,) if isinstance(passes, str) else passes)}
    originals = {cls: cls.__dict__.get("compress_rows_") for cls in classes}

    def counting(original):
        def counted(self, *args):
            done = original(self, *args)
            ran[0] += bool(done)
            return done
        return counted

    for cls in classes:
        cls.compress_rows_ = counting(cls.compress_rows_) if on else (lambda self, *args: False)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:  # (inherited: drop the patch)
                del cls.compress_rows_
            else:
                cls.compress_rows_ = original
