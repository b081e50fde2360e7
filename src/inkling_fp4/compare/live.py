"""The loss gap while a run trains (``fp4train pretrain --baseline RUN_DIR``), step by step.

The numbers are those of compare/loss_gap.py, with the window from the baseline's config. The
baseline may itself still be training: its ``metrics.jsonl`` is read from where the last read
stopped, and a line still being written is kept back until its newline arrives. After a resume the
run's own window starts empty, so the first gaps use fewer of its rows than the report will.
"""

from __future__ import annotations

import bisect
import math
from pathlib import Path

from inkling_fp4.compare.loss_gap import SMOOTH_MIN_ROWS, default_window
from inkling_fp4.compare.metrics import load_run_config, parse_metrics_lines, relative_gap, row_value
from inkling_fp4.errors import UserError
from inkling_fp4.runs.directory import CONFIG_FILE
from inkling_fp4.runs.metrics import METRICS_FILE


def _window_mean(steps: list[int], values: dict[int, float], step: int, window: int) -> float:
    """Mean of the values whose step lies in ``(step - window, step]`` (``steps`` sorted)."""
    lo = bisect.bisect_right(steps, step - window)
    hi = bisect.bisect_right(steps, step)
    picked = [values[s] for s in steps[lo:hi]]
    return math.fsum(picked) / len(picked)


class LiveGap:
    """Relative gap of a training run's loss to a baseline run's, step by step."""

    def __init__(self, baseline_run_dir: str | Path, window: int | None = None):
        self.run_dir = Path(baseline_run_dir)
        if not self.run_dir.is_dir():
            raise UserError(
                f"baseline run directory {self.run_dir} does not exist: pass --baseline a run directory "
                "written by `fp4train pretrain` (it may still be training)"
            )
        self.path = self.run_dir / METRICS_FILE
        if window is None:
            has_config = (self.run_dir / CONFIG_FILE).is_file()
            window = default_window(load_run_config(self.run_dir)) if has_config else SMOOTH_MIN_ROWS
        if window < 1:
            raise UserError(f"live gap window must be >= 1 step, got {window}")
        self.window = window
        self._offset = 0
        self._pending = b""
        self._base: dict[int, float] = {}
        self._base_steps: list[int] = []
        self._own: dict[int, float] = {}
        self._own_steps: list[int] = []

    def _refresh(self) -> None:
        """Read what the baseline appended since the last call (all of it if the file was replaced)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        if size < self._offset:  # rewritten from scratch: start over
            self._offset, self._pending, self._base = 0, b"", {}
        if size == self._offset:
            return
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(size - self._offset)
        self._offset += len(chunk)
        *lines, self._pending = (self._pending + chunk).split(b"\n")
        rows, _ = parse_metrics_lines([line.decode("utf-8", errors="replace") for line in lines])
        for row in rows:
            hit = row_value(row, "loss")
            if hit is None:
                continue
            step, loss = hit
            if loss is None:
                self._base.pop(step, None)
            else:
                self._base[step] = loss
        self._base_steps = sorted(self._base)

    def at(self, step: int) -> float | None:
        """The baseline's smoothed training loss at ``step``; None when it has not logged that step."""
        self._refresh()
        if step not in self._base:
            return None
        return _window_mean(self._base_steps, self._base, step, self.window)

    def gap(self, step: int, loss: float) -> float | None:
        """Record the run's loss at ``step`` and return its smoothed relative gap to the baseline,
        ``(L - L_base) / L_base``; None when the baseline has no such step or the loss is not finite."""
        if not math.isfinite(loss):
            return None
        if self._own_steps and step <= self._own_steps[-1]:  # resumed from an earlier step
            for s in self._own_steps[bisect.bisect_left(self._own_steps, step) :]:
                del self._own[s]
            self._own_steps = self._own_steps[: bisect.bisect_left(self._own_steps, step)]
        self._own[step] = float(loss)
        self._own_steps.append(step)
        base = self.at(step)
        if base is None:
            return None
        own = _window_mean(self._own_steps, self._own, step, self.window)
        return float(relative_gap(own, base))
