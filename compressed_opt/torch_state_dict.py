"""The optimizer's state dict through torch's distributed state_dict API
(``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
``set_optimizer_state_dict``), as FSDP2 users, accelerate, Lightning and torchtune checkpoint.

torch's functions keep two keys of a state dict, ``state`` (renamed by parameter name) and
``param_groups``, and pass each parameter's state on as it is: a tensor of a DTensor parameter
must be a DTensor (DCP saves each rank's shard and reshards on load), a plain tensor is one
replica's (DCP keeps one rank's copy of a key). ``"compressed_opt"`` would be dropped, and what is
each rank's own (error feedback, ZeRO's shards, 0/1 Adam's local state) kept from one rank only.
So ``state_dict()`` (:func:`publish`):

* gives the ``STATE`` buffers (moments: the parameter's shape) of a DTensor parameter as
  DTensors laid out as the parameter, as torch's AdamW under FSDP2 does;
* puts what is not a ``STATE`` buffer or is each rank's own in a *record* of this rank,
  ``{"extra": state_dict["compressed_opt"], "state": {position: those entries}, "params": {...}}``
  (the very objects), carried in the first parameter's state as
  ``state[first]["compressed_opt"] = {"rank<R>": RankRecord(R, record)}`` with ``R`` the job's
  rank: no two ranks write the same key, so DCP never keeps one rank's copy for all. A
  :class:`RankRecord` is an ``int`` to torch's flattening (``flatten_optimizer_state_dict=True``
  takes tensors, ints, floats and dicts) and one object to DCP, saved and loaded whole (its size
  need not match a fresh optimizer's, whose state dict is DCP's template on load).

The optimizer's live state names the carrier: ``optimizer.state[first]["compressed_opt"]`` holds
the job rank (:func:`hold_carrier`), because torch's load of a flattened state dict (and
torchtitan's own) rebuilds a parameter's state from the names its live state holds.

:func:`unpack` (in ``load_state_dict``, under its checks, so that a rank that cannot load makes
every rank raise) rebuilds the state dict from this rank's record, or, where it is not there, from
a consolidated one (``consolidate_state_dict`` before the save: each rank takes its part), else
from the lowest rank's: the error feedback then restarts from zero (a warning); ZeRO's shards, 0/1
Adam's local state and DTensor parameters' per-shard state of another rank are refused.

**Full state dicts** (``full_state_dict=True``): torch gathers the DTensor moments and keeps the
rest as each rank has it, so every rank's full state dict holds its own record. Saved through DCP
by every rank, each rank loads its own. Saved by rank 0 alone (``torch.save``), it holds rank 0's
record, which carries every rank's part after ``consolidate_state_dict()``; torch's load merges
it into the loading optimizer's own state dict, whose record of this rank, of another step, is
left out (:func:`_without_template`). torch's load of a full state dict needs a tensor in the
optimizer's own state dict to take the device from, which ZeRO's (moments in its record) has
not: torch raises there (``AssertionError: Expected device to be set``). Flattened and full
together fail in torch 2.13 for its own AdamW too (``KeyError``).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from .agreement import job_position
from .local_shards import is_dtensor, local_tensor

try:  # (torch builds without distributed support have no DTensor)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - every supported torch has it
    DTensor = None

#: the key of the record carrier in a parameter's state (and of the library's entry in a state dict)
CARRIER = "compressed_opt"


class RankRecord(int):
    """One rank's record as a value of a state dict: an ``int`` (the job rank ``R``) that holds
    the record (a dict: tensors, strings, lists, ...) in its ``record`` attribute.

    Why an ``int``: torch's flattened optimizer state dicts
    (``flatten_optimizer_state_dict=True``, torchtitan's) take tensors, ints, floats and dicts
    only, and check the type with ``isinstance``; DCP saves any value that is not a tensor whole
    (pickled) and loads it whole, whatever the loading state dict holds at that key; a tensor
    would have to match the template's size, which a fresh optimizer cannot know.

    Pickled (DCP, ``torch.save``), it is :func:`rank_record` of its rank and record: the record's
    tensors are written as tensors, once with the state dict's other references to them. The
    function is registered with ``torch.serialization.add_safe_globals`` when compressed_opt is
    imported, so ``torch.load(weights_only=True)`` reads a checkpoint holding one in a process that
    imported compressed_opt; elsewhere torch's error names it (``import compressed_opt`` first:
    Lightning loads a checkpoint before ``configure_optimizers``)."""

    def __new__(cls, rank: int, record: dict):
        obj = super().__new__(cls, rank)
        obj.record = record
        return obj

    def __reduce__(self):
        return rank_record, (int(self), self.record)

    def __repr__(self) -> str:
        return f"RankRecord(rank={int(self)})"

    __str__ = __repr__


def rank_record(rank: int, record: dict) -> RankRecord:
    """:class:`RankRecord` ``rank``'s ``record`` (what a pickled one is made again by)."""
    return RankRecord(rank, record)


