"""A compressed optimizer's checkpoints and copies: what a state dict holds, its strict checks
before anything is loaded and the ranks' agreement on them, the load, ``copy.deepcopy`` and pickling.

What ``state_dict()`` holds: torch's ``state`` and ``param_groups``, plus ``"compressed_opt"``
(:func:`with_extra`): the format version, the algorithm, ``global_step``, the saving rank and world
size, per bucket its ``SAVED`` buffers (every part's, as declared: error feedback, ZeRO's shards;
:mod:`compressed_opt.state`), the exchange the error buffers belong to, the algorithm's stage
fields, and after ``consolidate_state_dict`` every rank's part (:mod:`compressed_opt.consolidate`).
The per-parameter ``STATE`` buffers and ``LAYER`` rows are torch's part (views in
``optimizer.state[p]``). A copy (:func:`deep_copy`, :func:`pickled`) carries the same, with the
constructor's configuration, and makes its runtime parts anew.

:func:`validate_state_dict` runs first in ``CompressedOptimizer.load_state_dict``. It checks, on
each rank, that the state dict is one this version of the library wrote for this optimizer (the
``compressed_opt`` entry and its ``format``, the keys a load reads, their types, the parameter
groups, every per-parameter buffer's shape, the bucket buffers), so that a damaged or foreign
checkpoint raises an error that names what is wrong instead of a ``KeyError`` deep in the load or,
worse, a silent broadcast of a wrongly shaped buffer.

Then, with more than one rank, one small all-gather compares what must be the same on every rank
when the run resumes: the step counter and the stage (warmup or compression, 0/1 Adam's phase and
its counters). Per-rank checkpoints of different steps would otherwise make the ranks take
different collectives (a hang) or apply different updates (silent divergence). The all-gather
also carries whether this rank's checkpoint passed the local checks, so a rank with a bad file
makes *every* rank raise rather than leaving the others waiting: either every rank loads, or none
does. Hence every rank must call ``load_state_dict`` (as resuming a data-parallel run does anyway).
"""
from __future__ import annotations

import copy
import hashlib
import numbers
import struct
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compressed_opt.comm import Backend, chunk_numel, get_backend, row_bytes

from . import consolidate, state, torch_state_dict
from . import variance_tracking as tracking
from .exchange import error_sizes_of

#: the version of the ``state_dict()["compressed_opt"]`` layout this library writes
FORMAT = 3
#: the versions a load reads, migrated on load (:func:`upgrade`): format 1 (before one 1-bit scale
#: per block, ``scale_block``: ZeRO's momentum rows then carried one scale per row) and format 2
#: (before the tracked exchange, docs/design.md 2.3.3: error buffers and ZeRO's rows made with
#: exchange factors of 1)
READABLE = (1, 2, 3)
#: keys of ``state_dict()["compressed_opt"]`` that every checkpoint has
REQUIRED_KEYS = ("format", "algorithm", "global_step", "rank", "world_size", "buckets")
#: keys of an optimizer's ``_extra_state()`` that a load reads with a default (not required)
_OPTIONAL_EXTRA = frozenset({"freeze_rule", "last_step_kind", "exchange", "variance_tracking", "ranks", "paths"})
#: keys that differ between the ranks of one run by design (not compared across ranks)
_PER_RANK = frozenset({"rank", "buckets", "ranks", "freeze_rule", "format", "world_size", "algorithm"})


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this optimizer (a ``ValueError``)."""


@dataclass(frozen=True)
class Schema:
    """What a checkpoint of one optimizer holds beyond torch's state dict, from its algorithm's
    declarations, and what the checks compare it with."""

    name: str
    engine: object
    algorithm: object
    param_groups: list
    #: the per-parameter whole-bucket buffers (``STATE``) and per-layer rows (``LAYER``: name -> width)
    tensor_names: tuple
    layer_state: dict
    #: the per-parameter state that is each rank's own
    rank_state_names: tuple
    #: the algorithm's stage fields (what a load must read)
    stage_fields: tuple

    @property
    def backend(self):
        return self.engine.backend

    @property
    def scale_block(self) -> int:
        return self.engine.scale_block


def schema_of(engine, algorithm) -> Schema:
    """The :class:`Schema` of the optimizer that holds ``engine`` and ``algorithm``."""
    return Schema(engine.name, engine, algorithm, engine.param_groups, algorithm.tensor_names(),
                  algorithm.layer_state(), algorithm.rank_state_names, tuple(algorithm.stage_fields()))


def validate_state_dict(optimizer: Schema, state_dict) -> tuple[Mapping, dict]:
    """Raise :class:`CheckpointError` (a ``ValueError``) if ``state_dict`` cannot be loaded into
    ``optimizer`` (its :class:`Schema`), on *every* rank if it cannot be on some rank (see the
    module docstring). Returns ``(state_dict, own parameters)``: ``state_dict`` as it came through
    torch's state_dict API, unpacked (:func:`compressed_opt.torch_state_dict.unpack`)."""
    local_error, own_params = None, {}
    try:
        state_dict, own_params = torch_state_dict.unpack(state_dict, optimizer.rank_state_names, optimizer.backend,
                                                         optimizer.name)
        _check_locally(optimizer, state_dict)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the other ranks must hear of it
        local_error = exc
    backend = optimizer.backend
    if backend.world_size == 1:
        if local_error is not None:
            raise local_error
        return state_dict, own_params
    # every rank takes part, whatever its own checks said: a rank that raised here alone would
    # leave the others waiting in this all-gather
    mine = _agreement_row(state_dict if local_error is None else None)
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    everyone = torch.empty(backend.world_size * len(mine), dtype=torch.int64, device=device)
    backend.all_gather(everyone, torch.tensor(mine, dtype=torch.int64, device=device))
    rows = everyone.view(backend.world_size, -1).cpu().tolist()
    if local_error is not None:
        raise local_error
    bad = [r for r, row in enumerate(rows) if row[0] == 0]
    name = optimizer.name
    if bad:
        raise CheckpointError(
            f"{name}.load_state_dict: the checkpoint of rank(s) {', '.join(map(str, bad))} failed validation "
            "(that rank's error says why); no rank loaded its checkpoint"
        )
    steps = [row[1] for row in rows]
    stages = [row[2] for row in rows]
    if len(set(steps)) > 1 or len(set(stages)) > 1:
        per_rank = "; ".join(
            f"rank {r}: global_step {s}, {_STAGE_NAMES.get(c, c)}" for r, (s, c) in enumerate(zip(steps, stages))
        )
        raise CheckpointError(
            f"{name}.load_state_dict: the ranks' checkpoints are of different steps or stages ({per_rank}); "
            "resuming them would make the ranks diverge or wait in different collectives. Load the "
            "checkpoints that were saved at the same step, one per rank"
        )
    if len({row[3] for row in rows}) > 1:
        fields = ", ".join(sorted(_counters(state_dict["compressed_opt"])))
        raise CheckpointError(
            f"{name}.load_state_dict: the ranks' checkpoints are at the same step but their stage "
            f"counters differ (some of: {fields}); load the checkpoints of one run, saved at the same step"
        )
    return state_dict, own_params


