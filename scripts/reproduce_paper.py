"""Reproduce the NVFP4 paper's loss-gap comparison at small scale, on one GPU or several (torchrun).

Why: the paper (arXiv 2509.25149) trains a 12B hybrid Mamba-Transformer on 10T tokens and finds the
NVFP4 loss within 1% of FP8 through the stable phase, about 1.5% late in the decay, about 0.5% or
less when the GEMMs switch to BF16 before the decay, and MXFP4 worse than NVFP4. This script runs
the same comparison on a small hybrid (``hybrid-125m`` by default) with a token budget of your
choice: the same recipe, seed and data order, WSD with the decay over the final 20%, in

    fp8               the paper's FP8 baseline (E4M3, 1x128 / 128x128 blocks), never switching
    nvfp4             the paper's NVFP4 recipe, switching to BF16 at the first decay step
    bf16              all GEMMs in BF16
    mxfp4             MXFP4 (E8M0 scales, 1x32 blocks), the same layer split and switch
    nvfp4-no-switch   NVFP4 to the end (starts from nvfp4's checkpoint just before the switch)

and writes the report (loss.png, gap.png, report.md, report.json) to ``<run-dir>/report``.

GPU time is scarce, so it runs in pieces: ``--only`` picks runs (one recipe per invocation), a run
that finished is reused, an interrupted one resumes from its checkpoint, and ``--time-budget`` ends
training in time (a checkpoint is written) so that a job with a time limit can simply be repeated.
Every invocation rewrites the report from the runs that have finished (the baseline included).

Several GPUs: start it with torchrun and every process trains each run together (data parallel, the
training loop's DDP). The global batch stays the recipe's and each process takes 1/N of every micro
batch, so the data order, the gradient accumulation and the validation batches are those of one
process and runs trained on different GPU counts compare as they are (only the order of the gradient
reductions differs; NVFP4's stochastic rounding draws a stream per process). Rank 0 prints, copies
checkpoints and writes the report. A stopped run resumes only with the number of processes that
wrote its checkpoint (it holds each one's data position and random state); the script says which.

Usage:
    python scripts/reproduce_paper.py --tokens 100e6 --only fp8 --time-budget 540
    python scripts/reproduce_paper.py --tokens 100e6 --only nvfp4 --time-budget 540   # repeat until done
    python scripts/reproduce_paper.py --tokens 100e6 --noise --only fp8-reinit  # the noise floor
    python scripts/reproduce_paper.py --tokens 100e6 --report-only  # (--noise: with the noise floor)
    python scripts/reproduce_paper.py --tokens 2e6 train.log_every=5       # a quick smoke test
    torchrun --nproc_per_node 2 scripts/reproduce_paper.py --tokens 100e6 --only nvfp4 --time-budget 540
    torchrun --nproc_per_node 2 scripts/reproduce_paper.py --tokens 100e6 --only nvfp4-no-switch

Output: the training log of each run, then one table row per run: steps done, median tokens/s,
final validation loss (BF16 evaluation), and its gaps to fp8 (judged stable-phase max, judged decay
max, final validation gap) with the verdict against the paper's bounds. Exit code 0 when every
requested run has finished, 3 when training stopped early (run the same command again), 2 on a
usage or config error. Under torchrun every process exits with that code and torchrun itself with 1
unless all exit 0; its summary lists each rank's ``exitcode`` (a job that repeats until done looks
for 3 there, so that it does not repeat a usage error).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import threading
from pathlib import Path

from inkling_fp4 import distributed as D
from inkling_fp4.compare.loss_gap import boundaries_from_config
from inkling_fp4.compare.metrics import parse_metrics_lines
from inkling_fp4.config import RunConfig, load_config
from inkling_fp4.errors import UserError
from inkling_fp4.runs.checkpoint import STATE_FILE, check_processes, checkpoint_dirs
from inkling_fp4.runs.metrics import METRICS_FILE
from inkling_fp4.train.compare_baseline import (
    NOISE,
    PlannedRun,
    check_same_run,
    derive,
    plan_runs,
    sync_ranks,
    train_planned,
    trained_steps,
    write_comparison,
)
from inkling_fp4.trainer.interrupt import StopSignal

RUNS = ("fp8", "nvfp4", "bf16", "mxfp4", "nvfp4-no-switch")
"""The paper's runs; ``--noise`` adds the baseline's repeat from other initial weights."""
USAGE, STOPPED = 2, 3
BUDGET_POLL_S = 0.05
"""How often a spent time budget looks for a training loop to stop."""


def paper_config(recipe: str, tokens: float, overrides: list[str]) -> RunConfig:
    """The recipe as the paper trains it: NVFP4, WSD with the decay over the final 20%, the BF16
    switch at the first decay step; the step count from the token budget."""
    cfg = load_config(recipe, overrides)
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    steps = math.ceil(tokens / tokens_per_step)
    changes = {
        "train.steps": steps,
        "train.decay_fraction": 0.2,
        "precision.recipe": "nvfp4",
        "precision.switch_to_bf16": "decay",
    }
    return derive(cfg, changes, cfg.name)


def split_over_processes(cfg: RunConfig, processes: int) -> RunConfig:
    """The same run on ``processes`` data-parallel processes: the global batch and the accumulation
    steps of one process, each micro batch split evenly (``train.micro_batch_size`` is per process).
    The validation batches are micro batches too, so one process and N see the same validation set."""
    if processes == 1:
        return cfg
    batch, micro = cfg.train.batch_size, cfg.train.micro_batch_size or cfg.train.batch_size
    if micro % processes:
        fits = [m for m in range(processes, batch + 1, processes) if batch % m == 0]
        if not fits:
            raise UserError(
                f"train.batch_size={batch} does not split over {processes} processes; start a number of "
                f"processes that divides it (torchrun --nproc_per_node)"
            )
        best = max([m for m in fits if m <= micro] or fits[:1])
        raise UserError(
            f"the micro batch of {micro} sequences (train.micro_batch_size, the whole batch when unset) does "
            f"not split over {processes} processes; set train.micro_batch_size={best} (a multiple of "
            f"{processes} dividing train.batch_size={batch}) on every invocation of this comparison"
        )
    return derive(cfg, {"train.micro_batch_size": micro // processes}, cfg.name)


def check_process_count(plan: list[PlannedRun], wanted: list[str], run_dir: Path, processes: int) -> None:
    """Refuse up front to resume a stopped run on another number of processes than wrote its
    checkpoint (the training loop would refuse too, after loading the data and building the model)."""
    by_label = {p.label: p for p in plan}
    involved = dict.fromkeys(x for label in wanted for x in (label, by_label[label].branch_from) if x)
    steps = plan[0].cfg.train.steps
    for label in involved:
        path = run_dir / label
        ckpts = [c for _, c in checkpoint_dirs(path) if (c / STATE_FILE).is_file()]
        if not ckpts or trained_steps(path) >= steps:
            continue
        try:
            state = json.loads((ckpts[-1] / STATE_FILE).read_text())
        except ValueError:
            continue  # not a checkpoint the loop would resume from; it reports it itself
        if isinstance(state, dict) and isinstance(state.get("data"), list):
            check_processes(ckpts[-1], state, processes)


class TimeBudget:
    """``seconds`` of training for this invocation; once spent, the training loop in progress stops
    after its step (every rank checkpoints and returns, as on Ctrl-C) and no further run starts.

    NOTE: no SIGINT is sent. Outside a training step a signal raises KeyboardInterrupt wherever the
    process happens to be, e.g. in a collective that the other torchrun processes then wait in
    forever. Instead this sets the stop flag of the loop's own SIGINT handler (``StopSignal``), which
    the loop reads after each step and agrees on across ranks (``distributed.any_rank``); while no
    loop is listening (a run being set up) it waits for one. One process keeping time is enough."""

    def __init__(self, seconds: float | None, enabled: bool = True):
        self.seconds = seconds
        self.spent = False
        self._closed = threading.Event()
        if seconds and enabled:
            threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        if self._closed.wait(self.seconds):
            return
        self.spent = True
        while not self._closed.wait(BUDGET_POLL_S):
            stop = getattr(signal.getsignal(signal.SIGINT), "__self__", None)
            if isinstance(stop, StopSignal) and not stop.requested:
                stop.requested = True
                print(
                    f"\ntime budget of {self.seconds:g}s spent: finishing this step, then checkpointing",
                    flush=True,
                )

    def close(self) -> None:
        self._closed.set()


def train_wanted(plan: list[PlannedRun], wanted: list[str], run_dir: Path, budget: TimeBudget, say) -> bool:
    """Train the wanted runs in the plan's order; False when one stopped before its last step."""
    cfg = plan[0].cfg
    for label in (p.label for p in plan if p.label in wanted):
        unfinished = trained_steps(run_dir / label) < cfg.train.steps
        if unfinished and D.any_rank(budget.spent, D.init_distributed(cfg.train.device)):
            say(f"time budget of {budget.seconds:g}s spent before {label}; run the same command again")
            return False
        if not train_planned(plan, run_dir, say, only=label):
            return False
    return True


