"""Several RL settings side by side from one base, one process each, and their curves in one table.

    python scripts/sweep_rl.py --from runs/rl-bench/sft --out runs/rl-sweep --steps 120 --seconds 560 \
        --variant ctrl= --variant t07=sampler.temperature=0.7 \
        --variant g16='rl.group_size=16 rl.prompts_per_step=16' [--set KEY=VALUE ...]

Each variant is ``fp4train rollout --recipe R --from BASE --run-dir OUT/NAME`` with the common
``--set`` overrides, then its own. All start at once on the one device (bench_rl.py's way of running
commands side by side, through the CUDA MPS daemon where it starts: ``shared_gpu.py``); ``--seconds``
stops them with SIGTERM so that the command ends by then, each checkpointing, and the same command
again resumes them. ``sweep.md`` and ``sweep.json`` under --out hold,
per variant: held-out greedy pass@1 at every evaluation, the training reward and accuracy, the groups
with none / all completions right and the entropy over the first and last quarter of the steps done.
What it is for: choosing an RL setting by its held-out curve before the full bench (bench_rl.py).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rl import STOP_MARGIN_S, Job, child_env, finished, run_jobs  # noqa: E402
from shared_gpu import share_gpu  # noqa: E402

WINDOW_KEYS = {
    "reward_mean": "reward",
    "accuracy": "train acc",
    "unsolved_frac": "none right",
    "solved_frac": "all right",
    "zero_var_frac": "no signal",
    "entropy": "entropy",
}
"""Step figures summarised over the first and the last quarter of the steps done: key -> header."""


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=OVERRIDES`` (the overrides space-separated, possibly none) -> (name, overrides)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or "/" in name or name.startswith("."):
        raise ValueError(f"--variant {text!r}: write NAME=OVERRIDES, e.g. t07=sampler.temperature=0.7")
    return name, shlex.split(rest)


def own_steps(own: list[str], steps: int) -> int:
    """The trainer steps a variant runs: its own ``train.steps=`` (e.g. with rl.mini_batches > 1,
    several trainer steps per RL step) over the common count."""
    for item in own:
        key, _, value = item.partition("=")
        if key == "train.steps":
            steps = int(value)
    return steps


def plan(a) -> list[Job]:
    """One rollout command per variant; a finished one is skipped, a started one resumed."""
    jobs = []
    for name, own in map(parse_variant, a.variant):
        run_dir = a.out / name
        args = ["rollout", "--recipe", a.recipe, "--from", str(a.base), "--run-dir", str(run_dir)]
        args += ["log.progress=false", f"train.steps={a.steps}", *a.set, *own]
        if (run_dir / "checkpoints").is_dir():
            args.append("--resume")
        job = Job(name, args, a.out / "logs" / f"{name}.log")
        steps = own_steps(own, a.steps)
        if finished(run_dir, steps):
            job.skipped = f"done ({run_dir} has its step-{steps} checkpoint)"
        jobs.append(job)
    return jobs


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
    return rows


def summarize(run_dir: Path) -> dict:
    """One variant's curves: greedy pass@1 by evaluation step, and each window figure's first and last
    quarter of the steps done (means)."""
    rows = read_rows(run_dir)
    evals = {int(r["step"]): r["eval_accuracy"] for r in rows if "eval_accuracy" in r}
    steps = [r for r in rows if "reward_mean" in r]
    n = max(1, len(steps) // 4)
    windows = {}
    for key in WINDOW_KEYS:
        have = [r for r in steps if key in r]
        if have:
            first, last = have[:n], have[-n:]
            windows[key] = (sum(r[key] for r in first) / len(first), sum(r[key] for r in last) / len(last))
    return {"eval_accuracy": evals, "steps_done": len(steps), "window_steps": n, "windows": windows}


def render(summaries: dict[str, dict]) -> str:
    lines = ["# RL settings side by side (scripts/sweep_rl.py)", "", "## Held-out greedy pass@1", ""]
    names = list(summaries)
    steps = sorted({s for v in summaries.values() for s in v["eval_accuracy"]})
    lines += ["| step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in steps:
        cells = [summaries[n]["eval_accuracy"].get(s) for n in names]
        lines.append(f"| {s} | " + " | ".join("" if c is None else f"{c:.3f}" for c in cells) + " |")
    lines += ["", "## Step figures, first -> last quarter of the steps done", ""]
    header = ["variant", "steps", *WINDOW_KEYS.values()]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, v in summaries.items():
        pairs = [v["windows"].get(k) for k in WINDOW_KEYS]
        cells = ["n/a" if p is None else f"{p[0]:.3f} -> {p[1]:.3f}" for p in pairs]
        lines.append(f"| {name} | {v['steps_done']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="base", type=Path, required=True, help="the run every variant starts from")
    p.add_argument("--out", type=Path, required=True, help="one run directory per variant, logs, sweep.md")
    p.add_argument("--recipe", default="rl-hybrid-125m", help="the RL recipe every variant starts from")
    p.add_argument("--steps", type=int, default=120, help="RL steps of each variant")
    p.add_argument("--seconds", type=float, help="stop the runs so that this command ends within this long")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="every variant's override")
    p.add_argument("--variant", action="append", required=True, metavar="NAME=OVERRIDES",
                   help="a variant: its name and own overrides, space-separated (repeatable)")  # fmt: skip
    p.add_argument("--mps", choices=("auto", "off"), default="auto",
                   help="auto: the runs share the GPU through the CUDA MPS daemon where it starts; "
                        "off: the GPU time-slices between them")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        jobs = plan(a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len({j.name for j in jobs}) != len(jobs):
        print("error: two variants share a name; give each its own", file=sys.stderr)
        return 2
    t0 = time.time()
    a.out.mkdir(parents=True, exist_ok=True)
    limit = None if a.seconds is None else max(0.0, a.seconds - STOP_MARGIN_S)
    device = next((s.partition("=")[2] for s in reversed(a.set) if s.startswith("train.device=")), "cuda")
    todo = sum(j.skipped is None for j in jobs)
    with share_gpu(a.mps, device, todo, child_env(1)) as shared:
        print(f"the runs share the GPU: {shared.line}")
        run_jobs(jobs, seconds=limit, env=shared.env)
    summaries = {j.name: summarize(a.out / j.name) for j in jobs}
    text = render(summaries)
    (a.out / "sweep.md").write_text(text)
    (a.out / "sweep.json").write_text(json.dumps({"jobs": [j.to_dict() for j in jobs], "variants": summaries},
                                                 indent=2) + "\n")  # fmt: skip
    print(f"\n{text}\nsweep: {a.out / 'sweep.md'} ({time.time() - t0:.0f} s)")
    bad = [j.name for j in jobs if not (j.ok or j.stopped)]
    if bad:
        print(f"failed: {', '.join(bad)} (logs under {a.out / 'logs'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
