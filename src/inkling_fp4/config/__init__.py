"""Run configuration: typed dataclasses, YAML recipes and dotted overrides.

Precedence is dataclass defaults < recipe YAML < ``key=value`` overrides. Each section owns its
dataclass next to the code that uses it; the trainer's and the sampler's live here (trainer.py,
sampler.py) so that every layer that reads a run's config can import them. Plain data is converted
strictly: an unknown key or a value of the wrong type is a :class:`ConfigError` naming the key,
never a silent default.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Union

import yaml

from inkling_fp4.config.sampler import SamplerConfig
from inkling_fp4.config.trainer import (
    CheckpointConfig,
    EvalConfig,
    LogConfig,
    MonitorConfig,
    OptimConfig,
    TrainConfig,
)
from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.sft_config import SFTConfig
from inkling_fp4.errors import ConfigError
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.rl.config import RLConfig

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
"""The built-in recipes (package data: a link to ``recipes/`` in the repository, a copy when installed)."""


@dataclass
class RunConfig:
    """Everything a run needs; written to ``<run_dir>/config.yaml`` so the run can be repeated."""

    name: str = "tiny"
    """Run name: the default run directory is ``runs/<name>`` and wandb's run name."""
    stage: str = "pretrain"
    """Which stage trains this run: pretrain, sft or rollout (RL), each from its own ``fp4train`` command."""
    init_from: str | None = None
    """The run, checkpoint or Nemotron-H directory this run starts from (``--from``, resolved to the
    checkpoint used): always for sft and rollout; None: pretraining from random weights."""
    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Generation (``fp4train generate`` / ``eval``, rollouts): filters, stops, precision."""
    rl: RLConfig = field(default_factory=RLConfig)
    """The rollout stage: task, groups, GRPO variant, mismatch correction (rl/config.py)."""

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"stage must be one of {', '.join(STAGES)}, not '{self.stage}'")


STAGES = ("pretrain", "sft", "rollout")
"""Stages that train a run, each from its own command."""


# ----------------------------------------------------------------------------------------------
# plain data -> dataclasses


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        # Try the exact-type match first so that "1" stays a str in Union[int, str] and 3 an int.
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: a is not type(value)):
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} is not a valid {_type_name(tp)}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp) or (Any, Any)
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if is_dataclass(tp):
        return from_dict(tp, value, key)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key}: expected an integer, got {value!r}")
    if tp is float:
        number = None
        # a str too: YAML 1.1 reads "3e-4" (no dot) as a string
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                number = float(value)
            except ValueError:
                pass
            except OverflowError:  # an int beyond every float
                number = float("inf")
        if number is None:
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        # NOTE: no config field takes NaN or Inf ("nan <= 0" is False: a NaN slips past every range
        # check), so they are refused here once for all, before any __post_init__ sees them
        if not abs(number) < float("inf"):  # False for NaN too
            raise ConfigError(f"{key}: {value} is not a finite number; give a finite value")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, recursively, rejecting unknown keys."""
    where = prefix or "the recipe"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    valid = {f.name: f for f in fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in valid:
            raise ConfigError(
                f"unknown config key '{full}'; valid keys under {where}: {', '.join(sorted(valid))}"
            )
        kwargs[key] = _coerce(value, hints[key], full)
    try:
        return cls(**kwargs)
    except ValueError as e:  # __post_init__ validation speaks to the user
        raise ConfigError(f"{where}: {e}") from None


def to_dict(cfg: Any) -> Any:
    """Dataclass -> plain data (the inverse of from_dict)."""
    if is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


# ----------------------------------------------------------------------------------------------
# recipes and overrides


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.steps=200`` -> (["train", "steps"], 200); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key=value (e.g. train.steps=200)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
        try:
            value = float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            pass
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Merge dotted overrides into nested plain data (validated later by from_dict)."""
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def resolve_recipe_path(recipe: str | Path) -> Path:
    """A path, or a bare name looked up in the built-in ``recipes/`` folder (``tiny``)."""
    p = Path(recipe)
    if p.is_file():
        return p
    for cand in (RECIPES_DIR / f"{recipe}.yaml", RECIPES_DIR / str(recipe)):
        if cand.is_file():
            return cand
    known = sorted(q.stem for q in RECIPES_DIR.glob("*.yaml")) if RECIPES_DIR.is_dir() else []
    raise ConfigError(
        f"recipe file '{recipe}' not found; pass a path to a YAML file or one of the built-in "
        f"recipes: {', '.join(known) or '(none)'}"
    )


def recipe_description(path: Path) -> str:
    """What a recipe is for: the first sentence of the comment it opens with (after its ``name:``)."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines).removeprefix(f"{path.stem}:").strip()
    first = re.match(r".*?[.!?](?=\s|$)", text)
    text = first.group(0) if first else text
    return text[:1].upper() + text[1:]


def load_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections (model:, train:, ...)")
    return data


def load_config(recipe: str | Path | None = "tiny", overrides: list[str] | None = None, cls=RunConfig):
    """Defaults < recipe YAML < overrides, validated into ``cls``."""
    data = load_yaml(resolve_recipe_path(recipe)) if recipe is not None else {}
    data = apply_overrides(data, list(overrides or []))
    return from_dict(cls, data)


def save_config(cfg: Any, path: Path) -> None:
    """Write the config whole or not at all (a temporary file renamed over ``path``): runs trained side
    by side read each other's configs, and a crash must not leave a truncated one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    os.replace(tmp, path)


def replace(cfg: Any, **changes: Any) -> Any:
    return dataclasses.replace(cfg, **changes)
