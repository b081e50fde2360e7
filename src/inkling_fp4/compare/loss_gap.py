"""Loss-gap analysis: how far a low-precision run's loss sits above the FP8 baseline's.

The paper (arXiv 2509.25149) judges NVFP4 by the relative difference of its loss to FP8's,

    gap = (L_nvfp4 - L_fp8) / L_fp8,

below 1% through the stable phase of the WSD schedule, a little above 1.5% late in the decay, and
about 0.5% when the GEMMs switch to BF16 before the decay. Validation losses are aligned by step as
logged. Training losses are first smoothed, each run over its own rows, by a trailing mean over the
steps in ``(s - W, s]``: trailing so that a live comparison (compare/live.py) gets the same numbers,
over steps rather than rows so that it does not depend on the log interval. Both runs see the same
batches in the same order, so most batch noise cancels in the ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inkling_fp4.compare.metrics import (
    Aligned,
    RunMetrics,
    Series,
    align,
    read_metrics,
)
from inkling_fp4.config import RunConfig
from inkling_fp4.errors import UserError
from inkling_fp4.runs.metrics import METRICS_FILE
from inkling_fp4.runs.schedule import PrecisionSchedule, WSDSchedule

LOSS = "loss"
VAL_LOSS = "val_loss"
VAL_LOSS_BF16 = "val_loss_bf16"
"""What a loss comparison reads: training loss, validation loss, validation loss with every GEMM in BF16."""
LOSS_KEYS = (LOSS, VAL_LOSS, VAL_LOSS_BF16)
SMOOTH_MIN_ROWS = 5
"""The smoothing window spans at least this many logged rows ..."""
SMOOTH_MIN_FRACTION = 0.01
"""... and at least this fraction of the run's steps."""


def load_loss_metrics(run_dir: str | Path) -> RunMetrics:
    metrics = read_metrics(run_dir, LOSS_KEYS, "fp4train pretrain")
    if not len(metrics.curve(LOSS)) and not len(metrics.curve(VAL_LOSS)):
        path = Path(run_dir) / METRICS_FILE
        raise UserError(f"{path} has no training or validation losses yet: let the run log a few steps")
    return metrics


# ----------------------------------------------------------------------------------------------
# smoothing and the gap


def default_window(cfg: RunConfig) -> int:
    """Smoothing window in steps: at least SMOOTH_MIN_ROWS logged rows and 1% of the run."""
    return max(SMOOTH_MIN_ROWS * cfg.train.log_every, math.ceil(SMOOTH_MIN_FRACTION * cfg.train.steps), 1)


def trailing_mean(steps: np.ndarray, values: np.ndarray, window: int) -> np.ndarray:
    """For each row s: the mean of the values whose step lies in ``(s - window, s]``."""
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1 step, got {window}")
    csum = np.concatenate([[0.0], np.cumsum(values, dtype=np.float64)])  # csum[i] = sum(values[:i])
    lo = np.searchsorted(steps, steps - window, side="right")  # first row inside the window
    hi = np.arange(1, len(steps) + 1)
    return (csum[hi] - csum[lo]) / (hi - lo)


def smooth(series: Series, window: int) -> Series:
    return Series(series.steps, series.tokens, trailing_mean(series.steps, series.values, window))


def train_gap(run: RunMetrics, baseline: RunMetrics, window: int) -> Aligned:
    """Gap of the smoothed training losses (each run smoothed over its own rows, then aligned)."""
    return align(smooth(run.curve(LOSS), window), smooth(baseline.curve(LOSS), window), relative=True)


def val_gap(run: RunMetrics, baseline: RunMetrics, bf16: bool = False) -> Aligned:
    key = VAL_LOSS_BF16 if bf16 else VAL_LOSS
    return align(run.curve(key), baseline.curve(key), relative=True)


# ----------------------------------------------------------------------------------------------
# phases


