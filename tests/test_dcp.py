"""torch.distributed.checkpoint (DCP): a resume through ``compressed_opt.dcp.OptimizerState`` is
bit-identical to the uninterrupted run, in fresh processes, for every optimizer (and ZeRO); a state
that lost per-parameter fields on the way (DCP with torch's functions and the optimizer's own state
dict as the template, or put back by hand) is refused, never resumed with defaults (so is a round
trip through torch's get/set_optimizer_state_dict); state keyed by parameter name is accepted, as
torch.optim accepts it."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import compressed_opt
from compressed_opt.dcp import OptimizerState

from distributed import run_ranks
from layouts import legacy
from test_optim_contract import tensors_in

CONFIGS = {
    "OnebitAdam": dict(freeze_step=3),
    "OnebitAdam-zero1": dict(freeze_step=3, zero_stage=1),
    "OnebitLamb": dict(freeze_step=3),
    "ZeroOneAdam": dict(var_freeze_step=3, var_update_scaler=2, local_step_scaler=4),
}
SAVE_AT, STEPS = 6, 10


def _make(name, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))
    cls = getattr(compressed_opt, name.split("-")[0])
    return model, cls(model.parameters(), lr=1e-2, **CONFIGS[name])


def _train(model, opt, rank, steps):
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + rank)
        opt.zero_grad()
        model(torch.randn(8, 12, generator=g)).square().mean().backward()
        opt.step()


def _tensors(model, opt) -> list[torch.Tensor]:
    out = [(p.to_local() if hasattr(p, "to_local") else p).detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    for i in sorted(sd["state"]):
        out += [(v.to_local() if hasattr(v, "to_local") else v).clone()
                for k, v in sorted(sd["state"][i].items()) if torch.is_tensor(v)]
    return out


def _uninterrupted(rank, world, root):
    """Every config: train to SAVE_AT, save (DCP), train on to STEPS; the final tensors."""
    warnings.simplefilter("ignore", UserWarning)
    finals = {}
    for name in CONFIGS:
        model, opt = _make(name)
        _train(model, opt, rank, range(1, SAVE_AT + 1))
        dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)},
                 checkpoint_id=os.path.join(root, name))
        _train(model, opt, rank, range(SAVE_AT + 1, STEPS + 1))
        finals[name] = _tensors(model, opt)
    return finals


def _resumed(rank, world, root):
    """Every config, in fresh processes: another initialisation, loaded from the checkpoint (DCP),
    trained from SAVE_AT + 1 to STEPS; the final tensors."""
    warnings.simplefilter("ignore", UserWarning)
    finals = {}
    for name in CONFIGS:
        model, opt = _make(name, seed=1)
        state = {"model": model.state_dict(), "optim": OptimizerState(opt)}
        dcp.load(state, checkpoint_id=os.path.join(root, name))
        model.load_state_dict(state["model"])
        assert opt.global_step == SAVE_AT and opt.compressing
        _train(model, opt, rank, range(SAVE_AT + 1, STEPS + 1))
        finals[name] = _tensors(model, opt)
    return finals


def test_a_resume_through_dcp_is_bit_identical_to_the_uninterrupted_run(tmp_path):
    root = str(tmp_path)
    before = run_ranks(_uninterrupted, 2, root, timeout=240)
    after = run_ranks(_resumed, 2, root, timeout=240)
    for rank in range(2):
        for name in CONFIGS:
            a, b = before[rank][name], after[rank][name]
            assert len(a) == len(b)
            for x, y in zip(a, b):
                assert torch.equal(x, y), f"{name}, rank {rank}: the resumed run differs"
    # the two ranks' own parts were each saved: 0/1 Adam's local momentum differs between ranks
    assert not all(torch.equal(x, y) for x, y in zip(before[0]["ZeroOneAdam"], before[1]["ZeroOneAdam"]))


def test_a_checkpoint_of_another_world_size_is_refused(tmp_path):
    """Saved by 2 ranks, loaded by one process: a clear error, nothing loaded."""
    run_ranks(_save_two_ranks, 2, str(tmp_path), timeout=120)
    model, opt = _make("OnebitAdam", seed=1)
    with pytest.raises(ValueError, match="state of 2 ranks, and it is loaded on 1"):
        dcp.load({"optim": OptimizerState(opt)}, checkpoint_id=str(tmp_path))
    assert opt.global_step == 0


def _save_two_ranks(rank, world, root):
    model, opt = _make("OnebitAdam")
    _train(model, opt, rank, range(1, 5))
    dcp.save({"optim": OptimizerState(opt)}, checkpoint_id=root)


def test_optimizer_state_refuses_a_torch_optimizer():
    with pytest.raises(TypeError, match="compressed_opt optimizer"):
        OptimizerState(torch.optim.AdamW(nn.Linear(2, 2).parameters()))


# --- loading: incomplete state, state keyed by name (one process) ---------------------------------
def _compressing(name):
    model, opt = _make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _train(model, opt, 0, range(1, SAVE_AT + 1))
    return model, opt


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_a_compression_stage_state_that_lost_fields_is_refused(name):
    """The fields DCP's template lacked (the compression stage's ``scaling_coeff``, and OnebitAdam's
    ``exchange_factor``) dropped from a state dict: loading it raises and names them, where it
    used to resume with the coefficients made again and factors of 1."""
    model, opt = _compressing(name)
    sd = legacy(opt.state_dict())
    lost = {"scaling_coeff", "exchange_factor"}
    assert lost & set(sd["state"][0]), "the stage should hold the fields this test removes"
    sd["state"] = {i: {k: v for k, v in st.items() if k not in lost} for i, st in sd["state"].items()}
    fresh_model, fresh = _make(name, seed=1)
    with pytest.raises(ValueError, match="per-parameter state is incomplete: 'exchange_factor'|"
                                         "per-parameter state is incomplete: 'scaling_coeff'"):
        fresh.load_state_dict(sd)
    assert fresh.global_step == 0


@pytest.mark.parametrize("name", ["OnebitAdam", "OnebitLamb", "ZeroOneAdam"])
def test_torch_get_optimizer_state_dict_round_trip_resumes_nested_flattened_and_full(name):
    """torch's own functions keep only ``state`` and ``param_groups``: ``"compressed_opt"`` travels
    in the carrier (compressed_opt.torch_state_dict), a ``RankRecord`` that torch's flattening
    takes as an int and the optimizer's live state names (torch's unflattening keeps only what it
    names); a fresh optimizer resumes from it bit for bit, nested, flattened
    (``flatten_optimizer_state_dict=True``, torchtitan's) and full, as from its own state dict."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    model, opt = _compressing(name)
    results = []
    for options in (None, StateDictOptions(), StateDictOptions(flatten_optimizer_state_dict=True),
                    StateDictOptions(full_state_dict=True)):
        osd = None if options is None else get_optimizer_state_dict(model, opt, options=options)
        if options is not None and options.flatten_optimizer_state_dict:
            assert all(k.startswith(("state.", "param_groups.")) for k in osd), sorted(osd)[:4]
            assert [k for k in osd if ".compressed_opt." in k] == ["state.0.weight.compressed_opt.rank0"]
        elif options is not None:
            assert "compressed_opt" not in osd and set(osd) == {"state", "param_groups"}
        fresh_model, fresh = _make(name, seed=1)
        fresh_model.load_state_dict(model.state_dict())
        if options is None:
            fresh.load_state_dict(opt.state_dict())
        else:
            set_optimizer_state_dict(fresh_model, fresh, osd, options=options)
        assert fresh.global_step == SAVE_AT and fresh.compressing
        _train(fresh_model, fresh, 0, range(SAVE_AT + 1, STEPS + 1))
        results.append(_tensors(fresh_model, fresh))
    assert all(torch.equal(a, b) for other in results[1:] for a, b in zip(results[0], other))


def test_flattened_and_full_together_fail_in_torch_as_for_its_own_adamw():
    """``flatten_optimizer_state_dict=True`` with ``full_state_dict=True``: torch 2.13's load raises
    the same ``KeyError`` for its own AdamW (it flattens the loading optimizer's state dict one way
    and the given one another); a canary, so that the day torch takes it we test ours there."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=True)
    errors = []
    for torchs in (True, False):
        if torchs:
            model = _make("OnebitAdam")[0]
            opt = torch.optim.AdamW(model.parameters())
            _train(model, opt, 0, range(1, 3))
        else:
            model, opt = _compressing("OnebitAdam")
        osd = get_optimizer_state_dict(model, opt, options=options)
        with pytest.raises(KeyError) as caught:
            set_optimizer_state_dict(model, opt, osd, options=options)
        errors.append(str(caught.value))
    assert errors[0] == errors[1] == "'param_groups.0.params.0'", errors


def test_torch_set_optimizer_state_dict_of_a_whole_state_dict_of_ours_resumes():
    """torch's set function passes a state dict keyed by index on as it is: our own whole state
    dict (``"compressed_opt"`` included) loads through it as through ``load_state_dict`` (its step
    with zero gradients on the fresh optimizer is overwritten by the load)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    trained_model, trained = _compressing("OnebitAdam")
    results = []
    for through_torch in (False, True):
        model, opt = _make("OnebitAdam", seed=1)
        model.load_state_dict(trained_model.state_dict())
        if through_torch:
            set_optimizer_state_dict(model, opt, trained.state_dict())
        else:
            opt.load_state_dict(trained.state_dict())
        _train(model, opt, 0, range(SAVE_AT + 1, STEPS + 1))
        results.append(_tensors(model, opt))
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.parametrize("name", ["OnebitAdam", "ZeroOneAdam"])
def test_state_keyed_by_parameter_name_loads_like_state_keyed_by_index(name):
    """torch.optim maps a state dict's keys to parameters by the saved groups' order, so names
    work as keys; the same state keyed by names and by indices resumes identically."""
    model, opt = _compressing(name)
    sd = opt.state_dict()
    names = [n for n, _ in model.named_parameters()]
    by_name = dict(sd, state={names[i]: st for i, st in sd["state"].items()},
                   param_groups=[dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]])
    results = []
    for state_dict in (sd, by_name):
        fresh_model, fresh = _make(name, seed=1)
        fresh_model.load_state_dict(model.state_dict())
        fresh.load_state_dict(state_dict)
        _train(fresh_model, fresh, 0, range(SAVE_AT + 1, STEPS + 1))
        results.append(_tensors(fresh_model, fresh))
    assert all(torch.equal(a, b) for a, b in zip(*results))


