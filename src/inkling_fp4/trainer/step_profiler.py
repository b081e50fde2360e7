"""``log.profile_steps``: the torch profiler around a range of a run's steps, written into the run.

Why: a step's time says how far a recipe is from its target; which kernels (quantizers, GEMMs, glue,
the sampler's decode step in RL) take it says what to make faster, and that is wanted on the command
a user runs, not only in a bench script. ``fit`` calls :meth:`StepProfiler.before` ahead of each step
(for RL, the step includes its sampling) and :meth:`StepProfiler.after` when it ends; the main rank
writes ``<run>/profile/trace.json`` and ``<run>/profile/kernels.md``. A run stopped inside the range
writes the steps it profiled.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from inkling_fp4.trainer.kernel_groups import (
    breakdown,
    format_breakdown,
    format_rows,
    format_top,
    top_kernels,
)

PROFILE_DIR = "profile"


class StepProfiler:
    def __init__(self, steps: list[int] | None, run_dir: Path, device: torch.device, is_main: bool):
        self.first, self.last = steps if steps else (0, -1)
        self.out = Path(run_dir) / PROFILE_DIR
        self.cuda = device.type == "cuda"
        self.device = device
        self.enabled = steps is not None and is_main
        self._prof: profile | None = None
        self._t0, self._steps, self._start = 0.0, 0, 0

    def before(self, step: int) -> None:
        """``step`` (1-based) is about to run."""
        if self.enabled and self._prof is None and self.first <= step <= self.last:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._sync()
            self._prof = profile(activities=activities)
            self._prof.start()
            self._t0, self._steps, self._start = time.perf_counter(), 0, step

    def after(self, step: int) -> Path | None:
        """``step`` ended; at the range's last step the files are written (returns the folder)."""
        if self._prof is None:
            return None
        self._steps += 1
        return self.finish() if step >= self.last else None

    def finish(self) -> Path | None:
        """Stop and write what was profiled (None if nothing was)."""
        prof, self._prof = self._prof, None
        if prof is None or self._steps == 0:
            if prof is not None:
                prof.stop()
            return None
        self._sync()
        wall_ms = (time.perf_counter() - self._t0) * 1e3 / self._steps
        prof.stop()
        self.out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out / "trace.json"))
        (self.out / "kernels.md").write_text(self._summary(prof, wall_ms))
        return self.out

    def _summary(self, prof: profile, wall_ms: float) -> str:
        n = self._steps
        events = prof.key_averages()
        span = f"steps {self._start}-{self._start + n - 1}"
        lines = [f"# Profile of {span} ({n} steps, {wall_ms:.2f} ms a step)", ""]
        if self.cuda:
            kernels = [e for e in events if str(e.device_type).endswith("CUDA")]
            lines += ["```", format_breakdown("device", breakdown(kernels, n), wall_ms), "",
                      format_top(top_kernels(kernels, n, 30)), "```", ""]  # fmt: skip
        ops = sorted((e for e in events if not str(e.device_type).endswith("CUDA")),
                     key=lambda e: -e.self_cpu_time_total)[:30]  # fmt: skip
        rows = [("", e.key, e.self_cpu_time_total / 1e3 / n, round(e.count / n)) for e in ops]
        lines += ["```", format_rows("host ops by self CPU time (ms per step, calls per step)", rows, 0, 120),
                  "```", ""]  # fmt: skip
        return "\n".join(lines)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
