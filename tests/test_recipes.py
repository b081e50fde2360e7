"""Every recipe in recipes/ parses; the paper's recipe carries the paper's numbers."""

import pytest

from inkling_fp4.config import RECIPES_DIR, RunConfig, load_config
from inkling_fp4.errors import ConfigError

RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))


def test_the_recipes_are_there():
    assert {p.stem for p in RECIPES} >= {"tiny", "hybrid-125m", "hybrid-350m", "nemotron-h-12b"}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.name == path.stem
    assert cfg.train.batch_size % (cfg.train.micro_batch_size or cfg.train.batch_size) == 0
    assert cfg.model.vocab_size >= cfg.data.vocab_size


def test_tiny_is_the_default_and_runs_on_cpu():
    cfg = load_config()
    assert cfg.name == "tiny" and cfg.train.device == "cpu" and cfg.data.source == "builtin"
    assert cfg.precision.recipe == "nvfp4"


def test_paper_recipe():
    cfg = load_config("nemotron-h-12b")
    assert cfg.model.preset == "nemotron-h-12b"
    assert cfg.data.seq_len == 8192 and cfg.train.batch_size == 736
    assert cfg.optim.lr == 4.5e-4 and cfg.optim.lr * cfg.train.min_lr_ratio == pytest.approx(4.5e-6)
    assert cfg.train.decay_fraction == 0.2
    assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.weight_decay) == (0.9, 0.95, 0.1)
    assert cfg.precision.recipe == "nvfp4"
    assert (cfg.precision.bf16_first_layers, cfg.precision.bf16_last_layers) == (2, 8)


def test_single_gpu_recipes():
    for name in ("hybrid-125m", "hybrid-350m"):
        cfg = load_config(name)
        assert cfg.data.seq_len == 2048 and cfg.train.device in ("auto", "cuda")


def test_preset_under_explicit_keys_and_unknown_preset():
    cfg = load_config(None, ["model.preset=hybrid-125m", "model.d_model=384"])
    assert cfg.model.d_model == 384 and cfg.model.n_heads == 12  # explicit beats the preset, rest kept
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.preset=gpt-17"])
    assert "gpt-17" in str(e.value) and "hybrid-125m" in str(e.value)  # lists the known presets
