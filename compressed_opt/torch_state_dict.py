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
  (the very objects: ``torch.save`` writes them once), carried in the first parameter's state as
  ``state[first]["compressed_opt"] = {"rank<R>": (record,)}`` with ``R`` the job's rank: no two
  ranks write the same key, so DCP never keeps one rank's copy for all, and a tuple is one object
  to DCP, saved and loaded whole (its size need not match a fresh optimizer's, whose state dict is
  DCP's template on load).

:func:`unpack` (in ``load_state_dict``, under its checks, so that a rank that cannot load makes
every rank raise) rebuilds the state dict from this rank's record, or, where it is not there, from
a consolidated one (``consolidate_state_dict`` before the save: each rank takes its part), else
from the lowest rank's: the error feedback then restarts from zero (a warning); ZeRO's shards, 0/1
Adam's local state and DTensor parameters' per-shard state of another rank are refused.

**Sharded only.** A full state dict (``full_state_dict=True``) is refused at the load: torch's
load of one keeps only the keys (leaves) that the loading optimizer's own state dict holds, taking
the record apart into them (a fresh optimizer holds neither the compression stage's entries nor
error feedback), and gives every rank rank 0's values. That cannot resume the ranks' own state; it
would silently mix two states. Save sharded (DCP: the default of accelerate's FSDP2 plugin,
Lightning's ``ModelParallelStrategy`` and torchtitan), or use the optimizer's own ``state_dict()``.
``flatten_optimizer_state_dict=True`` is refused by torch at the save (its flattening takes
tensors, ints and floats only: ``NotImplementedError``), never at the resume.
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping


from .agreement import job_position
from .local_shards import is_dtensor, local_tensor

try:  # (torch builds without distributed support have no DTensor)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - every supported torch has it
    DTensor = None

#: the key of the record carrier in a parameter's state (and of the library's entry in a state dict)
CARRIER = "compressed_opt"



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
    first = next((pid for pid in positions if isinstance(state.get(pid), Mapping)), None)
    if first is not None:  # (before the first step nothing holds state: "compressed_opt" is only at the top)
        record = {"extra": sd[CARRIER], "state": rest, "params": own_params}
        state[first][CARRIER] = {f"rank{job_position(backend)[0]}": (record,)}
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
            carried.update(st.pop(CARRIER, None) or {})
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
    return _rebuilt(state_dict, _records(carried, name), rank_state_names, job_position(backend)[0], name)


def _records(carried: Mapping, name: str) -> dict[int, dict]:
    """The carrier's records by rank."""
    out = {}
    for key, value in carried.items():
        if isinstance(value, list):  # (torch's full state dict takes everything apart, tuples into lists)
            raise ValueError(
                f"{name}.load_state_dict: this state dict went through torch's full state dict "
                "(get/set_optimizer_state_dict with full_state_dict=True), which keeps of compressed_opt's record "
                "only what a fresh optimizer's state dict holds, and rank 0's values on every rank: it cannot "
                "resume the compression stage. Save and load it sharded (full_state_dict=False, through DCP), or "
                "with the optimizer's own state_dict() and load_state_dict()")
        if not (isinstance(key, str) and key.startswith("rank") and key[4:].isdigit() and isinstance(value, tuple)
                and len(value) == 1 and isinstance(value[0], Mapping)
                and {"extra", "state", "params"} <= set(value[0]) and isinstance(value[0]["extra"], Mapping)):
            raise ValueError(f"{name}.load_state_dict: the state dict's carrier of compressed_opt's entry holds "
                             f"{key!r}: a {type(value).__name__}, not a record compressed_opt wrote")
        out[int(key[4:])] = value[0]
    return out


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
            "and the optimizer holds DTensor parameters, whose per-rank state is per shard: a full state dict "
            "(full_state_dict=True) cannot resume them. Save and load it sharded (full_state_dict=False, "
            "through DCP), each rank its own")
    for i, entries in record["state"].items():
        state.setdefault(i, {}).update(entries if mine else {k: v for k, v in entries.items() if k not in per_rank})
    if not mine and "ranks" not in extra:
        lost = {k for entries in record["state"].values() for k in entries} & per_rank
        entries = extra.get("buckets", ())
        if lost or any(set(e) - {"numel", "worker_error", "server_error"} for e in entries):
            what = f"0/1 Adam's local state ({', '.join(sorted(lost))})" if lost else "ZeRO's shards"
            raise ValueError(
                f"{name}.load_state_dict: this state dict holds rank {chosen}'s {what} and not rank {here}'s. A full "
                "state dict carries every rank's own state after consolidate_state_dict() on every rank before "
                "get_optimizer_state_dict; or save it sharded (full_state_dict=False), each rank its own")
        if any("worker_error" in e for e in entries):
            warnings.warn(f"{name}: the state dict holds rank {chosen}'s error feedback and not rank {here}'s (a full "
                          "state dict without consolidate_state_dict): this rank's restarts from zero; moments, "
                          "variance and stage were kept", RuntimeWarning, stacklevel=5)
        extra["buckets"] = [{"numel": e["numel"]} for e in entries]
    own_params = dict(record["params"]) if mine else {}
    groups = [dict(g, params=[place[pid] for pid in g["params"]]) for g in state_dict["param_groups"]]
    return dict(state_dict, state=state, param_groups=groups, **{CARRIER: extra}), own_params
