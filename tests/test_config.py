"""Config loading: precedence, strict keys and types, clear errors."""

import pytest

from inkling_fp4.config import RunConfig, apply_overrides, from_dict, parse_override, to_dict
from inkling_fp4.errors import ConfigError


def test_override_parsing_types():
    assert parse_override("train.steps=200") == (["train", "steps"], 200)
    assert parse_override("optim.lr=3e-4") == (["optim", "lr"], 3e-4)
    assert parse_override("precision.recipe=fp8") == (["precision", "recipe"], "fp8")
    assert parse_override("precision.switch_to_bf16=null") == (["precision", "switch_to_bf16"], None)
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("train.steps")


def test_precedence_defaults_recipe_overrides():
    data = {"train": {"steps": 7, "seed": 3}, "optim": {"lr": 1e-3}}
    cfg = from_dict(RunConfig, apply_overrides(data, ["train.steps=11"]))
    assert cfg.train.steps == 11  # override beats recipe
    assert cfg.train.seed == 3  # recipe beats default
    assert cfg.optim.beta2 == RunConfig().optim.beta2  # default kept
    assert isinstance(cfg.optim.lr, float)


def test_unknown_key_names_key_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, {"train": {"stepz": 3}})
    msg = str(e.value)
    assert "train.stepz" in msg and "steps" in msg and "seed" in msg


def test_wrong_type_is_an_error():
    with pytest.raises(ConfigError, match="train.steps"):
        from_dict(RunConfig, {"train": {"steps": "many"}})
    with pytest.raises(ConfigError, match="log.wandb"):
        from_dict(RunConfig, {"log": {"wandb": "yes"}})


def test_validation_errors_are_config_errors():
    with pytest.raises(ConfigError, match="precision.recipe"):
        from_dict(RunConfig, {"precision": {"recipe": "fp2"}})


def test_union_fields_keep_their_type():
    cfg = from_dict(RunConfig, {"precision": {"switch_to_bf16": 120}})
    assert cfg.precision.switch_to_bf16 == 120 and isinstance(cfg.precision.switch_to_bf16, int)
    cfg = from_dict(RunConfig, {"precision": {"switch_to_bf16": 0.8}})
    assert cfg.precision.switch_to_bf16 == 0.8


def test_round_trip():
    cfg = from_dict(RunConfig, {"train": {"steps": 5}})
    assert from_dict(RunConfig, to_dict(cfg)) == cfg
