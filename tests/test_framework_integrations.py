"""The frameworks' checkpoints through their public hooks (compressed_opt.integrations): one line per
framework makes the file its saving rank writes hold every rank's own optimizer state, and without
that line the optimizer warns, naming it.

On 2 Gloo ranks, with the frameworks' own save paths (accelerate's ``save_state``, the
transformers Trainer's checkpoints) and a small model trained into the compression stage: without
the line, the saved optimizer state is this rank's alone and ``state_dict()`` warns
(``UnconsolidatedCheckpointWarning``) with the line to add; with it, the file holds one part per
rank, each equal to that rank's own state, and nothing is warned. ``examples/`` under the real
launchers (tests/test_integrations.py) resume from those files bit for bit. The loud failures
(an accelerate without the hook, a transformers that passes no optimizer to its callbacks, an
optimizer with nothing to consolidate, ``save_on_each_node`` on several nodes) are checked with
stand-ins.
"""
from __future__ import annotations

import os
import warnings
from types import SimpleNamespace

import pytest
import torch
from distributed import run_ranks

import compressed_opt
from compressed_opt import integrations
from compressed_opt.integrations import UnconsolidatedCheckpointWarning

FREEZE, STEPS = 2, 4  # compression from step 3: each rank's error feedback is its own


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, t: int):
    g = torch.Generator().manual_seed(1000 * rank + t)  # each rank its own data
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def _launcher_env(rank: int, world: int) -> None:
    """What torchrun sets (the frameworks read it; the process group is already up)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def _own_errors(opt) -> list:
    """This rank's own error feedback, per bucket (what its part of a consolidated file must hold)."""
    part = compressed_opt.checkpoint.rank_part(opt.engine, opt.engine.client, opt.param_groups, opt.state)
    return [{k: v.clone() for k, v in e.items() if k != "numel"} for e in part["buckets"]]


def _file_facts(sd: dict) -> dict:
    extra = sd["compressed_opt"]
    parts = extra.get("ranks")
    return {"rank": extra["rank"],
            "parts": None if parts is None else [{"rank": p["rank"], "buckets": [
                {k: v for k, v in e.items() if k != "numel"} for e in p["buckets"]]} for p in parts]}


def _messages(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UnconsolidatedCheckpointWarning)]


# --- accelerate: consolidate_before_save_state ---------------------------------------------------------
def _accelerate_saves(rank, world, folder):
    _launcher_env(rank, world)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = _model()
    opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, bucket_cap_mb=0.001)
    model, opt = accelerator.prepare(model, opt)
    for t in range(1, STEPS + 1):
        x, y = _batch(rank, t)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    facts = {"own": _own_errors(opt.optimizer)}
    with warnings.catch_warnings(record=True) as caught:  # without the line: warned, each rank's own state
        warnings.simplefilter("always")
        accelerator.save_state(os.path.join(folder, "without"))
    facts["without_warnings"] = _messages(caught)
    handle = compressed_opt.integrations.consolidate_before_save_state(accelerator, opt)  # the line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator.save_state(os.path.join(folder, "with"))
    facts["with_warnings"] = _messages(caught)
    facts["handle"] = type(handle).__name__
    accelerator.wait_for_everyone()
    for name in ("without", "with"):
        facts[name] = _file_facts(torch.load(os.path.join(folder, name, "optimizer.bin"), weights_only=True))
    return facts


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def _check_consolidated_file(results, saved) -> None:
    assert saved["parts"] is not None and [p["rank"] for p in saved["parts"]] == [0, 1], saved["parts"]
    for rank, r in enumerate(results):
        assert _same(saved["parts"][rank]["buckets"], r["own"]), f"the file's part {rank} is not rank {rank}'s state"
    assert not _same(results[0]["own"], results[1]["own"]), "the ranks' error feedback should differ (the check)"


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_accelerate_save_state_consolidates_with_the_line_and_warns_without(tmp_path):
    results = run_ranks(_accelerate_saves, 2, str(tmp_path), timeout=180)
    for r in results:  # save_state takes every rank's state dict: each warns once
        assert len(r["without_warnings"]) == 1, r["without_warnings"]
        assert integrations.ACCELERATE_LINE in r["without_warnings"][0]
        assert integrations.TRAINER_LINE in r["without_warnings"][0]
        assert r["with_warnings"] == [], r["with_warnings"]
    assert results[0]["without"]["parts"] is None and results[0]["without"]["rank"] == 0
    _check_consolidated_file(results, results[0]["with"])
    assert results[0]["handle"] == "RemovableHandle"