# --- HSDP: each rank's shard state through DCP ------------------------------------------------------
def _hsdp_run(rank, world, root, resume):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    r_rep, r_shard = mesh.get_coordinate()
    finals = {}
    for name in ("OnebitAdam", "ZeroOneAdam"):
        torch.manual_seed(1 if resume else 0)
        model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 6))
        for m in model:
            if isinstance(m, nn.Linear):
                fully_shard(m, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        cls = getattr(compressed_opt, name)
        opt = cls(model.parameters(), lr=1e-2, backend=mesh["replicate"], **CONFIGS[name])
        path = os.path.join(root, f"hsdp-{name}")
        if resume:
            state = {"model": model.state_dict(), "optim": OptimizerState(opt)}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
        else:
            _train(model, opt, 10 * r_rep + r_shard, range(1, SAVE_AT + 1))
            dcp.save({"model": model.state_dict(), "optim": OptimizerState(opt)}, checkpoint_id=path)
        _train(model, opt, 10 * r_rep + r_shard, range(SAVE_AT + 1, STEPS + 1))
        finals[name] = _tensors(model, opt)
    return finals


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_an_hsdp_resume_through_dcp_is_bit_identical(tmp_path):
    """HSDP (2 x 2, FSDP2 inside each replica): every rank's shard state, saved and loaded with the
    model's DTensor state in fresh processes, continues bit for bit."""
    before = run_ranks(_hsdp_run, 4, str(tmp_path), False, timeout=300)
    after = run_ranks(_hsdp_run, 4, str(tmp_path), True, timeout=300)
    for rank in range(4):
        for name in before[rank]:
            assert all(torch.equal(x, y) for x, y in zip(before[rank][name], after[rank][name])), (name, rank)


def test_a_legacy_checkpoint_resumes_with_legacy_true_and_is_refused_without(tmp_path):
    """The layout before resharding (each rank's whole state dict, one entry, no tensors), as
    compressed_opt 0.1.0 wrote it: OptimizerState(legacy=True) resumes it bit for bit; the default
    template asks DCP for the tensors it lacks, which DCP refuses, naming the key."""
    model, opt = _compressing("OnebitAdam")
    path = str(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"optim": OptimizerState(opt, legacy=True)}, checkpoint_id=path)
        fresh_model, fresh = _make("OnebitAdam", seed=1)
        with pytest.raises(CheckpointException) as caught:  # (each rank's error in .failures)
            dcp.load({"optim": OptimizerState(fresh)}, checkpoint_id=path)
        said = str(caught.value) + "".join(map(str, getattr(caught.value, "failures", {}).values()))
        assert "Missing key in checkpoint state_dict: optim.state.0.exp_avg" in said, said
        assert fresh.global_step == 0
        dcp.load({"optim": OptimizerState(fresh, legacy=True)}, checkpoint_id=path)
        fresh_model.load_state_dict(model.state_dict())
        results = []
        for m, o in ((model, opt), (fresh_model, fresh)):
            _train(m, o, 0, range(SAVE_AT + 1, STEPS + 1))
            results.append(_tensors(m, o))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    with pytest.raises(ValueError, match="legacy checkpoint holds no tensors"):
        OptimizerState(opt, reshard=True, legacy=True)


