"""The ``fp4train`` command line: one thin function per command, wiring only.

Each command loads its config and calls an importable ``run(cfg)``. A :class:`UserError` anywhere
below prints one line and exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path

import typer

from inkling_fp4.errors import UserError

app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,  # plain help: flags as --x/--no-x, no type column; stable across Typer versions
    no_args_is_help=True,
    help="Train hybrid Mamba-Transformer language models with NVFP4 4-bit forward passes.",
)


# options that several commands take, declared once
OVERRIDES = typer.Argument(None, metavar="KEY=VALUE", help="Dotted config overrides, e.g. train.steps=100.")
RUN_DIR = typer.Option(None, help="Run directory (default: runs/<name>).")
RESUME = typer.Option(
    False, show_default=False, help="Continue the run in --run-dir from its latest good checkpoint."
)
BASELINE = typer.Option(None, help="A baseline run directory: log the live loss gap to it.")
PRINT_CONFIG = typer.Option(
    False, show_default=False, help="Print the resolved config (YAML) and exit, writing nothing."
)


def _version(value: bool) -> None:
    if value:
        # imported here: start-up time
        from inkling_fp4 import __version__

        typer.echo(f"fp4train {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Train hybrid Mamba-Transformer language models with NVFP4 4-bit forward passes."""


def _print_config(cfg) -> None:
    # imported here: start-up time
    import yaml

    from inkling_fp4.config import to_dict

    typer.echo(yaml.safe_dump(to_dict(cfg), sort_keys=False), nl=False)


@app.command()
def recipes() -> None:
    """List the built-in recipes (use one with --recipe NAME).

    One line each: the recipe's name and what it is for."""
    # imported here: start-up time
    import shutil
    import textwrap

    from inkling_fp4.config import RECIPES_DIR, recipe_description

    width = max(60, min(shutil.get_terminal_size().columns, 100))
    for path in sorted(RECIPES_DIR.glob("*.yaml")):
        text = recipe_description(path)
        typer.echo(textwrap.fill(text, width, initial_indent=f"{path.stem:<16} ", subsequent_indent=" " * 17,
                                 break_long_words=False, break_on_hyphens=False))  # fmt: skip


@app.command()
def info(
    from_run: Path = typer.Option(
        None,
        "--from",
        help="A run, checkpoint or Nemotron-H directory to describe (default: the newest run under runs/, "
        "if there is one).",
    ),
) -> None:
    """Show the device and each precision recipe's backend.

    Which backend and kernels each precision recipe would use on this machine, and what a run holds
    (its checkpoint, model and tokenizer)."""
    # imported here: start-up time
    import importlib.util

    import torch

    from inkling_fp4.numerics import kernels
    from inkling_fp4.precision.backends import (
        describe_backend,
        hardware_summary,
        resolve_backend,
        te_available,
    )
    from inkling_fp4.precision.config import RECIPES

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    typer.echo(f"device: {hardware_summary(device)}, torch {torch.__version__}")
    triton = "not installed" if importlib.util.find_spec("triton") is None else "installed"
    on = "on" if kernels.available() else "off (the torch reference runs instead)"
    typer.echo(f"triton: {triton}; Triton kernels {on}")
    typer.echo(f"transformer engine: {'importable' if te_available() else 'not importable'}")
    for recipe in RECIPES:
        if recipe == "bf16":
            typer.echo("  bf16: BF16 GEMMs, FP32 accumulation")
            continue
        backend = resolve_backend("auto", recipe, device)
        typer.echo(f"  {recipe}: {describe_backend(backend, recipe, device)}")
    # imported here: start-up time
    from inkling_fp4.interop.load_run import describe
    from inkling_fp4.runs.find import RUNS_ROOT, default_from, newest_run

    if from_run is None and newest_run(RUNS_ROOT) is not None:
        from_run = default_from(typer.echo)
    if from_run is not None:
        for line in describe(from_run):
            typer.echo(line)


