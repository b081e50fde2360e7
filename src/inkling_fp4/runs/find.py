"""Finding a run and its checkpoint: what every command that starts from another run reads.

A run is named by its directory (its newest checkpoint that verifies) or one checkpoint directory
(``<run>/checkpoints/step_<N>``); Nemotron-H directories are :mod:`inkling_fp4.interop.load_run`'s.
"""

from __future__ import annotations

from pathlib import Path

import torch

from inkling_fp4.config import RunConfig
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import UserError
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.runs.checkpoint import (
    STATE_FILE,
    Checkpoint,
    CheckpointError,
    build_model,
    checkpoint_dirs,
    latest_good,
    load_checkpoint,
)
from inkling_fp4.runs.directory import CONFIG_FILE, TOKENIZER_FILE, recorded_config

RUNS_ROOT = Path("runs")
"""Where commands put runs by default (``runs/<name>``), and where ``--from`` looks without a path."""


def find_run_checkpoint(path: str | Path) -> tuple[Path, Checkpoint]:
    """(run directory, verified checkpoint) for a run directory or a checkpoint directory."""
    path = Path(path)
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


def read_run(
    run_dir: Path, ckpt: Checkpoint, device: str | torch.device = "cpu", path: str | Path | None = None
) -> tuple[RunConfig, HybridLM, Tokenizer]:
    """(config, model with ``ckpt``'s weights on ``device``, tokenizer); ``path``: what ``--from`` said."""
    path = run_dir if path is None else path
    cfg = recorded_config(run_dir)
    if cfg is None:
        raise UserError(f"--from {path}: {run_dir} has no {CONFIG_FILE}; pass a checkpoint of a complete run")
    tokenizer_file = run_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        raise UserError(f"--from {path}: {run_dir} has no {TOKENIZER_FILE}; pass a complete run directory")
    tokenizer = Tokenizer.from_file(tokenizer_file)
    return cfg, build_model(cfg.model, device, ckpt.model, source=path), tokenizer


def newest_run(
    root: str | Path, stages: tuple[str, ...] | None = None, exclude: Path | None = None
) -> Path | None:
    """The run under ``root`` (of one of ``stages``; None: any) whose last complete checkpoint is newest."""
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
