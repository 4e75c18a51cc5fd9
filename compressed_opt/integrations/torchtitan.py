"""torchtitan (0.3): compressed_opt's optimizers by name in torchtitan's optimizer config.

torchtitan builds its optimizers from ``OptimizersContainer.Config``: each
``ParamGroupConfig(pattern=..., optimizer_name=..., optimizer_kwargs=...)`` names an optimizer that
``OptimizersContainer`` looks up in a fixed table (``Adam``, ``AdamW``, ``DistMuon``); there is no
registry, any other name raises ``NotImplementedError``. :class:`CompressedOptimizersContainer` is
torchtitan's container that also knows ``OnebitAdam``, ``OnebitLamb`` and ``ZeroOneAdam``; every
other name goes to torchtitan's own table. What a user writes, in place of ``default_adamw(...)``::

    from compressed_opt.integrations.torchtitan import onebit_config

    config.optimizer = onebit_config("OnebitAdam", lr=8e-4, freeze_step=100)

torchtitan's parallelize function and checkpoint manager stay as they are. What the container
does beyond torchtitan's, and why:

* **the mesh**: nothing to pass. torchtitan hands an optimizer its parameters only; under FSDP2's
  own HSDP (``fully_shard`` on ``mesh["dp_replicate", "fsdp"]``) they are DTensors whose mesh the
  optimizer reads, and it takes the exchange across the replicas over from FSDP from its freeze
  step on (:mod:`compressed_opt.fsdp_replicas`).
* **the group keys** ``fused`` / ``foreach`` that torchtitan adds to every group from
  ``implementation`` are left out of ours (they select torch kernels our optimizers do not have);
  a value set in ``optimizer_kwargs`` is passed on.
* **checkpoints**: torchtitan's own. Its container flattens each optimizer's state dict and
  keeps the entries the live optimizer state names; ours carry each rank's own state (stage,
  counters, error feedback) in a record under the first parameter's ``compressed_opt`` entry,
  which their live state names (:mod:`compressed_opt.torch_state_dict`), each rank under its own
  key, and DTensor moments DCP saves per shard. A resume is on the same ranks and mesh.

torchtitan is imported when the container is first named, never by ``import compressed_opt``.
"""
from __future__ import annotations

# (and CompressedOptimizersContainer, made when first named: see __getattr__; not in ``import *``,
# which would import torchtitan)
__all__ = ["NAMES", "onebit_config"]

#: the names this container adds to torchtitan's
NAMES = ("OnebitAdam", "OnebitLamb", "ZeroOneAdam")
#: the group keys torchtitan derives from ``implementation`` for torch's optimizers
IMPLEMENTATION_KEYS = ("fused", "foreach")


def _factories() -> dict:
    import compressed_opt

    return {name: getattr(compressed_opt, name) for name in NAMES}


def _construct(cls, groups: list, **kwargs):
    """``cls(groups, **kwargs)`` with the constructor's own arguments lifted out of the groups.

    torchtitan puts a ``ParamGroupConfig``'s whole ``optimizer_kwargs`` into its parameter group;
    our optimizers take ``freeze_step``, ``zero_stage``, ... once, in the constructor, and a group
    key of that name would be ignored. A constructor argument that every group sets to the same
    value is passed to the constructor (per-group hyperparameters such as ``lr`` then come from
    the defaults, the same value); one that differs between groups is refused unless it is a
    per-group hyperparameter of the optimizer (``lr``, ``betas``, ``eps``, ``weight_decay``...)."""
    import inspect

    accepted = set(inspect.signature(cls).parameters) - {"params"}
    lifted = {}
    for key in sorted(accepted & {k for g in groups for k in g}):
        values = [g[key] for g in groups if key in g]
        if len(values) == len(groups) and all(v == values[0] for v in values):
            lifted[key] = values[0]
    opt = cls([{k: v for k, v in g.items() if k not in lifted} for g in groups], **lifted, **kwargs)
    left = sorted({k for g in opt.param_groups for k in g} & (accepted - set(opt.defaults)))
    if left:
        opt.close()
        raise ValueError(f"{cls.__name__}: {', '.join(left)} is one value per optimizer, not per parameter group, "
                         "but the ParamGroupConfigs naming it set it differently (or not in all of them): set it "
                         "the same in each, or once in optimizer_factory_kwargs_by_name")
    return opt


def _container_class():
    """:class:`CompressedOptimizersContainer`, made at first use (it subclasses torchtitan's)."""
    import functools
    from dataclasses import dataclass

    from torchtitan.components.optimizer import OptimizersContainer

    class CompressedOptimizersContainer(OptimizersContainer):
        """torchtitan's ``OptimizersContainer`` that also knows ``OnebitAdam``, ``OnebitLamb`` and
        ``ZeroOneAdam`` (see the module doc); built from its ``Config`` by torchtitan's trainer
        (``config.optimizer = CompressedOptimizersContainer.Config(param_groups=[...])``)."""

        @dataclass(kw_only=True, slots=True)
        class Config(OptimizersContainer.Config):
            pass

        @staticmethod
        def _resolve_optimizer_factory(name: str):
            ours = _factories()
            if name in ours:
                return functools.partial(_construct, ours[name])
            try:
                return OptimizersContainer._resolve_optimizer_factory(name)
            except NotImplementedError:
                raise ValueError(
                    f"optimizer_name {name!r} is neither one of compressed_opt's ({', '.join(NAMES)}) nor one that "
                    "torchtitan's OptimizersContainer knows (Adam, AdamW, DistMuon in torchtitan 0.3)"
                ) from None

        @staticmethod
        def _build_param_groups(model, param_group_configs, impl_kwargs):
            groups, patterns = OptimizersContainer._build_param_groups(model, param_group_configs, impl_kwargs)
            for name in NAMES:
                # one group per config of that name, in order (a config matching nothing raised above)
                configs = [pg for pg in param_group_configs if pg.optimizer_name == name]
                for group, pg in zip(groups.get(name, ()), configs):
                    for key in IMPLEMENTATION_KEYS:
                        if key in impl_kwargs and key not in pg.optimizer_kwargs:
                            group.pop(key, None)
            return groups, patterns

    CompressedOptimizersContainer.__module__ = __name__
    CompressedOptimizersContainer.__qualname__ = "CompressedOptimizersContainer"
    return CompressedOptimizersContainer


def onebit_config(name: str = "OnebitAdam", *, lr: float, pattern: str = ".*", **kwargs):
    """``CompressedOptimizersContainer.Config`` with one parameter group: every parameter whose name
    matches ``pattern`` (all by default) optimized by ``name`` (one of :data:`NAMES`) with
    ``lr`` and ``kwargs`` (the optimizer's own: ``freeze_step``, ``betas``, ``weight_decay``, ...).
    The counterpart of torchtitan's ``default_adamw(lr=...)``."""
    if name not in NAMES:
        raise ValueError(f"onebit_config: name must be one of {', '.join(NAMES)}, got {name!r} (torchtitan's own "
                         "optimizers: its default_adamw, or ParamGroupConfig in CompressedOptimizersContainer.Config)")
    from torchtitan.components.optimizer import ParamGroupConfig

    container = __getattr__("CompressedOptimizersContainer")
    group = ParamGroupConfig(pattern=pattern, optimizer_name=name, optimizer_kwargs={"lr": lr, **kwargs})
    return container.Config(param_groups=[group])


def __getattr__(name: str):
    # made when first named, so that importing this module does not import torchtitan
    if name == "CompressedOptimizersContainer":
        cls = globals()[name] = _container_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