def test_a_saved_state_dict_loads_with_weights_only_once_compressed_opt_is_imported(tmp_path):
    """``torch.load`` (``weights_only`` by default) reads a saved state dict in a process that
    imported compressed_opt (which registers its record's type as safe), and ``load_state_dict``
    resumes from it bit for bit; without the import torch's error names what to import. The
    record's tensors are written once with the state dict's other references to them: one storage
    written per storage held."""
    import subprocess
    import sys

    model, opt = _compressing("OnebitAdam")
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    script = ("import sys, torch\nif sys.argv[2] == 'import': import compressed_opt\nsd = torch.load(sys.argv[1])\n"
              "print(type(sd['state'][0]['compressed_opt']['rank0']).__name__)")
    runs = [subprocess.run([sys.executable, "-P", "-c", script, str(path), how], capture_output=True, text=True,
                           timeout=120) for how in ("import", "no import")]
    assert runs[0].returncode == 0 and runs[0].stdout.split() == ["RankRecord"], runs[0].stderr[-2000:]
    assert runs[1].returncode != 0 and "compressed_opt.torch_state_dict.rank_record" in runs[1].stderr
    sd = opt.state_dict()
    held = {t.untyped_storage().data_ptr() for t in tensors_in(sd)}
    import zipfile

    written = [n for n in zipfile.ZipFile(path).namelist() if "/data/" in n]  # (one entry per storage)
    assert len(written) == len(held), (written, len(held))
    results = []
    for state_dict in (sd, torch.load(path)):
        fresh_model, fresh = _make("OnebitAdam", seed=1)
        fresh_model.load_state_dict(model.state_dict())
        fresh.load_state_dict(state_dict)
        _train(fresh_model, fresh, 0, range(SAVE_AT + 1, STEPS + 1))
        results.append(_tensors(fresh_model, fresh))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_flattened_state_dict_carries_the_record_past_a_frozen_first_parameter():
    """The first parameter frozen (``requires_grad=False``) and its state entry made by a look-up
    (``optimizer.state`` is a defaultdict): torch's loads skip a frozen parameter's state, so the
    record rides with the first trainable one, and a flattened state dict resumes bit for bit."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    results = []
    for through_torch in (False, True):
        model, opt = _make("OnebitAdam")
        model[0].weight.requires_grad_(False)
        opt.state[model[0].weight]  # noqa: B018  (a look-up: an empty entry, as user code makes one)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _train(model, opt, 0, range(1, SAVE_AT + 1))
        fresh_model, fresh = _make("OnebitAdam", seed=1)
        fresh_model.load_state_dict(model.state_dict())
        fresh_model[0].weight.requires_grad_(False)
        if through_torch:
            osd = get_optimizer_state_dict(model, opt, options=options)
            assert [k for k in osd if ".compressed_opt." in k] == ["state.0.bias.compressed_opt.rank0"]
            set_optimizer_state_dict(fresh_model, fresh, osd, options=options)
        else:
            fresh.load_state_dict(opt.state_dict())
        assert fresh.global_step == SAVE_AT and fresh.compressing
        _train(fresh_model, fresh, 0, range(SAVE_AT + 1, STEPS + 1))
        results.append(_tensors(fresh_model, fresh))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_flattened_state_dict_of_another_optimizer_is_refused_and_nothing_is_loaded():
    """A flattened state dict (torchtitan's) of 1-bit LAMB loaded into 1-bit Adam over the same
    model: the record says whose it is, and loading raises, naming both, the optimizer untouched."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model, lamb = _compressing("OnebitLamb")
    osd = get_optimizer_state_dict(model, lamb, options=options)
    fresh_model, fresh = _make("OnebitAdam", seed=1)
    with pytest.raises(ValueError, match="OnebitLamb") as caught:
        set_optimizer_state_dict(fresh_model, fresh, osd, options=options)
    assert "OnebitAdam" in str(caught.value)
    assert fresh.global_step == 1 and not fresh.compressing  # (torch's own step at lr 0 only)
