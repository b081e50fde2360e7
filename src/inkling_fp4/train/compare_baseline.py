"""compare-baseline: train one recipe under the FP8 baseline and under its own precision, then report.

Every run of a comparison is the same recipe (model, data, seed and data order, schedule) and only
the precision differs: ``fp8``, the paper's baseline, in FP8 to the last step (the paper's FP8 run
never switches to BF16); the recipe as configured; ``--with`` other precisions; ``--ablate`` one
piece of the recipe off per run; ``--noise`` repeats (the baseline from other initial weights, or for
RL, whose runs start from trained weights, every precision with the next seed).

Runs go to ``<run_dir>/<label>`` and the report to ``<run_dir>/report``. A finished run is reused and
an interrupted one resumed, so a long comparison can run in pieces: interrupt it and run the same
command again. The run without the BF16 switch equals the recipe's run up to the switch, so it starts
from a copy of the recipe's checkpoint at the step before the switch.

Under torchrun every process trains every run together; rank 0 alone speaks, copies checkpoints and
writes the report, and the other ranks wait at a barrier wherever rank 0 writes files they read.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inkling_fp4 import distributed as D
from inkling_fp4.compare.compat import (
    check_comparable,
    config_differences,
    describe_differences,
    read_config_data,
)
from inkling_fp4.compare.loss_gap import boundaries_from_config
from inkling_fp4.compare.metrics import load_run_config, parse_metrics_lines, row_value
from inkling_fp4.compare.report import compare, not_a_report, write_report
from inkling_fp4.compare.rl_seeds import SEED_KEYS, seed_groups, seed_label
from inkling_fp4.config import RunConfig, from_dict, to_dict
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.interop.load_run import find_checkpoint, run_config
from inkling_fp4.output_guard import check_output
from inkling_fp4.precision.config import RECIPES
from inkling_fp4.runs.checkpoint import checkpoint_dirs
from inkling_fp4.runs.metrics import METRICS_FILE, truncate_metrics
from inkling_fp4.train import stages
from inkling_fp4.train.from_run_config import from_run_config
from inkling_fp4.train.rollout import DEFAULT_RECIPE, check_config

BASELINE = "fp8"
BASELINE_CHANGES = {
    "precision.recipe": "fp8",
    "precision.switch_to_bf16": "never",
    "precision.bf16_first_layers": None,
    "precision.bf16_last_layers": None,
    "precision.activation_scale": "tensor",
}
"""The paper's FP8 baseline: its recipe, its default BF16 layers, no switch."""
NOISE = f"{BASELINE}-reinit"
"""Label of the baseline's repeat from other initial weights (the noise floor)."""
ROW_SCALE = "nvfp4-row"
"""Label of nvfp4 with one FP32 activation scale per row (``precision.activation_scale=row``)."""
PRECISIONS: dict[str, dict[str, Any]] = {
    **{r: {"precision.recipe": r, "precision.activation_scale": "tensor"} for r in RECIPES},
    ROW_SCALE: {"precision.recipe": "nvfp4", "precision.activation_scale": "row"},
}
"""What ``--with`` takes: each precision recipe, and nvfp4 with per-row activation scales."""

ABLATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "rht": ("no random Hadamard transform on the wgrad operands", {"precision.rht": False}),
    "sr": ("round-to-nearest gradients (no stochastic rounding)", {"precision.stochastic_rounding": False}),
    "2d": ("1x16 weight scales instead of 16x16 tiles", {"precision.weight_2d": False}),
    "bf16-layers": (
        "every layer quantized (none kept in BF16)",
        {"precision.bf16_first_layers": 0, "precision.bf16_last_layers": 0},
    ),
    "switch": ("no switch to BF16 before the decay", {"precision.switch_to_bf16": "never"}),
}
"""Pieces of the recipe that ``--ablate`` switches off, one run each."""
ABLATABLE = {"rht": ("nvfp4", "mxfp4"), "sr": ("nvfp4", "mxfp4"), "2d": ("nvfp4",)}
"""Recipes that have the piece; a piece not listed exists in nvfp4 and mxfp4."""


