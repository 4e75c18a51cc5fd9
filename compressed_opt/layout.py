"""Where an optimizer's state lives: replicated on every rank, or sharded ZeRO-style by the
compressed allreduce's server chunks. One object, chosen once when the optimizer is made
(``optimizer.layout``), answers every question whose answer depends on that; ``step()`` and the
optimizers call it and never ask which layout it is.

:class:`Layout` is the interface, :class:`Replicated` (``zero_stage=0``, and every optimizer that
is not sharded) the layout of whole buffers on every rank, :class:`compressed_opt.zero.Sharded`
(``zero_stage=1``) and :class:`compressed_opt.zero.ShardedGradients` (``zero_stage=2``) the sharded
one; :func:`compressed_opt.zero.for_stage` picks one.

Every method takes the optimizer (the layout keeps nothing of its own, so copies and pickles of
the optimizer carry it as it is) and, where it concerns one bucket, the bucket.
"""
from __future__ import annotations

import torch

from .buckets import Bucket


class Layout:
    """The operations whose answer depends on where the state lives."""

    #: the ``zero_stage`` this layout stands for
    stage: int
    #: whether each rank holds only its chunk of the state (then the 1-bit exchange is flat: its
    #: server chunks are the shards)
    sharded: bool

    # --- checks, once -----------------------------------------------------------------------------
    def declare_buffers(self, opt) -> None:
        """Set the optimizer's bucket buffers for this layout (:mod:`compressed_opt.buffers`)."""
        raise NotImplementedError

    def check_options(self, opt, path: str, hierarchy: str) -> None:
        """Raise ``ValueError`` for a ``path`` or ``hierarchy`` this layout cannot take."""
        raise NotImplementedError

    def check_rebuild(self, opt) -> None:
        """Raise if the state cannot follow the parameters into new buckets."""
        raise NotImplementedError

    def checkpoint_problem(self, opt, rank: int, world: int, consolidated: bool) -> str | None:
        """Why a checkpoint saved by rank ``rank`` of ``world`` cannot be loaded here (``None``:
        it can)."""
        raise NotImplementedError

    def check_ddp(self, opt) -> None:
        """Raise ``ValueError`` if the optimizer cannot drive a ``DistributedDataParallel`` model."""
        raise NotImplementedError

    # --- the gradients ----------------------------------------------------------------------------
    def grad_buffer(self, opt, bucket: Bucket) -> torch.Tensor:
        """The bucket's flat fp32 gradient workspace (``bucket.numel`` elements)."""
        raise NotImplementedError

    def average(self, opt, bucket: Bucket, grad: torch.Tensor) -> None:
        """The full-precision average of the bucket's gradients, in place (collective)."""
        raise NotImplementedError


class Replicated(Layout):
    """Every rank holds the whole state of every bucket."""

    stage = 0
    sharded = False

    def declare_buffers(self, opt):
        pass  # the optimizer class's own table

    def check_options(self, opt, path, hierarchy):
        pass

    def check_rebuild(self, opt):
        pass

    def checkpoint_problem(self, opt, rank, world, consolidated):
        return None  # another rank's or world size's error feedback is dropped on load (warned)

    def check_ddp(self, opt):
        pass

    def grad_buffer(self, opt, bucket):
        return bucket.flat("grad")

    def average(self, opt, bucket, grad):
        opt.backend.all_reduce(grad, op="avg")
