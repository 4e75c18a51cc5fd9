"""A compressed optimizer's whole state in a ``torch.distributed.checkpoint`` (DCP) checkpoint,
resumed bit for bit on the same ranks or resharded onto another world size or mesh.

torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` take the compressed optimizers
too, sharded (:mod:`compressed_opt.torch_state_dict`: each rank's own state travels in a record of
that rank). :class:`OptimizerState` is the library's own entry, which also reshards at another
world size or on another mesh (``reshard=True``), and carries a :class:`compressed_opt.DiLoCo`.
A compressed optimizer's checkpoint holds, beside the moments, state that is each rank's own: the
error-feedback buffers, ZeRO's shards, 0/1 Adam's local momentum, the stage and its counters
(docs/guarantees.md, "Checkpoints"). :class:`OptimizerState` is a ``Stateful`` that DCP saves and
loads beside the model's state::

    import torch.distributed.checkpoint as dcp
    from compressed_opt.dcp import OptimizerState

    dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=path)
    ...
    state = {"model": model.state_dict(), "optim": OptimizerState(opt)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])     # the optimizer's state is loaded in place

A checkpoint holds two parts:

* **the moments, as tensors DCP can reshard** (``state.<i>.<name>``, ``i`` the parameter's
  position in ``param_groups``): every per-parameter buffer of the algorithm (``exp_avg``,
  ``exp_avg_sq``, 1-bit LAMB's fresh variance, 0/1 Adam's accumulator and synchronised
  parameters). A parameter of a sharded model (FSDP2, HSDP, tensor parallelism) has its state
  saved as a ``DTensor`` with the parameter's mesh and placements, a plain parameter's as a plain
  tensor (DCP writes each once). A state that differs between the ranks (0/1 Adam's local momentum
  and accumulator between synchronisations) is saved as the backend's rank 0 holds it (a broadcast
  when such a checkpoint is taken), so a resharded resume starts every rank from one replica's;
* **each rank's own part** (``rank<r>``, ``r`` its rank in the whole job: with HSDP or a
  pipeline the optimizer's backend is one group of it), a serialized ``state_dict()`` without
  those tensors: the stage and its counters, the per-layer statistics, the error-feedback
  buffers, ZeRO's shards, 0/1 Adam's local state.

:class:`compressed_opt.DiLoCo` goes through the same ``OptimizerState(diloco)``: each rank's whole
``state_dict()`` is its entry (the anchor, outer momentum and error buffers are that rank's, the
size of its shard under FSDP2; the inner optimizer's DTensor moments as its local tensors), and it
resumes on the same ranks and mesh, bit for bit, mid-round and with an exchange in flight.

``OptimizerState(opt)`` resumes on the same ranks: each rank reads its own part and the tensors,
and the run continues bit for bit as if it had not stopped. ``OptimizerState(opt, reshard=True)``
resumes at another world size or on another mesh: every rank reads rank 0's part and the tensors
resharded by DCP onto its own parameters (or shards); the error-feedback buffers start again from
zero (a warning says so), as after any change of the ranks (docs/guarantees.md). ZeRO's state
(``zero_stage`` 1/2) lives in the buckets' shards, not in per-parameter tensors, and is not
resharded: it resumes on the same world size. Loading without ``reshard=True`` at another world
size raises: this module's error on fewer ranks, DCP's ``Missing key ... optim.rank<r>`` on more
(DCP checks the template's keys before this module sees the checkpoint).
"""
from __future__ import annotations

import io
import warnings

import torch
from torch.distributed.checkpoint.stateful import Stateful

from . import torch_state_dict
from .agreement import job_position
from .local_shards import is_dtensor, local_tensor

try:  # (torch builds without distributed support have no DTensor)
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - every supported torch has it
    DTensor = None


