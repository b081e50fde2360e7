"""Two GPUs of one host end to end, in one command: the measurement behind BENCHMARKS.md's two-GPU RL
and FSDP2 rows.

    python scripts/bench_two_gpu.py --out runs/two-gpu --from runs/rl-bench/sft [--rl-steps 30]
                                    [--pretrain-steps 30]
    python scripts/bench_two_gpu.py --tiny --out /tmp/two-gpu      # CPU, gloo, tiny sizes

1. the base RL starts from: ``--from`` an SFT run, or ``bench_rl.py --until sft`` into ``<out>/base``
   (``--pretrain-set`` also goes to its pretraining);
2. ``rl-1`` (one GPU) and ``rl-2`` (torchrun, two ranks) of ``rl-hybrid-125m`` from it at the same
   global batch. Each rank samples its share of a step's prompts; before every checkpoint (the last
   one included) the trainer checks that both ranks hold the same weights bit for bit and stops the
   run otherwise, so ``rl-2`` finishing is that check passed;
3. ``hybrid-350m`` pretraining on one GPU, under DDP and under ``train.parallel=fsdp`` on two:
   tokens/s (median of the logged steps after the first ``WARM``), rank 0's peak memory, the losses
   against one GPU's;
4. a DDP run stopped at half its steps (``train.stop_after``) and resumed under torchrun: its losses
   against the straight DDP run's.

``summary.md`` and ``summary.json`` under --out; each command's output in ``<out>/logs/<name>.log``.
A command that fails is reported, the ones that need it are skipped, and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
SRC = SCRIPTS.parent / "src"
sys.path.insert(0, str(SCRIPTS))

import bench_rl  # noqa: E402  (the RL bench's base and its tiny sizes)

WARM = 2
"""Logged rows left out of tokens/s (compilation, autotuning, graph capture)."""


@dataclass(frozen=True)
class Profile:
    rl: tuple[str, ...]
    pretrain: tuple[str, ...]
    device: str
    rl_steps: int
    pretrain_steps: int


GPU = Profile(
    rl=("--recipe", "rl-hybrid-125m", "eval.every=0", "eval.at_start=false", "log.progress=false"),
    pretrain=tuple(
        "--recipe hybrid-350m eval.every=0 train.checkpoint_every=0 train.log_every=5 "
        "log.progress=false".split()
    ),  # fmt: skip
    device="cuda",
    rl_steps=30,
    pretrain_steps=40,
)
TINY = Profile(
    rl=(
        "--recipe", "rl-tiny", "rl.prompts_per_step=2", "rl.group_size=4", "train.batch_size=8",
        "train.micro_batch_size=2", "sampler.max_new_tokens=8", "rl.eval_prompts=2", "rl.eval_samples=0",
        "eval.every=0", "eval.at_start=false", "rl.levels=[1]", "train.checkpoint_every=0",
        "log.progress=false", "rl.mask_truncated=false",
    ),
    pretrain=("--recipe", "tiny", *bench_rl.TINY.extra[0], "train.micro_batch_size=1",
              "train.checkpoint_every=0", "train.log_every=1", "log.progress=false"),
    device="cpu",
    rl_steps=2,
    pretrain_steps=4,
)  # fmt: skip
"""A check of the pipeline on CPU (two gloo processes); its numbers mean nothing."""


@dataclass
class Command:
    """One fp4train command on ``ranks`` processes and how it went (run one after another)."""

    name: str
    argv: list[str]
    ranks: int
    rc: int | None = None
    seconds: float = 0.0
    skipped: str | None = None


def run(cmd: Command, logs: Path, echo=print) -> bool:
    """Run ``fp4train ARGV`` on ``ranks`` processes (torchrun for 2; one GPU otherwise), log to its file."""
    if cmd.skipped:
        echo(f"- {cmd.name}: skipped ({cmd.skipped})")
        return False
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])])
    )
    if cmd.ranks == 1:
        env.setdefault("CUDA_VISIBLE_DEVICES", "0")
        prefix = [sys.executable, "-m", "inkling_fp4"]
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
        prefix = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(cmd.ranks),
                  "-m", "inkling_fp4"]  # fmt: skip
    logs.mkdir(parents=True, exist_ok=True)
    echo(f"$ {'torchrun --nproc_per_node 2 ' if cmd.ranks > 1 else ''}fp4train {' '.join(cmd.argv)}")
    t0 = time.time()
    with open(logs / f"{cmd.name}.log", "w") as f:
        cmd.rc = subprocess.run([*prefix, *cmd.argv], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    cmd.seconds = time.time() - t0
    echo(f"  {cmd.name}: {'ok' if cmd.rc == 0 else f'failed (exit {cmd.rc})'} after {cmd.seconds:.0f} s")
    return cmd.rc == 0


def plan(a, p: Profile, base: Path) -> list[Command]:
    out, dev = a.out, f"train.device={a.device or p.device}"
    rl = ["rollout", *p.rl, "--from", str(base), dev, f"train.steps={a.rl_steps or p.rl_steps}", *a.rl_set]
    steps = a.pretrain_steps or p.pretrain_steps
    pre = ["pretrain", *p.pretrain, dev, f"train.steps={steps}", *a.pretrain_set]
    half = [f"train.stop_after={steps // 2}", f"train.checkpoint_every={steps // 2}"]
    return [
        Command("rl-1", [*rl, "--run-dir", str(out / "rl-1")], 1),
        Command("rl-2", [*rl, "--run-dir", str(out / "rl-2")], 2),
        Command("pretrain-1", [*pre, "--run-dir", str(out / "pretrain-1")], 1),
        Command("pretrain-ddp", [*pre, "--run-dir", str(out / "pretrain-ddp")], 2),
        Command("pretrain-fsdp", [*pre, "train.parallel=fsdp", "--run-dir", str(out / "pretrain-fsdp")], 2),
        Command("resume-first", [*pre, *half, "--run-dir", str(out / "pretrain-resumed")], 2),
        Command("resume-rest", ["pretrain", "--resume", "--run-dir", str(out / "pretrain-resumed")], 2),
    ]


# ----------------------------------------------------------------------------------------------
# the summary


def steps_of(run_dir: Path) -> list[dict]:
    """The run's step rows (those with a loss), by step; [] without metrics."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if "loss" in r and "event" not in r]


