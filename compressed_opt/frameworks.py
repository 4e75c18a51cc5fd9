"""Transitional (issue 27): the frameworks are no longer recognised here.

``CompressedOptimizer.step()`` still calls :func:`watch_trainer` at its first step; it does
nothing now. The checkpoints of the transformers Trainer and of accelerate consolidate through
their public hooks, one explicit line each (:mod:`compressed_opt.integrations`). Delete this
module together with that call.
"""


def watch_trainer(optimizer) -> None:
    """Does nothing (see the module doc): a Trainer's checkpoints consolidate with
    ``callbacks=[compressed_opt.integrations.ConsolidateBeforeSave()]``."""