torch.serialization.add_safe_globals([rank_record])


def record_in(value):
    """The record a carrier value holds: a :class:`RankRecord`'s, or the one-tuple of checkpoints
    written before it (compressed_opt through stop 54); ``None`` for anything else."""
    if isinstance(value, RankRecord):
        return getattr(value, "record", None)
    if isinstance(value, tuple) and len(value) == 1:
        return value[0]
    return None


def hold_carrier(state, param_groups: list, backend) -> None:
    """``state[first]["compressed_opt"] = R`` (the job rank) in the optimizer's live ``state``,
    ``first`` the first trainable parameter of ``param_groups`` that holds state: the key under
    which :func:`publish` carries this rank's record. torch's load of a flattened state dict
    (``flatten_optimizer_state_dict=True``) rebuilds a parameter's state from the names its live
    state holds, and would drop the record otherwise; it skips a frozen parameter's state. (torch's
    LBFGS likewise keeps its own state in its first parameter's.) A number, as the state's other
    entries are tensors and numbers: code that walks ``optimizer.state`` converting values to
    tensors keeps working."""
    first = next((p for g in param_groups for p in g["params"] if p.requires_grad and p in state), None)
    if first is not None and CARRIER not in state[first]:
        state[first][CARRIER] = job_position(backend)[0]


def without_carrier(state: Mapping) -> dict:
    """A packed ``state`` (by position) without :func:`hold_carrier`'s entry, which only names a key."""
    return {pid: {k: v for k, v in st.items() if k != CARRIER} if isinstance(st, Mapping) and CARRIER in st else st
            for pid, st in state.items()}


