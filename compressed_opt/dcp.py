"""A compressed optimizer's whole state in a ``torch.distributed.checkpoint`` (DCP) checkpoint.

torch's ``get_optimizer_state_dict`` keeps a state dict's ``state`` and ``param_groups`` only, and
``dcp.load`` fills only the entries its template (a state dict of the resuming optimizer) already
has. A compressed optimizer's checkpoint holds more, and some of it is each rank's own: the
error-feedback buffers, ZeRO's shards, 0/1 Adam's local momentum, the stage and its counters
(docs/guarantees.md, "Checkpoints"). Through torch's functions that would be lost, and the
optimizer refuses the incomplete state on load (:func:`compressed_opt.checkpoint.validate_state_dict`).
:class:`OptimizerState` carries it instead: a ``Stateful`` that DCP saves and loads beside the
model's state::

    import torch.distributed.checkpoint as dcp
    from compressed_opt.dcp import OptimizerState

    dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=path)
    ...
    state = {"model": model.state_dict(), "optim": OptimizerState(opt)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])     # the optimizer's state is loaded in place

Each rank's complete ``optimizer.state_dict()`` is one entry of the checkpoint under a key of its
own (``optim.rank<r>``, ``r`` its rank in the whole job: with HSDP or a pipeline the optimizer's
backend is one group of it), written by that rank, so the resume is bit-identical to the uninterrupted
run. The entries are serialized objects, not resharded tensors: the checkpoint is resumed on the
same world size (another raises DCP's missing-key error, or this module's world-size error), and
the replicated moments are stored once per rank.
"""
from __future__ import annotations

import io

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful


def _rank_and_world(optimizer) -> tuple[int, int]:
    """This process's rank and the job's size: the whole job's (DCP writes one checkpoint for
    every rank, and with HSDP or a pipeline the optimizer's backend is one group of it), or the
    backend's without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return optimizer.backend.rank, optimizer.backend.world_size


class OptimizerState(Stateful):
    """``optimizer``'s state for ``dcp.save`` / ``dcp.load`` (see the module doc).

    Args:
        optimizer: a :class:`~compressed_opt.optimizer.CompressedOptimizer`.
    """

    def __init__(self, optimizer):
        if not hasattr(optimizer, "comm_stats"):
            raise TypeError(f"OptimizerState takes a compressed_opt optimizer, got {type(optimizer).__name__}; "
                            "torch.optim optimizers go through torch.distributed.checkpoint.state_dict")
        self.optimizer = optimizer

    def _key(self) -> str:
        return f"rank{_rank_and_world(self.optimizer)[0]}"

    def state_dict(self) -> dict:
        """``{"world_size": W, "rank<r>": bytes}``: this rank's state dict, serialized, as one entry
        (DCP stores an entry it does not traverse as it is, under the key given). On a load, DCP
        asks for the same keys and puts what it read in their place."""
        buf = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buf)
        return {"world_size": _rank_and_world(self.optimizer)[1], self._key(): buf.getvalue()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what DCP read into the optimizer (its ``load_state_dict``, with every check)."""
        world = _rank_and_world(self.optimizer)[1]
        saved_world = state_dict.get("world_size")
        if saved_world != world:
            raise ValueError(f"this checkpoint holds the optimizer state of {saved_world} ranks, and it is loaded on "
                             f"{world}: OptimizerState resumes on the same world size (docs/guarantees.md)")
        data = state_dict[self._key()]
        if not isinstance(data, (bytes, bytearray)):
            raise ValueError(f"the checkpoint's entry {self._key()!r} is not an optimizer state saved by "
                             f"OptimizerState (got {type(data).__name__})")
        self.optimizer.load_state_dict(torch.load(io.BytesIO(data), map_location="cpu", weights_only=False))