_STAGE_NAMES = {0: "not frozen (warmup; 0/1 Adam's phase A)", 1: "frozen (compression stage; 0/1 Adam's phase B)"}


def _agreement_row(state_dict) -> list[int]:
    """``[valid, global_step, stage, hash of the other stage counters]`` of this rank."""
    if state_dict is None:
        return [0, -1, -1, 0]
    extra = state_dict["compressed_opt"]
    stage = 1 if extra.get("frozen") else 0
    digest = hashlib.sha256(repr(sorted(_counters(extra).items())).encode()).digest()
    return [1, int(extra["global_step"]), stage, struct.unpack("<q", digest[:8])[0]]


def _counters(extra: Mapping) -> dict:
    """The scalar stage fields (not ``global_step``) that must be equal on every rank."""
    return {
        k: v for k, v in extra.items()
        if k not in _PER_RANK and k not in ("global_step", "frozen") and isinstance(v, (int, str, type(None)))
    }


# --- the local checks ------------------------------------------------------------------------------
def _fail(optimizer, message: str):
    raise CheckpointError(f"{optimizer.name}.load_state_dict: {message}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_locally(optimizer, state_dict) -> None:
    name = optimizer.name
    if not isinstance(state_dict, Mapping):
        _fail(optimizer, f"expected a state dict (a dict), got {type(state_dict).__name__}")
    extra = state_dict.get("compressed_opt")
    if extra is None:
        _fail(optimizer,
              f"this state dict has no 'compressed_opt' entry: it was not saved by a {name} (to start "
              "from another optimizer's state, load its parameters and let this optimizer warm up), or it "
              "was saved through torch's get_optimizer_state_dict by an earlier compressed_opt or before the "
              "optimizer's first step (the entry then travels in the first parameter's state, "
              "compressed_opt.torch_state_dict): save and load it with compressed_opt.dcp.OptimizerState")
    if not isinstance(extra, Mapping):
        _fail(optimizer, f"state_dict['compressed_opt'] must be a dict, got {type(extra).__name__}")
    if "format" not in extra:
        _fail(optimizer, "state_dict['compressed_opt'] has no 'format' key: not a checkpoint of compressed_opt")
    fmt = extra["format"]
    if not _is_int(fmt) or fmt not in READABLE:
        _fail(optimizer,
              f"checkpoint format {fmt!r} is not one this version of compressed_opt reads "
              f"({', '.join(map(str, READABLE))}); it was written by another version, or is damaged")
    block = saved_block(extra)
    if fmt >= 2 and not (_is_int(block) and block >= 256 and block % 256 == 0):
        _fail(optimizer, f"state_dict['compressed_opt']['scale_block'] must be a multiple of 256, got {block!r}")
    missing = [k for k in REQUIRED_KEYS if k not in extra]
    if missing:
        _fail(optimizer, f"state_dict['compressed_opt'] lacks the key(s) {', '.join(map(repr, missing))}")
    if extra["algorithm"] != name:
        _fail(optimizer, f"state dict of {extra['algorithm']} given to {name}")
    step = extra["global_step"]
    if not _is_int(step) or step < 0:
        _fail(optimizer, f"global_step must be an int >= 0, got {step!r} ({type(step).__name__})")
    rank, world = extra["rank"], extra["world_size"]
    if not (_is_int(world) and world >= 1 and _is_int(rank) and 0 <= rank < world):
        _fail(optimizer, f"rank and world_size must be ints with 0 <= rank < world_size, got rank {rank!r}, "
                         f"world_size {world!r}")
    _check_extra(optimizer, extra)
    _check_param_groups(optimizer, state_dict)
    _check_param_state(optimizer, state_dict)
    _check_complete(optimizer, state_dict)
    _check_shards(optimizer, extra)
    key = _averaging_key(optimizer, extra.get("averaging"), world)
    paths = extra.get("paths", {})
    if not isinstance(paths, Mapping) or any(not (isinstance(n, str) and n.isdigit()) or p not in ("1bit", "fp32")
                                             for n, p in paths.items()):
        _fail(optimizer, f"state_dict['compressed_opt']['paths'] must map bucket sizes ('123') to '1bit' or 'fp32', "
                         f"got {paths!r}")
    _check_buckets(optimizer, extra["buckets"], world, key, block)
    consolidated = "ranks" in extra
    if consolidated:
        _check_rank_parts(optimizer, state_dict, extra["ranks"], world, key, block)
    entries = list(extra["buckets"]) + [e for part in extra.get("ranks", ()) for e in part["buckets"]]
    if block is not None and block != optimizer.scale_block and any("momentum_rows" in e for e in entries):
        _fail(optimizer, f"this checkpoint's 1-bit momentum rows (ZeRO) hold one scale per {block} elements, this "
                         f"optimizer's scale_block is {optimizer.scale_block}: resume with scale_block={block}")
    problem = optimizer.algorithm.checkpoint_problem(rank, world, consolidated)
    if problem is not None:
        _fail(optimizer, problem)


def _averaging_key(optimizer, key, world: int) -> tuple:
    """The exchange the checkpoint's error buffers belong to (``["flat", W]`` or ``["node", L,
    K]``, compressed_opt.exchange; absent: saved before the first step, flat)."""
    if key is None:
        return ("flat", world)
    ok = isinstance(key, (list, tuple)) and (
        (len(key) == 2 and key[0] == "flat" and key[1] == world)
        or (len(key) == 3 and key[0] == "node" and _is_int(key[1]) and _is_int(key[2]) and key[1] >= 1
            and key[2] >= 1 and key[1] * key[2] == world))
    if not ok:
        _fail(optimizer, f"state_dict['compressed_opt']['averaging'] must be ['flat', {world}] or ['node', L, K] with "
                         f"L K = {world}, got {key!r}")
    return tuple(key)


def _check_rank_parts(optimizer, state_dict: Mapping, parts, world: int, key: tuple, block: int | None) -> None:
    """``state_dict()["compressed_opt"]["ranks"]`` (written by ``consolidate_state_dict``): one
    part per rank, in rank order, each checked as the rank's own checkpoint would be."""
    if not isinstance(parts, (list, tuple)) or len(parts) != world:
        _fail(optimizer, f"state_dict['compressed_opt']['ranks'] must be a list of {world} per-rank parts (one per "
                         f"rank of the run that saved it), got {type(parts).__name__} of length "
                         f"{len(parts) if isinstance(parts, (list, tuple)) else '?'}")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for r, part in enumerate(parts):
        if not isinstance(part, Mapping) or set(part) != {"rank", "buckets", "state", "params"} or part["rank"] != r:
            _fail(optimizer, f"state_dict['compressed_opt']['ranks'][{r}] must be rank {r}'s part, a dict with the "
                             "keys 'rank', 'buckets', 'state' and 'params'")
        _check_buckets(optimizer, part["buckets"], world, key, block)
        for field, value in (("state", part["state"]), ("params", part["params"])):
            if not isinstance(value, Mapping):
                _fail(optimizer, f"ranks[{r}][{field!r}] must be a dict, got {type(value).__name__}")
        for i, own in part["state"].items():
            if not (_is_int(i) and 0 <= i < len(params)) or not isinstance(own, Mapping):
                _fail(optimizer, f"ranks[{r}]['state'] has an entry {i!r}, no parameter index of this optimizer")
            for field, value in own.items():
                if field not in optimizer.rank_state_names:
                    _fail(optimizer, f"ranks[{r}]['state'][{i}] has {field!r}, which is no per-rank state of "
                                     f"{optimizer.name}")
                _check_like(optimizer, f"ranks[{r}]['state'][{i}][{field!r}]", value, params[i])
        for i, value in part["params"].items():
            if not (_is_int(i) and 0 <= i < len(params)):
                _fail(optimizer, f"ranks[{r}]['params'] has an entry {i!r}, no parameter index of this optimizer")
            _check_like(optimizer, f"ranks[{r}]['params'][{i}]", value, params[i])


def _check_like(optimizer, what: str, value, param) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.shape != param.shape:
        _fail(optimizer, f"{what}: expected a floating-point tensor of shape {tuple(param.shape)}, got "
                         f"{getattr(value, 'shape', type(value).__name__)}")


def _check_extra(optimizer, extra: Mapping) -> None:
    """The algorithm's own keys (its ``stage_fields``: what a load must read)."""
    wanted = [k for k in optimizer.stage_fields if k not in _OPTIONAL_EXTRA]
    missing = [k for k in wanted if k not in extra]
    if missing:
        _fail(optimizer, f"state_dict['compressed_opt'] lacks the key(s) {', '.join(map(repr, missing))}")
    if "frozen" in wanted and not isinstance(extra["frozen"], bool):
        _fail(optimizer, f"'frozen' must be True or False, got {extra['frozen']!r}")
    for key in wanted:
        value = extra[key]
        if key.endswith(("_interval", "_counter", "_refreshes")) or key == "steps_since_sync":
            if not _is_int(value) or value < 0:
                _fail(optimizer, f"{key!r} must be an int >= 0, got {value!r}")
        elif key.endswith("freeze_step") and value is not None and (not _is_int(value) or value < 1):
            _fail(optimizer, f"{key!r} must be an int >= 1 or None, got {value!r}")


def _check_param_groups(optimizer, state_dict: Mapping) -> None:
    saved = state_dict.get("param_groups")
    if not isinstance(saved, (list, tuple)) or not all(isinstance(g, Mapping) and "params" in g for g in saved):
        _fail(optimizer, "state_dict['param_groups'] must be a list of param group dicts with 'params'")
    if len(saved) != len(optimizer.param_groups):
        _fail(optimizer, f"the checkpoint has {len(saved)} parameter group(s), this optimizer "
                         f"{len(optimizer.param_groups)}")
    for i, (s, g) in enumerate(zip(saved, optimizer.param_groups)):
        if len(s["params"]) != len(g["params"]):
            _fail(optimizer, f"parameter group {i} has {len(s['params'])} parameters in the checkpoint and "
                             f"{len(g['params'])} here")
    if not isinstance(state_dict.get("state"), Mapping):
        _fail(optimizer, "state_dict['state'] must be a dict (parameter index -> state)")


def _check_param_state(optimizer, state_dict: Mapping) -> None:
    """Every per-parameter buffer of the algorithm has its parameter's shape."""
    legacy = state_dict["compressed_opt"]["format"] < 2
    ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    place = {pid: i for i, pid in enumerate(ids)}
    for pid, st in state_dict["state"].items():
        if pid not in place:
            _fail(optimizer, f"state_dict['state'] has an entry for parameter {pid!r}, which no parameter group lists")
        i = place[pid]
        if not isinstance(st, Mapping):
            _fail(optimizer, f"the state of parameter {i} must be a dict, got {type(st).__name__}")
        for field in optimizer.tensor_names:
            if field not in st:
                continue
            value = st[field]
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                _fail(optimizer, f"state of parameter {i}, {field!r}: expected a floating-point tensor, got "
                                 f"{getattr(value, 'dtype', type(value).__name__)}")
            if tuple(value.shape) != tuple(params[i].shape):
                _fail(optimizer, f"state of parameter {i}, {field!r}: shape {tuple(value.shape)} in the checkpoint, "
                                 f"but the parameter's shape is {tuple(params[i].shape)} "
                                 f"(a checkpoint of another model?)")
        for field, width in optimizer.layer_state.items():
            value = st.get(field)
            widths = {width, tracking.LEGACY_COLUMNS} if field == "layer_variance" and legacy else {width}
            if value is not None and (not isinstance(value, torch.Tensor) or not value.is_floating_point()
                                      or value.dim() != 1 or value.shape[0] not in widths):
                _fail(optimizer, f"state of parameter {i}, {field!r}: expected a floating-point tensor of shape "
                                 f"({width},), got {getattr(value, 'shape', type(value).__name__)}")


def field_counts(state: Mapping) -> dict[str, int]:
    """Per name of a per-parameter state field, how many parameters hold it (a state dict
    records it as ``param_fields``, so that a state that lost some is found on load)."""
    counts: dict[str, int] = {}
    for st in state.values():
        if isinstance(st, Mapping):  # (a parameter's; a hook may add entries of other kinds)
            for field in st:
                counts[field] = counts.get(field, 0) + 1
    return dict(sorted(counts.items()))


def _check_complete(optimizer, state_dict: Mapping) -> None:
    """The per-parameter state holds every field it held when it was saved (``param_fields``):
    a state passed through a template that lacked some (``torch.distributed.checkpoint`` with a
    fresh optimizer's state dict, or state put back by hand) would resume with defaults in their
    place (a compression stage's coefficients made again, factors of 1) and drift from the run it
    continues, so it is refused."""
    saved = state_dict["compressed_opt"].get("param_fields")
    if saved is None:  # (a checkpoint from before the counts were recorded)
        return
    now = field_counts(state_dict["state"])
    missing = {f: n - now.get(f, 0) for f, n in saved.items() if now.get(f, 0) < n}
    if missing:
        lost = ", ".join(f"{f!r} (of {n} parameter(s))" for f, n in missing.items())
        _fail(optimizer, f"the per-parameter state is incomplete: {lost} missing, which it held when it was "
                         "saved. A state that went through torch.distributed.checkpoint with the optimizer's own "
                         "state dict as its template loses what that template lacked; save and load it with "
                         "compressed_opt.dcp.OptimizerState (docs/guarantees.md), or load the state dict as saved")


def _check_shards(optimizer, extra: Mapping) -> None:
    """A state of DTensor parameters' local shards (HSDP, tensor parallelism) loads only on the
    rank of the job that saved it: another rank holds other shards, often of the same shapes."""
    saved = extra.get("shards")
    if saved is None or not (dist.is_available() and dist.is_initialized()):
        return
    here = [dist.get_rank(), dist.get_world_size()]
    if list(saved) != here:
        _fail(optimizer, f"this checkpoint holds the parameter shards of rank {saved[0]} of {saved[1]} (DTensor "
                         f"parameters), and it is loaded on rank {here[0]} of {here[1]}: load each rank's own file")


def _check_buckets(optimizer, buckets, world: int, key: tuple, block: int | None) -> None:
    if not isinstance(buckets, (list, tuple)):
        _fail(optimizer, f"state_dict['compressed_opt']['buckets'] must be a list, got {type(buckets).__name__}")
    for j, entry in enumerate(buckets):
        if not isinstance(entry, Mapping):
            _fail(optimizer, f"bucket {j} of the checkpoint must be a dict, got {type(entry).__name__}")
        numel = entry.get("numel")
        if not _is_int(numel) or numel < 0:
            _fail(optimizer, f"bucket {j}: 'numel' must be an int >= 0, got {numel!r}")
        for field, value in entry.items():
            if field == "numel":
                continue
            if not isinstance(value, torch.Tensor):
                _fail(optimizer, f"bucket {j}, {field!r}: expected a tensor, got {type(value).__name__}")
        expected = dict(zip(("worker_error", "server_error"), error_sizes_of(key, numel)))
        for field, n in expected.items():
            if field in entry and entry[field].numel() != n:
                _fail(optimizer, f"bucket {j}, {field!r}: {entry[field].numel()} elements, expected {n} for a bucket "
                                 f"of {numel} elements on {world} ranks")
        if ("worker_error" in entry) != ("server_error" in entry):
            _fail(optimizer, f"bucket {j} has only one of 'worker_error' and 'server_error'")
        if "momentum_rows" in entry:
            n = world * _row_len(numel, world, block)
            if entry["momentum_rows"].dtype != torch.uint8 or entry["momentum_rows"].numel() != n:
                _fail(optimizer, f"bucket {j}, 'momentum_rows': expected {n} bytes (uint8) for a bucket of {numel} "
                                 f"elements on {world} ranks, got {entry['momentum_rows'].numel()}")


def saved_block(extra: Mapping) -> int | None:
    """The ``scale_block`` the checkpoint's 1-bit rows were laid out with; ``None`` for format 1
    (one scale per row)."""
    return None if extra.get("format", FORMAT) < 2 else extra.get("scale_block")


def _row_len(numel: int, world: int, block: int | None) -> int:
    """Bytes of one 1-bit row of a bucket of ``numel`` on ``world`` ranks (``block=None``: format 1)."""
    return 4 + chunk_numel(numel, world) // 8 if block is None else row_bytes(numel, world, block)


# --- older formats ---------------------------------------------------------------------------------
def upgrade(optimizer, state_dict: Mapping) -> Mapping:
    """A validated ``state_dict`` in the current format (the same object if it is). Formats 1 and
    2 were saved before the tracked exchange: their error buffers and ZeRO rows hold values of
    exchange factors 1, which ``unit_exchange_factors`` says (the optimizer carries the errors
    over at its first exchange; the rows are read with factors 1, the default). Format 1's ZeRO
    momentum rows, ``[scale | bits]`` per row, are laid out as rows of ``optimizer.scale_block``
    blocks, the row's one scale in every block's place, which decompresses to the same values; its
    variance-tracking rows gain the columns of :mod:`compressed_opt.variance_tracking` (no local
    EMA: the reference is made as format 1 made it)."""
    extra = state_dict["compressed_opt"]
    if extra["format"] == FORMAT:
        return state_dict
    if extra["format"] == 2:
        return dict(state_dict, compressed_opt=dict(extra, format=FORMAT, unit_exchange_factors=True))
    world = extra["world_size"]
    block = optimizer.scale_block

    def relaid(entries):
        out = []
        for entry in entries:
            entry = dict(entry)
            rows = entry.get("momentum_rows")
            if rows is not None:
                chunk = chunk_numel(entry["numel"], world)
                nb = (row_bytes(entry["numel"], world, block) - chunk // 8) // 4
                old = rows.view(world, 4 + chunk // 8)
                new = torch.empty(world, 4 * nb + chunk // 8, dtype=torch.uint8, device=rows.device)
                new[:, : 4 * nb] = old[:, :4].repeat(1, nb)
                new[:, 4 * nb:] = old[:, 4:]
                entry["momentum_rows"] = new.view(-1)
            out.append(entry)
        return out

    extra = dict(extra, format=FORMAT, scale_block=block, buckets=relaid(extra["buckets"]), unit_exchange_factors=True)
    if "ranks" in extra:
        extra["ranks"] = [dict(part, buckets=relaid(part["buckets"])) for part in extra["ranks"]]
    state = {}
    for pid, st in state_dict["state"].items():
        rows = st.get("layer_variance") if isinstance(st, Mapping) else None
        state[pid] = st if rows is None else dict(st, layer_variance=tracking.upgrade_rows(rows))
    return dict(state_dict, compressed_opt=extra, state=state)


# --- saving -----------------------------------------------------------------------------------------
def bucket_entries(engine) -> list[dict]:
    """Per bucket, what ``state_dict()["compressed_opt"]["buckets"]`` (and a copy) carries: its
    size and every part's ``SAVED`` buffers (loaded but not yet placed, before the first step after
    a load: as loaded)."""
    if engine._buckets is None and engine._pending_bucket_state is not None:
        return [dict(entry) for entry in engine._pending_bucket_state]
    return [{"numel": b.numel, **state.saved(b.feedback), **state.saved(b.state)} for b in engine._buckets or ()]


def state_bytes(engine) -> int:
    """Bytes of optimizer state this rank holds: every part's buffers of every bucket that are not
    workspace (:func:`compressed_opt.state.held_bytes`)."""
    return sum(state.held_bytes(b.feedback) + state.held_bytes(b.state) for b in engine._buckets or ())


def rank_part(engine, algorithm, param_groups, opt_state) -> dict:
    """What of the state is this rank's own (see :mod:`compressed_opt.consolidate`): its bucket
    entries, its per-rank per-parameter state, and its parameters where the algorithm says they are
    its own."""
    params = [p for g in param_groups for p in g["params"]]
    own = {}
    for i, p in enumerate(params):
        found = {name: opt_state[p][name] for name in algorithm.rank_state_names if name in opt_state.get(p, {})}
        if found:
            own[i] = found
    values = {i: p.detach() for i, p in enumerate(params)} if algorithm.rank_parameters() else {}
    return {"rank": engine.backend.rank, "buckets": bucket_entries(engine), "state": own, "params": values}


def with_extra(sd: dict, engine, algorithm, consolidated, local_shards) -> dict:
    """torch's state dict ``sd`` with ``"compressed_opt"`` (see the module docstring); where every
    rank's parts were gathered for this step (``consolidated``), they go with it."""
    backend = engine.backend
    sd["compressed_opt"] = {
        "format": FORMAT,
        "algorithm": engine.name,
        "global_step": engine.global_step,
        "rank": backend.rank,
        "world_size": backend.world_size,
        "buckets": bucket_entries(engine),
        "averaging": None if engine.exchange.chosen is None else list(engine.exchange.chosen.key),
        "paths": {str(n): p for n, p in sorted(engine.exchange.paths.items())},
        "scale_block": engine.scale_block,
        "param_fields": field_counts(sd["state"]),
        "shards": local_shards.position(),
        **algorithm.stage_fields(),
    }
    if consolidated is not None and consolidated[0] == engine.global_step:
        parts = list(consolidated[1])
        parts[backend.rank] = rank_part(engine, algorithm, engine.param_groups, algorithm.state)
        sd["compressed_opt"]["ranks"] = parts
    return sd


def restore_buckets(engine, entries: list[dict]) -> None:
    """A loaded checkpoint's bucket entries into the buckets just made (every part's ``SAVED``
    buffers), where they match them."""
    buckets = engine._buckets
    if not any(set(s) - {"numel"} for s in entries):
        return  # saved before any bucket held state (e.g. accelerate's prepare round trip)
    if len(entries) != len(buckets) or any(s["numel"] != b.numel for s, b in zip(entries, buckets)):
        if any(set(s) - {"numel", "worker_error", "server_error"} for s in entries):
            # (ZeRO: the shards of m, v and the masters are laid out by the buckets)
            raise ValueError(
                f"{engine.name}: the checkpoint's buckets ({[s['numel'] for s in entries]} elements) do not match "
                f"this optimizer's ({[b.numel for b in buckets]}): the sharded state cannot be placed. Resume with "
                "the same parameters and bucket_cap_mb"
            )
        warnings.warn("the checkpoint's buckets do not match this optimizer's (different parameters or "
                      "bucket_cap_mb): the error-feedback buffers were reset to zero", RuntimeWarning, stacklevel=5)
        return
    for s, b in zip(entries, buckets):
        state.restore(b.feedback, s, b.device)
        state.restore(b.state, s, b.device)


# --- loading ----------------------------------------------------------------------------------------
def prepare_load(schema: Schema, state_dict: dict) -> tuple[dict, dict, dict]:
    """``(torch's part, "compressed_opt", this rank's parameters of a consolidated part)`` of a state
    dict, checked (:func:`validate_state_dict`, on every rank), upgraded from an older format and
    with this rank's part of a consolidated one in place."""
    state_dict, carried = validate_state_dict(schema, state_dict)  # strict checks; every rank agrees or raises
    state_dict = upgrade(schema, state_dict)  # an older format, laid out as this one
    state_dict, own_params = consolidate.own_part(schema.engine, state_dict)
    own_params = own_params or carried
    extra = state_dict["compressed_opt"]
    return {k: v for k, v in state_dict.items() if k != "compressed_opt"}, extra, own_params


def finish_load(schema: Schema, opt_state, param_groups: list, plain: dict, extra: dict, own_params: dict) -> None:
    """After torch loaded ``plain`` (``state``, ``param_groups``): the per-parameter buffers as the
    algorithm keeps them (fp32, float64 rows: torch casts floating state to the parameter's dtype),
    a consolidated part's parameters, the step, the exchange's choice, the algorithm's stage; the
    buckets are made again at the next step, with the checkpoint's bucket entries where they are
    this rank's."""
    engine, algorithm = schema.engine, schema.algorithm
    # the state's keys are what the saved groups list, by position (indices, or names as torch.optim allows)
    index_to_param = dict(zip((i for g in plain["param_groups"] for i in g["params"]),
                              (p for g in param_groups for p in g["params"])))
    for idx, saved in plain.get("state", {}).items():
        p = index_to_param[idx]
        for name in schema.tensor_names:
            if name in saved:
                opt_state[p][name] = saved[name].to(device=p.device, dtype=torch.float32).clone()
        for name in schema.layer_state:
            if name in saved:
                opt_state[p][name] = saved[name].to(device=p.device, dtype=torch.float64).clone()
    with torch.no_grad():  # (0/1 Adam between synchronisations: this rank's own parameters)
        positional = [p for g in param_groups for p in g["params"]]
        for idx, values in own_params.items():  # (a consolidated part's: positions)
            positional[int(idx)].copy_(values)
    engine.global_step = int(extra["global_step"])
    # (a checkpoint from before the choice was saved: the flat exchange's buffers)
    engine.exchange.saved_key = tuple(extra.get("averaging") or ["flat", extra["world_size"]])
    engine.exchange.paths = {int(n): p for n, p in extra.get("paths", {}).items()}
    algorithm.load_stage(extra)
    engine.forget_buckets()  # (made again at the next step; the ranks are checked again)
    if extra["world_size"] == engine.backend.world_size and extra["rank"] == engine.backend.rank:
        engine._pending_bucket_state = [
            {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in entry.items()}
            for entry in extra["buckets"]]
    elif any("worker_error" in e for e in extra["buckets"]):
        warnings.warn(
            f"{engine.name}: checkpoint of rank {extra['rank']} of {extra['world_size']} loaded on "
            f"rank {engine.backend.rank} of {engine.backend.world_size}: the error-feedback buffers "
            "(worker and server error) were reset to zero; momentum, variance and stage were kept",
            RuntimeWarning, stacklevel=4,
        )


# --- copies and pickles -----------------------------------------------------------------------------
def _carried(optimizer, how: str) -> dict:
    """What a copy of ``optimizer`` carries (see :func:`deep_copy`), before it is copied."""
    engine, name = optimizer.engine, type(optimizer).__name__
    if engine.local_shards.pairs:  # (first: FSDP2's own HSDP attaches an averager too)
        raise RuntimeError(f"{how} of a {name} holding DTensor parameters (HSDP, tensor parallelism) is not "
                           "supported: they belong to the sharded model. Save state_dict() (or use "
                           "compressed_opt.dcp.OptimizerState) and load it into a new optimizer")
    if engine.averager is not None:
        raise RuntimeError(
            f"{how} of a {name} that drives a DistributedDataParallel communication hook is not "
            "supported: the hook belongs to the DDP model. Save state_dict() and load it into a new "
            "optimizer (whose first forward through the DDP model attaches it again)"
        )
    if not engine.idle:
        raise RuntimeError(
            f"{how} of a {name} between backward() and step(): this step's gradient communication "
            "has started (and may have changed the momentum and error feedback), which a copy cannot "
            "carry. Copy the optimizer between steps (after step(), before the next backward)"
        )
    return {"own": _own(optimizer), "engine": engine.carried(), "buckets": bucket_entries(engine)}


def _own(optimizer) -> dict:
    """The optimizer's own attributes a copy carries: not the runtime parts, nor methods patched
    onto the instance (an LR scheduler wraps ``step``: that wrapper would step the original), as
    torch's optimizers' copies drop them."""
    cls = type(optimizer)
    return {k: v for k, v in optimizer.__dict__.items()
            if k not in _RUNTIME and not k.startswith("_optimizer_")
            and not (callable(v) and callable(getattr(cls, k, None)))}


#: the optimizer's attributes a copy makes anew (the engine; torch's hook dictionaries; what was
#: gathered for a checkpoint)
_RUNTIME = frozenset({"engine", "_consolidated", "_local_shards", "_pending_engine", "_unpickled_place"})


def deep_copy(optimizer, memo: dict):
    """``copy.deepcopy(optimizer)``: an independent, working optimizer in the same state (see
    ``CompressedOptimizer.__deepcopy__``): the carried state deep-copied with ``memo``, a backend of
    the same kind over the same communicator."""
    copied = type(optimizer).__new__(type(optimizer))
    pending = optimizer.__dict__.get("_pending_engine")
    if pending is not None:  # (unpickled and not used yet: the copy too, made where it is first used)
        memo[id(optimizer)] = copied
        place = optimizer.__dict__.get("_unpickled_place")
        unpickled(copied, copy.deepcopy({"_copy": {**pending, "own": _own(optimizer)}, "_unpickled_place": place},
                                        memo))
        return copied
    carried = _carried(optimizer, "copy.deepcopy()")
    memo[id(optimizer)] = copied
    carried = copy.deepcopy(carried, memo)
    carried["backend"] = _backend_like(optimizer.engine.backend)
    _revive(copied, carried)
    return copied


def pickled(optimizer) -> dict:
    """``optimizer.__getstate__()``: what a copy carries, with the backend as the kind
    :func:`compressed_opt.comm.get_backend` makes again and the rank and world size it was on."""
    pending = optimizer.__dict__.get("_pending_engine")
    if pending is not None:  # (unpickled and not used yet: as it was carried)
        return {"_copy": {**pending, "own": _own(optimizer)},
                "_unpickled_place": optimizer.__dict__.get("_unpickled_place")}
    carried = _carried(optimizer, "pickling")
    backend = optimizer.engine.backend
    carried["backend_spec"] = _backend_spec(backend, type(optimizer).__name__)
    return {"_copy": carried, "_unpickled_place": (backend.rank, backend.world_size)}


def unpickled(optimizer, state: dict) -> None:
    """``optimizer.__setstate__(state)`` of a pickled optimizer: its parts as carried; its engine is
    made when first used (``optimizer.engine``), so that it may be unpickled before
    ``init_process_group``, on the rank and world size it was pickled on (else it raises)."""
    carried = state["_copy"]
    _restore_own(optimizer, carried["own"])
    optimizer.__dict__["_pending_engine"] = carried
    optimizer.__dict__["_unpickled_place"] = state.get("_unpickled_place")


def revive_pending(optimizer):
    """The engine of an unpickled optimizer, made now from what it carried (its backend made by
    ``get_backend`` on the same rank of the same world size, else ``RuntimeError``)."""
    carried = optimizer.__dict__.pop("_pending_engine")
    place = optimizer.__dict__.pop("_unpickled_place", None)
    kind, kwargs = carried.pop("backend_spec")
    backend = get_backend(kind, **kwargs)
    if place is not None and tuple(place) != (backend.rank, backend.world_size):
        optimizer.__dict__["_pending_engine"] = {**carried, "backend_spec": (kind, kwargs)}
        optimizer.__dict__["_unpickled_place"] = place
        raise RuntimeError(
            f"this {type(optimizer).__name__} was pickled on rank {place[0]} of {place[1]} and is used on rank "
            f"{backend.rank} of {backend.world_size}: its error-feedback buffers (and ZeRO shards) belong "
            "to that rank. Unpickle it on the same rank of the same world size, or move between world "
            "sizes with state_dict() / load_state_dict()"
        )
    carried["backend"] = backend
    _revive(optimizer, carried, unpickled=True)
    return optimizer.__dict__["engine"]


def _revive(optimizer, carried: dict, unpickled: bool = False) -> None:
    """A copy's runtime parts made anew from what it carried: its engine over ``carried["backend"]``
    (its buckets made at its next step, with the carried bucket entries), bound to its algorithm."""
    from .engine import GradientSync
    from .local_shards import LocalShards

    d = optimizer.__dict__
    if not unpickled:
        _restore_own(optimizer, carried["own"])
    d["_local_shards"] = LocalShards(type(optimizer).__name__)
    d["_consolidated"] = None
    algorithm = d["_algorithm"]
    engine = GradientSync.from_carried(type(optimizer).__name__, optimizer.param_groups, carried["backend"],
                                       algorithm, d["_local_shards"], carried["engine"])
    d["engine"] = engine
    algorithm.bind(optimizer.param_groups, optimizer.state, engine)
    engine._pending_bucket_state = carried["buckets"] or None
    if not engine.closed:
        engine.start()


def _restore_own(optimizer, own: dict) -> None:
    """The optimizer's own attributes as carried, through torch's ``__setstate__`` (its step hooks
    and wrapper), without the ``differentiable`` default torch adds (ours take none)."""
    had_differentiable = "differentiable" in own.get("defaults", {})
    optimizer.__dict__.update(own)
    torch.optim.Optimizer.__setstate__(optimizer, {"state": optimizer.state, "param_groups": optimizer.param_groups})
    if not had_differentiable:
        optimizer.defaults.pop("differentiable", None)


def _backend_like(backend: Backend) -> Backend:
    """A new backend of the same kind over the same communicator, for a deep copy (its own
    workspaces and byte counts); a backend of another class is shared."""
    from compressed_opt.comm import SingleProcessBackend

    kind = type(backend)
    if kind is SingleProcessBackend:
        return SingleProcessBackend()
    if kind.__name__ == "TorchBackend" and kind.__module__ == "compressed_opt.comm.torch_backend":
        return kind(group=backend.group)
    if kind.__name__ == "MPIBackend" and kind.__module__ == "compressed_opt.comm.mpi_backend":
        return kind(comm=backend.comm, cuda_aware=backend.cuda_aware)
    return backend


def _backend_spec(backend: Backend, owner: str) -> tuple[str, dict]:
    """``(kind, kwargs)`` for ``get_backend`` that makes ``backend`` again in another process;
    ``TypeError`` if none can."""
    from compressed_opt.comm import SingleProcessBackend

    kind = type(backend)
    if kind is SingleProcessBackend:
        return "single", {}
    if kind.__name__ == "TorchBackend" and kind.__module__ == "compressed_opt.comm.torch_backend":
        if backend.group is None or backend.group is dist.group.WORLD:
            return "torch", {}
    elif kind.__name__ == "MPIBackend" and kind.__module__ == "compressed_opt.comm.mpi_backend":
        if backend.comm is backend._mpi.COMM_WORLD:
            return "mpi", {"cuda_aware": backend.cuda_aware}
    raise TypeError(
        f"cannot pickle a {owner} whose backend is {backend!r}: only backends that get_backend() can make "
        "again in the loading process are pickled (single process, torch.distributed's default group, "
        "MPI's COMM_WORLD). Save state_dict() instead, or deep-copy within this process"
    )
