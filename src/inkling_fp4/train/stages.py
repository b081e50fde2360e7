"""Which stage's ``run()`` a config goes to: the one ``if`` over ``RunConfig.stage``."""

from __future__ import annotations

from pathlib import Path

from inkling_fp4.config import RunConfig
from inkling_fp4.train import pretrain, rollout, sft
from inkling_fp4.train.frame import RunResult


def run_stage(cfg: RunConfig, run_dir: Path, resume: bool = False, baseline: Path | None = None) -> RunResult:
    if cfg.stage == "pretrain":
        return pretrain.run(cfg, run_dir, resume=resume, baseline=baseline)
    if cfg.stage == "sft":
        return sft.run(cfg, run_dir, resume=resume, baseline=baseline)
    if cfg.stage == "rollout":
        return rollout.run(cfg, run_dir, resume=resume, baseline=baseline)
    raise AssertionError(f"unknown stage {cfg.stage}")  # RunConfig validates the stage
