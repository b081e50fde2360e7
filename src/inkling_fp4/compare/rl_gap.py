"""RL curves and their gap: what an RL run's ``metrics.jsonl`` says, aligned by step with a baseline's.

The runs of an RL comparison draw the same prompts in the same order (compare/compat.py), so step s
poses the same problems in each. Reward and accuracy lie in [0, 1], so the gap is the plain
difference ``run - baseline`` (a relative gap of a reward near 0 means nothing). One step's reward is
noisy, so figures are summarised over the tail, the logged steps in ``(last - k, last]``, where most
of the learning has happened; evaluations, being few, by the last one and the mean over all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inkling_fp4.compare.metrics import Aligned, RunMetrics, read_metrics
from inkling_fp4.errors import UserError
from inkling_fp4.runs.metrics import METRICS_FILE

TAIL_MAX_STEPS = 10
REWARD = "reward_mean"
EVAL_ACCURACY = "eval_accuracy"
GAP_KEYS = (REWARD, EVAL_ACCURACY)
"""The figures whose difference to the baseline is the comparison's gap."""


@dataclass(frozen=True)
class Figure:
    """One logged RL figure and how the comparison summarises it."""

    key: str
    """Its key in metrics.jsonl."""
    label: str
    reduce: str = "mean"
    """mean | min | max over the rows summarised (the extremes of the mismatch ratio are extremes)."""
    over: str = "tail"
    """tail (the last k steps) | all (every row: evaluations)."""
    warm: bool = False
    """Leave the first logged row out (timings and throughput: warm-up, no training before it)."""


FIGURES: tuple[Figure, ...] = (
    Figure(REWARD, "reward"),
    Figure("accuracy", "train accuracy"),
    Figure(EVAL_ACCURACY, "eval accuracy", over="all"),
    Figure("eval_reward", "eval reward", over="all"),
    Figure("eval_pass1_sampled", "eval sampled pass@1", over="all"),
    Figure("eval_pass_at_k", "eval pass@k", over="all"),
    Figure("eval_kl_to_start", "eval KL to the start", over="all"),
    Figure("reward_std", "reward std"),
    Figure("mismatch_k3", "mismatch k3 KL"),
    Figure("mismatch_abs_mean", "mean |Δ log p|"),
    Figure("mismatch_abs_max", "max |Δ log p|", reduce="max"),
    Figure("mismatch_ratio_min", "ratio min", reduce="min"),
    Figure("mismatch_ratio_mean", "ratio mean"),
    Figure("mismatch_ratio_max", "ratio max", reduce="max"),
    Figure("mismatch_frac_over_cap", "fraction beyond the cap"),
    Figure("entropy", "entropy"),
    Figure("completion_len_mean", "completion length"),
    Figure("truncated_frac", "truncated"),
    Figure("zero_var_frac", "zero-variance groups"),
    Figure("unsolved_frac", "groups with none right"),
    Figure("solved_frac", "groups with all right"),
    Figure("adv_abs_mean", "mean |advantage|"),
    Figure("clip_low", "clipped low"),
    Figure("clip_high", "clipped high"),
    Figure("gen_tokens_per_s", "generation tokens/s", warm=True),
    Figure("tokens_per_s", "training tokens/s", warm=True),
    Figure("time_sample_s", "sample s", warm=True),
    Figure("time_score_s", "score s", warm=True),
    Figure("time_train_s", "train s", warm=True),
    Figure("time_refresh_s", "weight refresh s", warm=True),
    Figure("time_eval_s", "an evaluation s", over="all"),
)
BY_KEY = {f.key: f for f in FIGURES}
EVAL_K = "eval_k"
"""The k of pass@k, logged beside it: read with the figures, summarised by none."""
REDUCE = {"mean": np.mean, "min": np.min, "max": np.max}
RL_KEYS = (*(f.key for f in FIGURES), EVAL_K)
"""What an RL comparison reads from metrics.jsonl."""


# ----------------------------------------------------------------------------------------------
# loading


def load_rl_metrics(run_dir: str | Path) -> RunMetrics:
    metrics = read_metrics(run_dir, RL_KEYS, "fp4train rollout")
    if not len(metrics.curve(REWARD)):
        raise UserError(f"{Path(run_dir) / METRICS_FILE} has no rewards yet: let the RL run log a step")
    return metrics


# ----------------------------------------------------------------------------------------------
# summaries


def steps_text(n: int) -> str:
    return "step" if n == 1 else f"{n} steps"


def signed(x: float | None, digits: int = 3) -> str:
    """``x`` with its sign; one that rounds to 0 is +0 (a mean's rounding error is no sign)."""
    return "n/a" if x is None or not math.isfinite(x) else f"{round(x, digits) + 0.0:+.{digits}f}"


def plain(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def tail_window(total_steps: int) -> int:
    """The tail in steps: a quarter of the run, at least 1, at most TAIL_MAX_STEPS."""
    return min(TAIL_MAX_STEPS, max(1, math.ceil(total_steps / 4)))


@dataclass(frozen=True)
class Stat:
    """One figure (or one gap) summarised."""

    final: float
    """At the last row."""
    value: float
    """The figure's reduction over the summarised rows (the tail, or all rows)."""
    points: int
    """Rows summarised."""
    first_step: int
    last_step: int

    def to_dict(self) -> dict:
        return {
            "final": self.final,
            "value": self.value,
            "points": self.points,
            "first_step": self.first_step,
            "last_step": self.last_step,
        }


def summarize_values(steps: np.ndarray, values: np.ndarray, figure: Figure, window: int) -> Stat | None:
    """``figure``'s summary of these rows (None without rows)."""
    if figure.warm and len(steps) > 1:
        steps, values = steps[1:], values[1:]
    if not len(steps):
        return None
    pick = np.ones(len(steps), bool) if figure.over == "all" else steps > steps[-1] - window
    return Stat(
        final=float(values[-1]),
        value=float(REDUCE[figure.reduce](values[pick])),
        points=int(pick.sum()),
        first_step=int(steps[pick][0]),
        last_step=int(steps[-1]),
    )


def gap_stat(d: Aligned, figure: Figure, window: int) -> Stat | None:
    """The gap summarised like its figure: the mean difference over the tail or over every evaluation."""
    return summarize_values(d.steps, d.gap, Figure(figure.key, figure.label, "mean", figure.over), window)