def publish(sd: dict, params: list, tensor_names: tuple, rank_state_names: tuple, own_params: dict,
            backend) -> dict:
    """``sd`` (a state dict with ``"compressed_opt"``; ``params`` the optimizer's parameters in its
    order) as torch's state_dict API needs it (see the module doc). The parameters' state dicts are
    new dicts: ``sd["state"]`` shared them with ``optimizer.state``."""
    positions = [pid for g in sd["param_groups"] for pid in g["params"]]
    param_of = dict(zip(positions, params))
    index_of = {pid: i for i, pid in enumerate(positions)}
    state, rest = {}, {}
    for pid, st in sd["state"].items():
        p = param_of.get(pid)
        if p is None or not isinstance(st, Mapping):  # (an entry a state-dict hook added: as it is)
            state[pid] = st
            continue
        own = {k: v for k, v in st.items() if k not in tensor_names or k in rank_state_names}
        if own:
            rest[index_of[pid]] = own
        state[pid] = {k: v if not is_dtensor(p) else DTensor.from_local(
                          v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                      for k, v in st.items() if k in tensor_names}
    # (the first trainable parameter with state, as hold_carrier's: torch's loads skip a frozen one's)
    first = next((pid for pid in positions if isinstance(state.get(pid), Mapping) and param_of[pid].requires_grad),
                 None)
    if first is not None:  # (before the first step nothing holds state: "compressed_opt" is only at the top)
        record = {"extra": sd[CARRIER], "state": rest, "params": own_params}
        rank = job_position(backend)[0]
        state[first][CARRIER] = {f"rank{rank}": RankRecord(rank, record)}
    sd["state"] = state
    return sd


def unpack(state_dict: Mapping, rank_state_names: tuple, backend, name: str) -> tuple[Mapping, dict]:
    """``(state dict, own parameters)``: ``state_dict`` with its carrier removed and every DTensor
    value as its local tensor; where it lacks ``"compressed_opt"`` (torch's API dropped it),
    rebuilt from a record (see the module doc), keyed by position. A state dict without a carrier
    is returned as it is (the checks then say what is wrong with it)."""
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(state, Mapping):
        return state_dict, {}
    carried, converted, clean = {}, False, {}
    for pid, st in state.items():
        if isinstance(st, Mapping) and (CARRIER in st or any(is_dtensor(v) for v in st.values())):
            st = dict(st)
            value = st.pop(CARRIER, None)
            carried.update(value if isinstance(value, Mapping) else {})  # (a live state's: the rank only)
            for k, v in st.items():
                if is_dtensor(v):
                    st[k], converted = local_tensor(v), True
        clean[pid] = st
    if not carried and not converted:
        return state_dict, {}
    state_dict = dict(state_dict, state=clean)
    if not carried:
        return state_dict, {}
    if CARRIER in state_dict:  # (as state_dict() made it: its own record holds the other entries)
        return _with_record(state_dict, _records(carried, name), name), {}
    here = job_position(backend)[0]
    return _rebuilt(state_dict, _without_template(_records(carried, name), here), rank_state_names, here, name)


def _records(carried: Mapping, name: str) -> dict[int, dict]:
    """The carrier's records by rank."""
    out = {}
    for key, value in carried.items():
        if isinstance(value, list):  # (torch's full state dict took a record of before RankRecord apart)
            raise ValueError(
                f"{name}.load_state_dict: this state dict was saved by an earlier compressed_opt through torch's "
                "full state dict (full_state_dict=True), which took its record apart: it cannot resume the "
                "compression stage. Load it sharded (full_state_dict=False, through DCP), or save it again")
        ranked = isinstance(key, str) and key.startswith("rank") and key[4:].isdigit()
        record = record_in(value) if ranked else None
        if not (isinstance(record, Mapping) and {"extra", "state", "params"} <= set(record)
                and isinstance(record["extra"], Mapping)):
            raise ValueError(f"{name}.load_state_dict: the state dict's carrier of compressed_opt's entry holds "
                             f"{key!r}: a {type(value).__name__}, not a record compressed_opt wrote")
        out[int(key[4:])] = record
    return out


def _without_template(records: dict[int, dict], here: int) -> dict[int, dict]:
    """``records`` less this rank's where it is the loading optimizer's own. torch's load of a full
    state dict (``full_state_dict=True``) merges it into the loading optimizer's own state dict:
    where the full one lacks this rank's record (one rank saved it), the merge holds this rank's
    record of the loading optimizer, of another step than the saved ones."""
    mine = records.get(here)
    steps = {r["extra"].get("global_step") for rank, r in records.items() if rank != here}
    if mine is None or not steps or mine["extra"].get("global_step") in steps:
        return records
    return {rank: r for rank, r in records.items() if rank != here}


def _with_record(state_dict: dict, records: dict[int, dict], name: str) -> dict:
    """A whole state dict (``"compressed_opt"`` at the top) with its record's entries put back in the
    parameters' state (the state dict's own keys: positions name them)."""
    top = state_dict[CARRIER]
    record = next((r for r in records.values() if r["extra"] is top), None)
    if record is None and len(records) == 1:
        record = next(iter(records.values()))
    if record is None:
        raise ValueError(f"{name}.load_state_dict: the state dict holds the records of ranks {sorted(records)} and "
                         "none is its own: not a state dict compressed_opt wrote")
    positions = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    state = dict(state_dict["state"])
    for i, entries in record["state"].items():
        pid = positions[i] if isinstance(i, int) and 0 <= i < len(positions) else i
        state[pid] = {**state.get(pid, {}), **entries}
    return dict(state_dict, state=state)


def _chosen(records: dict[int, dict], here: int) -> int:
    """The rank whose record this rank loads: its own, else a consolidated one, else the lowest rank's."""
    if here in records:
        return here
    return next((r for r in sorted(records) if "ranks" in records[r]["extra"]), min(records))


def _rebuilt(state_dict: dict, records: dict[int, dict], rank_state_names: tuple, here: int,
             name: str) -> tuple[dict, dict]:
    """The state dict of the chosen record (see the module doc), keyed by position."""
    chosen = _chosen(records, here)
    record = records[chosen]
    extra = dict(record["extra"])
    positions = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    place = {pid: i for i, pid in enumerate(positions)}
    state = {place.get(pid, pid): dict(st) for pid, st in state_dict["state"].items()}
    mine, per_rank = chosen == here, set(rank_state_names)
    if not mine and extra.get("shards") is not None:
        raise ValueError(
            f"{name}.load_state_dict: this state dict holds the record of rank {chosen} and not of rank {here}, "
            "and the optimizer holds DTensor parameters, whose per-rank state is per shard: one rank's state dict "
            "cannot resume the others. Save it through DCP on every rank (sharded, flattened or full: each rank "
            "writes its own record)")
    for i, entries in record["state"].items():
        state.setdefault(i, {}).update(entries if mine else {k: v for k, v in entries.items() if k not in per_rank})
    if not mine and "ranks" not in extra:
        lost = {k for entries in record["state"].values() for k in entries} & per_rank
        entries = extra.get("buckets", ())
        if lost or any(set(e) - {"numel", "worker_error", "server_error"} for e in entries):
            what = f"0/1 Adam's local state ({', '.join(sorted(lost))})" if lost else "ZeRO's shards"
            raise ValueError(
                f"{name}.load_state_dict: this state dict holds rank {chosen}'s {what} and not rank {here}'s. One "
                "rank's state dict carries every rank's own state after consolidate_state_dict() on every rank "
                "before get_optimizer_state_dict; or save it through DCP on every rank, each its own record")
        if any("worker_error" in e for e in entries):
            warnings.warn(f"{name}: the state dict holds rank {chosen}'s error feedback and not rank {here}'s (one "
                          "rank's state dict without consolidate_state_dict): this rank's restarts from zero; moments, "
                          "variance and stage were kept", RuntimeWarning, stacklevel=5)
        extra["buckets"] = [{"numel": e["numel"]} for e in entries]
    own_params = dict(record["params"]) if mine else {}
    groups = [dict(g, params=[place[pid] for pid in g["params"]]) for g in state_dict["param_groups"]]
    return dict(state_dict, state=state, param_groups=groups, **{CARRIER: extra}), own_params
