"""The numbers of an RL comparison: every run's figures side by side, each run's reward and
eval-accuracy gap to the baseline, and a headline per run (with seed repeats: compare/rl_seeds.py).

RL has no published bound for the gap, so the headline states the gaps and both runs' values and
leaves the judgement to the reader. Mismatch is not a gap: each precision has its own, side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from inkling_fp4.compare.metrics import Aligned, RunMetrics, align, load_run_config
from inkling_fp4.compare.rl_gap import (
    BY_KEY,
    EVAL_ACCURACY,
    FIGURES,
    GAP_KEYS,
    REWARD,
    Stat,
    gap_stat,
    load_rl_metrics,
    plain,
    signed,
    steps_text,
    summarize_values,
    tail_window,
)
from inkling_fp4.compare.rl_seeds import (
    SeedComparison,
    pair_label,
    seed_groups,
    seeds_to_dict,
    summarize_seeds,
)
from inkling_fp4.config import RunConfig
from inkling_fp4.errors import UserError


@dataclass
class RLRunSummary:
    """One run's figures and, for a run other than the baseline, its gaps to it."""

    label: str
    about: str
    metrics: RunMetrics
    config: RunConfig
    figures: dict[str, Stat | None]
    differences: dict[str, Aligned] = field(default_factory=dict)
    """run - baseline per shared step, for the GAP_KEYS (empty for the baseline)."""
    against: str = ""
    """The run its gaps are to: the baseline, or with seed repeats the baseline's run of the same seed."""
    gaps: dict[str, Stat | None] = field(default_factory=dict)
    headline: str = ""


@dataclass
class RLComparison:
    """A baseline RL run and the runs measured against it."""

    baseline: RLRunSummary
    runs: dict[str, RLRunSummary]
    window: int
    """The tail, in steps."""
    seeds: SeedComparison | None = None
    """Each precision over its seed repeats (``--noise``); None without repeats."""

    @property
    def main(self) -> RLRunSummary:
        """The first run measured against the baseline (the recipe the comparison is about)."""
        return next(iter(self.runs.values()))

    def all_runs(self) -> list[RLRunSummary]:
        """The baseline, then the others: the columns of the side-by-side table."""
        return [self.baseline, *self.runs.values()]


def summarize_rl_run(label: str, run_dir: Path, window: int, about: str = "") -> RLRunSummary:
    metrics = load_rl_metrics(run_dir)
    figures = {}
    for f in FIGURES:
        curve = metrics.curve(f.key)
        figures[f.key] = summarize_values(curve.steps, curve.values, f, window)
    return RLRunSummary(label, about, metrics, load_run_config(run_dir), figures)


def add_gaps(run: RLRunSummary, baseline: RLRunSummary, window: int) -> None:
    """The run's GAP_KEYS against the baseline's, and its headline."""
    run.against = baseline.label
    for key in GAP_KEYS:
        d = align(run.metrics.curve(key), baseline.metrics.curve(key), relative=False)
        run.differences[key] = d
        run.gaps[key] = gap_stat(d, BY_KEY[key], window)
    run.headline = headline(run, baseline, window)


def summarize_rl(
    runs: dict[str, str | Path],
    baseline_dir: str | Path,
    baseline_label: str = "fp8",
    window: int | None = None,
    about: dict[str, str] | None = None,
) -> RLComparison:
    """Every number of the report of ``runs`` (label -> run dir). A ``<label>-seed<n>`` run is a seed
    repeat, with its gaps to the baseline's repeat of the same seed."""
    if not runs:
        raise UserError("nothing to compare: give at least one run besides the baseline")
    about = about or {}
    if window is None:
        window = tail_window(load_run_config(baseline_dir).train.steps)
    base = summarize_rl_run(
        baseline_label, Path(baseline_dir), window, about.get(baseline_label, "the baseline")
    )
    dirs = {baseline_label: Path(baseline_dir), **{label: Path(d) for label, d in runs.items()}}
    summaries = {
        label: summarize_rl_run(label, Path(d), window, about.get(label, "")) for label, d in runs.items()
    }
    every = {baseline_label: base, **summaries}
    for label, s in summaries.items():
        other = every[pair_label(label, baseline_label, every)]
        add_gaps(s, other, window)
        if not len(s.differences[REWARD]):
            raise UserError(
                f"{dirs[label]} and {dirs[other.label]} share no logged RL step: they must log at the same "
                "steps (same train.log_every)"
            )
    groups = seed_groups(list(every))
    seeds = None
    if any(len(g) > 1 for g in groups.values()):
        metrics = {label: s.metrics for label, s in every.items()}
        seeds = summarize_seeds(groups, metrics, baseline_label, window)
    return RLComparison(base, summaries, window, seeds)