def _mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(values) / len(values) if values else None


def pretrain_figures(rows: list[dict]) -> dict:
    speeds = [r["tokens_per_s"] for r in rows[WARM:]] or [r["tokens_per_s"] for r in rows]
    memory = [r["peak_mem_gib"] for r in rows if "peak_mem_gib" in r]
    return {"steps": len(rows), "tokens_per_s": statistics.median(speeds) if speeds else None,
            "peak_mem_gib": max(memory) if memory else None,
            "losses": {str(r["step"]): r["loss"] for r in rows}}  # fmt: skip


RL_FIGURES = ("reward_mean", "accuracy", "zero_var_frac", "entropy", "mismatch_k3", "loss", "grad_norm")
RL_TIMES = ("time_sample_s", "time_score_s", "time_train_s", "time_refresh_s")


def rl_figures(rows: list[dict]) -> dict:
    timed = rows[1:] or rows  # the first step compiles and captures
    step_s = [sum(r.get(k, 0.0) for k in RL_TIMES) for r in timed]
    return {"steps": len(rows), **{k: _mean(rows, k) for k in RL_FIGURES},
            "step_s": statistics.median(step_s) if step_s else None}  # fmt: skip


def largest_gap(a: dict[str, float], b: dict[str, float]) -> float | None:
    """Largest relative difference of two loss curves over their common steps."""
    common = set(a) & set(b)
    return max(abs(a[s] - b[s]) / abs(a[s]) for s in common) if common else None


def replicas_identical(out: Path, commands: list[Command]) -> bool | None:
    """Whether the two-rank RL run's ranks held the same weights at every checkpoint: its replica check
    passed (it finished), failed (its log says the ranks differ), or None (it failed otherwise)."""
    rl_two = next(c for c in commands if c.name == "rl-2")
    if rl_two.rc == 0:
        return True
    log = out / "logs" / "rl-2.log"
    return False if log.is_file() and "ranks hold different weights" in log.read_text() else None


def summarize(out: Path, commands: list[Command]) -> dict:
    rl = {name: rl_figures(steps_of(out / name)) for name in ("rl-1", "rl-2")}
    pre = {name: pretrain_figures(steps_of(out / name))
           for name in ("pretrain-1", "pretrain-ddp", "pretrain-fsdp", "pretrain-resumed")}  # fmt: skip
    one = pre["pretrain-1"]
    for name in ("pretrain-ddp", "pretrain-fsdp"):
        r = pre[name]
        r["x_one_gpu"] = (
            r["tokens_per_s"] / one["tokens_per_s"] if r["tokens_per_s"] and one["tokens_per_s"] else None
        )
        r["largest_loss_gap_to_one"] = largest_gap(one["losses"], r["losses"])
    resumed = pre["pretrain-resumed"]
    resumed["largest_loss_gap_to_straight"] = largest_gap(pre["pretrain-ddp"]["losses"], resumed["losses"])
    rl_one, rl_two = rl["rl-1"]["step_s"], rl["rl-2"]["step_s"]
    return {"commands": [{"name": c.name, "ranks": c.ranks, "argv": c.argv, "rc": c.rc,
                          "seconds": round(c.seconds, 1), "skipped": c.skipped} for c in commands],
            "rl": rl, "rl_speedup": rl_one / rl_two if rl_one and rl_two else None,
            "replicas_identical": replicas_identical(out, commands),
            "pretrain": pre}  # fmt: skip