# --- transformers: ConsolidateBeforeSave --------------------------------------------------------------
class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        x, y = _batch(0, i)
        return {"x": x[0], "labels": y[0]}


class _Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


def _trainer_saves(rank, world, folder):
    _launcher_env(rank, world)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Record(TrainerCallback):  # each rank's own state right after the save
        def __init__(self, opt):
            self.opt, self.own = opt, None

        def on_save(self, args, state, control, **kwargs):
            self.own = _own_errors(self.opt)

    facts = {}
    for name, callbacks in (("without", []), ("with", [compressed_opt.integrations.ConsolidateBeforeSave()])):
        args = TrainingArguments(output_dir=os.path.join(folder, name), max_steps=STEPS - 1, save_strategy="steps",
                                 save_steps=STEPS - 1, per_device_train_batch_size=4, learning_rate=1e-2,
                                 use_cpu=True, ddp_backend="gloo", report_to="none", disable_tqdm=True,
                                 logging_strategy="no", dataloader_num_workers=0)
        model = _Regressor()
        opt = compressed_opt.OnebitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, bucket_cap_mb=0.001)
        record = Record(opt)
        trainer = Trainer(model=model, args=args, train_dataset=_Pairs(), optimizers=(opt, None),
                          callbacks=[record, *callbacks])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        facts[f"{name}_warnings"] = _messages(caught)
        facts[f"{name}_own"] = record.own
        path = os.path.join(folder, name, f"checkpoint-{STEPS - 1}", "optimizer.pt")
        trainer.accelerator.wait_for_everyone()
        facts[name] = _file_facts(torch.load(path, weights_only=True))
    return facts


@pytest.mark.multiprocess
@pytest.mark.timeout(280)
def test_trainer_checkpoint_consolidates_with_the_callback_and_warns_without(tmp_path):
    results = run_ranks(_trainer_saves, 2, str(tmp_path), timeout=260)
    # only the Trainer's saving rank takes the state dict: rank 0 warns, with the line to add
    assert len(results[0]["without_warnings"]) == 1, results[0]["without_warnings"]
    assert integrations.TRAINER_LINE in results[0]["without_warnings"][0]
    assert results[1]["without_warnings"] == []
    assert results[0]["without"]["parts"] is None
    assert [r["with_warnings"] for r in results] == [[], []]
    _check_consolidated_file([{"own": r["with_own"]} for r in results], results[0]["with"])