def _serialize(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


class OptimizerState(Stateful):
    """``optimizer``'s state for ``dcp.save`` / ``dcp.load`` (see the module doc).

    Args:
        optimizer: a :class:`~compressed_opt.optimizer.CompressedOptimizer`.
        reshard: on a load, read rank 0's part and the moments resharded onto this optimizer's
            parameters, at any world size or mesh (the error feedback restarts from zero);
            ``False`` (default): resume each rank's own state exactly, on the same ranks and mesh.
            A save writes the same checkpoint either way.
        legacy: read (or write) the layout of compressed_opt 0.1.0 before resharding (each rank's
            whole ``state_dict()`` as one entry, no tensors): such a checkpoint loads only with
            ``legacy=True`` (without it, DCP reports ``Missing key ... optim.state.0.exp_avg``),
            on the ranks that saved it.
    """

    def __init__(self, optimizer, reshard: bool = False, legacy: bool = False):
        from .diloco import DiLoCo  # (DiLoCo drives the engine, as the optimizers do: no cycle at import)

        self._diloco = isinstance(optimizer, DiLoCo)
        if self._diloco and (reshard or legacy):
            raise ValueError("OptimizerState(DiLoCo, reshard=True / legacy=True): a DiLoCo checkpoint resumes on "
                             "the ranks and mesh that saved it; pass neither")
        if not hasattr(optimizer, "comm_stats"):
            raise TypeError(f"OptimizerState takes a compressed_opt optimizer, got {type(optimizer).__name__}; "
                            "torch.optim optimizers go through torch.distributed.checkpoint.state_dict")
        for name, value in (("reshard", reshard), ("legacy", legacy)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        if reshard and legacy:
            raise ValueError("OptimizerState(reshard=True, legacy=True): a legacy checkpoint holds no tensors to "
                             "reshard; resume it on the ranks that saved it")
        if reshard and not self._diloco and optimizer.engine.client.zero_stage:
            raise ValueError(f"OptimizerState(reshard=True) with {type(optimizer).__name__}(zero_stage="
                             f"{optimizer.engine.client.zero_stage}): ZeRO's state lives in the buckets' shards and "
                             "is not resharded; resume it on the same world size with OptimizerState(optimizer)")
        self.optimizer = optimizer
        self.reshard = reshard
        self.legacy = legacy

    # --- the parameters, as the checkpoint's tensors lay them out ------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _as_saved(self, p, local: torch.Tensor) -> torch.Tensor:
        """``local`` (state of ``p``'s shape) as the checkpoint holds it: a DTensor laid out as the
        model's parameter for the shard of a DTensor parameter, else as it is."""
        if not is_dtensor(p):
            return local
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())

    def _tensor_names(self) -> tuple[str, ...]:
        return self.optimizer.engine.client.tensor_names()

    # --- Stateful ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The entries DCP saves, or, on a load, the template DCP fills: ``world_size``, this rank's
        own part (``rank<r>``; rank 0's with ``reshard=True``) and the per-parameter tensors
        ``state.<i>.<name>``. Collective (0/1 Adam between synchronisations: a broadcast)."""
        opt = self.optimizer
        rank, world = job_position(opt.backend)
        if self._diloco:
            from .diloco import rank_record
            return {"world_size": world, f"rank{rank}": _serialize(rank_record(opt))}
        # (as this rank holds it: no carrier for torch's state_dict API, no DTensors; those are made below)
        sd, _ = torch_state_dict.unpack(opt.state_dict(), (), opt.backend, type(opt).__name__)
        if self.legacy:
            return {"world_size": world, f"rank{rank}": _serialize(sd)}
        params = self._params()
        positions = [pid for g in sd["param_groups"] for pid in g["params"]]
        # a state that differs between the ranks (0/1 Adam between synchronisations): the backend's
        # rank 0's on every rank, so that the tensors are one replica's whichever rank DCP has write
        # them (every rank is here, in the same order: dcp.save and dcp.load are collective)
        algorithm = opt.engine.client  # (its declared state: compressed_opt.optimizer.Algorithm)
        own_values = algorithm.rank_parameters()
        tensors, present = {}, {}
        for i, (pid, p) in enumerate(zip(positions, params)):
            st = sd["state"].get(pid, {})
            names = [n for n in self._tensor_names() if n in st]
            if names:
                present[i] = names
            for name in self._tensor_names():
                value = st.get(name)
                local = value.detach() if value is not None else torch.zeros_like(local_tensor(p), dtype=torch.float32)
                if own_values and name in algorithm.rank_state_names and opt.backend.world_size > 1:
                    local = local.clone()
                    opt.backend.broadcast(local, src=0)
                tensors[f"state.{i}.{name}"] = self._as_saved(p, local)
        own = dict(sd, state={pid: {k: v for k, v in st.items()
                                    if k not in self._tensor_names() or k in algorithm.rank_state_names}
                              for pid, st in sd["state"].items()})
        part = {"state_dict": own, "present": present,
                "local_shapes": [tuple(local_tensor(p).shape) for p in params]}
        return {"world_size": world, f"rank{0 if self.reshard else rank}": _serialize(part), **tensors}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what DCP read into the optimizer (its ``load_state_dict``, with every check). A
        checkpoint this rank cannot load raises on every rank."""
        problem, sd = None, None
        try:
            sd = self._state_dict_from(state_dict)
        except ValueError as exc:
            problem = exc
        except Exception as exc:  # noqa: BLE001 - a damaged entry (torch.load's errors): every rank must hear of it
            problem = ValueError(f"this rank's entry of the checkpoint could not be read ({type(exc).__name__}: {exc})")
            problem.__cause__ = exc
        _agree(self.optimizer, problem)
        self.optimizer.load_state_dict(sd)

    def _state_dict_from(self, state_dict: dict) -> dict:
        """The optimizer's state dict, from DCP's entries (``ValueError`` if they cannot make it)."""
        opt = self.optimizer
        rank, world = job_position(opt.backend)
        key = f"rank{0 if self.reshard else rank}"
        saved_world = state_dict.get("world_size")
        if not self.reshard and saved_world != world:
            raise ValueError(f"this checkpoint holds the optimizer state of {saved_world} ranks, and it is loaded on "
                             f"{world}: OptimizerState(optimizer) resumes on the same ranks; load it with "
                             "OptimizerState(optimizer, reshard=True) to reshard the moments (the error feedback "
                             "restarts from zero; docs/guarantees.md)")
        data = state_dict.get(key)
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"the checkpoint's entry {key!r} is not an optimizer state saved by "
                             f"OptimizerState (got {type(data).__name__})")
        part = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        if self._diloco:
            if not isinstance(part, dict) or "diloco" not in part:
                raise ValueError(f"the checkpoint's entry {key!r} is not a DiLoCo state saved by OptimizerState")
            return part  # (a record, which DiLoCo.load_state_dict reads: compressed_opt.diloco.rank_record)
        if self.legacy:
            if not isinstance(part, dict) or "compressed_opt" not in part:
                raise ValueError(f"the checkpoint's entry {key!r} is not a legacy OptimizerState entry (one state "
                                 "dict per rank): load it without legacy=True")
            return part
        if not isinstance(part, dict) or "state_dict" not in part:
            raise ValueError(f"the checkpoint's entry {key!r} is a legacy OptimizerState entry (one state dict per "
                             "rank): load it with OptimizerState(optimizer, legacy=True)")
        params = self._params()
        if not self.reshard and part["local_shapes"] != [tuple(local_tensor(p).shape) for p in params]:
            raise ValueError("the parameters here are sharded otherwise than when this checkpoint was saved (another "
                             "mesh, or another model): OptimizerState(optimizer) resumes on the same ranks and mesh; "
                             "load it with OptimizerState(optimizer, reshard=True)")
        sd = part["state_dict"]
        positions = [pid for g in sd["param_groups"] for pid in g["params"]]
        if len(positions) != len(params):
            raise ValueError(f"this checkpoint holds the state of {len(positions)} parameters, this optimizer has "
                             f"{len(params)}")
        state = {pid: dict(st) for pid, st in sd["state"].items()}
        for i, names in part["present"].items():
            st = state.setdefault(positions[i], {})
            for name in names:
                if self.reshard or name not in st:
                    value = state_dict[f"state.{i}.{name}"]
                    st[name] = value.to_local() if DTensor is not None and isinstance(value, DTensor) else value
        sd = dict(sd, state=state)
        return self._resharded(sd) if self.reshard else sd

    def _resharded(self, sd: dict) -> dict:
        """Rank 0's state dict, made this rank's: its own parts (error feedback, the saver's place
        and paths) dropped, with a warning where they held error feedback."""
        opt = self.optimizer
        extra = dict(sd["compressed_opt"])
        if any("worker_error" in e for e in extra["buckets"]):
            warnings.warn(
                f"{type(opt).__name__}: resharded from a checkpoint of {extra['world_size']} rank(s): the "
                "error-feedback buffers (worker and server error) start again from zero; moments, variance and "
                "stage were kept",
                RuntimeWarning,
                stacklevel=3,
            )
        extra.pop("ranks", None)
        shards = None if extra.get("shards") is None else list(job_position(opt.backend))
        extra.update(rank=opt.backend.rank, world_size=opt.backend.world_size, averaging=None, paths={},
                     buckets=[], shards=shards)
        return dict(sd, compressed_opt=extra)


def _agree(optimizer, problem: ValueError | None) -> None:
    """Raise ``problem`` here, and an error on every other rank of the optimizer's backend, if any
    of them has one (a rank that raised alone would leave the others waiting in the optimizer's
    load, whose checks are collective over the backend; DCP's own group may be larger, or, with
    ``dcp.load(process_group=...)``, another)."""
    backend = optimizer.backend
    if backend.world_size > 1:
        device = optimizer.engine.device
        flags = torch.empty(backend.world_size, dtype=torch.int64, device=device)
        backend.all_gather(flags, torch.tensor([0 if problem is None else 1], dtype=torch.int64, device=device))
        if problem is None and bool(flags.any()):
            raise ValueError("OptimizerState: another rank could not load its part of this checkpoint (its error "
                             "says why); no rank loaded it")
    if problem is not None:
        raise problem
