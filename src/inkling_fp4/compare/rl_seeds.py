"""The seeds of an RL comparison: each precision over its seed repeats, its gap to the baseline beside
the spread between seeds, and a verdict per precision.

One RL run says little alone: its reward and accuracy move with the prompts it drew, the completions
it sampled and its stochastic rounding. A precision's gap is its mean over seeds minus the baseline's,
within the seeds' spread when |gap| <= the larger of the two spreads (max - min). A built-in task
draws its held-out problems from ``train.seed`` too, so an evaluation's spread includes the problems.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from inkling_fp4.compare.metrics import RunMetrics
from inkling_fp4.compare.rl_gap import EVAL_K, plain, signed, steps_text

SEED_SUFFIX = "-seed"
SEED_KEYS = ("train.seed", "sampler.seed")
"""The keys a seed repeat changes (and the comparability check lets differ)."""


def seed_label(label: str, n: int) -> str:
    """The label of ``label``'s repeat with seed offset ``n``."""
    return f"{label}{SEED_SUFFIX}{n}"


def _split(label: str) -> tuple[str, int]:
    """(precision label, seed offset) of a run label; offset 0 for a run that is no repeat."""
    root, sep, n = label.rpartition(SEED_SUFFIX)
    return (root, int(n)) if sep and root and n.isdigit() else (label, 0)


def seed_groups(labels: list[str]) -> dict[str, list[str]]:
    """Each precision's label -> its runs (itself, then its repeats), in the order of ``labels``; a
    ``<x>-seed<n>`` label is a repeat only when ``x`` is a label too."""
    groups: dict[str, list[str]] = {}
    for label in labels:
        root, n = _split(label)
        if n and root in labels:
            groups.setdefault(root, [root]).append(label)
        else:
            groups.setdefault(label, [label])
    return groups


def pair_label(label: str, baseline: str, labels) -> str:
    """The run ``label``'s per-step gaps are against: the baseline's repeat of its seed, else the baseline."""
    root, n = _split(label)
    twin = seed_label(baseline, n)
    return twin if n and root in labels and twin in labels and twin != label else baseline


@dataclass(frozen=True)
class SeedFigure:
    """A figure read once per seed."""

    key: str
    """Its key in the report."""
    label: str
    source: str
    """Its key in metrics.jsonl."""
    at: str
    """last (the last evaluation) | change (the last evaluation minus the one at step 0) | tail (the
    mean over the tail)."""


SEED_FIGURES: tuple[SeedFigure, ...] = (
    SeedFigure("eval_accuracy", "eval accuracy", "eval_accuracy", "last"),
    SeedFigure("eval_accuracy_change", "eval accuracy change from step 0", "eval_accuracy", "change"),
    SeedFigure("reward_mean", "reward", "reward_mean", "tail"),
    SeedFigure("eval_pass1_sampled", "eval sampled pass@1", "eval_pass1_sampled", "last"),
    SeedFigure("eval_pass_at_k", "eval pass@k", "eval_pass_at_k", "last"),
    SeedFigure("eval_kl_to_start", "eval KL to the start", "eval_kl_to_start", "last"),
    SeedFigure("adv_abs_mean", "mean |advantage|", "adv_abs_mean", "tail"),
    SeedFigure("zero_var_frac", "zero-variance groups", "zero_var_frac", "tail"),
)
BY_KEY = {f.key: f for f in SEED_FIGURES}
VERDICT_FIGURES = ("eval_accuracy", "reward_mean")
"""The figures a precision's verdict is about: where the policy ends up, and what it earned."""


def describe(f: SeedFigure, window: int) -> str:
    if f.at == "last":
        return f"{f.label} (last evaluation)"
    if f.at == "change":
        return f"{f.label} (last evaluation - step 0)"
    return f"{f.label} (mean over the last {steps_text(window)})"


def seed_value(metrics: RunMetrics, f: SeedFigure, window: int) -> tuple[float | None, int | None]:
    """(value, step of its last row) of one run; None where the run did not log it (a change: or
    has no evaluation at step 0)."""
    curve = metrics.curve(f.source)
    if not len(curve):
        return None, None
    steps, values, last = curve.steps, curve.values, int(curve.steps[-1])
    if f.at == "last":
        return float(values[-1]), last
    if f.at == "change":
        start = values[steps == 0]
        return (float(values[-1] - start[0]) if len(start) else None), last
    return float(np.mean(values[steps > last - window])), last


@dataclass(frozen=True)
class SeedStat:
    """One figure of one precision, one value per seed."""

    values: tuple[float | None, ...]
    steps: tuple[int | None, ...]

    @property
    def mean(self) -> float | None:
        if not self.values or None in self.values:
            return None
        return float(np.mean(self.values))

    @property
    def spread(self) -> float | None:
        if len(self.values) < 2 or None in self.values:
            return None
        return float(max(self.values) - min(self.values))