class _Recorder(torch.optim.SGD):
    """A torch optimizer that counts the consolidations asked of it."""

    def __init__(self):
        super().__init__([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        self.calls = []

    def consolidate_state_dict(self, to=0):
        self.calls.append(to)


def test_the_trainer_callback_consolidates_before_each_save_and_only_then():
    """Every rank consolidates at the end of a step after which the Trainer saves, not otherwise;
    with save_strategy="best" after each evaluation (the save is decided right after it); never
    when only the model is saved. The optimizer comes from the events (wrapped, as the Trainer's
    is by accelerate) or from the constructor."""
    from transformers import TrainerControl

    opt = _Recorder()
    wrapped = SimpleNamespace(optimizer=opt)  # accelerate's AcceleratedOptimizer keeps it as .optimizer
    callback = integrations.ConsolidateBeforeSave()
    args = SimpleNamespace(save_only_model=False, save_strategy="steps")
    callback.on_train_begin(args, None, TrainerControl(), optimizer=wrapped)
    callback.on_step_end(args, None, TrainerControl(should_save=False), optimizer=wrapped)
    assert opt.calls == []
    callback.on_step_end(args, None, TrainerControl(should_save=True), optimizer=wrapped)
    callback.on_epoch_end(args, None, TrainerControl(should_save=True), optimizer=wrapped)
    callback.on_evaluate(args, None, TrainerControl(), optimizer=wrapped)
    assert opt.calls == [0, 0]
    callback.on_evaluate(SimpleNamespace(save_only_model=False, save_strategy="best"), None, TrainerControl(),
                         optimizer=wrapped)
    assert opt.calls == [0, 0, 0]
    callback.on_step_end(SimpleNamespace(save_only_model=True, save_strategy="steps"), None,
                         TrainerControl(should_save=True), optimizer=wrapped)
    assert opt.calls == [0, 0, 0]
    named = _Recorder()
    integrations.ConsolidateBeforeSave(named).on_step_end(args, None, TrainerControl(should_save=True), optimizer=None)
    assert named.calls == [0]
    # the Trainer's own AdamW has nothing to consolidate: left alone
    adamw = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    callback.on_train_begin(args, None, TrainerControl(), optimizer=adamw)
    callback.on_step_end(args, None, TrainerControl(should_save=True), optimizer=adamw)


def test_the_trainer_callback_without_an_optimizer_names_the_fix():
    from transformers import TrainerControl

    with pytest.raises(RuntimeError, match=r"callbacks=\[compressed_opt\.integrations\.ConsolidateBeforeSave"
                                           r"\(optimizer\)\]"):
        integrations.ConsolidateBeforeSave().on_train_begin(SimpleNamespace(), None, TrainerControl(), optimizer=None)
    # outside training (an evaluation before train()) there is nothing to consolidate yet: no error
    integrations.ConsolidateBeforeSave().on_evaluate(SimpleNamespace(save_strategy="best"), None, TrainerControl(),
                                                     optimizer=None)


def test_save_on_each_node_on_another_node_is_warned():
    from transformers import TrainerControl

    elsewhere = SimpleNamespace(should_save=True, process_index=2, save_strategy="steps")
    with pytest.warns(UnconsolidatedCheckpointWarning, match="Resume every node from rank 0's checkpoint"):
        integrations.ConsolidateBeforeSave().on_train_begin(elsewhere, None, TrainerControl(), optimizer=_Recorder())
    accelerator = SimpleNamespace(register_save_state_pre_hook=lambda hook: None, is_main_process=False,
                                  is_local_main_process=True, process_index=2,
                                  project_configuration=SimpleNamespace(save_on_each_node=True))
    with pytest.warns(UnconsolidatedCheckpointWarning, match="Resume every node from rank 0's checkpoint"):
        integrations.consolidate_before_save_state(accelerator, _Recorder())


def test_the_accelerate_line_names_the_version_it_needs_and_what_it_is_for():
    old = SimpleNamespace(project_configuration=SimpleNamespace(save_on_each_node=False))  # accelerate < 0.16
    with pytest.raises(RuntimeError, match=r"accelerate>=0\.16\.0"):
        integrations.consolidate_before_save_state(old, _Recorder())
    hooks = []
    accelerator = SimpleNamespace(register_save_state_pre_hook=hooks.append, is_main_process=True,
                                  is_local_main_process=True, project_configuration=SimpleNamespace())
    with pytest.raises(TypeError, match="nothing to consolidate"):
        integrations.consolidate_before_save_state(accelerator, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]))
    opt = _Recorder()
    integrations.consolidate_before_save_state(accelerator, SimpleNamespace(optimizer=opt))  # the prepared one
    hooks[0]([], [], "out")  # what save_state calls it with, on every rank
    assert opt.calls == [0]


def test_an_accelerate_that_cannot_say_whether_it_is_in_use_is_warned_about(monkeypatch):
    """The warning's condition read by public API only; where it is missing (a renamed
    ``accelerate.state.is_initialized``), the optimizer warns rather than stays silent."""
    monkeypatch.setitem(__import__("sys").modules, "accelerate.state", SimpleNamespace())
    assert integrations._accelerate_in_use() is None
    with pytest.warns(UnconsolidatedCheckpointWarning, match="no accelerate.state.is_initialized"):
        integrations.check_consolidated(_Stepped())
    monkeypatch.setitem(__import__("sys").modules, "accelerate.state", SimpleNamespace(is_initialized=lambda: False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        integrations.check_consolidated(_Stepped())  # not in use: silent


class _Stepped:
    """Stands for a multi-rank optimizer after its first step."""

    global_step = 3
    backend = SimpleNamespace(rank=1, world_size=2)