@dataclass
class PlannedRun:
    label: str
    cfg: RunConfig
    about: str
    branch_from: str | None = None
    """Label of the run whose checkpoint just before the BF16 switch this run starts from."""
    branch_step: int | None = None


def derive(cfg: RunConfig, changes: dict[str, Any], name: str) -> RunConfig:
    """A copy of ``cfg`` with dotted-key changes, validated like any recipe."""
    data = to_dict(cfg)
    for key, value in changes.items():
        section, field = key.split(".")
        data[section][field] = value
    data["name"] = name
    return from_dict(RunConfig, data)


def precision_label(cfg: RunConfig) -> str:
    return ROW_SCALE if cfg.precision.activation_scale == "row" else cfg.precision.recipe


def seed_changes(cfg: RunConfig) -> dict[str, int]:
    """An RL run's repeat with the next seed: other prompts, order, samples and stochastic rounding."""
    return {"train.seed": cfg.train.seed + 1, "sampler.seed": cfg.sampler.seed + 1}


def plan_runs(cfg: RunConfig, with_recipes=(), ablate=(), noise: bool = False) -> list[PlannedRun]:
    """The runs of a comparison: baseline, recipe, other precisions, ablations, and ``noise``'s repeats."""
    main, main_label = cfg.precision.recipe, precision_label(cfg)
    if main == BASELINE:
        raise ConfigError(
            "precision.recipe=fp8 is the baseline itself: compare-baseline trains the recipe in FP8 and in "
            "its own precision; set precision.recipe to nvfp4 (or mxfp4, bf16, fp8-tensorwise)"
        )
    if cfg.stage == "rollout":
        check_config(cfg)  # before any run directory is made
    if cfg.train.stop_after is not None:
        raise ConfigError(
            "train.stop_after does not apply to a comparison of several runs; interrupt it (Ctrl-C) and run "
            "the same command again to continue"
        )
    plan = [
        PlannedRun(
            BASELINE, derive(cfg, BASELINE_CHANGES, f"{cfg.name}-{BASELINE}"), "the paper's FP8 baseline"
        ),
        PlannedRun(main_label, derive(cfg, {}, f"{cfg.name}-{main_label}"), "the recipe as configured"),
    ]
    for label in dict.fromkeys(with_recipes):
        if label not in PRECISIONS or label in (BASELINE, main_label):
            others = [r for r in PRECISIONS if r not in (BASELINE, main_label)]
            raise ConfigError(f"--with {label}: choose among {', '.join(others)}")
        extra = " (nvfp4, one FP32 activation scale per row)" if label == ROW_SCALE else ""
        run = derive(cfg, PRECISIONS[label], f"{cfg.name}-{label}")
        plan.append(PlannedRun(label, run, f"the recipe in {label}{extra}"))
    precisions = list(plan)  # what the RL seed repeats repeat (not the ablations)
    for piece in dict.fromkeys(ablate):
        if piece not in ABLATIONS:
            raise ConfigError(f"--ablate {piece}: choose among {', '.join(ABLATIONS)}")
        if main not in ABLATABLE.get(piece, ("nvfp4", "mxfp4")):
            raise ConfigError(f"--ablate {piece}: the {main} recipe has no such piece")
        about, changes = ABLATIONS[piece]
        label = f"{main_label}-no-{piece}"
        run = PlannedRun(label, derive(cfg, changes, f"{cfg.name}-{label}"), about)
        if piece == "switch":
            switch = boundaries_from_config(cfg).switch_step
            if switch is None:
                raise ConfigError(
                    "--ablate switch: the recipe never switches to BF16 (precision.switch_to_bf16)"
                )
            if switch > 1:
                run.branch_from, run.branch_step = main_label, switch - 1
        plan.append(run)
    if noise and cfg.stage == "rollout":
        for p in precisions:
            changes = seed_changes(p.cfg)
            seeds = ", ".join(f"{key}={value}" for key, value in changes.items())
            about = f"{p.label} with the next seed ({seeds})"
            label = seed_label(p.label, 1)
            plan.append(PlannedRun(label, derive(p.cfg, changes, f"{cfg.name}-{label}"), about))
    elif noise:
        init_seed = (cfg.train.seed if cfg.train.init_seed is None else cfg.train.init_seed) + 1
        changes = {**BASELINE_CHANGES, "train.init_seed": init_seed}
        about = f"the baseline from other initial weights (train.init_seed={init_seed}): the noise floor"
        plan.append(PlannedRun(NOISE, derive(cfg, changes, f"{cfg.name}-{NOISE}"), about))
    return plan


