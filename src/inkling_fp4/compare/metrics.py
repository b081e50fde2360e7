"""What a run's ``metrics.jsonl`` says, read the same way for every stage, and two runs aligned by step.

One Series per key; a step logged twice (a resumed run logs again) keeps its last row; NaN/Inf
values are counted and left out, and so are event rows (a monitor trigger may carry the value it
rejected). Comparable runs see the same data in the same order (compare/compat.py), so aligning by
step is aligning by tokens.
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

FALLBACK_LABEL = "bf16-fallback"
"""The precision label the training loop logs while the noise monitor has the run in BF16."""
SKIP_EVENTS = ("grad_spike", "loss_spike", "nonfinite")
"""Metrics events of a step whose update the noise monitor skipped."""


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
        """``{step: (tokens, value)}`` -> Series."""
        steps = np.array(sorted(rows), dtype=np.int64)
        tokens = np.array([rows[s][0] for s in steps], dtype=np.float64)
        values = np.array([rows[s][1] for s in steps], dtype=np.float64)
        return Series(steps, tokens, values)


EMPTY = Series.from_rows({})


@dataclass
class RunMetrics:
    """One run's figures, one Series per key that any row has, and what the noise monitor did."""

    run_dir: Path
    curves: dict[str, Series]
    precision: dict[int, str] = field(default_factory=dict)
    """Precision label of each step that logged a training loss (changes at the BF16 switch)."""
    skipped_lines: int = 0
    """Lines that were not JSON (a write cut short by a crash); ignored."""
    nonfinite: int = 0
    """Values of the read keys that were NaN or Inf; left out."""
    skipped_updates: tuple[int, ...] = ()
    """Steps whose update the noise monitor skipped (a spike or a non-finite value)."""

    def curve(self, key: str) -> Series:
        return self.curves.get(key) or EMPTY

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
    """``(step, value)`` of a non-event row with an integer step and ``key``; value None when NaN/Inf."""
    step = row.get("step")
    if key not in row or "event" in row or not isinstance(step, int) or isinstance(step, bool):
        return None
    return step, float(row[key]) if _finite(row[key]) else None


def metrics_from_rows(run_dir: Path, rows: list[dict], keys, skipped: int = 0) -> RunMetrics:
    """The rows sorted into one Series per key of ``keys`` (x: the row's token count)."""
    columns: dict[str, dict[int, tuple[float, float]]] = {key: {} for key in keys}
    nonfinite = 0
    precision: dict[int, str] = {}
    skips: set[int] = set()
    for row in rows:
        if row.get("event") in SKIP_EVENTS and isinstance(row.get("step"), int):
            skips.add(row["step"])
        if row_value(row, "loss") is not None and isinstance(row.get("precision"), str):
            precision[row["step"]] = row["precision"]
        tokens = float(row["tokens"]) if _finite(row.get("tokens")) else math.nan
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
    curves = {key: Series.from_rows(col) for key, col in columns.items() if col}
    return RunMetrics(Path(run_dir), curves, precision, skipped, nonfinite, tuple(sorted(skips)))


def read_metrics(run_dir: str | Path, keys, writer: str) -> RunMetrics:
    """``<run_dir>/metrics.jsonl`` read for ``keys``; ``writer``: the command to name when it is missing."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise UserError(f"no {METRICS_FILE} in {run_dir}: pass a run directory written by `{writer}`")
    rows, skipped = parse_metrics_lines(path.read_bytes().decode("utf-8", errors="replace").splitlines())
    return metrics_from_rows(Path(run_dir), rows, keys, skipped)


def load_run_config(run_dir: str | Path) -> RunConfig:
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"no {CONFIG_FILE} in {run_dir}: pass a run directory written by `fp4train pretrain`")
    try:
        return from_dict(RunConfig, recorded_config_data(Path(run_dir)))
    except ConfigError as e:
        raise UserError(f"{path} is not a config this version can read ({e})") from None


# ----------------------------------------------------------------------------------------------
# two runs aligned


@dataclass(frozen=True)
class Aligned:
    """A figure of a run against the baseline's at the steps both logged, and their gap."""

    steps: np.ndarray
    tokens: np.ndarray
    """Tokens at each step (the baseline's count; the same for both runs when they are comparable)."""
    run: np.ndarray
    baseline: np.ndarray
    gap: np.ndarray
    """``(run - baseline) / baseline`` for a loss, ``run - baseline`` for a figure in [0, 1]."""

    def __len__(self) -> int:
        return len(self.steps)


def relative_gap(loss, baseline_loss):
    """``(L - L_base) / L_base``: 0.01 means the loss is 1% above the baseline's."""
    return (np.asarray(loss, dtype=np.float64) - baseline_loss) / baseline_loss


def common_steps(run: Series, baseline: Series) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the steps both series have, their indices in ``run``, in ``baseline``)."""
    return np.intersect1d(run.steps, baseline.steps, assume_unique=True, return_indices=True)


def align(run: Series, baseline: Series, relative: bool) -> Aligned:
    steps, ia, ib = common_steps(run, baseline)
    tokens = np.where(np.isnan(baseline.tokens[ib]), run.tokens[ia], baseline.tokens[ib])
    a, b = run.values[ia], baseline.values[ib]
    return Aligned(steps, tokens, a, b, relative_gap(a, b) if relative else a - b)
