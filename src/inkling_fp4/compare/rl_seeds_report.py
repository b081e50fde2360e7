"""The seeds part of the RL report: its markdown section and ``seeds.png``, from report.json's
``seeds`` (compare/rl_seeds.py ``seeds_to_dict``), so they show the numbers report.json holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from inkling_fp4.compare.markdown import cell
from inkling_fp4.compare.rl_gap import plain, signed


def _fmt(key: str, x: float | None) -> str:
    """KL to the start spans orders of magnitude; the rest lie in [0, 1] or near it."""
    if x is None:
        return "n/a"
    return f"{x:.2e}" if key == "eval_kl_to_start" else plain(x)


def _fmt_signed(key: str, x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:+.2e}" if key == "eval_kl_to_start" else signed(x)


def _verdict_cell(gap: dict) -> str:
    if gap["within"] is None:
        return "n/a"
    if gap["within"]:
        return "within"
    return "beyond" + ("" if gap["times_spread"] is None else f" ({gap['times_spread']:.1f}x)")


def _k_text(p: dict) -> str:
    ks = {k for k in p["k"] if k is not None}
    return f" (k = {ks.pop()})" if len(ks) == 1 else ""


def seeds_section(data: dict) -> list[str]:
    """The verdicts, then per figure and precision: each seed's value, mean, spread and gap to baseline."""
    seeds = data["seeds"]
    base, precisions = seeds["baseline"], seeds["precisions"]
    lines = [
        "## Seeds",
        "",
        f"Every precision ran once more with `{'` and `'.join(seeds['keys'])}` one higher (other prompts in "
        "another order, other samples and stochastic rounding; the same starting checkpoint and "
        "held-out problems). Gap = "
        f"{seeds['gap_definition']}; seeds' spread = {seeds['spread_definition']}.",
        "",
    ]
    lines += [f"- {p['verdict']}" for p in precisions.values() if "verdict" in p]
    header = ["figure", "precision", "runs", "per seed", "mean", "max - min", f"gap to {base}",
              "seeds' spread", "verdict"]  # fmt: skip
    rows = []
    for f in seeds["figures"]:
        key = f["key"]
        if all(v is None for p in precisions.values() for v in p["figures"][key]["seeds"]):
            continue
        for label, p in precisions.items():
            st = p["figures"][key]
            name = f["describe"] + (_k_text(p) if key == "eval_pass_at_k" else "")
            row = [cell(name), label, ", ".join(p["runs"]), ", ".join(_fmt(key, v) for v in st["seeds"]),
                   _fmt(key, st["mean"]), _fmt(key, st["spread"])]  # fmt: skip
            if "gaps" in p:
                g = p["gaps"][key]
                row += [_fmt_signed(key, g["gap"]), _fmt(key, g["spread"]), _verdict_cell(g)]
            else:
                row += ["-", "-", "-"]
            rows.append(row)
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows] + [""]


def plot_seeds(data: dict, path: Path) -> None:
    """Per verdict figure: each precision's seeds (dots) and their mean (a bar)."""
    seeds = data["seeds"]
    by_key = {f["key"]: f for f in seeds["figures"]}
    keys = seeds["verdict_figures"]
    fig = Figure(figsize=(5 * len(keys), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_1d(fig.subplots(1, len(keys)))
    labels = list(seeds["precisions"])
    for ax, key in zip(axes, keys, strict=True):
        for i, label in enumerate(labels):
            st = seeds["precisions"][label]["figures"][key]
            values = [v for v in st["seeds"] if v is not None]
            if st["mean"] is not None:
                ax.bar(i, st["mean"], color=f"C{i}", alpha=0.35, width=0.6)
            ax.plot([i] * len(values), values, ls="none", marker="o", color=f"C{i}")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(by_key[key]["describe"], fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=120)
