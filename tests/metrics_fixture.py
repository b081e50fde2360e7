"""Hand-made run directories (config.yaml + metrics.jsonl) with known loss gaps, for the compare tests.

The fixture schedule (steps count from 1, as in runs/schedule.py): 100 steps, warmup steps 1-10,
stable 11-80, decay over the final 20% (steps 81-100), the BF16 switch at step 81, logged at every
step, 2 x 16 tokens per step. The baseline's loss is a falling line plus noise that both runs share
(the same batches); the other run's loss is the baseline's times (1 + g) with a known g per phase,
so every gap the analysis reports has an exact answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inkling_fp4.config import RunConfig, apply_overrides, from_dict, save_config

STEPS = 100
WARMUP_STEPS = 10
WARMUP_END = 11
"""First stable step."""
DECAY_START = 81
"""First decay step."""
TOKENS_PER_STEP = 2 * 16
BASE_OVERRIDES = [
    "name=fx",
    f"train.steps={STEPS}",
    f"train.warmup_steps={WARMUP_STEPS}",
    "train.decay_fraction=0.2",
    "train.log_every=1",
    "train.batch_size=2",
    "data.seq_len=16",
]


def phase_of(step: int) -> str:
    return "warmup" if step < WARMUP_END else "stable" if step < DECAY_START else "decay"


def baseline_losses(rng: np.random.Generator) -> dict[int, float]:
    steps = np.arange(1, STEPS + 1)
    losses = 5.0 - 0.02 * steps + 0.05 * rng.standard_normal(STEPS)
    return dict(zip(steps.tolist(), losses.tolist(), strict=True))


def write_run(
    run_dir: Path,
    train: dict[int, float],
    val: dict[int, float] | None = None,
    val_in_precision: dict[int, float] | None = None,
    overrides: list[str] = (),
    precision: str = "nvfp4",
    extra_lines: list[str] = (),
) -> Path:
    """A run directory with this config and these training / validation losses (step -> loss);
    ``val`` is the BF16 evaluation, ``val_in_precision`` the one in the training precision."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = from_dict(
        RunConfig, apply_overrides({}, [*BASE_OVERRIDES, f"precision.recipe={precision}", *overrides])
    )
    save_config(cfg, run_dir / "config.yaml")
    lines = []
    for step, loss in train.items():
        row = {
            "step": step,
            "tokens": step * TOKENS_PER_STEP,
            "loss": loss,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "precision": precision,
            "tokens_per_s": 100.0,
            "phase": phase_of(step),
        }
        lines.append(json.dumps(row))
        if val and step in val:
            row = {"step": step, "tokens": step * TOKENS_PER_STEP, "val_loss_bf16": val[step]}
            row["val_loss"] = (val_in_precision or val)[step]
            lines.append(json.dumps(row))
    lines.extend(extra_lines)
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


def scaled(losses: dict[int, float], gaps: dict[str, float]) -> dict[int, float]:
    """Each loss times (1 + the gap of its phase)."""
    return {s: v * (1.0 + gaps[phase_of(s)]) for s, v in losses.items()}


def make_pair(
    tmp: Path,
    gaps: dict[str, float],
    seed: int | None = None,
    val_gaps: dict[str, float] | None = None,
    precision_penalty: float = 0.0,
):
    """(run_dir, baseline_dir): an nvfp4 run whose losses are the fp8 baseline's times (1 + gap); its
    validation loss in its own precision is its BF16 one times (1 + precision_penalty)."""
    rng = np.random.default_rng(seed)
    base = baseline_losses(rng)
    val_base = {s: base[s] + 0.1 for s in (20, 40, 60, 80, 90, 100)}
    val_run = scaled(val_base, val_gaps or gaps)
    b = write_run(tmp / "fp8", base, val_base, precision="fp8", overrides=["precision.switch_to_bf16=never"])
    in_precision = {s: v * (1.0 + precision_penalty) for s, v in val_run.items()}
    a = write_run(tmp / "nvfp4", scaled(base, gaps), val_run, in_precision)
    return a, b