@app.command()
def pretrain(
    overrides: list[str] = OVERRIDES,
    recipe: str = typer.Option(
        None, help="Recipe YAML path or built-in name (default: tiny; with --resume: the run's config)."
    ),
    run_dir: Path = RUN_DIR,
    resume: bool = RESUME,
    baseline: Path = BASELINE,
    print_config: bool = PRINT_CONFIG,
    from_run: Path = typer.Option(
        None, "--from", help="Continue pretraining a run, checkpoint or Nemotron-H directory (its model)."
    ),
) -> None:
    """Pretrain with the WSD schedule and the precision recipe.

    NVFP4 forward and backward GEMMs by default, switching to BF16 before the learning-rate decay."""
    # imported here: start-up time
    from inkling_fp4.config import load_config
    from inkling_fp4.interop.load_run import find_checkpoint
    from inkling_fp4.runs.directory import TOKENIZER_FILE
    from inkling_fp4.train.from_run_config import from_run_config
    from inkling_fp4.train.pretrain import run

    overrides = list(overrides or [])
    cfg = load_config(recipe or "tiny", overrides)
    run_dir = run_dir or Path("runs") / cfg.name
    recorded = _recorded_with(run_dir, overrides) if resume and recipe is None else None
    if recorded is not None and from_run is not None:
        raise UserError(f"--resume continues {run_dir} from its own checkpoint; drop --from")
    if recorded is not None:
        cfg = recorded  # the run's own config
    elif from_run is not None:  # the base run's model and tokenizer, this recipe's everything else
        cfg = from_run_config(recipe, overrides, from_run, stage="pretrain", default_recipe="tiny")
        cfg.data.tokenizer = str(find_checkpoint(from_run)[0] / TOKENIZER_FILE)
    if print_config:
        return _print_config(cfg)
    _finish(run(cfg, run_dir, resume=resume, baseline=baseline), "pretrain")


@app.command()
def sft(
    overrides: list[str] = OVERRIDES,
    from_run: Path = typer.Option(
        None,
        "--from",
        help="Run, checkpoint or Nemotron-H directory to fine-tune (default: the newest run under runs/).",
    ),
    recipe: str = typer.Option(
        None, help="SFT recipe path or built-in name (default: sft-tiny; with --resume: the run's config)."
    ),
    run_dir: Path = RUN_DIR,
    resume: bool = RESUME,
    baseline: Path = BASELINE,
    print_config: bool = PRINT_CONFIG,
) -> None:
    """Fine-tune a run on chat data, with NVFP4 GEMMs.

    The loss is on the answers; the weights, model and tokenizer are those of the --from run, the
    optimizer starts fresh."""
    # imported here: start-up time
    from inkling_fp4.config import load_config
    from inkling_fp4.train.sft import DEFAULT_RECIPE, run

    overrides = list(overrides or [])
    name = load_config(recipe or DEFAULT_RECIPE, overrides).name  # no model yet: only the name
    run_dir = run_dir or Path("runs") / name
    cfg = _on_base(recipe, DEFAULT_RECIPE, overrides, from_run, run_dir, resume, "sft")
    if print_config:
        return _print_config(cfg)
    _finish(run(cfg, run_dir, resume=resume, baseline=baseline), "sft")


def _on_base(recipe, default_recipe, overrides, from_run, run_dir, resume, stage):
    """A later stage's config: the run's own on --resume, else the recipe on the model of --from
    (default: the newest run under runs/ but this one)."""
    # imported here: start-up time
    from inkling_fp4.runs.find import default_from
    from inkling_fp4.train.from_run_config import from_run_config

    cfg = _recorded_with(run_dir, overrides) if resume and recipe is None else None
    if cfg is not None and from_run is not None:
        raise UserError(
            f"--resume continues {run_dir} from its own checkpoint (it started from {cfg.init_from}); "
            "drop --from"
        )
    if cfg is None:
        from_run = from_run or default_from(typer.echo, exclude=run_dir)
        cfg = from_run_config(recipe, overrides, from_run, stage=stage, default_recipe=default_recipe)
    return cfg


def _recorded_with(run_dir: Path, overrides: list[str]):
    """The run's recorded config (amendments applied) with ``overrides``, or None without one."""
    # imported here: start-up time
    from inkling_fp4.config import RunConfig, apply_overrides, from_dict
    from inkling_fp4.runs.directory import recorded_config_data

    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file, not a directory; pass a directory path")
    data = recorded_config_data(run_dir)
    return None if data is None else from_dict(RunConfig, apply_overrides(data, overrides))


