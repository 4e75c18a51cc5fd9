"""Every rank's own state in one checkpoint file: ``consolidate_state_dict`` and its load.

Most of a compressed optimizer's state is the same on every rank: the averaged momentum, the
(frozen) variance, the stage and its counters. Some is not, by the algorithm:

* the error feedback (docs/design.md 2.2): rank ``i``'s worker error ``e_i`` is the residual of
  *its* compressed momentum, its server error that of the chunk it averages;
* ZeRO (``zero_stage`` 1/2): the shards of the moments and masters rank ``i`` owns;
* 0/1 Adam between two synchronisations: each rank's local momentum, accumulated update and
  parameters (its local steps used its own gradients).

A checkpoint that one rank writes and every rank loads (what the HF Trainer, accelerate's
``save_state`` and Lightning do) cannot resume the other ranks exactly unless those parts travel
in it. :func:`gather_rank_parts` (``optimizer.consolidate_state_dict(to)``, collective) brings
every rank's part to rank ``to``, whose next ``state_dict()`` carries them as
``state_dict()["compressed_opt"]["ranks"]``: a list, entry ``i`` rank ``i``'s part. Loading such
a state dict, :func:`own_part` puts the loading rank's part in place of the saver's, so every
rank resumes with exactly the state it had (same world size; with another world size the error
feedback restarts from zero, with a warning, as for any checkpoint of another rank).

DiLoCo's :meth:`compressed_opt.DiLoCo.consolidate_state_dict` gathers its ranks' records the same
way (:func:`gather_objects`).

A rank's part is ``{"rank", "buckets", "state", "params"}``: its entries of
``state_dict()["compressed_opt"]["buckets"]``, the per-parameter state the algorithm declares
per rank (``rank_state_names``), and, where the algorithm says the rank's parameters are its own
(:meth:`rank_parameters`), their values (loaded into the parameters: load the model first, then
the optimizer, as the frameworks do).
"""
from __future__ import annotations

import io
import warnings

import torch


def gather_rank_parts(engine, mine: dict, to: int) -> list[dict] | None:
    """Collective over ``engine``'s backend: every rank's part (this rank's: ``mine``) on rank ``to``
    (``None`` on the others). Each part is serialised (``torch.save``), its length all-gathered,
    and each rank's bytes broadcast from it in turn: one small all-gather and ``N - 1`` broadcasts,
    run only when a checkpoint is taken."""
    return gather_objects(engine.backend, engine.device, mine, to)


def gather_objects(backend, device, mine, to: int) -> list | None:
    """Collective over ``backend``: every rank's ``mine`` (nested dicts, lists and tuples of
    tensors and plain values) on rank ``to``, on the CPU (``None`` on the others); see
    :func:`gather_rank_parts`."""
    world, rank = backend.world_size, backend.rank
    if world == 1:
        return [mine]
    payload = _serialise(mine)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    backend.all_gather(lengths, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    lengths = lengths.cpu().tolist()
    parts: list[dict | None] = [None] * world
    parts[rank] = mine if rank == to else None
    for src in range(world):
        if src == to:
            continue
        buf = payload.to(device) if src == rank else torch.empty(lengths[src], dtype=torch.uint8, device=device)
        backend.broadcast(buf, src=src)
        if rank == to:
            parts[src] = torch.load(io.BytesIO(buf.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
    return parts if rank == to else None


def _serialise(part) -> torch.Tensor:
    """``part`` as one uint8 tensor (``torch.save`` of its CPU copy)."""
    out = io.BytesIO()
    torch.save(_on_cpu(part), out)
    return torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)


def _on_cpu(obj):
    """``obj`` with every tensor copied to the CPU (dicts, lists and tuples followed)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_cpu(v) for v in obj)
    return obj


def own_part(engine, state_dict):
    """``(state_dict, params)``: a consolidated state dict (validated: see
    ``compressed_opt.checkpoint``) with the loading rank's part in place of the saver's, and the
    parameter values of that part (``{index: tensor}``, possibly empty). A state dict without
    parts, or of another world size (then: a warning, the parts dropped), is returned as it is."""
    extra = state_dict["compressed_opt"]
    parts = extra.get("ranks")
    if parts is None:
        return state_dict, {}
    backend = engine.backend
    extra = {k: v for k, v in extra.items() if k != "ranks"}
    if extra["world_size"] != backend.world_size:
        warnings.warn(
            f"{engine.name}: the checkpoint holds the state of {extra['world_size']} ranks and is loaded "
            f"on {backend.world_size}: each rank's error-feedback buffers were reset to zero (momentum, variance and "
            "stage were kept)",
            RuntimeWarning,
            stacklevel=5,
        )
        extra["buckets"] = [{"numel": e["numel"]} for e in extra["buckets"]]
        return {**state_dict, "compressed_opt": extra}, {}
    part = parts[backend.rank]
    extra["rank"] = backend.rank
    extra["buckets"] = part["buckets"]
    state = {k: dict(v) for k, v in state_dict["state"].items()}
    for index, entries in part["state"].items():
        state.setdefault(index, {}).update(entries)
    return {**state_dict, "state": state, "compressed_opt": extra}, dict(part["params"])
