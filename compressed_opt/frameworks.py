"""Checkpoints under the training frameworks: consolidating where they save from one rank.

Each framework saves the optimizer from one rank and, on resume, loads that file on every rank.
For the file to hold every rank's own state (:mod:`compressed_opt.consolidate`), every rank must
call ``consolidate_state_dict()`` before the saving rank calls ``state_dict()``:

* **Lightning** (``Trainer`` and Fabric) calls ``optimizer.consolidate_state_dict()`` on every rank
  itself before saving, as for torch's ``ZeroRedundancyOptimizer``: nothing to do here.
* **accelerate**: ``Accelerator.save_state`` runs on every rank and calls ``state_dict()`` on each
  (rank 0 writes the file): :func:`saving_on_every_rank` recognises that call, and ``state_dict()``
  consolidates first.
* **HF transformers Trainer**: only the saving rank calls ``state_dict()``. At the first step the
  optimizer finds the Trainer that steps it (:func:`watch_trainer`) and adds a callback that
  consolidates, on every rank, at the end of each step after which the Trainer will save
  (``control.should_save``; with ``save_strategy="best"``, after each evaluation, since the save
  is decided right after it).

Both recognitions read the calling frames (function and module names, the Trainer's class),
once per save or once per optimizer; a loop that none of them matches saves each rank's own
state, as without a framework.
"""
from __future__ import annotations

import sys
import weakref

#: how far up the stack a framework's caller is looked for
_DEPTH = 12


def saving_on_every_rank() -> bool:
    """Whether ``state_dict()`` was called by accelerate's ``save_accelerator_state`` (which runs
    on every rank: ``Accelerator.save_state`` is called by every process)."""
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return False
        code, module = frame.f_code.co_name, frame.f_globals.get("__name__")
        if code == "save_accelerator_state" and module == "accelerate.checkpointing":
            return True
        frame = frame.f_back
    return False


def _is_training_loop(frame) -> bool:
    """A method of transformers' ``trainer`` module (its training loop steps the optimizer)."""
    return frame.f_globals.get("__name__") == "transformers.trainer" and frame.f_code.co_varnames[:1] == ("self",)


def _hf_trainer(obj) -> bool:
    return any(c.__name__ == "Trainer" and c.__module__ == "transformers.trainer" for c in type(obj).__mro__)


def watch_trainer(optimizer) -> None:
    """If a transformers ``Trainer`` up the stack is stepping ``optimizer``, add (once) the
    callback that consolidates before its saves."""
    frame = sys._getframe(1)
    for _ in range(_DEPTH):
        if frame is None:
            return
        # (the code's name first: reading f_locals keeps a snapshot of that frame's locals alive)
        trainer = frame.f_locals.get("self") if _is_training_loop(frame) else None
        if trainer is not None and _hf_trainer(trainer):
            handler = getattr(trainer, "callback_handler", None)
            if handler is None or any(isinstance(c, _callback_class()) and c.optimizer is optimizer
                                      for c in handler.callbacks):
                return
            trainer.add_callback(_callback_class()(optimizer))
            return
        frame = frame.f_back


_CALLBACK = None


def _callback_class():
    """The ``TrainerCallback`` (made once transformers is imported: only a Trainer needs it)."""
    global _CALLBACK
    if _CALLBACK is None:
        from transformers import TrainerCallback

        class ConsolidateBeforeSave(TrainerCallback):
            """Every rank consolidates the optimizer's per-rank state before the Trainer saves
            (only its saving rank calls ``state_dict()``)."""

            def __init__(self, optimizer):
                self._optimizer = weakref.ref(optimizer)

            @property
            def optimizer(self):
                return self._optimizer()

            def _consolidate(self, args):
                opt = self.optimizer
                if opt is not None and not getattr(args, "save_only_model", False):
                    opt.consolidate_state_dict(0)

            def on_step_end(self, args, state, control, **kwargs):
                if control.should_save:
                    self._consolidate(args)

            def on_epoch_end(self, args, state, control, **kwargs):
                if control.should_save:
                    self._consolidate(args)

            def on_evaluate(self, args, state, control, **kwargs):
                if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
                    self._consolidate(args)

        _CALLBACK = ConsolidateBeforeSave
    return _CALLBACK
