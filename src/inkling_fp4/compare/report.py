"""A comparison of runs against a baseline, for any stage: its numbers and its report directory.

What is compared depends on the stage the baseline ran:

| stage | what is compared | its gap | numbers, sections |
|---|---|---|---|
| pretrain, sft | losses (loss_gap.LOSS_KEYS) | relative, per phase | loss_summary, loss_report |
| rollout | reward, accuracy, mismatch (rl_gap.FIGURES) | difference, over the tail | rl_summary, rl_report |

Every report is one plain-data summary, written as report.json, that report.md and the plots render
(so they never disagree); report.json lists the plots, by which an earlier report is recognised
before it is replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

from inkling_fp4.compare import loss_report, rl_report
from inkling_fp4.compare.loss_summary import Comparison, comparison_to_dict, summarize
from inkling_fp4.compare.metrics import load_run_config
from inkling_fp4.compare.rl_summary import RLComparison, rl_comparison_to_dict, summarize_rl
from inkling_fp4.errors import UserError


def compare(
    runs: dict[str, str | Path],
    baseline_dir: str | Path,
    baseline_label: str,
    about: dict[str, str] | None = None,
    noise_label: str | None = None,
) -> Comparison | RLComparison:
    """Every number of the report of ``runs`` (label -> run dir) against the baseline. ``noise_label``
    (loss comparisons only): the baseline's repeat from other initial weights."""
    if load_run_config(baseline_dir).stage == "rollout":
        if noise_label is not None:
            raise UserError(
                "--noise-run: an RL comparison reads its gaps against seed repeats, not a noise run; drop "
                "--noise-run (compare-baseline --stage rollout --noise trains the repeats)"
            )
        return summarize_rl(runs, baseline_dir, baseline_label, about=about)
    return summarize(runs, baseline_dir, baseline_label, about=about, noise_label=noise_label)


def write_report(
    comparison: Comparison | RLComparison, out_dir: str | Path, *, wandb: bool | None = None
) -> Path:
    """The plots, report.json and report.md into ``out_dir``; a loss comparison also goes to wandb when
    the main run's config enables it (or when ``wandb`` says so). Returns ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(comparison, RLComparison):
        data = rl_comparison_to_dict(comparison)
        data["plots"] = rl_report.write_plots(data, out_dir)
        markdown = rl_report.render_markdown(data)
    else:
        data = comparison_to_dict(comparison)
        data["plots"] = loss_report.write_plots(comparison, out_dir)
        markdown = loss_report.render_markdown(data)
    (out_dir / "report.json").write_text(json.dumps(data, indent=2) + "\n")
    (out_dir / "report.md").write_text(markdown)
    if isinstance(comparison, Comparison):
        config = comparison.main.config
        if wandb if wandb is not None else config.log.wandb:
            name = f"{config.name}-compare"
            loss_report.log_to_wandb(data, out_dir, project=config.log.wandb_project, name=name)
    return out_dir


def not_a_report(path: Path) -> str | None:
    """Why ``path`` is not an earlier report (None: it holds only the files its report.json lists)."""
    try:
        plots = set(json.loads((path / "report.json").read_text())["plots"].values())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return "it has no readable report.json"
    other = sorted(p.name for p in path.iterdir() if p.name not in plots | {"report.json", "report.md"})
    if other:
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        return f"it also holds {other[0]}{more}, which the report did not write"
    return None
