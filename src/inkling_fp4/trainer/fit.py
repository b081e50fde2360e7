"""fit: a task trained to the end on the run's log / eval / checkpoint cadence; SIGINT / SIGTERM end
the step in flight, checkpoint, and report the signal (a second SIGINT: see interrupt.py)."""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from inkling_fp4 import distributed as D
from inkling_fp4.runs.checkpoint import STATE_FILE, checkpoint_dirs
from inkling_fp4.runs.metrics import format_duration
from inkling_fp4.trainer.flops import mfu
from inkling_fp4.trainer.interrupt import StoppedAtOnce, StopSignal
from inkling_fp4.trainer.step_profiler import StepProfiler
from inkling_fp4.trainer.trainer import Task, Trainer


@dataclass
class FitResult:
    step: int
    interrupted_by: int | None
    """The signal (SIGINT, SIGTERM) that ended the run early after a checkpoint, or None."""
    checkpoint: Path | None


def _log_evaluation(trainer: Trainer, task: Task, step: int) -> dict | None:
    values = task.evaluate(trainer)
    if values is not None:
        phase = trainer.wsd.phase_at(step)
        trainer.log.log({"step": step, "tokens": trainer.tokens["real"], **values, "phase": phase})
        trainer.log.info(_eval_line(step, values))
    return values


def fit(trainer: Trainer, task: Task) -> FitResult:
    """Train ``task`` until ``train.steps`` (or ``train.stop_after``, or a signal), on the run's
    log / eval / checkpoint cadence. Returns where it stopped and why."""
    cfg, dist, log = trainer.cfg, trainer.dist, trainer.log
    stop = StopSignal()
    last_val, path, interrupted_by = None, None, None
    step = trainer.step_count
    if step >= cfg.train.steps:
        log.info(f"the run is already complete ({step} of {cfg.train.steps} steps); nothing to do")
    # throughput counts training time only: evaluation and checkpoint time goes to `paused`
    timer_t0, timer_steps, timer_tokens, paused = time.perf_counter(), 0, 0, 0.0
    session_time, session_steps = 0.0, 0
    trainer.graph_on(step, first=True, own_loss=task.loss_fn is not None)
    profiler = StepProfiler(cfg.log.profile_steps, trainer.run_dir, trainer.device, dist.is_main)
    try:
        if cfg.eval.at_start and step == 0 and cfg.train.steps > 0:
            _log_evaluation(trainer, task, 0)
        timer_t0 = time.perf_counter()
        while trainer.step_count < cfg.train.steps:
            profiler.before(trainer.step_count + 1)
            batches = task.next_batches(trainer.micro, trainer.accum)
            result = trainer.step(batches, task.loss_fn, task.real_tokens(batches))
            step = trainer.step_count
            timer_steps += 1
            timer_tokens += result.real_tokens
            log.advance(step)

            if step % cfg.train.log_every == 0 or step == cfg.train.steps or result.verdict.skip:
                elapsed = time.perf_counter() - timer_t0 - paused
                session_time += elapsed
                session_steps += timer_steps
                tok_s = timer_tokens / elapsed
                record = {
                    "step": step, "tokens": trainer.tokens["real"], "loss": result.loss, "lr": result.lr,
                    "grad_norm": result.grad_norm, "precision": trainer.precision_label(),
                    "phase": trainer.wsd.phase_at(step), "tokens_per_s": tok_s,
                    "mfu": mfu(trainer.flops_per_token, tok_s, dist.world_size, trainer.peak),
                    "eta_s": (cfg.train.steps - step) * session_time / session_steps,
                    "skipped": result.verdict.skip, "trained_tokens": trainer.tokens["trained"],
                }  # fmt: skip
                if trainer.device.type == "cuda":  # this rank's: the ranks of DDP and FSDP are alike
                    record["peak_mem_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
                record.update(task.step_metrics())  # the stage's own figures (rewards, mismatch, ...)
                if trainer.live_gap is not None:
                    record["baseline_loss"] = trainer.live_gap.at(step)
                    record["gap"] = trainer.live_gap.gap(step, result.loss)
                log.log_step(record)
                timer_t0, timer_steps, timer_tokens, paused = time.perf_counter(), 0, 0, 0.0

            pause_t0 = time.perf_counter()
            profiled = profiler.after(step)
            if profiled is not None:
                log.event(step, "profile", f"profile: {profiled}/kernels.md, {profiled}/trace.json")
            interrupted = D.any_rank(stop.requested, dist)
            last = step == cfg.train.steps or step == cfg.train.stop_after or interrupted
            if (cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.train.steps:
                values = _log_evaluation(trainer, task, step)
                if values is not None:
                    last_val = values.get("val_loss_bf16")
            if (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or last:
                with stop.writing_checkpoint():
                    path = trainer.checkpoint(task.state_dict())
                log.event(step, "checkpoint", f"checkpoint: {path}")
                if D.any_rank(stop.again, dist):  # a second Ctrl-C waited for this checkpoint
                    interrupted = last = True
            if last:
                if interrupted and step < cfg.train.steps:
                    interrupted_by = stop.signum
                    # recorded only: the caller says it once, with the command that resumes
                    message = f"interrupted after step {step}; continue with --resume"
                    log.log({"step": step, "event": "interrupt", "message": message})
                elif step < cfg.train.steps:
                    log.event(
                        step, "stop", f"stopped after step {step} (train.stop_after); continue with --resume"
                    )
                break
            paused += time.perf_counter() - pause_t0
    except StoppedAtOnce:  # said here: the CLI (Typer) turns any KeyboardInterrupt into a silent exit 130
        message = _stopped_at_once(trainer, stop.stopped_writing)
        if dist.is_main:
            print(message, file=sys.stderr, flush=True)
        raise StoppedAtOnce(message) from None
    finally:
        stop.restore()
        profiler.finish()  # a run stopped inside the range: the steps it profiled
        trainer.close()

    if dist.is_main and step == cfg.train.steps and session_steps:
        val = f", val loss (bf16) {last_val:.4f}" if last_val is not None else ""
        print(f"done: {step} steps in {format_duration(session_time)}{val}", flush=True)
    return FitResult(step, interrupted_by, path)


def _stopped_at_once(trainer: Trainer, writing: bool) -> str:
    """What a Ctrl-C that stopped the run at once left: --resume starts from the newest complete
    checkpoint on disk (``writing``: the Ctrl-C came while one was written, which may have ended)."""
    saved = [step for step, path in checkpoint_dirs(trainer.run_dir) if (path / STATE_FILE).is_file()]
    newest = max(saved, default=0)
    resume = f"fp4train {trainer.cfg.stage} --resume --run-dir {trainer.run_dir}"
    if writing and saved and newest == trainer.step_count:  # the write had reached its rename
        return f"stopped at once by SIGINT after the checkpoint of step {newest}; continue with {resume}"
    start = f"from step {newest}" if saved else "from step 0 (there is no checkpoint yet)"
    return f"stopped at once by SIGINT, no new checkpoint written; {resume} starts {start}"


def _eval_line(step: int, values: dict) -> str:
    parts = []
    if "val_loss_bf16" in values:
        parts.append(f"val loss bf16 {values['val_loss_bf16']:.4f}")
        if values.get("val_precision", "bf16") != "bf16":
            parts[-1] += f" | {values['val_precision']} {values['val_loss']:.4f}"
    parts += [f"{k} {v:.4f}" for k, v in values.items() if k.startswith("eval_") and isinstance(v, float)]
    return f"eval step {step}: " + " | ".join(parts)


SIGNAL_EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
"""Exit code of a run interrupted (after its checkpoint) by each signal: 128 + the signal number."""