# ----------------------------------------------------------------------------------------------
# training the planned runs


def last_logged_step(run_dir: Path) -> int:
    """The last training step in a run's metrics (0 when it has none)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    rows, _ = parse_metrics_lines(path.read_bytes().decode("utf-8", errors="replace").splitlines())
    steps = [hit[0] for hit in (row_value(r, "loss") for r in rows) if hit is not None]
    return max(steps, default=0)


def trained_steps(run_dir: Path) -> int:
    """The steps a run has trained: its last logged step or, when later, its newest checkpoint (the
    loop checkpoints where it stops, interrupted or at ``train.stop_after``, logged or not)."""
    saved = [step for step, path in checkpoint_dirs(run_dir) if (path / "state.json").is_file()]
    return max([last_logged_step(run_dir), *saved])


def check_same_run(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse to reuse a run directory that holds a different run."""
    if not (run_dir / "config.yaml").is_file():
        return
    old = read_config_data(run_dir)
    new = to_dict(cfg)
    diffs = config_differences(old, new)
    old_p, new_p = old.get("precision", {}), new["precision"]
    diffs += [(f"precision.{k}", old_p.get(k), v) for k, v in new_p.items() if old_p.get(k, v) != v]
    if diffs:
        raise UserError(
            f"{run_dir} holds a different run ({describe_differences(diffs)}); pass another --run-dir or "
            "remove it to start over"
        )


def _checkpoint_steps(run_dir: Path) -> list[int]:
    return [step for step, _ in checkpoint_dirs(run_dir)]


def train_run(cfg: RunConfig, run_dir: Path, baseline: Path | None, echo: Callable[[str], None]) -> bool:
    """Train (or resume, or reuse) one run; True once it has trained its last step."""
    target = cfg.train.stop_after or cfg.train.steps
    done = trained_steps(run_dir)
    if done >= target:
        echo(f"{run_dir}: already trained to step {done}, reusing it")
        return True
    resume = bool(_checkpoint_steps(run_dir))
    echo(f"{run_dir}: {'resuming' if resume else 'training'} {cfg.precision.recipe} to step {target}")
    stages.run_stage(cfg, run_dir, resume=resume, baseline=baseline)
    done = trained_steps(run_dir)
    if done < target:
        echo(f"{run_dir}: stopped at step {done} of {target}; run the same command again to continue")
        return False
    return True


def branch(parent: PlannedRun, child: PlannedRun, run_dir: Path, echo: Callable[[str], None]) -> bool:
    """Start ``child`` from ``parent``'s checkpoint at ``child.branch_step`` (training the parent that
    far first). False when training stopped early; a child that cannot branch trains from scratch."""
    child_dir, parent_dir, step = run_dir / child.label, run_dir / parent.label, child.branch_step
    if last_logged_step(child_dir) or _checkpoint_steps(child_dir):
        return True  # branched (or started) before
    if trained_steps(parent_dir) < step:
        stop_cfg = derive(parent.cfg, {"train.stop_after": step}, parent.cfg.name)
        if not train_run(stop_cfg, parent_dir, _baseline_dir(run_dir, parent), echo):
            return False
    source = parent_dir / "checkpoints" / f"step_{step}"
    if not (source / "state.json").is_file():
        echo(
            f"{child_dir}: no checkpoint of {parent.label} at step {step} to start from; "
            "training it from scratch"
        )
        return True
    ranks = sync_ranks(child.cfg)  # every rank has looked at child_dir before rank 0 writes into it
    if ranks.is_main:
        child_dir.mkdir(parents=True, exist_ok=True)
        shutil.copytree(source, child_dir / "checkpoints" / source.name)
        for name in ("tokenizer.json", METRICS_FILE):
            if (parent_dir / name).is_file():
                shutil.copy2(parent_dir / name, child_dir / name)
        truncate_metrics(child_dir / METRICS_FILE, step)  # the parent may have logged past the branch
    sync_ranks(child.cfg)  # ... and every rank finds the copy complete
    echo(f"{child_dir}: starts from {parent.label}'s checkpoint at step {step} (identical until the switch)")
    return True


