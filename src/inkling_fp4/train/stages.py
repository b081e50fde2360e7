"""What every stage's ``run()`` shares, and which ``run()`` a config goes to.

A stage (pretrain.py, sft.py) builds its own data, model and task; around that, every stage has the
same frame and the same end:

    with stage_frame(cfg, run_dir, resume) as (dist, start):   determinism, the process group, the
        ... build data, model, Trainer, task ...              run directory's plan (read only)
        return finish(trainer, task, start, tokenizer, ...)   restore the checkpoint, write the run
                                                              directory, train to the end

``run_stage`` is the one ``if`` over ``RunConfig.stage``, for compare-baseline and the commands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from inkling_fp4.config import RunConfig
from inkling_fp4.train import determinism
from inkling_fp4.train import distributed as D
from inkling_fp4.train.run_dir import RunStart, plan_start
from inkling_fp4.train.trainer import Trainer, fit


@dataclass
class RunResult:
    run_dir: Path
    step: int
    interrupted_by: int | None
    """The signal that stopped the run after its checkpoint (None: finished, or train.stop_after)."""


@contextlib.contextmanager
def stage_frame(
    cfg: RunConfig, run_dir: Path, resume: bool, baseline: Path | None = None
) -> Iterator[tuple[D.DistInfo, RunStart]]:
    """Determinism (before the first GEMM on the GPU: cuBLAS reads its setting once), the process
    group, and the run directory's plan, whose lock is released however the run ends."""
    if cfg.train.deterministic:
        determinism.enable_determinism()
    dist = D.init_distributed(cfg.train.device)
    start = plan_start(cfg, Path(run_dir), resume, dist.is_main, baseline)
    try:
        yield dist, start
    finally:
        start.release()
    D.barrier(dist)
    D.shutdown(dist)


def finish(trainer: Trainer, task, start: RunStart, tokenizer, describe: list[str],
           extra_files: dict[str, str] | None = None) -> RunResult:  # fmt: skip
    """Restore the checkpoint (if any), write the run directory (every check has passed by now), then
    train the task to its end."""
    if start.checkpoint is not None:
        task.load_state_dict(trainer.restore(start.checkpoint))
        start.notes.append(f"resumed from {start.checkpoint.path} (step {trainer.step_count})")
    start.commit(tokenizer, trainer.dist.is_main, extra_files)
    D.barrier(trainer.dist)
    trainer.build()
    trainer.open_log(start.notes, describe)
    result = fit(trainer, task)
    return RunResult(start.run_dir, result.step, result.interrupted_by)


def run_stage(cfg: RunConfig, run_dir: Path, resume: bool = False, baseline: Path | None = None) -> RunResult:
    """Train ``cfg`` with its stage's task."""
    if cfg.stage == "pretrain":
        from inkling_fp4.train import pretrain

        return pretrain.run(cfg, run_dir, resume=resume, baseline=baseline)
    if cfg.stage == "sft":
        from inkling_fp4.train import sft

        return sft.run(cfg, run_dir, resume=resume, baseline=baseline)
    if cfg.stage == "rollout":
        from inkling_fp4.train import rollout

        return rollout.run(cfg, run_dir, resume=resume, baseline=baseline)
    raise AssertionError(f"unknown stage {cfg.stage}")  # RunConfig validates the stage
