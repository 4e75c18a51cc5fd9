"""Checkpoints under the training frameworks: every rank consolidates before one rank saves.

A framework saves the optimizer from one rank and, on resume, loads that file on every rank. For
that file to resume every rank exactly it must hold what of the state is each rank's own (error
feedback, ZeRO shards, 0/1 Adam's local state between synchronisations:
:mod:`compressed_opt.consolidate`), so every rank must call ``optimizer.consolidate_state_dict()``
before the saving rank calls ``state_dict()``. One line per framework, through its public hooks:

* **transformers** ``Trainer``: its callback mechanism (only the Trainer's saving rank calls
  ``state_dict()``, but every rank runs the callbacks)::

      Trainer(..., optimizers=(opt, None), callbacks=[compressed_opt.integrations.ConsolidateBeforeSave()])

* **accelerate**: ``Accelerator.register_save_state_pre_hook`` (accelerate >= 0.16; the hook runs
  on every rank inside ``save_state``, before it takes the optimizers' state dicts), once per
  optimizer, after ``accelerator.prepare``::

      compressed_opt.integrations.consolidate_before_save_state(accelerator, opt)

* **Lightning** (``Trainer`` and Fabric): nothing. It calls ``optimizer.consolidate_state_dict()``
  on every rank before saving any optimizer that has it, as for torch's ``ZeroRedundancyOptimizer``.

Without the line, the optimizer cannot know that the file its state dict goes into will be loaded
on every rank, so it warns instead: ``state_dict()`` of a multi-rank job after its first step, not
consolidated, while accelerate is in use in the process (an ``Accelerator``, or a transformers
``Trainer``, which makes one) and no line above was registered for this optimizer, warns once
with :class:`UnconsolidatedCheckpointWarning`, naming the line to add (:func:`check_consolidated`).
Nothing here reads the caller's stack frames: the frameworks are recognised by public API only
(``accelerate.state.is_initialized()``), so a renamed internal cannot silently turn it off; where
that public API is missing, the warning is given anyway (it cannot tell).

Lightning's consolidation, the callback's and the hook's all target rank 0, the rank these
frameworks save from (with ``save_on_each_node=True`` on several nodes the other nodes' first
ranks save too, without the other ranks' state: warned).
"""
from __future__ import annotations

import sys
import warnings
import weakref

import torch

# (and ConsolidateBeforeSave, made when first named: see __getattr__; not in ``import *``, which
# would import transformers)
__all__ = ["consolidate_before_save_state", "check_consolidated", "UnconsolidatedCheckpointWarning"]

#: the one line to add, per framework (what the warnings name)
TRAINER_LINE = "Trainer(..., callbacks=[compressed_opt.integrations.ConsolidateBeforeSave()])"
ACCELERATE_LINE = "compressed_opt.integrations.consolidate_before_save_state(accelerator, optimizer)"
#: accelerate's first release with ``Accelerator.register_save_state_pre_hook`` (and
#: ``accelerate.state.is_initialized``)
ACCELERATE_MIN = "0.16.0"


class UnconsolidatedCheckpointWarning(UserWarning):
    """A multi-rank job under a framework that saves the optimizer from one rank took a state dict
    that holds this rank's own state only: a resume from that file would reset the other ranks'
    error feedback (and cannot place their ZeRO shards). The message names the line to add. A job
    that saves and loads one file per rank on purpose can silence it with
    ``warnings.filterwarnings("ignore", category=UnconsolidatedCheckpointWarning)``."""


#: optimizers that a framework consolidates before it saves (a line above was registered for them)
_consolidated_by_framework: weakref.WeakSet = weakref.WeakSet()
#: optimizers already warned about (once each)
_warned: weakref.WeakSet = weakref.WeakSet()


def _unwrap(optimizer):
    """The optimizer that a framework's wrapper holds (accelerate's ``AcceleratedOptimizer``
    keeps it as ``.optimizer``), down to one whose class has ``consolidate_state_dict``; the
    innermost optimizer if none has."""
    for _ in range(8):
        if hasattr(type(optimizer), "consolidate_state_dict"):
            return optimizer
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            return optimizer
        optimizer = inner
    return optimizer


def _consolidates(optimizer) -> bool:
    return callable(getattr(type(optimizer), "consolidate_state_dict", None))


