"""Reproduce the NVFP4 paper's loss-gap comparison at small scale on one GPU.

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

Usage:
    python scripts/reproduce_paper.py --tokens 100e6 --only fp8 --time-budget 540
    python scripts/reproduce_paper.py --tokens 100e6 --only nvfp4 --time-budget 540   # repeat until done
    python scripts/reproduce_paper.py --tokens 100e6 --report-only
    python scripts/reproduce_paper.py --tokens 2e6 train.log_every=5       # a quick smoke test

Output: the training log of each run, then one table row per run: steps done, median tokens/s,
final validation loss (BF16 evaluation), and its gaps to fp8 (judged stable-phase max, judged decay
max, final validation gap) with the verdict against the paper's bounds. Exit code 0 when every
requested run has finished, 3 when training stopped early (run the same command again), 2 on a
usage or config error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import sys
import threading
from pathlib import Path

from inkling_fp4.compare.gap import METRICS_FILE, boundaries_from_config, parse_metrics_lines
from inkling_fp4.compare.run import derive, last_logged_step, plan_runs, train_planned, write_comparison
from inkling_fp4.config import load_config
from inkling_fp4.errors import UserError

RUNS = ("fp8", "nvfp4", "bf16", "mxfp4", "nvfp4-no-switch")
STOPPED = 3


def paper_config(recipe: str, tokens: float, overrides: list[str]):
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


@contextlib.contextmanager
def time_budget(seconds: float | None):
    """After ``seconds``, interrupt as Ctrl-C does: the training loop checkpoints and returns."""
    if not seconds:
        yield
        return
    timer = threading.Timer(seconds, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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
            f"{label:<17} {f'{last_logged_step(d)}/{steps}':>13} "
            f"{'n/a' if rate is None else f'{rate:,.0f}':>9} {'n/a' if loss is None else f'{loss:.4f}':>9} "
            f"{_pct(checks.get('stable')) if r else '':>11} {_pct(checks.get('decay')) if r else '':>10} "
            f"{_pct(val.get('gap')) if r else '':>10}  {verdict}"
        )
    if report.is_file():
        print(f"\nreport: {report.parent}")


def main(argv: list[str] | None = None) -> int:
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
        "--only", default=",".join(RUNS), help=f"comma list of runs to train (of {', '.join(RUNS)})"
    )
    ap.add_argument("--time-budget", type=float, default=None, help="seconds of training before stopping")
    ap.add_argument("--report-only", action="store_true", help="train nothing, rewrite the report")
    args = ap.parse_args(argv)
    try:
        cfg = paper_config(args.recipe, args.tokens, args.overrides)
        plan = plan_runs(cfg, ["bf16", "mxfp4"], ["switch"])
        labels = [p.label for p in plan]
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        unknown = sorted(set(wanted) - set(labels))
        if unknown:
            raise UserError(f"--only {','.join(unknown)}: choose among {', '.join(labels)}")
        steps = cfg.train.steps
        print(
            f"{cfg.name}: {steps} steps x {cfg.train.batch_size} x {cfg.data.seq_len} tokens = "
            f"{steps * cfg.train.batch_size * cfg.data.seq_len / 1e6:.1f}M tokens per run, decay from step "
            f"{boundaries_from_config(cfg).decay_start}; runs under {args.run_dir}",
            flush=True,
        )
        args.run_dir.mkdir(parents=True, exist_ok=True)
        stopped = False
        if not args.report_only:
            try:
                with time_budget(args.time_budget):
                    for label in (x for x in labels if x in wanted):
                        if not train_planned(plan, args.run_dir, only=label):
                            stopped = True
                            break
            except KeyboardInterrupt:
                print("interrupted outside a training step; run the same command again to continue")
                stopped = True
        finished = [x for x in labels if last_logged_step(args.run_dir / x) >= steps]
        if "fp8" in finished and len(finished) > 1:
            write_comparison(args.run_dir, finished, {p.label: p.about for p in plan})
        print_table(args.run_dir, labels, steps)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report_only:
        return 0
    requested_done = all(last_logged_step(args.run_dir / x) >= steps for x in wanted)
    return 0 if requested_done and not stopped else STOPPED


if __name__ == "__main__":
    sys.exit(main())
