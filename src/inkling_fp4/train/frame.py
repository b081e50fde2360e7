"""What every stage's ``run()`` shares: the frame around it and its end.

A stage builds its own data, model and task; around that:

    with stage_frame(cfg, run_dir, resume) as (dist, start):   determinism, the process group, the
        ... build data, model, Trainer, task ...              run directory's plan (read only)
        return finish(trainer, task, start, tokenizer, ...)   restore the checkpoint, write the run
                                                              directory, train, say what to run next
"""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from inkling_fp4 import distributed as D
from inkling_fp4.config import RunConfig
from inkling_fp4.runs.directory import RunStart, plan_start
from inkling_fp4.trainer import determinism
from inkling_fp4.trainer.fit import fit
from inkling_fp4.trainer.trainer import Trainer


@dataclass
class RunResult:
    run_dir: Path
    step: int
    interrupted_by: int | None
    """The signal that stopped the run after its checkpoint (None: finished, or train.stop_after)."""
    next_commands: list[str] = field(default_factory=list)
    """What to run next on this run, as shell commands (:func:`next_commands`)."""


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
    return RunResult(start.run_dir, result.step, result.interrupted_by,
                     next_commands(trainer.cfg, start.run_dir, result.step))  # fmt: skip


PRETRAIN_PROMPT = "def fibonacci(n):"
"""A prompt in the built-in corpus's language (Python sources)."""
CHAT_PROMPT = "Compute 12 + 30. End your answer with #### followed by the result."
"""A prompt of the built-in arithmetic task, as sft-tiny's examples and rl-tiny's prompts word it."""


def next_commands(cfg: RunConfig, run_dir: Path, step: int) -> list[str]:
    """The commands that follow a run stopped at ``step``: its resume if unfinished, then the next stage,
    generate, eval and export."""
    here = shlex.quote(str(run_dir))
    commands = [f"fp4train {cfg.stage} --resume --run-dir {here}"] if step < cfg.train.steps else []
    if cfg.stage == "pretrain":
        prompt = PRETRAIN_PROMPT if cfg.data.source == "builtin" else "The"
        return [*commands, f"fp4train sft --from {here}",
                f"fp4train generate --from {here} --prompt {shlex.quote(prompt)}"]  # fmt: skip
    if cfg.stage == "sft":
        commands.append(f"fp4train rollout --from {here}")
    task = cfg.rl.task if cfg.stage == "rollout" else "arithmetic"
    commands += [
        f"fp4train generate --from {here} --prompt {shlex.quote(CHAT_PROMPT)}",
        f"fp4train eval --from {here} --task {shlex.quote(task)}",
    ]
    if cfg.stage == "rollout":
        out = shlex.quote(f"exports/{Path(run_dir).name}-hf")
        commands.append(f"fp4train export --from {here} --format hf --out {out}")
    return commands
