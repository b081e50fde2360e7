"""The numbers of a comparison: each run's gap to the baseline per phase, at the end, and a verdict.

The verdict holds a run to the paper's bounds (arXiv 2509.25149): the relative gap of the training
loss stays below 1% through the stable phase and below 1.5% through the decay. "Stays below" is
tested on the phase's largest smoothed gap (PhaseStats.settled_max), as the paper's claim says, not
its mean. The warmup is not judged: its losses fall fast, and small shifts in time give large gaps.
With a noise run (``compare-baseline --noise``) each verdict also says whether the judged gaps lie
beyond the noise floor; at small scale that floor can exceed the paper's bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from inkling_fp4.compare.loss_gap import (
    VAL_LOSS_BF16,
    PhaseBoundaries,
    PhaseStats,
    boundaries_from_config,
    default_window,
    load_loss_metrics,
    phase_summary,
    train_gap,
    val_gap,
)
from inkling_fp4.compare.metrics import Aligned, RunMetrics, load_run_config
from inkling_fp4.config import RunConfig
from inkling_fp4.errors import UserError

PAPER_BOUNDS = {"stable": 0.01, "decay": 0.015}
"""Largest relative gap of the smoothed training loss the paper reports per phase."""


@dataclass(frozen=True)
class Check:
    """One phase held to its bound."""

    phase: str
    bound: float
    value: float | None
    """PhaseStats.settled_max of the phase; None when the run logged no step in it."""

    @property
    def ok(self) -> bool | None:
        return None if self.value is None else self.value < self.bound

    def describe(self) -> str:
        if self.value is None:
            return f"{self.phase}: no logged steps in this phase"
        margin = abs(self.bound - self.value) * 100
        relation = (
            f"< {fmt_bound(self.bound)}, {margin:.2f} pp to spare"
            if self.ok
            else (f">= {fmt_bound(self.bound)}, over by {margin:.2f} pp")
        )
        return f"{self.phase} max gap {pct(self.value)} ({relation})"


@dataclass(frozen=True)
class NoiseFloor:
    """Per judged phase, the largest |settled smoothed gap| of the baseline's repeat from other initial
    weights (None where it logged no step in the phase): a gap inside it cannot be told from chance."""

    label: str
    """The repeat's label in the comparison."""
    band: dict[str, float | None]

    @classmethod
    def from_phases(cls, label: str, phases: dict[str, PhaseStats | None]) -> NoiseFloor:
        band = {}
        for phase in PAPER_BOUNDS:
            st = phases.get(phase)
            band[phase] = None if st is None else max(abs(st.settled_max), abs(st.settled_min))
        return cls(label, band)


@dataclass(frozen=True)
class Verdict:
    checks: tuple[Check, ...]
    line: str
    beyond_noise: tuple[str, ...] | None = None
    """Phases whose judged gap lies beyond the noise floor; None without a noise floor."""

    @property
    def within(self) -> bool | None:
        """True within all bounds, False outside any, None when a phase could not be judged."""
        oks = [c.ok for c in self.checks]
        if False in oks:
            return False
        return None if None in oks else True


@dataclass
class RunSummary:
    """One run against the baseline."""

    label: str
    about: str
    """What this run is (e.g. "no stochastic rounding"); shown in the report."""
    metrics: RunMetrics
    config: RunConfig
    bounds: PhaseBoundaries
    train: Aligned
    """Gap of the smoothed training loss."""
    val: Aligned
    """Gap of the validation loss evaluated with every GEMM in BF16, as the paper reports it (the
    logged ``val_loss`` where a run has no BF16 evaluation)."""
    val_in_precision: Aligned
    """Gap of the validation loss evaluated in each run's training precision (``val_loss``)."""
    phases: dict[str, PhaseStats | None]
    """Training-loss gap per phase, and at the 'end'."""
    val_phases: dict[str, PhaseStats | None]
    """Validation-loss gap per phase, and at the 'end'."""
    verdict: Verdict