@dataclass(frozen=True)
class SeedGap:
    """A precision's mean minus the baseline's, and the spread it is read against."""

    gap: float | None
    spread: float | None
    """The larger of the two precisions' spreads (the one there is, when only one has repeats)."""

    @property
    def within(self) -> bool | None:
        if self.gap is None or self.spread is None:
            return None
        return abs(self.gap) <= self.spread

    @property
    def times_spread(self) -> float | None:
        if self.gap is None or not self.spread:
            return None
        return abs(self.gap) / self.spread

    def text(self) -> str:
        if self.within is None:
            return "no seeds' spread to read it against"
        if self.within:
            return f"within the seeds' spread {plain(self.spread)}"
        times = "" if self.times_spread is None else f" ({self.times_spread:.1f}x)"
        return f"beyond the seeds' spread {plain(self.spread)}{times}"


def gap_of(run: SeedStat, base: SeedStat) -> SeedGap:
    gap = None if run.mean is None or base.mean is None else run.mean - base.mean
    spreads = [x for x in (run.spread, base.spread) if x is not None]
    return SeedGap(gap, max(spreads) if spreads else None)


@dataclass
class PrecisionSeeds:
    """One precision's runs (one per seed), their figures and, but for the baseline, gaps and verdict."""

    label: str
    runs: list[str]
    figures: dict[str, SeedStat]
    k: list[int | None]
    """The k of pass@k of each seed (None where not logged)."""
    gaps: dict[str, SeedGap] = field(default_factory=dict)
    verdict: str = ""


@dataclass
class SeedComparison:
    baseline: PrecisionSeeds
    precisions: dict[str, PrecisionSeeds]
    """The others, in the comparison's order."""
    window: int

    @property
    def headline(self) -> str:
        """The verdict of the first precision measured (the recipe's own)."""
        return next((p.verdict for p in self.precisions.values()), "")


def precision_seeds(
    label: str, runs: list[str], metrics: dict[str, RunMetrics], window: int
) -> PrecisionSeeds:
    figures = {}
    for f in SEED_FIGURES:
        read = [seed_value(metrics[r], f, window) for r in runs]
        figures[f.key] = SeedStat(tuple(v for v, _ in read), tuple(s for _, s in read))
    ks = [metrics[r].curve(EVAL_K) for r in runs]
    return PrecisionSeeds(label, list(runs), figures, [int(c.values[-1]) if len(c) else None for c in ks])


def verdict(p: PrecisionSeeds, base: PrecisionSeeds, window: int) -> str:
    """One line: per verdict figure, the gap of the means, both means, and how it sits in the spread."""
    n = str(len(p.runs)) if len(p.runs) == len(base.runs) else f"{len(p.runs)} and {len(base.runs)}"
    parts = []
    for key in VERDICT_FIGURES:
        f, g = BY_KEY[key], p.gaps[key]
        means = f"{plain(p.figures[key].mean)} vs {plain(base.figures[key].mean)}"
        parts.append(f"{describe(f, window)} {signed(g.gap)} ({means}), {g.text()}")
    return f"{p.label} vs {base.label} over {n} seeds: " + "; ".join(parts)


def summarize_seeds(
    groups: dict[str, list[str]], metrics: dict[str, RunMetrics], baseline: str, window: int
) -> SeedComparison:
    """Every precision's figures over its seeds (``groups``: precision -> run labels), gaps and verdict."""
    base = precision_seeds(baseline, groups[baseline], metrics, window)
    others = {}
    for label, runs in groups.items():
        if label == baseline:
            continue
        p = precision_seeds(label, runs, metrics, window)
        p.gaps = {key: gap_of(p.figures[key], base.figures[key]) for key in BY_KEY}
        p.verdict = verdict(p, base, window)
        others[label] = p
    return SeedComparison(base, others, window)


def _precision_to_dict(p: PrecisionSeeds) -> dict:
    out = {
        "runs": list(p.runs),
        "k": list(p.k),
        "figures": {
            key: {"seeds": list(st.values), "steps": list(st.steps), "mean": st.mean, "spread": st.spread}
            for key, st in p.figures.items()
        },
    }
    if p.gaps:
        out["gaps"] = {
            key: {"gap": g.gap, "spread": g.spread, "within": g.within, "times_spread": g.times_spread}
            for key, g in p.gaps.items()
        }
        out["verdict"] = p.verdict
    return out


def seeds_to_dict(s: SeedComparison) -> dict:
    """The plain data of report.json's ``seeds``."""
    return {
        "keys": list(SEED_KEYS),
        "baseline": s.baseline.label,
        "window_steps": s.window,
        "gap_definition": f"a precision's mean over its seeds - {s.baseline.label}'s mean",
        "spread_definition": f"the larger of the precision's and {s.baseline.label}'s max - min over "
        "their seeds; within: |gap| <= spread",
        "figures": [{**asdict(f), "describe": describe(f, s.window)} for f in SEED_FIGURES],
        "verdict_figures": list(VERDICT_FIGURES),
        "headline": s.headline,
        "precisions": {p.label: _precision_to_dict(p) for p in [s.baseline, *s.precisions.values()]},
    }