def median_tokens_per_s(run_dir: Path) -> float | None:
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None
    rows, _ = parse_metrics_lines(path.read_text().splitlines())
    rates = [
        r["tokens_per_s"]
        for r in rows
        if "event" not in r and isinstance(r.get("tokens_per_s"), (int, float))
    ]
    return statistics.median(rates) if rates else None


def _pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:+.2f}%"


def print_table(run_dir: Path, labels: list[str], steps: int) -> None:
    report = run_dir / "report" / "report.json"
    data = json.loads(report.read_text())["runs"] if report.is_file() else {}
    header = f"{'run':<17} {'steps':>13} {'tok/s':>9} {'val loss':>9} {'stable max':>11} {'decay max':>10} "
    print("\n" + header + f"{'final val':>10}  verdict")
    for label in labels:
        d = run_dir / label
        rate = median_tokens_per_s(d)
        r = data.get(label)
        checks = {c["phase"]: c["max_gap"] for c in r["verdict"]["checks"]} if r else {}
        val = (r or {}).get("final", {}).get("val") or {}
        loss = val.get("loss")
        verdict = (
            {True: "within", False: "outside", None: "undetermined"}[r["verdict"]["within"]] if r else ""
        )
        if label == "fp8" and data:
            loss = next(iter(data.values()))["final"]["val"]["baseline_loss"]
            verdict = "baseline"
        print(
            f"{label:<17} {f'{trained_steps(d)}/{steps}':>13} "
            f"{'n/a' if rate is None else f'{rate:,.0f}':>9} {'n/a' if loss is None else f'{loss:.4f}':>9} "
            f"{_pct(checks.get('stable')) if r else '':>11} {_pct(checks.get('decay')) if r else '':>10} "
            f"{_pct(val.get('gap')) if r else '':>10}  {verdict}"
        )
    if report.is_file():
        print(f"\nreport: {report.parent}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "overrides", nargs="*", help="dotted config overrides for every run, e.g. train.compile=true"
    )
    ap.add_argument("--recipe", default="hybrid-125m", help="recipe name or YAML path (default: hybrid-125m)")
    ap.add_argument("--tokens", type=float, default=100e6, help="training tokens per run (default: 100e6)")
    ap.add_argument(
        "--run-dir", type=Path, default=Path("runs/reproduce-paper"), help="runs and report go here"
    )
    ap.add_argument(
        "--only", default=None, help=f"comma list of runs to train (of {', '.join(RUNS)}; default: all)"
    )
    ap.add_argument(
        "--noise", action="store_true", help=f"also the baseline from other initial weights ({NOISE})"
    )
    ap.add_argument("--time-budget", type=float, default=None, help="seconds of training before stopping")
    ap.add_argument("--report-only", action="store_true", help="train nothing, rewrite the report")
    return ap.parse_args(argv)


