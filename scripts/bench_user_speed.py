"""The generation speed a user gets: ``fp4train generate`` and ``fp4train eval`` as a user runs them.

    python scripts/bench_user_speed.py --from runs/rl-bench/sft --out runs/speed [--prompts 1024]
    python scripts/bench_user_speed.py --from runs/sft-tiny --out /tmp/speed --prompts 8 --problems 4

Each command runs in its own process, as typed at a shell, so the figures include what a user pays:
start-up, loading the run, the first call's cache allocation and graph capture. For every command
the summary gives the wall time, the new tokens and new tokens/s the command prints, and the one-off
decode-graph set-up it states apart:

1. ``generate --prompts`` over ``--prompts`` held-out arithmetic prompts, up to 128 new tokens, with
   the sampler in BF16, then in NVFP4 with row activation scales;
2. ``eval --task arithmetic --samples 8`` over ``--problems`` problems;
3. with ``--rl-steps N``: ``rollout --recipe rl-hybrid-125m`` from the same run for N steps, alone
   (one run at a time), under BF16 and under NVFP4, each with padded and with packed rows
   (``rl.pack``): the median step's split (sample / score / train / weight refresh, the first step
   left out) and each NVFP4 step against the BF16 step of the same packing.

``summary.md`` and ``summary.json`` go under --out with every command and its log.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from inkling_fp4.rl.tasks import arithmetic, held_out  # noqa: E402

SAMPLERS = {"bf16": ["sampler.precision=bf16"],
            "nvfp4-row": ["sampler.precision=nvfp4", "precision.activation_scale=row"]}  # fmt: skip
"""Label -> the sampler overrides of a generate command."""
SPEED = re.compile(
    r"(?P<tokens>\d+) new tokens in (?P<seconds>[\d.]+) s: (?P<rate>[\d,.]+) new tokens/s"
    r"(?: \(not counting (?P<setup>[\d.]+) s of one-off graph capture and compilation\))?"
)
"""The line generate and eval print at their end (GenerationStats.describe)."""


def parse_speed(output: str) -> dict | None:
    """The last speed line of a command's output as numbers, or None when it printed none."""
    found = list(SPEED.finditer(output))
    if not found:
        return None
    m = found[-1]
    rate = float(m["rate"].replace(",", ""))
    return {"new_tokens": int(m["tokens"]), "seconds": float(m["seconds"]), "tokens_per_s": rate,
            "setup_s": float(m["setup"] or 0.0)}  # fmt: skip


def write_prompts(path: Path, n: int) -> int:
    """``n`` held-out arithmetic prompts (every level in turn, repeated when there are fewer), one a
    line; returns how many distinct ones there are."""
    distinct = [p.prompt for p in held_out(arithmetic.problems, n, arithmetic.LEVELS)]
    path.write_text("".join(distinct[i % len(distinct)] + "\n" for i in range(n)))
    return len(distinct)


def run(name: str, args: list[str], out: Path) -> dict:
    """One fp4train command: its log under ``out``, wall time, exit code and printed speed."""
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "inkling_fp4", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    log.write_text(done.stdout + done.stderr)
    return {"name": name, "command": "fp4train " + " ".join(args), "rc": done.returncode,
            "wall_s": wall, "speed": parse_speed(done.stdout), "log": str(log)}  # fmt: skip


RL_TIMES = ("time_sample_s", "time_score_s", "time_train_s", "time_refresh_s")


