"""The RL comparison's report sections: three plots (four with seed repeats) and report.md's text.

All of it renders the plain-data summary that compare/report.py writes as report.json, on
matplotlib's Agg canvas as loss_report.py does. The mismatch plot uses log scales: mismatch spans
orders of magnitude between precisions.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from inkling_fp4.compare.loss_gap import trailing_mean
from inkling_fp4.compare.markdown import cell, monitor_section, table
from inkling_fp4.compare.rl_gap import EVAL_ACCURACY, REWARD, plain, signed, steps_text
from inkling_fp4.compare.rl_seeds_report import plot_seeds, seeds_section

PLOTS = {"reward": "reward.png", "gap": "gap.png", "mismatch": "mismatch.png"}
SEEDS_PLOT = "seeds.png"


def write_plots(data: dict, out_dir: Path) -> dict[str, str]:
    """reward.png, gap.png, mismatch.png (seeds.png with repeats) into ``out_dir``; returns {plot: file}."""
    plots = dict(PLOTS) if data["seeds"] is None else {**PLOTS, "seeds": SEEDS_PLOT}
    plot_rewards(data, out_dir / PLOTS["reward"])
    plot_gap(data, out_dir / PLOTS["gap"])
    plot_mismatch(data, out_dir / PLOTS["mismatch"])
    if data["seeds"] is not None:
        plot_seeds(data, out_dir / SEEDS_PLOT)
    return plots


# ----------------------------------------------------------------------------------------------
# plots


def _runs(data: dict) -> list[tuple[str, dict]]:
    base = data["baseline"]
    return [(f"{base['label']} (baseline)", base)] + [(label, r) for label, r in data["runs"].items()]


def _styles(data: dict) -> dict[str, tuple[str, str]]:
    """(colour, line style) of each run: one colour per precision, its seed repeats dashed."""
    labels = [r["label"] for _, r in _runs(data)]
    if data["seeds"] is None:
        return {label: (f"C{i}", "-") for i, label in enumerate(labels)}
    out = {}
    for i, p in enumerate(data["seeds"]["precisions"].values()):
        out.update({run: (f"C{i}", "-" if j == 0 else "--") for j, run in enumerate(p["runs"])})
    return out


def _xy(series: dict, key_y: str = "values") -> tuple[np.ndarray, np.ndarray]:
    steps = np.asarray(series["steps"], dtype=np.int64)
    values = np.asarray([np.nan if v is None else v for v in series[key_y]], dtype=np.float64)
    keep = np.isfinite(values)
    return steps[keep], values[keep]


def _trend(
    ax, steps: np.ndarray, values: np.ndarray, window: int, style: tuple[str, str], label: str
) -> None:
    """The per-step values faint, their trailing mean over ``window`` steps bold."""
    if not len(steps):
        return
    color, ls = style
    ax.plot(steps, values, color=color, ls=ls, lw=0.8, alpha=0.35)
    ax.plot(steps, trailing_mean(steps, values, window), color=color, ls=ls, lw=1.6, label=label)


def _finish(ax, title: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _canvas(figsize: tuple[float, float], panels: int):
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, panels)
    return fig, np.atleast_1d(axes)


def plot_rewards(data: dict, path: Path) -> None:
    window = data["tail"]["window_steps"]
    fig, (ax_r, ax_e) = _canvas((12, 4.5), 2)
    styles = _styles(data)
    for label, r in _runs(data):
        color, ls = style = styles[r["label"]]
        if REWARD in r["series"]:
            _trend(ax_r, *_xy(r["series"][REWARD]), window, style, label)
        if EVAL_ACCURACY in r["series"]:
            ax_e.plot(*_xy(r["series"][EVAL_ACCURACY]), color=color, ls=ls, marker="o", ms=4, lw=1.2,
                      label=label)  # fmt: skip
    _finish(ax_r, f"reward per step (bold: trailing mean over {steps_text(window)})", "reward")
    _finish(ax_e, "held-out accuracy (greedy pass@1)", "accuracy")
    fig.savefig(path, dpi=120)


def plot_gap(data: dict, path: Path) -> None:
    window, base = data["tail"]["window_steps"], data["baseline"]["label"]
    fig, (ax,) = _canvas((10, 5), 1)
    styles = _styles(data)
    for label, r in data["runs"].items():
        style, name = styles[label], label if r["against"] == base else f"{label} - {r['against']}"
        _trend(ax, *_xy(r["gaps"][REWARD]["series"], "diff"), window, style, f"{name}: reward")
        steps, diff = _xy(r["gaps"][EVAL_ACCURACY]["series"], "diff")
        if len(steps):
            ax.plot(steps, diff, color=style[0], ls="none", marker="o", ms=5, label=f"{name}: eval accuracy")
    ax.axhline(0.0, color="0.3", lw=0.8)
    _finish(ax, f"gap to {base}: run - {base} (bold: trailing mean over {steps_text(window)})", "gap")
    fig.savefig(path, dpi=120)


def plot_mismatch(data: dict, path: Path) -> None:
    fig, axes = _canvas((12, 4.5), 2)
    panels = (("mismatch_k3", "k3 KL(sampler || trainer)"), ("mismatch_abs_mean", "mean |Δ log p|"))
    styles = _styles(data)
    for ax, (key, title) in zip(axes, panels, strict=True):
        for label, r in _runs(data):
            if key not in r["series"]:
                continue
            steps, values = _xy(r["series"][key])
            positive = values > 0
            if positive.any():
                color, ls = styles[r["label"]]
                ax.plot(steps[positive], values[positive], color=color, ls=ls, lw=1.2, label=label)
        if ax.get_lines():
            ax.set_yscale("log")
        _finish(ax, f"rollout / trainer mismatch: {title}", title)
    fig.savefig(path, dpi=120)


# ----------------------------------------------------------------------------------------------
# markdown


def fmt_figure(key: str, x: float | None) -> str:
    """A figure in the digits that tell its runs apart."""
    if x is None:
        return "n/a"
    if key in ("mismatch_k3", "mismatch_abs_mean", "mismatch_abs_max"):
        return f"{x:.2e}"
    if key.startswith("mismatch_"):
        return f"{x:.4f}"
    if key.endswith("tokens_per_s"):
        return f"{x:,.0f}"
    if key == "completion_len_mean":
        return f"{x:.1f}"
    return plain(x)


def _figure_rows(data: dict) -> list[list[str]]:
    """One row per figure (its summary), plus the last step's reward and the last evaluation."""
    runs = [r for _, r in _runs(data)]
    window = steps_text(data["tail"]["window_steps"])
    rows = []
    for f in data["figures"]:
        key = f["key"]
        if all(r["figures"][key] is None for r in runs):
            continue
        how = "mean of the evaluations" if f["over"] == "all" else f"{f['reduce']} over the last {window}"
        how += ", first step left out" if f["warm"] else ""
        values = [fmt_figure(key, _get(r["figures"][key], "value")) for r in runs]
        rows.append([cell(f"{f['label']} ({how})"), *values])
        if key in (REWARD, EVAL_ACCURACY):
            where = "last step" if key == REWARD else "last evaluation"
            finals = [fmt_figure(key, _get(r["figures"][key], "final")) for r in runs]
            rows.append([f"{f['label']} ({where})", *finals])
    return rows