def _finish(result, command: str) -> None:
    """Say where the run went and what to run next; an interrupted run exits 130 (SIGINT) or 143
    (SIGTERM)."""
    # imported here: start-up time
    from inkling_fp4.trainer.fit import SIGNAL_EXIT_CODES

    if os.environ.get("RANK", "0") != "0":  # once under torchrun
        return
    typer.echo(f"run directory: {result.run_dir}")
    if result.interrupted_by is not None:
        name = signal.Signals(result.interrupted_by).name
        typer.echo(
            f"interrupted by {name} after step {result.step} (checkpoint written); continue with "
            f"fp4train {command} --resume --run-dir {result.run_dir}",
            err=True,
        )
        sys.exit(SIGNAL_EXIT_CODES.get(result.interrupted_by, 128 + int(result.interrupted_by)))
    for i, line in enumerate(result.next_commands):
        typer.echo(f"{'next:' if i == 0 else '':<6}{line}")


@app.command()
def tokenizer(
    out: Path = typer.Argument(..., metavar="OUT", help="Where to save tokenizer.json (a file or a folder)."),
    source: str = typer.Option("builtin", help="Text source: builtin, local files / globs, or a hub name."),
    vocab_size: int = typer.Option(4096, help="Vocabulary size, special tokens included."),
    text_field: str = typer.Option("text", help="Field holding the text in structured sources."),
    max_documents: int = typer.Option(None, help="Train on at most this many documents."),
    force: bool = typer.Option(
        False, show_default=False, help="Replace OUT if it is a tokenizer this command wrote."
    ),
) -> None:
    """Train a byte-level BPE tokenizer on a text source.

    Use it in a recipe or override with data.tokenizer=PATH."""
    # imported here: start-up time
    from inkling_fp4.data.bpe_training import train_tokenizer_command

    typer.echo(train_tokenizer_command(source, vocab_size, out, text_field, max_documents, force=force))


@app.command()
def export(
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE", help="Export options, e.g. export.calibration_batches=8."
    ),
    from_run: Path = typer.Option(
        None, "--from", help="Run, checkpoint or Nemotron-H directory (default: the newest run under runs/)."
    ),
    step: int = typer.Option(None, help="Export checkpoints/step_N of the run (default: the newest good)."),
    format: str = typer.Option(..., "--format", help="hf | nvfp4-modelopt | nvfp4-compressed-tensors."),
    out: Path = typer.Option(..., help="Directory to write: a new or empty one (or an earlier export)."),
    force: bool = typer.Option(False, show_default=False, help="Replace --out if it is an earlier export."),
) -> None:
    """Export a run for transformers or NVFP4 serving engines.

    hf: transformers' NemotronHForCausalLM in FP32; nvfp4-modelopt and nvfp4-compressed-tensors: the
    NVFP4 weights the training forward pass uses, in the layouts of ModelOpt and compressed-tensors."""
    # imported here: start-up time
    from inkling_fp4.config import apply_overrides, from_dict
    from inkling_fp4.interop.calibration import ExportConfig
    from inkling_fp4.interop.export import run_export
    from inkling_fp4.runs.find import default_from

    data = apply_overrides({"export": {}}, list(overrides or []))
    unknown = sorted(set(data) - {"export"})
    if unknown:
        raise UserError(f"export takes export.<field>=value options only, not {', '.join(unknown)}")
    options = from_dict(ExportConfig, data["export"], "export")
    from_run = from_run or default_from(typer.echo)
    run_export(from_run, format, out, step=step, options=options, force=force, echo=typer.echo)


def _comma_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