def train_planned(
    plan: list[PlannedRun], run_dir: Path, echo: Callable[[str], None] = print, only: str | None = None
) -> bool:
    """Train the planned runs in order (or just ``only``); False as soon as one stops early. A run that
    branches from another is branched before that one trains past the branch point."""
    by_label = {p.label: p for p in plan}
    if only is not None and only not in by_label:
        raise UserError(f"no run '{only}' in this comparison; its runs are {', '.join(by_label)}")
    for p in plan:
        check_same_run(run_dir / p.label, p.cfg)
    if not sync_ranks(plan[0].cfg).is_main:  # the barrier: configs read before rank 0 rewrites them
        echo = _silent
    for p in plan:
        if only is not None and p.label != only:
            continue
        children = [c for c in plan if c.branch_from == p.label]  # branched before p trains past them
        for child in ([p] if p.branch_from else []) + children:
            if not branch(by_label[child.branch_from], child, run_dir, echo):
                return False
        if not train_run(p.cfg, run_dir / p.label, _baseline_dir(run_dir, p), echo):
            return False
    return True


def sync_ranks(cfg: RunConfig) -> D.DistInfo:
    """A barrier over the torchrun processes; returns this one's rank. The first call opens the process
    group every later run uses (the training loop closes only a group it opened itself)."""
    ranks = D.init_distributed(cfg.train.device)
    D.barrier(ranks)
    return ranks


def _silent(_: str) -> None:
    pass


def _baseline_dir(run_dir: Path, planned: PlannedRun) -> Path | None:
    """The baseline run to log the live loss gap against (once it exists); none for RL, whose policy
    loss hovers around 0 and so has no relative gap."""
    path = run_dir / BASELINE
    live = planned.label != BASELINE and planned.cfg.stage != "rollout"
    return path if live and path.is_dir() else None


# ----------------------------------------------------------------------------------------------
# entry points


RL_BASES = ("sft", "pretrain")
"""The stages an RL comparison starts from."""


def rollout_config(recipe: str | None, overrides: list[str], base: str | Path) -> RunConfig:
    """The RL recipe on the model of ``base``, an sft or pretrain run or checkpoint (or a Nemotron-H
    directory): every run of an RL comparison starts from the policy before any RL."""
    base_dir, _ = find_checkpoint(base)
    base_cfg = run_config(base_dir)
    if base_cfg is not None and base_cfg.stage not in RL_BASES:
        raise UserError(
            f"--from {base}: a {base_cfg.stage} run; an RL comparison starts from an sft or pretrain run "
            f"(this one started from {base_cfg.init_from})"
        )
    return from_run_config(recipe, overrides, base, stage="rollout", default_recipe=DEFAULT_RECIPE)


def run_compare(
    cfg: RunConfig,
    run_dir: str | Path,
    with_recipes=(),
    ablate=(),
    only: str | None = None,
    echo: Callable[[str], None] = print,
    noise: bool = False,
) -> Path | None:
    """Train the comparison's runs and write the report; returns the report directory, or None when
    a run stopped early (interrupted) or only one run (the one labelled ``only``) was asked for."""
    run_dir = Path(run_dir)
    plan = plan_runs(cfg, with_recipes, ablate, noise)
    ranks = D.init_distributed(cfg.train.device)  # one process group for all the runs (torchrun)
    run_dir.mkdir(parents=True, exist_ok=True)
    report = None
    if train_planned(plan, run_dir, echo, only) and only is None:
        labels, about = [p.label for p in plan], {p.label: p.about for p in plan}
        report = write_comparison(run_dir, labels, about) if ranks.is_main else run_dir / "report"
    D.barrier(ranks)  # no rank leaves (torchrun then ends the others) before the report is written
    D.shutdown(ranks)
    return report