def rl_split(run_dir: Path) -> dict | None:
    """The median of each part of the step's time over the logged RL steps after the first (which
    compiles and captures), and of their sum; None without steps."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    steps = [r for r in rows if "time_train_s" in r][1:]
    if not steps:
        return None
    split = {k: statistics.median(r[k] for r in steps) for k in RL_TIMES}
    return {**split, "step_s": statistics.median(sum(r[k] for k in RL_TIMES) for r in steps),
            "steps": len(steps)}  # fmt: skip


def rl_rows(a, common_rl: list[str]) -> list[dict]:
    """The RL runs of ``--rl-steps``, one at a time, each with its split."""
    rows = []
    for pack in ("false", "true"):
        for recipe in ("bf16", "nvfp4"):
            run_dir = a.out / f"rl-{recipe}-pack-{pack}"
            args = ["rollout", "--recipe", a.rl_recipe, "--from", str(a.from_run), "--run-dir", str(run_dir),
                    f"precision.recipe={recipe}", f"rl.pack={pack}", f"train.steps={a.rl_steps}",
                    "eval.every=0", "eval.at_start=false", "log.progress=false", *common_rl]  # fmt: skip
            row = run(f"rollout {a.rl_steps} steps, {recipe}, rl.pack={pack}", args, a.out)
            row["rl"] = rl_split(run_dir)
            rows.append(row)
    for row in rows:  # NVFP4 against BF16 of the same packing
        if "nvfp4" in row["name"]:
            bf16 = next(r for r in rows if r["name"] == row["name"].replace("nvfp4", "bf16"))
            ok = row["rl"] and bf16["rl"]
            row["rl_x_bf16"] = row["rl"]["step_s"] / bf16["rl"]["step_s"] if ok else None
    return rows


def render_rl(rows: list[dict]) -> list[str]:
    lines = ["", "RL steps alone (median of the steps after the first):", "",
             "| run | exit | sample s | score s | train s | weight refresh s | step s | x bf16 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        t = r["rl"] or {}
        cells = [f"{t[k]:.3f}" if t else "-" for k in (*RL_TIMES, "step_s")]
        ratio = r.get("rl_x_bf16")
        lines.append(
            f"| {r['name']} | {r['rc']} | {' | '.join(cells)} | {'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    return lines


def render(rows: list[dict]) -> str:
    lines = ["# The generation speed a user gets (bench_user_speed.py)", "",
             "| command | exit | wall s | new tokens | new tokens/s | one-off set-up s |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in (r for r in rows if "rl" not in r):
        s = r["speed"] or {}
        cells = [r["name"], str(r["rc"]), f"{r['wall_s']:.1f}", str(s.get("new_tokens", "-")),
                 f"{s['tokens_per_s']:,.0f}" if s else "-", f"{s['setup_s']:.2f}" if s else "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    rl = [r for r in rows if "rl" in r]
    if rl:
        lines += render_rl(rl)
    lines += ["", "Commands:", ""] + [f"    {r['command']}" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="from_run", type=Path, required=True, help="an sft (or rollout) run")
    p.add_argument("--out", type=Path, required=True, help="logs, prompts and summary (a new directory)")
    p.add_argument("--prompts", type=int, default=1024, help="generate's prompts (default 1024)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--problems", type=int, default=256, help="eval's problems (default 256)")
    p.add_argument("--samples", type=int, default=8, help="eval's samples per problem (default 8)")
    p.add_argument("--device", default=None, help="sampler.device (default: the run's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of every command (repeatable)")  # fmt: skip
    p.add_argument("--rl-steps", type=int, default=0, help="also time RL steps alone (0: not)")
    p.add_argument("--rl-recipe", default="rl-hybrid-125m")
    p.add_argument("--rl-set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more override of the RL runs (repeatable)")  # fmt: skip
    a = p.parse_args(argv)
    if a.out.exists():
        print(f"error: --out {a.out} exists; give a new directory", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True)
    prompts = a.out / "prompts.txt"
    distinct = write_prompts(prompts, a.prompts)
    device = [f"sampler.device={a.device}"] if a.device else []
    common = [f"sampler.max_new_tokens={a.max_new_tokens}", *device, *a.set]
    rows = []
    for label, sets in SAMPLERS.items():
        args = ["generate", "--from", str(a.from_run), "--prompts", str(prompts),
                "--out", str(a.out / f"generate-{label}.jsonl"), *common, *sets]  # fmt: skip
        rows.append(run(f"generate {a.prompts} prompts ({distinct} distinct), {label}", args, a.out))
    args = ["eval", "--from", str(a.from_run), "--task", "arithmetic", "--samples", str(a.samples),
            "--problems", str(a.problems), *common]  # fmt: skip
    rows.append(run(f"eval --samples {a.samples}, {a.problems} problems", args, a.out))
    if a.rl_steps:
        rows += rl_rows(a, [*device, *a.rl_set])
    (a.out / "summary.json").write_text(json.dumps(rows, indent=1))
    (a.out / "summary.md").write_text(render(rows))
    print(render(rows))
    return 0 if all(r["rc"] == 0 and (r["speed"] is not None or r.get("rl")) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