def plan_invocation(
    args: argparse.Namespace, processes: int
) -> tuple[RunConfig, list[PlannedRun], list[str]]:
    """The comparison's config and runs and the ones to train, checked before any process waits for
    another: every rank finds the same errors in the same files."""
    cfg = split_over_processes(paper_config(args.recipe, args.tokens, args.overrides), processes)
    plan = plan_runs(cfg, ["bf16", "mxfp4"], ["switch"], noise=args.noise)
    labels = [p.label for p in plan]
    wanted = labels if args.only is None else [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = sorted(set(wanted) - set(labels))
    if unknown:
        raise UserError(f"--only {','.join(unknown)}: choose among {', '.join(labels)}")
    if not args.report_only:
        for p in plan:
            check_same_run(args.run_dir / p.label, p.cfg)
        check_process_count(plan, wanted, args.run_dir, processes)
    return cfg, plan, wanted


def hold_exit_code(processes: int):
    """Under torchrun, ignore SIGTERM until ``release``; returns the handler it replaced.

    NOTE torchrun ends the other processes with SIGTERM as soon as one exits with a code other than
    0. A process that is about to exit with the same code (a usage error that every rank finds, a stop
    that every rank agreed on) would die with -15 instead, rank 0 perhaps before saying why."""
    return signal.signal(signal.SIGTERM, signal.SIG_IGN) if processes > 1 else None


def release(previous) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, processes = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    say = print if rank == 0 else _silent
    sigterm = hold_exit_code(processes)
    try:
        cfg, plan, wanted = plan_invocation(args, processes)
    except UserError as e:
        say(f"error: {e}", file=sys.stderr)
        return USAGE
    release(sigterm)
    steps, batch = cfg.train.steps, cfg.train.batch_size
    micro = cfg.train.micro_batch_size or batch
    say(
        f"{cfg.name}: {steps} steps x {batch} x {cfg.data.seq_len} tokens = "
        f"{steps * batch * cfg.data.seq_len / 1e6:.1f}M tokens per run ({processes} process(es) x micro "
        f"batch {micro} x {batch // (micro * processes)} accumulation), decay from step "
        f"{boundaries_from_config(cfg).decay_start}; runs under {args.run_dir}",
        flush=True,
    )
    try:
        ranks = sync_ranks(cfg)  # torchrun's processes meet; the process group stays open for every run
        if ranks.is_main:
            args.run_dir.mkdir(parents=True, exist_ok=True)
        stopped = False
        if not args.report_only:
            budget = TimeBudget(args.time_budget, enabled=ranks.is_main)
            try:
                stopped = not train_wanted(plan, wanted, args.run_dir, budget, say)
            except KeyboardInterrupt:
                print("interrupted outside a training step; run the same command again to continue")
                if processes > 1:
                    return STOPPED  # the other processes may wait in a collective: no more of them
                stopped = True
            finally:
                budget.close()
        write_report(args.run_dir, plan, steps, cfg)
    except UserError as e:
        print(f"error: {e}" if rank == 0 else f"rank {rank}: error: {e}", file=sys.stderr)
        return USAGE
    done = all(trained_steps(args.run_dir / x) >= steps for x in wanted)
    code = 0 if args.report_only or (done and not stopped) else STOPPED
    if code:
        hold_exit_code(processes)
    D.shutdown(ranks)
    return code


def write_report(run_dir: Path, plan: list[PlannedRun], steps: int, cfg: RunConfig) -> None:
    """Rank 0 writes the report of the finished runs and prints the table; every rank returns once it
    is written (torchrun ends the other processes as soon as one exits with a code other than 0) and
    raises rank 0's UserError, if any, so that all exit alike."""
    ranks = D.init_distributed(cfg.train.device)
    labels = [p.label for p in plan]
    error = None
    if ranks.is_main:
        try:
            finished = [x for x in labels if trained_steps(run_dir / x) >= steps]
            if "fp8" in finished and len(finished) > 1:
                write_comparison(run_dir, finished, {p.label: p.about for p in plan})
            print_table(run_dir, labels, steps)
        except UserError as e:
            error = str(e)
    error = D.gather_objects(error, ranks)[0]
    if error is not None:
        raise UserError(error)


def _silent(*_, **__) -> None:
    pass


def exit_process(code: int) -> None:
    """Exit with ``code``; under torchrun without the interpreter's teardown.

    NOTE a torchrun process sometimes aborts in that teardown (SIGABRT, "terminate called without an
    active exception": a thread of the gloo process group is destroyed unjoined) after main has
    returned with everything written, and torchrun then reports -6 for a run that stopped cleanly.
    Every file is closed and the process group destroyed by then; only stdout and stderr need a flush.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_process(main())