def write_comparison(run_dir: str | Path, labels: list[str], about: dict[str, str] | None = None) -> Path:
    """The report of the runs under ``run_dir`` (``labels[0]`` the baseline) in ``run_dir/report``."""
    run_dir = Path(run_dir)
    missing = [label for label in labels if not (run_dir / label / METRICS_FILE).is_file()]
    if missing:
        raise UserError(f"{run_dir}: no run yet for {', '.join(missing)}; train it first")
    base, *others = labels
    repeats = {r for runs in seed_groups(labels).values() for r in runs[1:]}
    for label in others:
        allow = SEED_KEYS if label in repeats else _noise_allowance(label == NOISE)
        check_comparable(run_dir / label, run_dir / base, allow=allow)
    noise_label = NOISE if NOISE in others else None
    runs = {label: run_dir / label for label in others}
    return write_report(compare(runs, run_dir / base, base, about, noise_label), run_dir / "report")


def _is_rollout(run_dir: Path) -> bool:
    return load_run_config(run_dir).stage == "rollout"


def _noise_allowance(is_noise_run: bool) -> tuple[str, ...]:
    """The key a noise-floor repeat may differ in from its baseline: the initial weights' seed."""
    return ("train.init_seed",) if is_noise_run else ()


def compare_runs(
    run_a: str | Path,
    baseline_b: str | Path,
    out_dir: str | Path | None = None,
    noise_run: str | Path | None = None,
    force: bool = False,
    echo: Callable[[str], None] = print,
) -> Path:
    """Compare two existing run directories that differ only in precision; with ``noise_run`` (the
    baseline from other initial weights), read each gap against the noise floor."""
    run_a, baseline_b = Path(run_a), Path(baseline_b)
    own = run_a / "report"
    if out_dir is not None and Path(out_dir).resolve() != own.resolve():
        inputs = [("--run", run_a), ("--baseline", baseline_b), ("--noise-run", noise_run)]
        replacing = check_output(out_dir, "--out", "compare-baseline", kind="directory", force=force,
                                 not_own=not_a_report, inputs=inputs)  # fmt: skip
        if replacing:
            echo(replacing)
    check_comparable(run_a, baseline_b)
    label_a = load_run_config(run_a).precision.recipe
    label_b = load_run_config(baseline_b).precision.recipe
    if label_a == label_b:
        label_a, label_b = run_a.name, baseline_b.name
    out = Path(out_dir) if out_dir else own
    runs, noise_label = {label_a: run_a}, None
    if noise_run is not None:
        noise_run = Path(noise_run)
        noise_label = NOISE if noise_run.name in (label_a, label_b) else noise_run.name
        runs[noise_label] = noise_run
        if not _is_rollout(baseline_b):
            _check_noise_run(noise_run, baseline_b)
    return write_report(compare(runs, baseline_b, label_b, noise_label=noise_label), out)


def _check_noise_run(noise_run: Path, baseline: Path) -> None:
    """A noise run must be the baseline with another ``train.init_seed`` and nothing else changed."""
    check_comparable(noise_run, baseline, allow=_noise_allowance(True))
    repeat, base = load_run_config(noise_run), load_run_config(baseline)
    if repeat.precision != base.precision:
        raise UserError(
            f"--noise-run {noise_run}: its precision ({repeat.precision.recipe}) differs from the baseline's "
            f"({base.precision.recipe}); the noise floor is the baseline trained again with another "
            "train.init_seed and nothing else changed"
        )
    if _init_seed(repeat) == _init_seed(base):
        raise UserError(
            f"--noise-run {noise_run}: it starts from the same weights as the baseline "
            f"(train.init_seed {_init_seed(repeat)}); train the baseline again with another train.init_seed"
        )


def _init_seed(cfg: RunConfig) -> int:
    return cfg.train.seed if cfg.train.init_seed is None else cfg.train.init_seed
