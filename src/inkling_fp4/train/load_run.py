"""A run's model as one call, for every stage that starts from another: sft, rollout, export.

``load_run(path)`` takes a run directory (its newest checkpoint whose checksums verify), one
checkpoint directory (``<run>/checkpoints/step_<N>``) or a Nemotron-H directory in transformers'
layout (``config.json`` of ``model_type: nemotron_h``, or a hub id when online; see
:mod:`inkling_fp4.interop.importer`) and returns the run's config (as recorded, amendments applied;
for Nemotron-H the imported model section), its model with the checkpoint's weights, and its
tokenizer. The model is a plain ``HybridLM`` in FP32 master weights with no precision policy
applied: the caller applies its own recipe.

``newest_run(root)`` is how every command without ``--from`` finds what to start from: the run under
``root`` (of any stage the command can use) whose last checkpoint was written last, whatever stage
wrote it; :func:`default_from` says on the console which run that is.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inkling_fp4.config import RunConfig
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import UserError
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.train.checkpoint import (
    STATE_FILE,
    Checkpoint,
    CheckpointError,
    checkpoint_dirs,
    latest_good,
    load_checkpoint,
    load_model_tensors,
)
from inkling_fp4.train.run_dir import CONFIG_FILE, TOKENIZER_FILE, recorded_config

RUNS_ROOT = Path("runs")
"""Where commands put runs by default (``runs/<name>``), and where ``--from`` looks without a path."""


def find_checkpoint(path: str | Path) -> tuple[Path, Checkpoint]:
    """(run directory, verified checkpoint) for a run directory or a checkpoint directory. For a
    Nemotron-H directory: (that directory, a step-0 Checkpoint of it whose weights are not read yet:
    :func:`load_run_checkpoint` reads them)."""
    from inkling_fp4.interop.importer import is_nemotron_h_dir, looks_like_hub_id, resolve

    if looks_like_hub_id(path):
        path = resolve(path)
    path = Path(path)
    if is_nemotron_h_dir(path) and not (path / CONFIG_FILE).is_file():
        return path, Checkpoint(path=path, step=0, model={}, optimizer={}, state={})
    if not path.exists():
        raise UserError(
            f"--from {path}: no such directory; pass a run directory (runs/<name>) or a checkpoint"
        )
    if (path / STATE_FILE).is_file() or path.parent.name == "checkpoints":
        try:
            return path.parent.parent, load_checkpoint(path)
        except CheckpointError as e:
            raise UserError(f"--from {path}: {e}; pass another checkpoint or its run directory") from None
    if not (path / CONFIG_FILE).is_file():
        raise UserError(
            f"--from {path}: not a run directory (no {CONFIG_FILE}) nor a checkpoint (no {STATE_FILE}); "
            "pass a directory written by fp4train pretrain or sft"
        )
    reasons: list[str] = []
    ckpt = latest_good(path, report=reasons.append)
    if ckpt is None:
        why = "; ".join(reasons) if reasons else "it has none yet"
        raise UserError(f"--from {path}: no checkpoint verifies ({why}); let the run write one first")
    return path, ckpt


def load_run(path: str | Path, device: str | torch.device = "cpu") -> tuple[RunConfig, HybridLM, Tokenizer]:
    """(config, model with the checkpoint's weights on ``device``, tokenizer) of a run or checkpoint."""
    cfg, model, tokenizer, _ = load_run_checkpoint(path, device)
    return cfg, model, tokenizer


def run_config(run_dir: Path) -> RunConfig | None:
    """The recorded config of a run directory, the imported one of a Nemotron-H directory, or None."""
    from inkling_fp4.interop.importer import imported_config, is_nemotron_h_dir

    cfg = recorded_config(run_dir)
    if cfg is None and is_nemotron_h_dir(run_dir):
        cfg, _ = imported_config(run_dir)
    return cfg


def load_run_checkpoint(path: str | Path, device: str | torch.device = "cpu"):
    """:func:`load_run` plus the checkpoint it read (for logs and the config's ``init_from``)."""
    run_dir, ckpt = find_checkpoint(path)
    from inkling_fp4.interop.importer import is_nemotron_h_dir, load_nemotron_h

    if is_nemotron_h_dir(run_dir) and not (run_dir / CONFIG_FILE).is_file():
        cfg, model, tokenizer = load_nemotron_h(run_dir, device)
        return cfg, model, tokenizer, ckpt
    cfg = recorded_config(run_dir)
    if cfg is None:
        raise UserError(f"--from {path}: {run_dir} has no {CONFIG_FILE}; pass a checkpoint of a complete run")
    tokenizer_file = run_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise UserError(f"--from {path}: {run_dir} has no {TOKENIZER_FILE}; pass a complete run directory")
    tokenizer = Tokenizer.from_file(tokenizer_file)
    device = torch.device(device)
    with torch.device(device):
        model = HybridLM(cfg.model)
    try:
        load_model_tensors(model, ckpt.model, device)
    except CheckpointError as e:
        raise UserError(f"--from {path}: {e}") from None
    return cfg, model, tokenizer, ckpt


def newest_run(
    root: str | Path, stages: tuple[str, ...] | None = None, exclude: Path | None = None
) -> Path | None:
    """The run under ``root`` (of one of ``stages``; None: any) whose last complete checkpoint was
    written last."""
    root = Path(root)
    if not root.is_dir():
        return None
    best, best_time = None, -1.0
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        if exclude is not None and run_dir.resolve() == Path(exclude).resolve():
            continue
        try:
            cfg = recorded_config(run_dir)
        except UserError:
            continue
        if cfg is None or (stages is not None and cfg.stage not in stages):
            continue
        done = [p / STATE_FILE for _, p in checkpoint_dirs(run_dir) if (p / STATE_FILE).is_file()]
        if done and (t := done[-1].stat().st_mtime) > best_time:
            best, best_time = run_dir, t
    return best


def default_from(echo, stages: tuple[str, ...] | None = None, exclude: Path | None = None) -> Path:
    """What ``--from`` means when it is left out: the newest run under ``runs/`` (of one of ``stages``,
    the ones the command can start from; None: any), named on ``echo``."""
    kind = f"{' or '.join(stages)} " if stages else ""
    found = newest_run(RUNS_ROOT, stages, exclude)
    if found is None:
        raise UserError(f"no {kind}run with a checkpoint under {RUNS_ROOT}/; run `fp4train pretrain` first, "
                        "or pass --from RUN")  # fmt: skip
    cfg = recorded_config(found)
    last = [name for name, p in checkpoint_dirs(found) if (p / STATE_FILE).is_file()][-1]
    echo(f"--from: {found} ({cfg.stage} run, step {last}), the {kind}run under {RUNS_ROOT}/ whose last "
         "checkpoint is the newest")  # fmt: skip
    return found


def describe(path: str | Path) -> list[str]:
    """What ``--from path`` finds, as lines: the kind of directory, the checkpoint, the model, the
    tokenizer (no weights are read)."""
    from inkling_fp4.interop.importer import imported_config, is_nemotron_h_dir

    run_dir, ckpt = find_checkpoint(path)
    if is_nemotron_h_dir(run_dir) and not (run_dir / CONFIG_FILE).is_file():
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