@app.command("compare-baseline")
def compare_baseline(
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE", help="Dotted overrides for every run, e.g. train.steps=100."
    ),
    recipe: str = typer.Option(None, help="Recipe to train in FP8 and in its own precision (default: tiny)."),
    run_dir: Path = typer.Option(None, help="Where the runs and report go (default: runs/<name>-compare)."),
    with_recipes: str = typer.Option(
        "",
        "--with",
        help="More precisions to compare (any stage): bf16, mxfp4, fp8-tensorwise, nvfp4, nvfp4-row "
        "(nvfp4 with one FP32 activation scale per row).",
    ),
    ablate: str = typer.Option("", help="Pieces to turn off, one run each: rht,sr,2d,bf16-layers,switch."),
    only: str = typer.Option(None, help="Train only this run of the comparison (e.g. fp8), no report."),
    run: Path = typer.Option(None, help="An existing run directory to compare with --baseline."),
    baseline: Path = typer.Option(None, help="The existing baseline run directory for --run."),
    out: Path = typer.Option(None, help="Report directory for --run / --baseline (default: <run>/report)."),
    force: bool = typer.Option(False, show_default=False, help="Replace --out if it is an earlier report."),
    noise: bool = typer.Option(
        False,
        show_default=False,
        help="Also train the baseline from other initial weights: the noise floor of every gap (--stage "
        "rollout: repeat every precision with the next train.seed and sampler.seed, <label>-seed1).",
    ),
    noise_run: Path = typer.Option(
        None, help="With --run / --baseline: the baseline trained again with another train.init_seed."
    ),
    stage: str = typer.Option("pretrain", help="Which stage to compare: pretrain, sft or rollout."),
    from_run: Path = typer.Option(
        None,
        "--from",
        help="--stage sft / rollout: the run or checkpoint every run starts from (default: the newest run "
        "under runs/ it can start from).",
    ),
) -> None:
    """Compare NVFP4 with the paper's FP8 baseline.

    Trains the recipe under FP8 and under its own precision with the same seed, data order and
    schedule, and reports the loss gap (RL: the reward and accuracy gap); --run A --baseline B
    compares two existing runs."""
    # imported here: start-up time
    from inkling_fp4.config import load_config
    from inkling_fp4.runs.find import default_from
    from inkling_fp4.train.compare_baseline import compare_runs, run_compare

    if run is not None or baseline is not None:
        if run is None or baseline is None:
            raise UserError("--run and --baseline go together: pass both run directories")
        if overrides or recipe or run_dir or with_recipes or ablate or only or noise or from_run:
            raise UserError(
                "--run / --baseline compare existing runs: drop --recipe, --run-dir, --with, --ablate, "
                "--only, --noise (use --noise-run DIR) and the overrides"
            )
        typer.echo(f"report: {compare_runs(run, baseline, out, noise_run, force=force, echo=typer.echo)}")
        return
    if out is not None or noise_run is not None or force:
        raise UserError(
            "--out, --force and --noise-run go with --run / --baseline; a new comparison reports into "
            "--run-dir (--noise trains its noise-floor run)"
        )
    if stage == "sft":
        # imported here: start-up time
        from inkling_fp4.train.from_run_config import from_run_config
        from inkling_fp4.train.sft import DEFAULT_RECIPE

        name = load_config(recipe or DEFAULT_RECIPE, list(overrides or [])).name
        from_run = from_run or default_from(typer.echo, exclude=Path("runs") / f"{name}-compare")
        cfg = from_run_config(
            recipe, list(overrides or []), from_run, stage="sft", default_recipe=DEFAULT_RECIPE
        )
    elif stage == "rollout":
        # imported here: start-up time
        from inkling_fp4.train.compare_baseline import RL_BASES, rollout_config
        from inkling_fp4.train.rollout import DEFAULT_RECIPE as RL_RECIPE

        name = load_config(recipe or RL_RECIPE, list(overrides or [])).name
        from_run = from_run or default_from(typer.echo, RL_BASES, exclude=Path("runs") / f"{name}-compare")
        cfg = rollout_config(recipe, list(overrides or []), from_run)
    elif stage == "pretrain":
        if from_run is not None:
            raise UserError("--from goes with --stage sft or rollout; pretraining starts from random weights")
        cfg = load_config(recipe or "tiny", list(overrides or []))
    else:
        raise UserError(f"--stage {stage}: choose pretrain, sft or rollout")
    run_dir = run_dir or Path("runs") / f"{cfg.name}-compare"
    withs, pieces = _comma_list(with_recipes), _comma_list(ablate)
    report = run_compare(cfg, run_dir, withs, pieces, only=only, echo=typer.echo, noise=noise)
    if report is not None:
        typer.echo(f"report: {report}")


@app.command()
def generate(
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE", help="sampler.* / precision.* overrides, e.g. sampler.top_p=0.9."
    ),
    from_run: Path = typer.Option(
        None, "--from", help="Run or checkpoint directory (default: the newest run under runs/)."
    ),
    prompt: list[str] = typer.Option(
        None, metavar="TEXT", help="A prompt (repeatable); runs trained on the chat template get it."
    ),
    prompts: Path = typer.Option(
        None, help="A file of prompts, one a line (or .jsonl with a 'prompt' field)."
    ),
    out: Path = typer.Option(None, help="Write the completions as jsonl here (a new file)."),
    force: bool = typer.Option(
        False, show_default=False, help="Replace --out if it is an earlier output of generate."
    ),
    stream: bool = typer.Option(
        None, "--stream/--no-stream", help="Print the text as it is decoded (default: one prompt, no --out)."
    ),
) -> None:
    """Complete prompts with a run's model in its precision.

    The run's own precision recipe by default (sampler.precision); prompts go in the chat template
    when the run's weights were trained on it. Shows new tokens/s."""
    # imported here: start-up time
    from inkling_fp4.infer.generate import run_generate

    run_generate(from_run, prompt, prompts, out, list(overrides or []), echo=typer.echo, stream=stream,
                 write=lambda text: typer.echo(text, nl=False), force=force)  # fmt: skip