@dataclass
class Comparison:
    """A baseline run and the runs measured against it."""

    baseline_label: str
    baseline: RunMetrics
    baseline_config: RunConfig
    window: int
    """Smoothing window of the training loss, in steps."""
    runs: dict[str, RunSummary]
    noise: NoiseFloor | None = None
    """The baseline against its own repeat, when the comparison has one (also among ``runs``)."""

    @property
    def main(self) -> RunSummary:
        """The first run measured against the baseline (the recipe the comparison is about)."""
        return next(iter(self.runs.values()))


def pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:+.2f}%"


def fmt_bound(x: float) -> str:
    return f"{100 * x:g}%"


def judge(
    label: str,
    baseline_label: str,
    phases: dict[str, PhaseStats | None],
    final_val: float | None,
    noise: NoiseFloor | None = None,
):
    """The verdict: within the paper's bounds or not, by how much, and which gaps lie beyond the noise."""
    checks = tuple(
        Check(phase, bound, None if phases.get(phase) is None else phases[phase].settled_max)
        for phase, bound in PAPER_BOUNDS.items()
    )
    within = Verdict(checks, "").within
    word = {True: "within the paper's bounds", False: "outside the paper's bounds", None: "undetermined"}
    line = f"{label} vs {baseline_label}: {word[within]}: " + "; ".join(c.describe() for c in checks)
    if final_val is not None:
        line += f"; final validation gap {pct(final_val)}"
    if noise is None or label == noise.label:
        return Verdict(checks, line)
    judged = [(c, noise.band[c.phase]) for c in checks if None not in (c.value, noise.band[c.phase])]
    beyond = tuple(c.phase for c, band in judged if abs(c.value) > band)
    if judged:
        where = f"beyond the noise floor in {', '.join(beyond)}" if beyond else "within the noise floor"
        sizes = "; ".join(f"{c.phase} {pct(c.value)} vs ±{100 * band:.2f}%" for c, band in judged)
        line += f"; {where} ({sizes}, from {noise.label} vs {baseline_label})"
    return Verdict(checks, line, beyond)


def summarize_run(
    label: str,
    run_dir: Path,
    baseline: RunMetrics,
    baseline_label: str,
    window: int,
    about: str = "",
    noise: NoiseFloor | None = None,
) -> RunSummary:
    metrics = load_loss_metrics(run_dir)
    config = load_run_config(run_dir)
    bounds = boundaries_from_config(config)
    train = train_gap(metrics, baseline, window)
    val_in_precision = val_gap(metrics, baseline)
    both_bf16 = len(metrics.curve(VAL_LOSS_BF16)) and len(baseline.curve(VAL_LOSS_BF16))
    val = val_gap(metrics, baseline, bf16=True) if both_bf16 else val_in_precision
    phases = phase_summary(train, bounds, window)
    val_phases = phase_summary(val, bounds)
    final_val = val_phases["end"].last if val_phases["end"] is not None else None
    return RunSummary(
        label=label,
        about=about,
        metrics=metrics,
        config=config,
        bounds=bounds,
        train=train,
        val=val,
        val_in_precision=val_in_precision,
        phases=phases,
        val_phases=val_phases,
        verdict=judge(label, baseline_label, phases, final_val, noise),
    )


def summarize(
    runs: dict[str, str | Path],
    baseline_dir: str | Path,
    baseline_label: str = "fp8",
    window: int | None = None,
    about: dict[str, str] | None = None,
    noise_label: str | None = None,
) -> Comparison:
    """Every number of the report of ``runs`` (label -> run dir). ``noise_label``: the baseline's repeat
    from other initial weights, the noise floor every other verdict is read against."""
    if not runs:
        raise UserError("nothing to compare: give at least one run besides the baseline")
    if noise_label is not None and noise_label not in runs:
        raise UserError(f"no run '{noise_label}' to take the noise floor from")
    baseline = load_loss_metrics(baseline_dir)
    baseline_config = load_run_config(baseline_dir)
    if window is None:
        window = default_window(baseline_config)
    about = about or {}

    def one(label: str, noise: NoiseFloor | None) -> RunSummary:
        return summarize_run(
            label, Path(runs[label]), baseline, baseline_label, window, about.get(label, ""), noise
        )

    noise, summaries = None, {}
    if noise_label is not None:  # first: every other verdict is read against it
        summaries[noise_label] = one(noise_label, None)
        noise = NoiseFloor.from_phases(noise_label, summaries[noise_label].phases)
    summaries = {label: summaries.get(label) or one(label, noise) for label in runs}
    for s in summaries.values():
        if not len(s.train) and not len(s.val):
            raise UserError(
                f"{s.metrics.run_dir} and {baseline_dir} share no logged step: "
                "they must log at the same steps (same train.log_every and eval.every)"
            )
    return Comparison(baseline_label, baseline, baseline_config, window, summaries, noise)