# --- accelerate ------------------------------------------------------------------------------------
def consolidate_before_save_state(accelerator, optimizer):
    """Make ``accelerator.save_state(...)`` write ``optimizer``'s state for every rank: a
    save-state pre hook (``Accelerator.register_save_state_pre_hook``, which ``save_state`` runs
    on every rank before it takes the optimizers' state dicts, rank 0 writing them) in which every
    rank calls ``optimizer.consolidate_state_dict(0)``. Call it once per optimizer, on every rank,
    after ``accelerator.prepare`` (``optimizer``: the prepared one or the one given to
    ``prepare``)::

        model, opt, loader = accelerator.prepare(model, opt, loader)
        compressed_opt.integrations.consolidate_before_save_state(accelerator, opt)

    ``accelerator.load_state`` then resumes every rank exactly (each rank takes its own part of
    the file). Returns the hook's ``torch.utils.hooks.RemovableHandle``. Raises ``TypeError``
    for an optimizer with nothing to consolidate (no ``consolidate_state_dict``: torch's AdamW
    needs no line), ``RuntimeError`` for an accelerate older than 0.16 (no such hook)."""
    target = _unwrap(optimizer)
    if not _consolidates(target):
        raise TypeError(
            f"consolidate_before_save_state: {type(target).__name__} has no consolidate_state_dict(), so there is "
            "nothing to consolidate (its state is the same on every rank): leave this line out for it. It is for "
            "compressed_opt's optimizers (and torch's ZeroRedundancyOptimizer)"
        )
    register = getattr(accelerator, "register_save_state_pre_hook", None)
    if not callable(register):
        raise RuntimeError(
            f"consolidate_before_save_state: this accelerate ({_version('accelerate')}) has no "
            f"Accelerator.register_save_state_pre_hook, which it needs: install accelerate>={ACCELERATE_MIN}, or "
            "call optimizer.consolidate_state_dict() on every rank right before each accelerator.save_state(...)"
        )
    config = getattr(accelerator, "project_configuration", None)
    if (getattr(config, "save_on_each_node", False) and getattr(accelerator, "is_local_main_process", False)
            and not getattr(accelerator, "is_main_process", True)):
        _warn_saving_elsewhere(target, "ProjectConfiguration(save_on_each_node=True)",
                               getattr(accelerator, "process_index", "?"))

    def consolidate(*_):  # (models, weights, output_dir): on every rank, before the state dicts are taken
        target.consolidate_state_dict(0)

    handle = register(consolidate)
    _consolidated_by_framework.add(target)
    return handle


# --- transformers ------------------------------------------------------------------------------------
def _trainer_callback_class():
    """:class:`ConsolidateBeforeSave`, a ``transformers.TrainerCallback`` (made at first use, so
    that importing compressed_opt does not import transformers)."""
    from transformers import TrainerCallback

    class ConsolidateBeforeSave(TrainerCallback):
        """A transformers ``TrainerCallback`` that makes the Trainer's checkpoints hold every
        rank's optimizer state: every rank calls ``optimizer.consolidate_state_dict(0)`` at the
        end of each step (and epoch) after which the Trainer will save (``control.should_save``;
        with ``save_strategy="best"`` after each evaluation, since the save is decided right after
        it), so the state dict the Trainer's saving rank writes carries every rank's own part and
        ``resume_from_checkpoint`` resumes every rank exactly::

            Trainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None),
                    callbacks=[compressed_opt.integrations.ConsolidateBeforeSave()])

        It takes the optimizer from the callback events (the Trainer passes its own,
        ``optimizer=``); ``ConsolidateBeforeSave(opt)`` names it instead. An optimizer without
        ``consolidate_state_dict`` (the Trainer's default AdamW) is left alone. Put it after any
        callback of yours that sets ``control.should_save``. Nothing is consolidated when only the
        model is saved (``save_only_model=True``)."""

        def __init__(self, optimizer=None):
            self._given = optimizer

        def _optimizer(self, kwargs, *, required: bool = False):
            """The optimizer to consolidate (unwrapped), or ``None`` (none, or one that needs none)."""
            optimizer = self._given if self._given is not None else kwargs.get("optimizer")
            if optimizer is None:
                if required:
                    raise RuntimeError(
                        f"ConsolidateBeforeSave: this transformers ({_version('transformers')}) passed no optimizer= "
                        "to the callback at on_train_begin, so the callback cannot tell which optimizer to "
                        "consolidate: name it, Trainer(..., callbacks=[compressed_opt.integrations."
                        "ConsolidateBeforeSave(optimizer)])"
                    )
                return None
            optimizer = _unwrap(optimizer)
            return optimizer if _consolidates(optimizer) else None

        def on_train_begin(self, args, state, control, **kwargs):
            optimizer = self._optimizer(kwargs, required=True)
            if optimizer is None:
                return
            _consolidated_by_framework.add(optimizer)
            if getattr(args, "should_save", False) and getattr(args, "process_index", 0) != 0:
                _warn_saving_elsewhere(optimizer, "TrainingArguments(save_on_each_node=True)", args.process_index)

        def _consolidate(self, args, kwargs):
            optimizer = self._optimizer(kwargs)
            if optimizer is not None and not getattr(args, "save_only_model", False):
                optimizer.consolidate_state_dict(0)

        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save:
                self._consolidate(args, kwargs)

        def on_epoch_end(self, args, state, control, **kwargs):
            if control.should_save:
                self._consolidate(args, kwargs)

        def on_evaluate(self, args, state, control, **kwargs):
            strategy = getattr(args, "save_strategy", None)
            if str(getattr(strategy, "value", strategy)) == "best":
                self._consolidate(args, kwargs)

    ConsolidateBeforeSave.__module__ = __name__
    ConsolidateBeforeSave.__qualname__ = "ConsolidateBeforeSave"
    return ConsolidateBeforeSave