@app.command("eval")
def eval_(
    overrides: list[str] = typer.Argument(
        None, metavar="KEY=VALUE", help="sampler.* / precision.* overrides, e.g. sampler.temperature=0.7."
    ),
    from_run: Path = typer.Option(
        None, "--from", help="Run or checkpoint directory (default: the newest run under runs/)."
    ),
    task: str = typer.Option(
        ..., help="arithmetic, countdown, or a jsonl FILE of {prompt|question, answer}."
    ),
    samples: int = typer.Option(1, help="Completions per problem: > 1 adds pass@1 sampled and pass@K."),
    problems: int = typer.Option(100, help="Held-out problems to score (a FILE: at most this many)."),
) -> None:
    """Score a run on a task's held-out split (pass@1, pass@k).

    pass@1 greedy and, with --samples K, pass@1 sampled and pass@K, appended to the run's
    metrics.jsonl."""
    # imported here: start-up time
    from inkling_fp4.infer.evaluate import run_eval

    run_eval(from_run, task, samples, problems, list(overrides or []), echo=typer.echo)


@app.command()
def rollout(
    overrides: list[str] = OVERRIDES,
    from_run: Path = typer.Option(
        None, "--from", help="Run or checkpoint to train (default: the newest run under runs/)."
    ),
    task: str = typer.Option(None, help="Built-in task: arithmetic or countdown (rl.task)."),
    data: Path = typer.Option(None, help="A jsonl of {prompt, answer} or {question, answer} records."),
    reward: str = typer.Option(None, help="A reward function MODULE:FUNCTION(prompt, completion, answer)."),
    recipe: str = typer.Option(
        None, help="RL recipe path or built-in name (default: rl-tiny; with --resume: the run's config)."
    ),
    run_dir: Path = RUN_DIR,
    resume: bool = RESUME,
    baseline: Path = BASELINE,
    print_config: bool = PRINT_CONFIG,
) -> None:
    """RL a run with NVFP4 rollouts and verifiable rewards.

    Samples with the run's own forward pass, scores with the task's verifier (or --reward) and takes
    GRPO steps."""
    # imported here: start-up time
    from inkling_fp4.config import load_config
    from inkling_fp4.train import rollout as rl_stage

    overrides = list(overrides or [])
    if task is not None and data is not None:
        raise UserError("--task and --data both name the prompts; pass one")
    if task is not None or data is not None:
        overrides.append(f"rl.task={task if task is not None else data}")
    if reward is not None:
        overrides.append(f"rl.reward={reward}")
    name = load_config(recipe or rl_stage.DEFAULT_RECIPE, overrides).name
    run_dir = run_dir or Path("runs") / name
    cfg = _on_base(recipe, rl_stage.DEFAULT_RECIPE, overrides, from_run, run_dir, resume, "rollout")
    if print_config:
        return _print_config(cfg)
    _finish(rl_stage.run(cfg, run_dir, resume=resume, baseline=baseline), "rollout")


def main() -> None:
    if not sys.stderr.isatty():  # logs and captured output: no progress bars between the lines
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        if "datasets" in sys.modules:
            sys.modules["datasets"].disable_progress_bars()
    try:
        app()
    except UserError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as e:
        if not _out_of_memory(e):
            raise  # a bug: its traceback
        typer.echo(f"error: {_out_of_memory_line(e)}", err=True)
        sys.exit(1)


def _out_of_memory(e: Exception) -> bool:
    """The accelerator ran out of memory (torch is imported by then if it could)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(e, torch.OutOfMemoryError)


def _out_of_memory_line(e: Exception) -> str:
    """One line for a resource problem, not a bug: how much was asked, what to lower, how to go on."""
    asked = re.search(r"Tried to allocate [\d.]+ \w+", str(e))
    what = f" ({asked[0].lower()})" if asked else ""
    return (
        f"out of GPU memory{what}: lower train.micro_batch_size (training) or sampler.batch_size "
        "(sampling), or free the GPU of other processes; a training run goes on from its last "
        "checkpoint with --resume"
    )


if __name__ == "__main__":
    main()
