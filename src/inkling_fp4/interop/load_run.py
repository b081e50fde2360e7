"""A run's model as one call, for every command that starts from another: sft, rollout, generate, export.

It takes a run directory, a checkpoint directory or a Nemotron-H directory or hub id (:mod:`~.importer`);
run directories alone are :mod:`inkling_fp4.runs.find`'s. The model is a plain ``HybridLM`` in FP32
master weights with no precision policy applied: the caller applies its own recipe.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inkling_fp4.config import RunConfig
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.interop.importer import (
    imported_config,
    is_nemotron_h_dir,
    load_nemotron_h,
    looks_like_hub_id,
    resolve,
)
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.model.vocab import fit_tokenizer
from inkling_fp4.runs.checkpoint import Checkpoint
from inkling_fp4.runs.directory import CONFIG_FILE, TOKENIZER_FILE, recorded_config
from inkling_fp4.runs.find import find_run_checkpoint, read_run


def _imported(path: Path) -> bool:
    """A Nemotron-H directory that is not also a run directory."""
    return is_nemotron_h_dir(path) and not (path / CONFIG_FILE).is_file()


def find_checkpoint(path: str | Path) -> tuple[Path, Checkpoint]:
    """(run directory, verified checkpoint) of a run or checkpoint directory; of a Nemotron-H directory,
    (it, a step-0 Checkpoint whose weights :func:`load_run_checkpoint` reads later)."""
    if looks_like_hub_id(path):
        path = resolve(path)
    path = Path(path)
    if _imported(path):
        return path, Checkpoint(path=path, step=0, model={}, optimizer={}, state={})
    return find_run_checkpoint(path)


def load_run(path: str | Path, device: str | torch.device = "cpu") -> tuple[RunConfig, HybridLM, Tokenizer]:
    """(config, model with the checkpoint's weights on ``device``, tokenizer) of a run or checkpoint."""
    cfg, model, tokenizer, _ = load_run_checkpoint(path, device)
    return cfg, model, tokenizer


def run_config(run_dir: Path) -> RunConfig | None:
    """The recorded config of a run directory, the imported one of a Nemotron-H directory, or None."""
    cfg = recorded_config(run_dir)
    if cfg is None and is_nemotron_h_dir(run_dir):
        cfg, _ = imported_config(run_dir)
    return cfg


def load_run_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """:func:`load_run` plus the checkpoint it read (for logs and the config's ``init_from``)."""
    run_dir, ckpt = find_checkpoint(path)
    if _imported(run_dir):
        cfg, model, tokenizer = load_nemotron_h(run_dir, device)
    else:
        cfg, model, tokenizer = read_run(run_dir, ckpt, device, path)
    return cfg, model, tokenizer, ckpt


def base_weights(
    model: HybridLM, tokenizer: Tokenizer | None = None
) -> tuple[dict[str, torch.Tensor], str | None]:
    """(copies of the loaded model's tensors, to build a stage's own model from; the log line of
    fitting the vocabulary to ``tokenizer``, or None)."""
    grown = None if tokenizer is None else fit_tokenizer(model, tokenizer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, grown


def describe(path: str | Path) -> list[str]:
    """What ``--from path`` finds, as lines: the directory, checkpoint, model and tokenizer (no weights)."""
    run_dir, ckpt = find_checkpoint(path)
    if _imported(run_dir):
        cfg, tokenizer = imported_config(run_dir)
        kind = "a Nemotron-H directory (transformers' layout), its config.json mapped to model.*"
    else:
        cfg = recorded_config(run_dir)
        tokenizer = Tokenizer.from_file(run_dir / TOKENIZER_FILE)
        kind = f"a {cfg.stage} run, checkpoint {ckpt.path.name} (step {ckpt.step})"
    with torch.device("meta"):
        params = HybridLM(cfg.model).num_params()
    m = cfg.model
    return [
        f"--from {path}: {kind}",
        f"model: pattern {m.pattern} ({m.n_layers} layers), d_model {m.d_model}, vocab {m.vocab_size}, "
        f"{params / 1e6:.2f}M parameters, dt_min_clamp {m.dt_min_clamp}",
        tokenizer.describe(),
    ]
