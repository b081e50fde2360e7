"""The config of a stage that starts from another run (sft, rollout, continued pretraining): its
recipe and overrides on the base run's model and tokenizer. The base may be a Nemotron-H directory,
which interop reads; nothing below the stages knows that layout.
"""

from __future__ import annotations

from pathlib import Path

from inkling_fp4.config import RunConfig, apply_overrides, from_dict, load_yaml, resolve_recipe_path, to_dict
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.interop.load_run import find_checkpoint, run_config
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.runs.directory import TOKENIZER_FILE


def from_run_config(
    recipe: str | Path | None, overrides: list[str], base: str | Path, *, stage: str, default_recipe: str
) -> RunConfig:
    """The recipe and overrides of a stage on the model of ``base`` (a run or checkpoint directory).
    The model section and the tokenizer are the base run's: a recipe or override that sets one of
    their fields to another value is refused, naming the field and both values."""
    base_dir, ckpt = find_checkpoint(base)
    base_cfg = run_config(base_dir)  # a Nemotron-H directory: its imported config
    if base_cfg is None:
        raise UserError(f"--from {base}: {base_dir} has no config.yaml; pass a complete run directory")
    data = load_yaml(resolve_recipe_path(recipe or default_recipe))
    if stage == "pretrain":  # a pretraining recipe describes its own model: the base's replaces it
        data.pop("model", None)
    data = apply_overrides(data, list(overrides))
    given_model = data.pop("model", None) or {}
    base_model = to_dict(base_cfg.model)
    if not isinstance(given_model, dict):
        raise ConfigError("model: expected a mapping of keys (or leave it out: the model is the base run's)")
    probe = from_dict(ModelConfig, {**base_model, **given_model}, "model")
    for key in given_model:
        if getattr(probe, key) != getattr(base_cfg.model, key):
            raise ConfigError(
                f"model.{key}={getattr(probe, key)!r} disagrees with the checkpoint {ckpt.path} "
                f"(model.{key}={getattr(base_cfg.model, key)!r}); leave the model section out of the {stage} "
                "recipe: the model is the base run's"
            )
    data["model"] = base_model
    data["stage"] = stage
    data["init_from"] = str(ckpt.path)
    section = data.setdefault("data", {})
    if not isinstance(section, dict):
        raise ConfigError("data: expected a mapping of keys")
    if section.get("tokenizer") is not None:
        given = Tokenizer.load(str(section["tokenizer"]))
        own = Tokenizer.from_file(base_dir / TOKENIZER_FILE)
        if given.content_hash != own.content_hash:
            raise ConfigError(
                f"data.tokenizer={section['tokenizer']} is another tokenizer ({given.vocab_size} tokens, "
                f"hash {given.content_hash[:12]}) than the checkpoint's ({own.vocab_size} tokens, hash "
                f"{own.content_hash[:12]}); leave data.tokenizer out: {stage} uses the base run's"
            )
        section["tokenizer"] = None
    section["vocab_size"] = base_cfg.data.vocab_size
    return from_dict(RunConfig, data)