def _get(d: dict | None, key: str):
    return None if d is None else d.get(key)


def render_markdown(data: dict) -> str:
    base = data["baseline"]["label"]
    window = data["tail"]["window_steps"]
    lines = [
        f"# RL: reward and accuracy gap to the {base} baseline",
        "",
        f"**Headline:** {data['headline']}",
        "",
    ]
    lines += [
        f"Gap = run - {base} at the same step; higher reward and accuracy are better. Every run starts "
        "from the same checkpoint with the same seed, prompt order and sampling seeds: only the precision "
        f"differs{'' if data['seeds'] is None else ' (a seed repeat differs in its seeds too)'}. "
        f'"The last {steps_text(window)}": the logged steps in (last - {window}, last]; evaluations '
        "(greedy pass@1 on held-out problems): the last one and the mean of all; timings and tokens/s "
        "leave the first step out (warm-up). The mismatch figures compare the sampler's log-probabilities "
        "with the trainer's on the same tokens, within each run.",
        "",
        f"![reward and eval accuracy]({data['plots']['reward']})",
        "",
        f"![gap]({data['plots']['gap']})",
        "",
        f"![mismatch]({data['plots']['mismatch']})",
        "",
        "## Runs",
        "",
    ]
    rows = []
    for label, r in _runs(data):
        rows.append([label, r["recipe"], r["activation_scale"], r["sampler_precision"], r["correction"],
                     r["about"], f"`{r['run_dir']}`"])  # fmt: skip
    lines += table(["run", "recipe", "activation scale", "sampler", "correction", "what", "run dir"], rows)
    if data["seeds"] is not None:
        lines += ["", f"![seeds]({data['plots']['seeds']})", "", *seeds_section(data)]
    lines += ["", f"## Gap to {base}", ""]
    paired = any(r["against"] != base for r in data["runs"].values())
    if paired:
        lines += ["A seed repeat's gap is to the baseline's run of the same seed (column vs).", ""]
    rows = []
    for label, r in data["runs"].items():
        reward, acc = r["gaps"][REWARD], r["gaps"][EVAL_ACCURACY]
        gaps = [signed(reward["value"]), signed(reward["final"]), signed(acc["final"]), signed(acc["value"])]
        rows.append([label, *([r["against"]] if paired else []), *gaps, str(acc["points"])])
    header = [
        "run",
        *(["vs"] if paired else []),
        f"reward (last {steps_text(window)})",
        "reward (last step)",
        "eval accuracy (last evaluation)",
        "eval accuracy (mean of evaluations)",
        "evaluations",
    ]
    lines += table(header, rows)
    lines += ["", "## Side by side", ""]
    lines += table(["figure"] + [label for label, _ in _runs(data)], _figure_rows(data))
    lines += monitor_section(data)
    notes = [(label, r) for label, r in _runs(data) if r["skipped_lines"] or r["nonfinite"]]
    for label, r in notes:
        lines += ["", f"Note: {label}: {r['skipped_lines']} unreadable metrics lines and {r['nonfinite']} "
                  "non-finite values were left out."]  # fmt: skip
    return "\n".join(lines) + "\n"
