"""from_deepspeed_config: DeepSpeed "optimizer" sections build the right optimizer."""
import pytest
from torch import nn

from compressed_opt import OnebitAdam, OnebitLamb, ZeroOneAdam, from_deepspeed_config
from compressed_opt.comm import SingleProcessBackend


def params():
    return nn.Linear(4, 3).parameters()


def test_onebit_adam_section_with_its_parameters():
    section = {
        "type": "OneBitAdam",
        "params": {"lr": 4e-4, "betas": [0.9, 0.98], "eps": 1e-8, "weight_decay": 0.01,
                   "freeze_step": 23000, "cuda_aware": False, "comm_backend_name": "nccl"},
    }
    opt = from_deepspeed_config(params(), section, backend=SingleProcessBackend())
    assert isinstance(opt, OnebitAdam)
    group = opt.param_groups[0]
    assert group["lr"] == 4e-4 and group["betas"] == (0.9, 0.98) and group["weight_decay"] == 0.01
    assert opt.freeze_step == 23000 and group["bias_correction"] is True


def test_whole_config_lamb_and_deepspeed_numerics():
    config = {"train_batch_size": 8, "optimizer": {"type": "OneBitLamb", "params": {
        "lr": 1e-3, "freeze_step": 10, "max_coeff": 0.3, "min_coeff": 0.01, "coeff_beta": 0.9,
        "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}}}
    opt = from_deepspeed_config(params(), config, deepspeed_numerics=True)
    assert isinstance(opt, OnebitLamb)
    assert opt.param_groups[0]["max_coeff"] == 0.3 and opt.param_groups[0]["bias_correction"] is False
    # no weight_decay in the section: DeepSpeed's default (0), not the classes' own (AdamW's 1e-2)
    assert opt.param_groups[0]["weight_decay"] == 0.0 and OnebitLamb(params()).defaults["weight_decay"] == 1e-2


def test_zero_one_adam_section():
    section = {"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 100, "var_update_scaler": 16,
                                                 "local_step_scaler": 1000, "local_step_clipper": 16}}
    opt = from_deepspeed_config(params(), section)
    assert isinstance(opt, ZeroOneAdam) and opt.param_groups[0]["lr"] == 1e-3
    assert (opt.var_freeze_step, opt.schedule.var_update_scaler, opt.schedule.local_step_scaler,
            opt.schedule.local_step_clipper) == (100, 16, 1000, 16)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"type": "Adam", "params": {}}, "not one of DeepSpeed's compressed optimizers"),
        ({"type": "OneBitAdam", "params": {"freeze_stpe": 3}}, r"unknown OneBitAdam parameter\(s\) \['freeze_stpe'\]"),
        ({"type": "OneBitAdam", "params": {"comm_backend_name": "carrier-pigeon"}}, "comm_backend_name"),
        ({"type": "OneBitAdam", "params": {"lr": -1}}, "Invalid learning rate"),
    ],
)
def test_bad_sections_say_what_is_wrong(section, match):
    with pytest.raises(ValueError, match=match):
        from_deepspeed_config(params(), section)


def test_zero_stage_from_the_whole_config_and_options():
    config = {"optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 10}},
              "zero_optimization": {"stage": 2}}
    opt = from_deepspeed_config(params(), config, backend=SingleProcessBackend())
    assert isinstance(opt, OnebitLamb) and opt.engine.client.zero_stage == 2
    opt = from_deepspeed_config(params(), config, backend=SingleProcessBackend(), zero_stage=0, overlap=False,
                                bucket_cap_mb=1.0)
    assert opt.engine.client.zero_stage == 0 and opt.engine.overlap is False and opt.engine.bucket_cap_bytes == 2**20
    section_only = from_deepspeed_config(params(), config["optimizer"], backend=SingleProcessBackend())
    assert section_only.engine.client.zero_stage == 0  # a section alone carries no ZeRO setting


@pytest.mark.parametrize("config, match", [
    ({"optimizer": {"type": "OneBitAdam", "params": {}}, "zero_optimization": {"stage": 3}}, "stage 3"),
    ({"optimizer": {"type": "ZeroOneAdam", "params": {}}, "zero_optimization": {"stage": 1}}, "not sharded"),
])
def test_zero_settings_that_cannot_be_honoured_say_why(config, match):
    with pytest.raises(ValueError, match=match):
        from_deepspeed_config(params(), config, backend=SingleProcessBackend())


def test_unknown_option_is_named():
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['zero'\]"):
        from_deepspeed_config(params(), {"type": "OneBitAdam", "params": {}}, zero=1)