# ----------------------------------------------------------------------------------------------
# plain data for report.json and wandb


def _num(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def _series(g: Aligned) -> dict:
    return {
        "steps": [int(s) for s in g.steps],
        "tokens": [_num(t) for t in g.tokens],
        "loss": [_num(v) for v in g.run],
        "baseline_loss": [_num(v) for v in g.baseline],
        "gap": [_num(v) for v in g.gap],
    }


def _phases(phases: dict[str, PhaseStats | None]) -> dict:
    return {name: None if st is None else st.to_dict() for name, st in phases.items()}


def _final(g: Aligned) -> dict | None:
    if not len(g):
        return None
    return {
        "step": int(g.steps[-1]),
        "tokens": _num(g.tokens[-1]),
        "loss": _num(g.run[-1]),
        "baseline_loss": _num(g.baseline[-1]),
        "gap": _num(g.gap[-1]),
    }


def monitor_to_dict(m: RunMetrics) -> dict:
    """What the noise monitor did in a run: skipped updates and BF16 fallback stretches."""
    return {
        "skipped_updates": list(m.skipped_updates),
        "fallback_spans": [list(span) for span in m.fallback_spans()],
    }


def run_to_dict(s: RunSummary) -> dict:
    return {
        "run_dir": str(s.metrics.run_dir),
        "about": s.about,
        "recipe": s.config.precision.recipe,
        "switch_to_bf16": s.config.precision.switch_to_bf16,
        "boundaries": s.bounds.to_dict(),
        "final": {
            "train": _final(s.train),
            "val": _final(s.val),
            "val_in_training_precision": _final(s.val_in_precision),
        },
        "phases": {"train": _phases(s.phases), "val": _phases(s.val_phases)},
        "verdict": {
            "within": s.verdict.within,
            "beyond_noise": None if s.verdict.beyond_noise is None else list(s.verdict.beyond_noise),
            "line": s.verdict.line,
            "checks": [
                {"phase": c.phase, "bound": c.bound, "max_gap": c.value, "ok": c.ok} for c in s.verdict.checks
            ],
        },
        "series": {
            "train": _series(s.train),
            "val": _series(s.val),
            "val_in_training_precision": _series(s.val_in_precision),
        },
        "skipped_lines": s.metrics.skipped_lines,
        "nonfinite_losses": s.metrics.nonfinite,
        "monitor": monitor_to_dict(s.metrics),
    }


def comparison_to_dict(c: Comparison) -> dict:
    return {
        "baseline": {
            "label": c.baseline_label,
            "run_dir": str(c.baseline.run_dir),
            "recipe": c.baseline_config.precision.recipe,
            "monitor": monitor_to_dict(c.baseline),
        },
        "gap_definition": "(L_run - L_baseline) / L_baseline",
        "smoothing": {
            "kind": "trailing mean over the logged steps in (s - window, s]",
            "window_steps": c.window,
        },
        "paper_bounds": dict(PAPER_BOUNDS),
        "noise_floor": None if c.noise is None else {"label": c.noise.label, "band": dict(c.noise.band)},
        "verdict": c.main.verdict.line,
        "runs": {label: run_to_dict(s) for label, s in c.runs.items()},
    }