# ----------------------------------------------------------------------------------------------
# the headline


def headline(run: RLRunSummary, base: RLRunSummary, window: int) -> str:
    """One line: the reward gap over the tail, the eval-accuracy gap at the last evaluation and over
    all of them, and the two runs' mismatch (k3 over the tail)."""
    parts = [f"{run.label} vs {base.label}:"]
    reward = run.gaps.get(REWARD)
    if reward is not None:
        a, b = run.figures[REWARD], base.figures[REWARD]
        parts.append(
            f"reward gap {signed(reward.value)} over the last {steps_text(window)} "
            f"({plain(a.value if a else None)} vs {plain(b.value if b else None)})"
        )
    acc = run.gaps.get(EVAL_ACCURACY)
    if acc is not None:
        d = run.differences[EVAL_ACCURACY]
        parts.append(
            f"eval accuracy gap {signed(acc.final)} at step {acc.last_step} ({plain(float(d.run[-1]))} vs "
            f"{plain(float(d.baseline[-1]))}), {signed(acc.value)} over {acc.points} evaluations"
        )
    else:
        parts.append("no shared evaluation")
    k3_run, k3_base = run.figures.get("mismatch_k3"), base.figures.get("mismatch_k3")
    if k3_run is not None and k3_base is not None:
        parts.append(f"mismatch k3 {k3_run.value:.2e} vs {k3_base.value:.2e}")
    return parts[0] + " " + "; ".join(parts[1:])


# ----------------------------------------------------------------------------------------------
# plain data for report.json


def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


_EMPTY_STAT = {"final": None, "value": None, "points": 0, "first_step": None, "last_step": None}
"""A gap without a shared step (two runs that never evaluated at the same step)."""


def _run_to_dict(s: RLRunSummary) -> dict:
    cfg = s.config
    out = {
        "label": s.label,
        "run_dir": str(s.metrics.run_dir),
        "about": s.about,
        "recipe": cfg.precision.recipe,
        "activation_scale": cfg.precision.activation_scale,
        "sampler_precision": cfg.sampler.precision,
        "correction": cfg.rl.correction,
        "figures": {k: None if st is None else st.to_dict() for k, st in s.figures.items()},
        "series": {
            k: {"steps": [int(x) for x in c.steps], "values": [_num(v) for v in c.values]}
            for k, c in s.metrics.curves.items()
        },
        "skipped_lines": s.metrics.skipped_lines,
        "nonfinite": s.metrics.nonfinite,
        "monitor": {  # as the loss comparison's report.json has it
            "skipped_updates": list(s.metrics.skipped_updates),
            "fallback_spans": [list(span) for span in s.metrics.fallback_spans()],
        },
    }
    if s.differences:
        out["against"] = s.against
        out["headline"] = s.headline
        out["gaps"] = {
            k: {
                **(_EMPTY_STAT if s.gaps[k] is None else s.gaps[k].to_dict()),
                "series": {
                    "steps": [int(x) for x in d.steps],
                    "run": [_num(v) for v in d.run],
                    "baseline": [_num(v) for v in d.baseline],
                    "diff": [_num(v) for v in d.gap],
                },
            }
            for k, d in s.differences.items()
        }
    return out


def rl_comparison_to_dict(c: RLComparison) -> dict:
    return {
        "stage": "rollout",
        "baseline": _run_to_dict(c.baseline),
        "gap_definition": "run - baseline at the same step (higher reward and accuracy are better)",
        "tail": {
            "window_steps": c.window,
            "kind": "the logged steps in (last - window, last]; evaluations: all of them; timings and "
            "tokens/s without the first logged step",
        },
        "figures": [
            {"key": f.key, "label": f.label, "reduce": f.reduce, "over": f.over, "warm": f.warm}
            for f in FIGURES
        ],
        "headline": c.main.headline if c.seeds is None else c.seeds.headline,
        "runs": {label: _run_to_dict(s) for label, s in c.runs.items()},
        "seeds": None if c.seeds is None else seeds_to_dict(c.seeds),
    }
