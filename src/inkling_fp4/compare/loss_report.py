"""The loss comparison's report sections: two plots, report.md's text, and the numbers for wandb.

All of it renders the plain-data summary that compare/report.py writes as report.json. Plots draw
on matplotlib's Agg canvas, not pyplot: no display, no process-wide backend change.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from inkling_fp4.compare.loss_gap import LOSS, VAL_LOSS, smooth
from inkling_fp4.compare.loss_summary import PAPER_BOUNDS, Comparison, fmt_bound, pct
from inkling_fp4.compare.markdown import monitor_section, table

PLOTS = {"loss": "loss.png", "gap": "gap.png"}
BOUNDARY_STYLE = {"warmup_end": ("stable starts", ":"), "decay_start": ("decay starts", "--")}


def write_plots(comparison: Comparison, out_dir: Path) -> dict[str, str]:
    """loss.png and gap.png into ``out_dir``; returns {plot: file name}."""
    plot_losses(comparison, out_dir / PLOTS["loss"])
    plot_gap(comparison, out_dir / PLOTS["gap"])
    return dict(PLOTS)


# ----------------------------------------------------------------------------------------------
# plots


def _tokens_axis(comparison: Comparison) -> bool:
    """Plot over tokens when the baseline logged them, else over steps."""
    t = comparison.baseline.curve(LOSS).tokens
    return len(t) > 0 and bool(np.isfinite(t).all())


def _x_of_step(comparison: Comparison, step: float) -> float:
    """Where a step lies on the x axis (tokens grow by the same batch every step)."""
    train = comparison.baseline.curve(LOSS)
    if not _tokens_axis(comparison):
        return float(step)
    return float(step * train.tokens[-1] / train.steps[-1])


def _boundaries(comparison: Comparison, ax) -> None:
    """Vertical lines where the main run's phases start, and at each run's switch to BF16."""
    main = comparison.main.bounds
    lines: dict[int, list[str]] = {}
    styles: dict[int, str] = {}
    for key, (label, style) in BOUNDARY_STYLE.items():
        step = getattr(main, key)
        if step <= main.total_steps:
            lines.setdefault(step, []).append(label)
            styles.setdefault(step, style)
    switches: dict[int, list[str]] = {}
    for s in comparison.runs.values():
        if s.bounds.switch_step is not None:
            switches.setdefault(s.bounds.switch_step, []).append(s.label)
    for step, labels in switches.items():
        lines.setdefault(step, []).append(f"BF16 switch of {', '.join(labels)}")
        styles.setdefault(step, "-.")
    for step, labels in sorted(lines.items()):
        x = _x_of_step(comparison, step)
        ax.axvline(x, color="0.45", ls=styles[step], lw=1, label=f"{' + '.join(labels)} (step {step})")


def _robust_ylim(ax, arrays: list[np.ndarray], include: tuple[float, ...] = ()) -> None:
    vals = np.concatenate([a[np.isfinite(a)] for a in arrays] + [np.asarray(include, dtype=float)])
    if not len(vals):
        return
    lo, hi = float(vals.min()), float(vals.max())
    pad = 0.08 * (hi - lo) if hi > lo else max(abs(hi), 1.0) * 0.05
    ax.set_ylim(lo - pad, hi + pad)


def _after_warmup(steps: np.ndarray, values: np.ndarray, warmup_end: int) -> np.ndarray:
    keep = steps >= warmup_end
    return values[keep] if keep.any() else values


def plot_losses(comparison: Comparison, path: Path) -> None:
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_train, ax_val = fig.subplots(1, 2)
    use_tokens = _tokens_axis(comparison)
    warmup_end = comparison.main.bounds.warmup_end
    runs = [(f"{comparison.baseline_label} (baseline)", comparison.baseline)]
    runs += [(s.label, s.metrics) for s in comparison.runs.values()]
    shown = []
    for i, (label, m) in enumerate(runs):
        color = f"C{i}"
        sm, val = smooth(m.curve(LOSS), comparison.window), m.curve(VAL_LOSS)
        if len(sm):
            ax_train.plot(sm.tokens if use_tokens else sm.steps, sm.values, color=color, lw=1.4, label=label)
            shown.append(_after_warmup(sm.steps, sm.values, warmup_end))
        if len(val):
            x = val.tokens if use_tokens else val.steps
            ax_val.plot(x, val.values, color=color, marker="o", ms=3, lw=1.2, label=label)
    _robust_ylim(ax_train, shown)
    ax_train.set_title(f"training loss (trailing mean over {comparison.window} steps)")
    ax_val.set_title("validation loss")
    for ax in (ax_train, ax_val):
        _boundaries(comparison, ax)
        ax.set_xlabel("tokens" if use_tokens else "step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


def plot_gap(comparison: Comparison, path: Path) -> None:
    fig = Figure(figsize=(10, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    use_tokens = _tokens_axis(comparison)
    warmup_end = comparison.main.bounds.warmup_end
    shown = []
    for i, s in enumerate(comparison.runs.values(), start=1):
        color = f"C{i}"
        if len(s.train):
            x = s.train.tokens if use_tokens else s.train.steps
            ax.plot(x, 100 * s.train.gap, color=color, lw=1.4, label=f"{s.label}: training loss (smoothed)")
            shown.append(100 * _after_warmup(s.train.steps, s.train.gap, warmup_end))
        if len(s.val):
            x = s.val.tokens if use_tokens else s.val.steps
            label = f"{s.label}: validation"
            ax.plot(x, 100 * s.val.gap, color=color, ls="none", marker="o", ms=4, label=label)
            shown.append(100 * _after_warmup(s.val.steps, s.val.gap, warmup_end))
    ax.axhline(0.0, color="0.3", lw=0.8)
    ax.axhline(100 * PAPER_BOUNDS["stable"], color="k", ls="--", lw=1.2, label="paper: 1% (stable phase)")
    ax.axhline(100 * PAPER_BOUNDS["decay"], color="k", ls=":", lw=1.2, label="paper: 1.5% (decay)")
    _boundaries(comparison, ax)
    _robust_ylim(ax, shown, include=(0.0, 100 * PAPER_BOUNDS["decay"]))
    ax.set_title(
        f"relative loss gap to {comparison.baseline_label}: (L - L_{comparison.baseline_label}) / L_"
        f"{comparison.baseline_label}"
    )
    ax.set_xlabel("tokens" if use_tokens else "step")
    ax.set_ylabel("gap (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------
# markdown


def human_tokens(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def _token_span(st: dict | None) -> str:
    if st is None:
        return "n/a"
    return f"{human_tokens(st['first_tokens'])}-{human_tokens(st['last_tokens'])}"


def _loss(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4f}"


def _get(d: dict | None, *keys):
    for k in keys:
        if d is None:
            return None
        d = d.get(k)
    return d


def _noise_paragraph(data: dict) -> list[str]:
    noise = data["noise_floor"]
    if noise is None:
        return []
    band = ", ".join(
        f"{phase} ±{100 * b:.2f}%" if b is not None else f"{phase} n/a" for phase, b in noise["band"].items()
    )
    return [
        f"**Noise floor:** `{noise['label']}` is the baseline trained again from other initial weights "
        f"(same data, order and schedule). Against the baseline its judged smoothed gap moves within {band}: "
        "a run's gap inside that band cannot be told apart from chance with one run per precision.",
        "",
    ]


def _noise_cell(label: str, run: dict, noise_label: str) -> str:
    if label == noise_label:
        return "(the repeat)"
    beyond = run["verdict"]["beyond_noise"]
    if beyond is None:
        return "n/a"
    return f"beyond in {', '.join(beyond)}" if beyond else "within"


def render_markdown(data: dict) -> str:
    base = data["baseline"]["label"]
    runs = data["runs"]
    first = next(iter(runs.values()))
    lines = [f"# Loss gap to the {base} baseline", "", f"**Verdict:** {data['verdict']}", ""]
    lines += [
        f"Relative gap = (L_run - L_{base}) / L_{base}. Training loss smoothed by a trailing mean over "
        f"{data['smoothing']['window_steps']} steps before the ratio; validation loss evaluated with every "
        "GEMM in BF16 as in the paper (and, where logged, in each run's training precision). "
        f"The paper's bounds: stable phase < {fmt_bound(data['paper_bounds']['stable'])}, decay < "
        f"{fmt_bound(data['paper_bounds']['decay'])}, held against the largest smoothed training-loss "
        'gap of each phase among the steps whose smoothing window lies inside the phase ("judged").',
        "",
        *_noise_paragraph(data),
        f"![loss curves]({data['plots']['loss']})",
        "",
        f"![relative gap]({data['plots']['gap']})",
        "",
        "## Runs",
        "",
    ]
    rows = [
        [
            f"{base} (baseline)",
            data["baseline"]["recipe"],
            "the baseline",
            f"`{data['baseline']['run_dir']}`",
            _loss(_get(first, "final", "train", "baseline_loss")),
            _loss(_get(first, "final", "val", "baseline_loss")),
        ]
    ]
    for label, r in runs.items():
        train_loss, val_loss = _get(r, "final", "train", "loss"), _get(r, "final", "val", "loss")
        rows.append([label, r["recipe"], r["about"], f"`{r['run_dir']}`", _loss(train_loss), _loss(val_loss)])
    header = ["run", "recipe", "what", "run dir", "final train loss (smoothed)", "final val loss"]
    lines += table(header, rows)
    lines += ["", f"## Gap to {base}", ""]
    rows = []
    for label, r in runs.items():
        ph = r["phases"]["train"]
        rows.append(
            [
                label,
                pct(_get(ph, "stable", "mean_gap")),
                pct(_get(ph, "stable", "settled_max_gap")),
                pct(_get(ph, "decay", "settled_max_gap")),
                pct(_get(ph, "after_switch", "end_gap")),
                pct(_get(r, "final", "train", "gap")),
                pct(_get(r, "final", "val", "gap")),
                pct(_get(r, "final", "val_in_training_precision", "gap")),
                {True: "within", False: "outside", None: "undetermined"}[r["verdict"]["within"]],
            ]
        )
        if data["noise_floor"] is not None:
            rows[-1].append(_noise_cell(label, r, data["noise_floor"]["label"]))
    header = [
        "run",
        "stable mean",
        "stable max (judged)",
        "decay max (judged)",
        "after switch, end",
        "final train",
        "final val",
        "final val (training precision)",
        "paper's bounds",
    ]
    if data["noise_floor"] is not None:
        header.append("noise floor")
    lines += table(header, rows)
    lines += monitor_section(data)
    for label, r in runs.items():
        lines += ["", f"## {label}: gap per phase", "", r["verdict"]["line"], ""]
        b = r["boundaries"]
        switch = "never" if b["switch_step"] is None else f"from step {b['switch_step']}"
        lines += [
            f"Schedule: {b['total_steps']} steps; warmup until step {b['warmup_end'] - 1}, stable from step "
            f"{b['warmup_end']}, decay from step {b['decay_start']}; BF16 GEMMs: {switch}.",
            "",
        ]
        rows = []
        for phase, st in r["phases"]["train"].items():
            val = r["phases"]["val"].get(phase)
            rows.append(
                [
                    phase.replace("_", " "),
                    "n/a" if st is None else f"{st['first_step']}-{st['last_step']}",
                    _token_span(st),
                    pct(_get(st, "mean_gap")),
                    pct(_get(st, "max_gap")),
                    pct(_get(st, "settled_max_gap")),
                    pct(_get(st, "end_gap")),
                    pct(_get(val, "mean_gap")),
                    pct(_get(val, "end_gap")),
                ]
            )
        header = ["phase", "steps", "tokens", "train mean", "train max", "train max (judged)", "train end"]
        header += ["val mean", "val end"]
        lines += table(header, rows)
        if r["skipped_lines"] or r["nonfinite_losses"]:
            lines += [
                "",
                f"Note: {r['skipped_lines']} unreadable metrics lines and {r['nonfinite_losses']} "
                "non-finite losses were left out.",
            ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# wandb


def _flat(prefix: str, d, out: dict) -> None:
    if isinstance(d, dict):
        for k, v in d.items():
            _flat(f"{prefix}/{k}" if prefix else k, v, out)
    elif isinstance(d, (int, float)) and not isinstance(d, bool):
        out[prefix] = d


def wandb_summary(data: dict) -> dict[str, float]:
    """The report's scalar numbers, as ``compare/<run>/<phase>/<stat>`` keys."""
    out: dict[str, float] = {}
    for label, r in data["runs"].items():
        _flat(f"compare/{label}/final", r["final"], out)
        _flat(f"compare/{label}/phases", r["phases"], out)
        out[f"compare/{label}/within_paper_bounds"] = {True: 1, False: 0, None: -1}[r["verdict"]["within"]]
        if r["verdict"]["beyond_noise"] is not None:
            out[f"compare/{label}/beyond_noise_floor"] = float(bool(r["verdict"]["beyond_noise"]))
    if data["noise_floor"] is not None:
        for phase, band in data["noise_floor"]["band"].items():
            if band is not None:
                out[f"compare/noise_floor/{phase}"] = band
    return out


def log_to_wandb(data: dict, out_dir: Path, *, project: str, name: str) -> None:
    """Summary numbers, the gap series by step, and both plots (offline unless WANDB_API_KEY is set)."""
    import wandb

    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    run = wandb.init(project=project, name=name, dir=str(out_dir), mode=mode, job_type="compare")
    by_step: dict[int, dict] = {}
    for label, r in data["runs"].items():
        for kind in ("train", "val"):
            s = r["series"][kind]
            for step, tokens, gap in zip(s["steps"], s["tokens"], s["gap"], strict=True):
                if gap is None:
                    continue
                row = by_step.setdefault(step, {})
                row[f"compare/{label}/gap_{kind}"] = gap
                if tokens is not None:
                    row["tokens"] = tokens
    for step in sorted(by_step):
        run.log(by_step[step], step=step)
    run.summary.update(wandb_summary(data))
    run.summary.update({"compare/verdict": data["verdict"]})
    run.log({f"compare/{k}": wandb.Image(str(out_dir / v)) for k, v in data["plots"].items()})
    run.finish()
