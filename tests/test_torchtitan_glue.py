"""The torchtitan container's checks that need no torchtitan (tests/test_torchtitan.py runs the
container inside torchtitan, under make test-compat): the constructor arguments torchtitan puts
into each parameter group are lifted out where the groups agree and refused where they differ,
and a name that is not ours is refused before torchtitan is imported."""
from __future__ import annotations

import sys

import pytest
import torch

import compressed_opt
from compressed_opt.integrations import torchtitan as glue


def _groups(**per_group):
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    return [dict(params=list(m.parameters()), lr=1e-3, **kw) for m, kw in zip((a, b), per_group.get("kw", ({}, {})))]


def test_constructor_arguments_the_groups_agree_on_go_to_the_constructor():
    opt = glue._construct(compressed_opt.OnebitAdam, _groups(kw=({"freeze_step": 7}, {"freeze_step": 7})))
    assert opt.freeze_step == 7
    assert all("freeze_step" not in g for g in opt.param_groups)
    opt.close()


def test_constructor_arguments_the_groups_set_differently_are_refused():
    with pytest.raises(ValueError, match="freeze_step is one value per optimizer"):
        glue._construct(compressed_opt.OnebitAdam, _groups(kw=({"freeze_step": 7}, {"freeze_step": 9})))


def test_a_name_that_is_not_ours_is_refused_before_torchtitan_is_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # (an import of it would raise)
    with pytest.raises(ValueError, match="OnebitAdam, OnebitLamb, ZeroOneAdam"):
        glue.onebit_config("AdamW", lr=1e-3)