def __getattr__(name: str):
    # ConsolidateBeforeSave subclasses transformers.TrainerCallback: made when first named
    # (``compressed_opt.integrations.ConsolidateBeforeSave``, ``from ... import``), not at import
    if name == "ConsolidateBeforeSave":
        cls = globals()[name] = _trainer_callback_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), "ConsolidateBeforeSave"})


# --- without a line: the warning -----------------------------------------------------------------
def _accelerate_in_use() -> bool | None:
    """Whether an ``Accelerator`` (or a transformers ``Trainer``, which makes one) was created in
    this process, by accelerate's public ``accelerate.state.is_initialized()``; ``False`` when
    accelerate was never imported, ``None`` when it was but cannot say (no such function)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return False
    is_initialized = getattr(state, "is_initialized", None)
    if not callable(is_initialized):
        return None
    return bool(is_initialized())


def check_consolidated(optimizer) -> None:
    """Called by ``state_dict()`` of a multi-rank optimizer that holds no consolidated parts:
    warns (once per optimizer, :class:`UnconsolidatedCheckpointWarning`) when the state dict is
    taken after the first step, while accelerate is in use (or accelerate cannot say whether it
    is), and no line of this module consolidates for this optimizer: the framework then writes
    this one rank's state for every rank. The message names the line to add."""
    if getattr(optimizer, "global_step", 0) == 0 or optimizer in _consolidated_by_framework or optimizer in _warned:
        return
    in_use = _accelerate_in_use()
    if in_use is False:
        return
    _warned.add(optimizer)
    backend = optimizer.backend
    why = ("accelerate is in use in this process (an Accelerator, or a transformers Trainer, which makes one)"
           if in_use else f"accelerate ({_version('accelerate')}) is imported but has no accelerate.state."
           "is_initialized() to tell whether it is in use")
    warnings.warn(
        f"{type(optimizer).__name__}.state_dict() on rank {backend.rank} of {backend.world_size} at step "
        f"{optimizer.global_step} holds this rank's own state only (error feedback, ZeRO shards), not consolidated, "
        f"and {why}: its checkpoints save the optimizer from one rank and load that file on every rank, so a resume "
        "would reset the other ranks' error feedback. Add the line that consolidates before the framework saves: "
        f"with the transformers Trainer, {TRAINER_LINE}; with accelerate's save_state, {ACCELERATE_LINE} once after "
        "accelerator.prepare(...); when saving by hand, optimizer.consolidate_state_dict() on every rank before rank "
        "0 calls state_dict(). (Saving and loading one file per rank on purpose: filter "
        "compressed_opt.integrations.UnconsolidatedCheckpointWarning.)",
        UnconsolidatedCheckpointWarning,
        stacklevel=3,
    )


def _warn_saving_elsewhere(optimizer, setting: str, process) -> None:
    warnings.warn(
        f"{type(optimizer).__name__}: with {setting} on several nodes, process {process} (the first of its node) "
        "saves checkpoints too, but the optimizer is consolidated onto rank 0 only: this node's files hold its own "
        "optimizer state, not every rank's. Resume every node from rank 0's checkpoint (copy it to each node)",
        UnconsolidatedCheckpointWarning,
        stacklevel=3,
    )


def _version(distribution: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "version unknown"
