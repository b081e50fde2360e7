"""Loss-gap analysis: how far a low-precision run's loss sits above the FP8 baseline's.

The paper (arXiv 2509.25149) judges NVFP4 by the *relative* difference of its loss to the
FP8 baseline's over training tokens,

    gap = (L_nvfp4 - L_fp8) / L_fp8,

below 1% through the stable phase of the WSD schedule, a little above 1.5% late in the decay, and
back to about 0.5% when the GEMMs switch to BF16 before the decay. This module computes those numbers
from two run directories (``metrics.jsonl`` rows, see DESIGN.md):

- validation loss: the eval rows of both runs aligned by step (``val_loss_bf16``, every GEMM in BF16
  as the paper evaluates, and ``val_loss``, in the run's training precision);
- training loss: smoothed first, because one step's loss is noisy. Smoothing is a *trailing mean*
  over the logged rows whose step lies in ``(s - W, s]``. Trailing (causal) so that the smoothed
  value at step s uses nothing after s, which is exactly what a comparison made while the run is
  still training can compute (compare/live.py gives the same numbers); a plain mean over a window
  counted in steps rather than an EMA over rows, so that the smoothing means the same whatever the
  log interval, and known answers are easy to write down. Each run is smoothed over its own rows,
  then the two are aligned on the steps they share. Both runs see the same batches in the same
  order, so most batch-to-batch noise is common to both and cancels in the ratio; the smoothing
  takes out what is left.

Runs with the same data, seed and schedule (compare/compat.py checks) see the same tokens at every
step, so aligning by step is aligning by tokens; plots use the baseline's token counts.

Phases (warmup, stable, decay, and after the switch to BF16) come from the run's own config through
the training schedules (runs/schedule.py), so that the boundaries here are the ones the run used.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inkling_fp4.config import RunConfig, from_dict
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.runs.directory import CONFIG_FILE, recorded_config_data
from inkling_fp4.runs.metrics import METRICS_FILE
from inkling_fp4.runs.schedule import PrecisionSchedule, WSDSchedule

SMOOTH_MIN_ROWS = 5
"""The smoothing window spans at least this many logged rows ..."""
SMOOTH_MIN_FRACTION = 0.01
"""... and at least this fraction of the run's steps."""


# ----------------------------------------------------------------------------------------------
# loading


@dataclass(frozen=True)
class Series:
    """One quantity over training: one row per step, sorted by step."""

    steps: np.ndarray
    """int64 [n], strictly increasing."""
    tokens: np.ndarray
    """float64 [n], tokens seen at each step (NaN where a row did not say)."""
    values: np.ndarray
    """float64 [n], finite."""

    def __len__(self) -> int:
        return len(self.steps)

    @staticmethod
    def from_rows(rows: dict[int, tuple[float, float]]) -> Series:
        """``{step: (tokens, value)}`` -> Series (the dict already keeps the last row per step)."""
        steps = np.array(sorted(rows), dtype=np.int64)
        tokens = np.array([rows[s][0] for s in steps], dtype=np.float64)
        values = np.array([rows[s][1] for s in steps], dtype=np.float64)
        return Series(steps, tokens, values)


@dataclass
class RunMetrics:
    """What ``metrics.jsonl`` says about one run."""

    run_dir: Path
    train: Series
    """Training loss (``loss``) of the logged steps."""
    val: Series
    """Validation loss (``val_loss``) of the evaluations."""
    val_bf16: Series
    """Validation loss evaluated in BF16 (``val_loss_bf16``); empty when the run did not log it."""
    precision: dict[int, str] = field(default_factory=dict)
    """Precision label of each logged training step (changes at the BF16 switch)."""
    skipped_lines: int = 0
    """Lines that were not JSON (a write cut short by a crash); ignored."""
    nonfinite: int = 0
    """Rows whose loss was NaN or Inf (steps the monitor skipped); left out of the analysis."""
    skipped_updates: tuple[int, ...] = ()
    """Steps whose update the noise monitor skipped (a spike or a non-finite value)."""

    def fallback_spans(self) -> list[tuple[int, int]]:
        """(first, last) logged steps of each stretch the noise monitor ran in BF16 (its fallback)."""
        spans: list[tuple[int, int]] = []
        inside = False
        for step in sorted(self.precision):
            if self.precision[step] != FALLBACK_LABEL:
                inside = False
            elif inside:
                spans[-1] = (spans[-1][0], step)
            else:
                spans.append((step, step))
                inside = True
        return spans


FALLBACK_LABEL = "bf16-fallback"
"""The precision label the training loop logs while the noise monitor has the run in BF16."""
SKIP_EVENTS = ("grad_spike", "loss_spike", "nonfinite")
"""Metrics events of a step whose update the noise monitor skipped."""


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def parse_metrics_lines(lines: list[str]) -> tuple[list[dict], int]:
    """JSON objects of the complete lines, and how many lines were not valid JSON objects."""
    rows, skipped = [], 0
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def row_value(row: dict, key: str) -> tuple[int, float | None] | None:
    """``(step, value)`` of a metrics row that has ``key``; value None when it is NaN or Inf; None
    when the row has no integer step or no such key, or is an event (a monitor trigger may carry the
    loss it rejected, which is not the step's logged loss)."""
    step = row.get("step")
    if key not in row or "event" in row or not isinstance(step, int) or isinstance(step, bool):
        return None
    return step, float(row[key]) if _finite(row[key]) else None