def _f(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def render(data: dict) -> str:
    lines = ["# Two GPUs: the bench_two_gpu.py measurement", "", "| command | ranks | status | seconds |",
             "|---|---:|---|---:|"]  # fmt: skip
    for c in data["commands"]:
        status = (
            f"skipped: {c['skipped']}"
            if c["skipped"]
            else "ok"
            if c["rc"] == 0
            else f"failed (exit {c['rc']})"
        )
        lines.append(f"| {c['name']} | {c['ranks']} | {status} | {c['seconds']:.0f} |")
    lines += ["", "## RL: one GPU against torchrun on two (the same global batch)", "",
              "| figure (mean over the steps) | one GPU | two GPUs |", "|---|---:|---:|"]  # fmt: skip
    for key in (*RL_FIGURES, "step_s", "steps"):
        lines.append(
            f"| {key} | {_f(data['rl']['rl-1'][key], '.4g')} | {_f(data['rl']['rl-2'][key], '.4g')} |"
        )
    same = {True: "yes", False: "no", None: "unknown, the run failed"}[data["replicas_identical"]]
    lines += ["", f"RL step time one GPU / two GPUs: {_f(data['rl_speedup'], '.2f')}x. Both ranks held "
              f"bit-identical weights at every checkpoint (the run stops otherwise): {same}."]  # fmt: skip
    header = "| run | steps | tokens/s | x one GPU | peak GiB (rank 0) | largest loss gap |"
    lines += ["", "## Pretraining", "", header, "|---|---:|---:|---:|---:|---:|"]
    for name, r in data["pretrain"].items():
        gap = r.get("largest_loss_gap_to_one", r.get("largest_loss_gap_to_straight"))
        cells = [_f(r["tokens_per_s"], ",.0f"), _f(r.get("x_one_gpu"), ".2f"), _f(r["peak_mem_gib"], ".1f")]
        lines.append(f"| {name} | {r['steps']} | {' | '.join(cells)} | {_f(gap, '.2e')} |")
    lines += ["", "Loss gaps: DDP and FSDP against one GPU; the resumed run against the straight DDP run."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="runs, logs and summary (a new directory)")
    p.add_argument("--from", dest="base", type=Path, help="the SFT run RL starts from (default: build one)")
    p.add_argument("--tiny", action="store_true", help="tiny recipes on CPU, two gloo processes")
    p.add_argument("--rl-steps", type=int)
    p.add_argument("--pretrain-steps", type=int)
    p.add_argument("--device", help="train.device (default cuda; --tiny cpu)")
    for stage in ("rl", "pretrain"):
        p.add_argument(f"--{stage}-set", action="append", default=[], metavar="KEY=VALUE",
                       help=f"an override of every {stage} command (repeatable)")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    profile = TINY if a.tiny else GPU
    if a.out.exists() and any(a.out.iterdir()):
        print(f"--out {a.out} is not empty: pass a new directory", file=sys.stderr)
        return 2
    base = a.base
    if base is None:
        base = a.out / "base" / "sft"
        bench_rl = [
            sys.executable,
            str(SCRIPTS / "bench_rl.py"),
            "--out",
            str(a.out / "base"),
            "--until",
            "sft",
        ]
        sets = [x for value in a.pretrain_set for x in ("--pretrain-set", value)]  # e.g. its data cache
        done = subprocess.run([*bench_rl, *(["--tiny"] if a.tiny else []), *sets])
        if done.returncode != 0:
            print(
                f"the base failed (bench_rl.py --until sft, logs under {a.out / 'base' / 'logs'})",
                file=sys.stderr,
            )
            return 1
    elif not (base / "checkpoints").is_dir():
        print(f"--from {base}: no checkpoints there; pass an SFT run directory", file=sys.stderr)
        return 2
    commands = plan(a, profile, base)
    needs = {"resume-rest": "resume-first"}
    for cmd in commands:
        before = next((c for c in commands if c.name == needs.get(cmd.name)), None)
        if before is not None and before.rc != 0:
            cmd.skipped = f"{before.name} failed"
        run(cmd, a.out / "logs")
    data = summarize(a.out, commands)
    (a.out / "summary.json").write_text(json.dumps(data, indent=1))
    text = render(data)
    (a.out / "summary.md").write_text(text)
    print(text)
    return 0 if all(c.rc == 0 for c in commands) else 1


if __name__ == "__main__":
    sys.exit(main())