@dataclass(frozen=True)
class PhaseBoundaries:
    """Where a run's phases start, in the 1-based steps of runs/schedule.py."""

    total_steps: int
    warmup_end: int
    """First step after the warmup (warmup is steps 1 .. warmup_end - 1)."""
    decay_start: int
    """First step of the decay (total_steps + 1 when there is none); wins where warmup overlaps it."""
    switch_step: int | None
    """First step trained in BF16 after the precision switch; None when the run never switches."""

    def starts(self) -> dict[str, float]:
        """Phase name -> its first step ('after_switch' only when the run switches)."""
        out = {"warmup": -math.inf, "stable": self.warmup_end, "decay": self.decay_start}
        if self.switch_step is not None:
            out["after_switch"] = self.switch_step
        return out

    def masks(self, steps: np.ndarray) -> dict[str, np.ndarray]:
        """Phase name -> which of ``steps`` lie in it ('after_switch' only when the run switches)."""
        decay = steps >= self.decay_start
        warmup = (steps < self.warmup_end) & ~decay
        out = {"warmup": warmup, "stable": ~warmup & ~decay, "decay": decay}
        if self.switch_step is not None:
            out["after_switch"] = steps >= self.switch_step
        return out

    def to_dict(self) -> dict:
        return {
            "total_steps": self.total_steps,
            "warmup_end": self.warmup_end,
            "decay_start": self.decay_start,
            "switch_step": self.switch_step,
        }


def boundaries_from_config(cfg: RunConfig) -> PhaseBoundaries:
    """The phase boundaries the run's own schedules (runs/schedule.py) used."""
    t = cfg.train
    wsd = WSDSchedule(t.steps, t.warmup_steps, t.decay_fraction, t.decay_shape, t.min_lr_ratio)
    switch = None
    if cfg.precision.recipe != "bf16":  # a BF16 run has nothing to switch away from
        switch = PrecisionSchedule(cfg.precision.switch_to_bf16, wsd).switch_step
    return PhaseBoundaries(t.steps, wsd.warmup_steps + 1, wsd.first_decay_step, switch)


@dataclass(frozen=True)
class PhaseStats:
    """The gap over one phase."""

    first_step: int
    last_step: int
    first_tokens: float
    last_tokens: float
    points: int
    mean: float
    max: float
    min: float
    last: float
    """The gap at the last point of the phase."""
    settled_max: float
    """Largest gap among the points whose smoothing window lies wholly inside the phase (the last
    point's gap when the phase is shorter than the window): what the verdict holds to the bounds."""
    settled_min: float
    """Smallest gap among the same points (with ``settled_max``: the band of the noise floor)."""

    def to_dict(self) -> dict:
        return {
            "first_step": self.first_step,
            "last_step": self.last_step,
            "first_tokens": self.first_tokens,
            "last_tokens": self.last_tokens,
            "points": self.points,
            "mean_gap": self.mean,
            "max_gap": self.max,
            "min_gap": self.min,
            "end_gap": self.last,
            "settled_max_gap": self.settled_max,
            "settled_min_gap": self.settled_min,
        }


def _stats(gap: Aligned, mask: np.ndarray, settled: np.ndarray) -> PhaseStats | None:
    if not mask.any():
        return None
    idx = np.flatnonzero(mask)
    g = gap.gap[idx]
    inside = gap.gap[mask & settled]
    return PhaseStats(
        first_step=int(gap.steps[idx[0]]),
        last_step=int(gap.steps[idx[-1]]),
        first_tokens=float(gap.tokens[idx[0]]),
        last_tokens=float(gap.tokens[idx[-1]]),
        points=len(idx),
        mean=float(g.mean()),
        max=float(g.max()),
        min=float(g.min()),
        last=float(g[-1]),
        settled_max=float(inside.max()) if len(inside) else float(g[-1]),
        settled_min=float(inside.min()) if len(inside) else float(g[-1]),
    )


def phase_summary(gap: Aligned, bounds: PhaseBoundaries, window: int = 1) -> dict[str, PhaseStats | None]:
    """Gap statistics per phase (None for a phase without points) and at the 'end' (last point).
    ``window`` is the smoothing window the gap was computed with (1 for validation losses)."""
    out: dict[str, PhaseStats | None] = {}
    starts = bounds.starts()
    for name, mask in bounds.masks(gap.steps).items():
        out[name] = _stats(gap, mask, gap.steps - window + 1 >= starts[name])
    last = np.zeros(len(gap), dtype=bool)
    if len(gap):
        last[-1] = True
    out["end"] = _stats(gap, last, last)
    return out