def columns_from_rows(rows: list[dict], keys) -> tuple[dict[str, Series], int]:
    """One Series per key of ``keys`` that any row has (x: the row's token count), and how many values
    were NaN or Inf and left out. A step logged twice (a resumed run logs again) keeps its last row."""
    columns: dict[str, dict[int, tuple[float, float]]] = {key: {} for key in keys}
    nonfinite = 0
    for row in rows:
        tokens = row.get("tokens")
        tokens = float(tokens) if _finite(tokens) else math.nan
        for key, col in columns.items():
            hit = row_value(row, key)
            if hit is None:
                continue
            step, value = hit
            if value is None:
                col.pop(step, None)
                nonfinite += 1
            else:
                col[step] = (tokens, value)
    return {key: Series.from_rows(col) for key, col in columns.items() if col}, nonfinite


def metrics_from_rows(run_dir: Path, rows: list[dict], skipped: int = 0) -> RunMetrics:
    """Sort rows into series; a step logged twice (a resumed run logs again) keeps its last row."""
    curves, nonfinite = columns_from_rows(rows, ("loss", "val_loss", "val_loss_bf16"))
    precision: dict[int, str] = {}
    skips: set[int] = set()
    for row in rows:
        if row.get("event") in SKIP_EVENTS and isinstance(row.get("step"), int):
            skips.add(row["step"])
        if row_value(row, "loss") is not None and isinstance(row.get("precision"), str):
            precision[row["step"]] = row["precision"]
    empty = Series.from_rows({})
    return RunMetrics(
        run_dir=Path(run_dir),
        train=curves.get("loss", empty),
        val=curves.get("val_loss", empty),
        val_bf16=curves.get("val_loss_bf16", empty),
        precision=precision,
        skipped_lines=skipped,
        nonfinite=nonfinite,
        skipped_updates=tuple(sorted(skips)),
    )


def read_metrics_rows(run_dir: str | Path, writer: str) -> tuple[Path, list[dict], int]:
    """(its path, the rows, lines that were not JSON) of ``<run_dir>/metrics.jsonl``; ``writer`` is the
    command that writes such a directory (named when there is none)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise UserError(f"no {METRICS_FILE} in {run_dir}: pass a run directory written by `{writer}`")
    rows, skipped = parse_metrics_lines(path.read_bytes().decode("utf-8", errors="replace").splitlines())
    return path, rows, skipped


def load_metrics(run_dir: str | Path) -> RunMetrics:
    """Read ``<run_dir>/metrics.jsonl``: training loss, validation loss, precision per step."""
    path, rows, skipped = read_metrics_rows(run_dir, "fp4train pretrain")
    metrics = metrics_from_rows(Path(run_dir), rows, skipped)
    if not len(metrics.train) and not len(metrics.val):
        raise UserError(f"{path} has no training or validation losses yet: let the run log a few steps")
    return metrics


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config a run wrote into its directory."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"no {CONFIG_FILE} in {run_dir}: pass a run directory written by `fp4train pretrain`")
    try:
        return from_dict(RunConfig, recorded_config_data(Path(run_dir)))
    except ConfigError as e:
        raise UserError(f"{path} is not a config this version can read ({e})") from None


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


def relative_gap(loss, baseline_loss):
    """``(L - L_base) / L_base``: 0.01 means the loss is 1% above the baseline's."""
    return (np.asarray(loss, dtype=np.float64) - baseline_loss) / baseline_loss


@dataclass(frozen=True)
class GapSeries:
    """A run's loss against the baseline's at the steps both logged."""

    steps: np.ndarray
    tokens: np.ndarray
    """Tokens at each step (the baseline's count; the same for both runs when they are comparable)."""
    loss: np.ndarray
    baseline_loss: np.ndarray
    gap: np.ndarray
    """relative_gap(loss, baseline_loss)."""

    def __len__(self) -> int:
        return len(self.steps)


def common_steps(run: Series, baseline: Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the steps both series have, their indices in ``run``, in ``baseline``)."""
    return np.intersect1d(run.steps, baseline.steps, assume_unique=True, return_indices=True)


def aligned_gap(run: Series, baseline: Series) -> GapSeries:
    """The gap at the steps both series have."""
    steps, ia, ib = common_steps(run, baseline)
    tokens = np.where(np.isnan(baseline.tokens[ib]), run.tokens[ia], baseline.tokens[ib])
    loss, base = run.values[ia], baseline.values[ib]
    return GapSeries(steps, tokens, loss, base, relative_gap(loss, base))


def train_gap(run: RunMetrics, baseline: RunMetrics, window: int) -> GapSeries:
    """Gap of the smoothed training losses (each run smoothed over its own rows, then aligned)."""
    return aligned_gap(smooth(run.train, window), smooth(baseline.train, window))


def val_gap(run: RunMetrics, baseline: RunMetrics, bf16: bool = False) -> GapSeries:
    """Gap of the validation losses (``val_loss``, or ``val_loss_bf16`` with bf16=True)."""
    if bf16:
        return aligned_gap(run.val_bf16, baseline.val_bf16)
    return aligned_gap(run.val, baseline.val)


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
    """The phase boundaries the run's schedules used (warmup, decay start, BF16 switch)."""
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
    """Largest gap among the points whose smoothing window lies wholly inside the phase, so that the
    previous phase's losses do not leak in; the last point's gap when the phase is shorter than the
    window. This is what the verdict holds against the paper's bounds."""
    settled_min: float
    """Smallest gap among the same points: with ``settled_max``, the band a repeat of the baseline
    (the noise floor) moves in."""

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


def _stats(gap: GapSeries, mask: np.ndarray, settled: np.ndarray) -> PhaseStats | None:
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


def phase_summary(gap: GapSeries, bounds: PhaseBoundaries, window: int = 1) -> dict[str, PhaseStats | None]:
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
