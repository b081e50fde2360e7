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


# ----------------------------------------------------------------------------------------------
# impossible values: NaN, Inf, out of range


def _float_fields(cls, prefix=""):
    """Dotted keys of every float field (alone or in a union) of the config tree under ``cls``."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            yield from _float_fields(tp, f"{key}.")
        elif tp is float or float in typing.get_args(tp):
            yield key


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", ".nan", ".inf", "-.inf", "Infinity"])
def test_lr_must_be_finite(value):
    with pytest.raises(ConfigError, match=r"^optim\.lr: \S+ is not a finite number") as e:
        from_dict(RunConfig, apply_overrides({}, [f"optim.lr={value}"]))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("value", ["-1", "0", "0.0"])
def test_lr_must_be_positive(value):
    with pytest.raises(ConfigError, match=r"optim\.lr=.* must be a finite number > 0"):
        from_dict(RunConfig, apply_overrides({}, [f"optim.lr={value}"]))


def test_every_float_field_refuses_nan_and_inf():
    keys = list(_float_fields(RunConfig))
    assert {"optim.lr", "optim.eps", "optim.grad_clip", "monitor.loss_zscore", "train.warmup_steps"} <= set(
        keys
    )
    for key in keys:
        for value in ("nan", "inf", "-inf"):
            with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
                from_dict(RunConfig, apply_overrides({}, [f"{key}={value}"]))


def test_float_lists_refuse_nan():
    # a union field (list[float] | None) names the key and its type, not the element
    with pytest.raises(ConfigError, match=r"data\.phases\[0\]\.weights: \[1, 'nan'\] is not a valid list"):
        from_dict(
            RunConfig, {"data": {"phases": [{"at": 0.0, "sources": ["a", "b"], "weights": [1, "nan"]}]}}
        )


def test_direct_construction_checks_finiteness_too():
    """The dataclasses validate NaN themselves (a NaN slips past `x <= 0`), without from_dict."""
    from inkling_fp4.config.trainer import LogConfig, MonitorConfig, OptimConfig

    nan = float("nan")
    for kwargs in (
        {"lr": nan},
        {"lr": float("inf")},
        {"eps": nan},
        {"grad_clip": nan},
        {"weight_decay": nan},
    ):
        with pytest.raises(ValueError, match="finite"):
            OptimConfig(**kwargs)
    for kwargs in ({"loss_zscore": nan}, {"grad_min_ratio": nan}, {"min_rel_spread": float("inf")}):
        with pytest.raises(ValueError):
            MonitorConfig(**kwargs)
    with pytest.raises(ValueError, match="log.peak_flops"):
        LogConfig(peak_flops=0.0)


def test_finite_values_still_load():
    cfg = from_dict(
        RunConfig, apply_overrides({}, ["optim.lr=3e-4", "optim.grad_clip=0", "log.peak_flops=1e15"])
    )
    assert cfg.optim.lr == 3e-4 and cfg.optim.grad_clip == 0.0 and cfg.log.peak_flops == 1e15


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_cli_refuses_bad_lr_before_creating_the_run_dir(monkeypatch, capsys, tmp_path, value):
    import sys

    from inkling_fp4.cli import main

    run_dir = tmp_path / "D"
    monkeypatch.setattr(sys, "argv", ["fp4train", "pretrain", "--run-dir", str(run_dir), f"optim.lr={value}"])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "optim.lr" in err and "Traceback" not in err
    assert not run_dir.exists()
