"""RL under NVFP4 on one GPU end to end, in one command: the measurement behind docs/RL.md.

    python scripts/bench_rl.py --out runs/rl-bench [--pretrain-steps 40] [--sft-steps 250] [--rl-steps 120]
                               [--rl-seconds S] [--seconds S] [--until sft] [--parallel N] [--mps off]
    python scripts/bench_rl.py --tiny --out /tmp/rl-bench      # the same pipeline on CPU, tiny sizes

1. pretrain hybrid-125m briefly (``hybrid-125m`` with an 8192-token vocabulary, as bench_sft.py);
2. fine-tune it in NVFP4 on the built-in task examples (``sft-hybrid-125m``);
3. eight RL runs of ``rl-hybrid-125m`` from that SFT checkpoint, side by side as separate processes on
   the one GPU (a 125M model leaves most of an H200 idle, and the runs are independent), as many at once
   as its free memory holds (``--parallel``; all eight on an H200, five on an 80 GB H100), through the
   CUDA MPS daemon where the driver has one (``--mps``, ``shared_gpu.py``: the runs' kernels side by side):
   ``compare-baseline --stage rollout --with bf16,nvfp4-row --noise``, whose runs are fp8, nvfp4
   (tensor activation scales), bf16 and nvfp4-row (one activation scale per row), each with two
   seeds (``<label>-seed1``), one process each through ``--only``; then the same command once more,
   which reuses them and writes the report (each gap to FP8 beside the seeds' spread);
4. ``summary.md`` and ``summary.json`` under --out: held-out accuracy over the steps and reward per
   step of every run, the mismatch figures (k3, mean / max |Δ log p|, ratio range, fraction beyond
   the cap), the wall-time split (sample / score / train / weight refresh) and generation tokens/s,
   summarised over the last steps as compare-baseline's RL report does (compare/rl_gap.py), and the
   comparison's headlines.

Every command's output goes to ``<out>/logs/<name>.log``. A command that fails is reported in the
summary, the commands that need its result are skipped, and the script exits 1 after writing the
summary; an RL run that runs out of GPU memory beside others is first started again as one ends.
``--rl-seconds`` stops the RL runs after that long (SIGTERM: each checkpoints), ``--seconds`` stops
them so that the whole command ends within that many seconds (a job's time limit); run again on the
same --out, it reuses the stages that finished and resumes the runs that did not. ``--until sft``
stops after the base the RL runs start from (to try RL settings on it, then call again without it).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))

from inkling_fp4.compare.markdown import monitor_section  # noqa: E402
from inkling_fp4.compare.metrics import load_run_config  # noqa: E402
from inkling_fp4.compare.rl_gap import tail_window  # noqa: E402
from inkling_fp4.compare.rl_summary import summarize_rl_run  # noqa: E402
from inkling_fp4.errors import UserError  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shared_gpu import share_gpu  # noqa: E402


@dataclass(frozen=True)
class Profile:
    """Recipes, step counts and extra overrides of the three stages, and the device."""

    recipes: tuple[str, str, str]
    steps: tuple[int, int, int]
    extra: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]
    device: str


H200 = Profile(
    recipes=("hybrid-125m", "sft-hybrid-125m", "rl-hybrid-125m"),
    steps=(40, 250, 120),
    extra=(
        (
            "data.vocab_size=8192",
            "model.vocab_size=8192",
            "data.builtin_site_packages=false",
            "eval.batches=4",
        ),
        (),
        ("rl.eval_samples_at=ends",),
    ),
    device="cuda",
)
"""The docs/RL.md measurement. SFT 250 steps leaves a base that answers 14-17% of the held-out
4-number problems greedily (the recipe's RL level) and 31-36% in 8 samples: RL lifts the runs 10-15
points in 120 steps (one FP8 run 9.96) and turns groups with none right into groups with a signal.
Only the step-0 and last evaluations sample; the others (every 30 steps) are greedy. The eight runs
are bound by the GPU (6-7 s an RL step side by side): on one H200 about 4 minutes of base and 21 of
RL, in three calls (``--seconds``, then the same command again at once). The stages keep their
recipes' warmups: shorter ones gave a far weaker base."""
TINY = Profile(
    recipes=("tiny", "sft-tiny", "rl-tiny"),
    steps=(4, 2, 3),
    extra=(
        tuple(
            "model.pattern=M*-M model.vocab_size=512 model.d_model=32 model.n_heads=2 model.n_kv_heads=1 "
            "model.ffn_dim=64 model.mamba_heads=4 model.mamba_head_dim=16 model.n_groups=1 model.d_state=8 "
            "model.chunk_size=16 data.vocab_size=512 data.seq_len=32 data.max_documents=30 "
            "train.batch_size=4 eval.every=0 train.warmup_steps=1".split()
        ),
        tuple("sft.builtin_examples=200 train.batch_size=4 eval.every=0 train.warmup_steps=1".split()),
        tuple(
            "rl.prompts_per_step=2 rl.group_size=4 train.batch_size=8 train.micro_batch_size=4 "
            "sampler.max_new_tokens=16 rl.eval_prompts=4 rl.eval_samples=2 eval.every=2 rl.levels=[1] "
            "train.checkpoint_every=0 rl.mask_truncated=false train.warmup_steps=1".split()
        ),
    ),
    device="cpu",
)
"""A check of the pipeline on CPU in well under a minute (its numbers mean nothing)."""

PRECISIONS = {"fp8": "fp8", "nvfp4-tensor": "nvfp4", "nvfp4-row": "nvfp4-row", "bf16": "bf16"}
"""Summary label -> the compare-baseline run it is (each also with a second seed, ``-seed1``)."""
COMPARED = {**PRECISIONS, **{f"{k}-seed1": f"{v}-seed1" for k, v in PRECISIONS.items()}}
MISMATCH = {
    "mismatch_k3": ("k3", ".2e"),
    "mismatch_abs_mean": ("mean \\|Δ log p\\|", ".2e"),
    "mismatch_abs_max": ("max \\|Δ log p\\|", ".2e"),
    "mismatch_ratio_min": ("ratio min", ".4f"),
    "mismatch_ratio_max": ("ratio max", ".4f"),
    "mismatch_frac_over_cap": ("beyond cap", ".4f"),
}
"""The mismatch columns of the summary: key -> (header, format)."""
TIME_SPLIT = {"time_sample_s": "sample s", "time_score_s": "score s", "time_train_s": "train s",
              "time_refresh_s": "weight refresh s"}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# commands


@dataclass
class Job:
    """One fp4train command, its log, and how it went."""

    name: str
    args: list[str]
    log: Path
    rc: int | None = None
    seconds: float = 0.0
    skipped: str | None = None
    """Why it did not run (a command it needs failed, or its result is there already)."""
    proc: subprocess.Popen | None = field(default=None, repr=False)
    started: float = 0.0
    stopped: bool = False
    """Stopped at the time limit (--rl-seconds, --seconds): checkpointed, to be resumed by the next call."""
    retried: int = 0
    """Times it was started again after running out of GPU memory beside other runs."""

    @property
    def ok(self) -> bool:
        """Finished: a run stopped at the time limit exits 0 after its checkpoint, but is not done."""
        return (self.rc == 0 and not self.stopped) or (
            self.skipped is not None and self.skipped.startswith("done")
        )

    def status(self) -> str:
        if self.skipped is not None:
            return f"skipped: {self.skipped}"
        if self.stopped:
            return "stopped at the time limit (run again to resume)"
        again = (
            f" (started {self.retried + 1} times: out of GPU memory beside other runs)"
            if self.retried
            else ""
        )
        return ("ok" if self.rc == 0 else f"failed (exit {self.rc})") + again

    def to_dict(self) -> dict:
        command = "fp4train " + " ".join(self.args)
        status, seconds = self.status(), round(self.seconds, 1)
        return {"name": self.name, "command": command, "log": str(self.log), "rc": self.rc,
                "seconds": seconds, "status": status, "retried": self.retried}  # fmt: skip


def child_env(threads: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a command: this checkout's package first, and ``threads`` CPU threads
    (unless the caller chose): processes that share the cores must not each start one thread per
    core, or they spend their time waiting for each other. The CUDA allocator grows its segments
    (unless the caller chose): eight runs resuming at once on one GPU ran out of memory to
    fragmentation with fixed-size segments."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(name, str(threads))
    return {**env, **(extra or {})}


def run_jobs(
    jobs: list[Job],
    echo=print,
    seconds: float | None = None,
    parallel: int | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Run every job that is not skipped, at most ``parallel`` at a time (all at once by default), each
    writing to its log and with its share of the CPU cores (``env``: more variables for each); a job
    starts as soon as another ends. After ``seconds``, SIGTERM the ones still running (a training run
    checkpoints and stops, and the next call resumes it) and start no more: those left are reported
    stopped, to be run by the next call. A job that runs out of GPU memory while others run is started
    again (it resumes from its last checkpoint) once one of them ends, and from then on one job fewer
    runs at once: a failed run would cost the whole comparison its report."""
    todo = [j for j in jobs if j.skipped is None]
    for job in jobs:
        if job.skipped is not None:
            echo(f"- {job.name}: {job.skipped}")
    width = len(todo) if parallel is None else max(1, min(parallel, len(todo)))
    threads = max(1, (os.cpu_count() or 1) // max(1, width))
    waiting, running = list(todo), []
    deadline = None if seconds is None else time.time() + seconds
    while waiting or running:
        if deadline is not None and time.time() > deadline:
            echo(f"  the time limit ({seconds:.0f} s of RL) reached: stopping the runs (each checkpoints)")
            for job in running:
                job.proc.send_signal(signal.SIGTERM)
            for job in [*running, *waiting]:
                job.stopped = True
            waiting, deadline = [], None
        while waiting and len(running) < width:
            job = waiting.pop(0)
            _start(job, threads, echo, env)
            running.append(job)
        for job in list(running):
            if job.proc.poll() is not None:
                job.rc, job.seconds = job.proc.returncode, time.time() - job.started
                running.remove(job)
                if job.rc != 0 and running and job.retried < MAX_RETRIES and ran_out_of_memory(job.log):
                    width = max(1, len(running))
                    echo(
                        f"  {job.name}: out of GPU memory beside {len(running)} runs after "
                        f"{job.seconds:.0f} s: starts again when one ends ({width} at once from now)"
                    )
                    job.retried, job.rc = job.retried + 1, None
                    waiting.insert(0, job)
                    continue
                echo(f"  {job.name}: {job.status()} after {job.seconds:.0f} s")
        time.sleep(0.2)


MAX_RETRIES = 2
OUT_OF_MEMORY = "out of GPU memory"
"""What fp4train's one-line error says when CUDA runs out of memory."""


def ran_out_of_memory(log: Path) -> bool:
    """Whether the command writing ``log`` ended on fp4train's out-of-memory error."""
    if not log.is_file():
        return False
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
        return OUT_OF_MEMORY in f.read().decode(errors="replace")


def _start(job: Job, threads: int, echo, env: dict[str, str] | None = None) -> None:
    job.log.parent.mkdir(parents=True, exist_ok=True)
    echo(f"$ fp4train {' '.join(job.args)}\n  > {job.log}")
    command = [sys.executable, "-m", "inkling_fp4", *job.args]
    with open(job.log, "a" if job.retried else "w") as f:  # a retry keeps the log of the failure
        job.proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=child_env(threads, env))
    job.started = time.time()


RUN_GPU_GIB = 15.0
"""GPU memory one rl-hybrid-125m run may need at its peak (sampling 512 completions, then training
512 x 512 tokens): eight runs at once ran out of memory on an 80 GB H100, five fit."""


FREE_MEMORY = "import torch; print(torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else -1)"
"""Asked in a child process: this one keeps no CUDA context of its own beside the runs'."""


def runs_at_once(device: str, runs: int) -> int:
    """How many RL runs share the GPU at once: as many as its free memory holds at RUN_GPU_GIB each
    (all of them off CUDA); the rest wait for a run to end."""
    if not device.startswith("cuda"):
        return runs
    asked = subprocess.run([sys.executable, "-c", FREE_MEMORY], env=child_env(1), capture_output=True,
                           text=True, timeout=180)  # fmt: skip
    free = int(asked.stdout.split()[-1]) if asked.returncode == 0 and asked.stdout.split() else -1
    if free < 0:
        return runs  # the runs themselves say that CUDA is missing
    return max(1, min(runs, int(free / 2**30 // RUN_GPU_GIB)))


STOP_MARGIN_S = 45.0
"""What stopping the RL runs takes under --seconds: each checkpoints, then the summary is written."""


def rl_time_limit(rl_seconds: float | None, budget: float | None, elapsed: float) -> float | None:
    """Seconds the RL runs may take: ``--rl-seconds``, and under ``--seconds`` what is left of the
    command's budget after ``elapsed`` and the stop margin (None: no limit)."""
    if budget is None:
        return rl_seconds
    left = max(0.0, budget - elapsed - STOP_MARGIN_S)
    return left if rl_seconds is None else min(rl_seconds, left)


def skip_all(jobs: list[Job], why: str) -> None:
    for job in jobs:
        job.skipped = job.skipped or why


def finished(run_dir: Path, steps: int) -> bool:
    """Whether a run has its checkpoint of its last step (the loop always writes one there)."""
    return (run_dir / "checkpoints" / f"step_{steps}" / "state.json").is_file()


# ----------------------------------------------------------------------------------------------
# the plan


def stage_overrides(a, profile: Profile, stage: int, steps: int) -> list[str]:
    """The overrides of one stage: the profile's, the step count, the device, then the user's."""
    user = (a.pretrain_set, a.sft_set, a.rl_set)[stage] or []
    common = ["log.progress=false", f"train.steps={steps}", f"train.device={a.device or profile.device}"]
    if stage < 2:  # one checkpoint, at the end: what the next stage starts from
        common.append(f"train.checkpoint_every={steps}")
    return [*profile.extra[stage], *common, *user]


def plan(a, profile: Profile) -> dict[str, list[Job]]:
    """The commands of every stage (none started)."""
    out, logs = a.out, a.out / "logs"
    given = (a.pretrain_steps, a.sft_steps, a.rl_steps)
    steps = [d if s is None else s for s, d in zip(given, profile.steps, strict=True)]
    pre, sft = out / "pretrain", out / "sft"
    args = ["pretrain", "--recipe", profile.recipes[0], "--run-dir", str(pre)]
    pretrain = Job("pretrain", [*args, *stage_overrides(a, profile, 0, steps[0])], logs / "pretrain.log")
    args = ["sft", "--recipe", profile.recipes[1], "--from", str(pre), "--run-dir", str(sft)]
    tune = Job("sft", [*args, *stage_overrides(a, profile, 1, steps[1])], logs / "sft.log")
    if finished(pre, steps[0]):
        pretrain.skipped = f"done ({pre} has its step-{steps[0]} checkpoint)"
    if finished(sft, steps[1]):
        tune.skipped = f"done ({sft} has its step-{steps[1]} checkpoint)"
    rl = stage_overrides(a, profile, 2, steps[2])
    compare = ["compare-baseline", "--stage", "rollout", "--recipe", profile.recipes[2], "--from", str(sft),
               "--with", "bf16,nvfp4-row", "--noise", "--run-dir", str(out / "rl-compare"), *rl]  # fmt: skip
    runs = [
        Job(label, [*compare, "--only", run], logs / f"rl-{label}.log") for label, run in COMPARED.items()
    ]
    for job, run in zip(runs, COMPARED.values(), strict=True):
        if finished(out / "rl-compare" / run, steps[2]):
            job.skipped = f"done ({run} has its step-{steps[2]} checkpoint)"
    report = Job("report", compare, logs / "rl-report.log")
    return {"pretrain": [pretrain], "sft": [tune], "rl": runs, "report": [report]}


def run_dirs(out: Path) -> dict[str, Path]:
    """Summary label -> run directory of the five RL runs."""
    return {label: out / "rl-compare" / run for label, run in COMPARED.items()}


# ----------------------------------------------------------------------------------------------
# the summary


def summarize_bench(
    out: Path, jobs: list[Job], window: int | None = None, sharing: str | None = None
) -> dict:
    """The plain data of summary.json: the commands and how they went, how this call's RL runs shared
    the GPU, each RL run's figures and curves (a run without metrics is reported missing), the
    comparison's headlines."""
    runs: dict[str, dict] = {}
    for label, run_dir in run_dirs(out).items():
        if not run_dir.exists():
            runs[label] = {"run_dir": str(run_dir), "missing": "not started"}
            continue
        try:
            if window is None:  # the RL runs all have the same number of steps
                window = tail_window(load_run_config(run_dir).train.steps)
            s = summarize_rl_run(label, run_dir, window)
        except UserError as e:
            runs[label] = {"run_dir": str(run_dir), "missing": str(e)}
            continue
        curves = s.metrics.curves
        runs[label] = {
            "run_dir": str(run_dir),
            "recipe": s.config.precision.recipe,
            "activation_scale": s.config.precision.activation_scale,
            "correction": s.config.rl.correction,
            "figures": {k: None if st is None else st.to_dict() for k, st in s.figures.items()},
            "eval_accuracy": _curve(curves.get("eval_accuracy")),
            "eval_pass1_sampled": _curve(curves.get("eval_pass1_sampled")),
            "eval_kl_to_start": _curve(curves.get("eval_kl_to_start")),
            "eval_truncated": _curve(curves.get("eval_truncated")),
            "reward": _curve(curves.get("reward_mean")),
            "zero_var_frac": _curve(curves.get("zero_var_frac")),
            "unsolved_frac": _curve(curves.get("unsolved_frac")),
            "solved_frac": _curve(curves.get("solved_frac")),
            "eval_pass_at_k": _curve(curves.get("eval_pass_at_k")),
            "eval_accuracy_by_level": _level_curves(run_dir),
            "time_eval_s": _curve(curves.get("time_eval_s")),
            "monitor": {  # as the comparison's report.json has it
                "skipped_updates": list(s.metrics.skipped_updates),
                "fallback_spans": [list(span) for span in s.metrics.fallback_spans()],
            },
        }
    report = out / "rl-compare" / "report" / "report.json"
    fresh = any(j.name == "report" and j.rc == 0 for j in jobs)  # not a report an earlier call left
    data = json.loads(report.read_text()) if fresh else {}
    headlines = [r.get("headline", "") for r in data.get("runs", {}).values()]
    seeds = data.get("seeds") or {}
    verdicts = [
        p["verdict"] for label, p in seeds.get("precisions", {}).items() if label != seeds.get("baseline")
    ]
    return {"jobs": [j.to_dict() for j in jobs], "gpu_sharing": sharing, "window_steps": window, "runs": runs,
            "report": str(report.with_name("report.md")) if fresh else None,
            "headlines": headlines, "seed_verdicts": verdicts}  # fmt: skip


def _curve(series) -> dict[str, float]:
    """step (a JSON key) -> value."""
    if series is None:
        return {}
    return {str(int(s)): float(v) for s, v in zip(series.steps, series.values, strict=True)}


def _level_curves(run_dir: Path) -> dict[str, dict[str, float]]:
    """``level<L>`` -> step -> held-out greedy pass@1 of that level (rows that have it)."""
    out: dict[str, dict[str, float]] = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        row = json.loads(line)
        for key, value in row.items():
            if key.startswith("eval_accuracy_level"):
                out.setdefault(key.removeprefix("eval_accuracy_"), {})[str(row["step"])] = float(value)
    return out


def _value(run: dict, key: str) -> float | None:
    stat = (run.get("figures") or {}).get(key)
    return None if stat is None else stat["value"]


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _by_step(runs: dict[str, dict], key: str, spec: str) -> list[list[str]]:
    """One row per step any run logged ``key`` at, one column per run."""
    steps = sorted({int(s) for r in runs.values() for s in r.get(key, {})})
    return [[str(s)] + [_fmt(r.get(key, {}).get(str(s)), spec) for r in runs.values()] for s in steps]


def render_summary(data: dict) -> str:
    runs, k = data["runs"], data["window_steps"]
    present = {label: r for label, r in runs.items() if "missing" not in r}
    lines = ["# RL under NVFP4: the bench_rl.py measurement", ""]
    rows = [[j["name"], j["status"], f"{j['seconds']:.0f}", f"`{j['log']}`"] for j in data["jobs"]]
    lines += _table(["command", "status", "seconds", "log"], rows)
    if data.get("gpu_sharing"):
        lines += ["", f"The RL runs of this call shared the GPU: {data['gpu_sharing']}."]
    missing = [f"- {label}: {r['missing']}" for label, r in runs.items() if "missing" in r]
    if missing:
        lines += ["", "Runs without metrics:", "", *missing]
    if data["headlines"]:
        lines += ["", f"## compare-baseline --stage rollout (`{data['report']}`)", ""]
        lines += [f"- {h}" for h in data.get("seed_verdicts", [])]
        lines += [f"- {h}" for h in data["headlines"]]
    if present:
        lines += _curves_section(present, k) + _mismatch_section(present, k) + _time_section(present, k)
        lines += _monitor_section(present)
    return "\n".join(lines) + "\n"


def _seeds_section(runs: dict[str, dict]) -> list[str]:
    """Per precision and seed: held-out greedy pass@1 at the first and the last evaluation, and each
    precision's seeds' mean change and spread."""
    lines = ["", "## Held-out greedy pass@1 by precision and seed", ""]
    rows = []
    for label in PRECISIONS:
        ends = []
        for run_label in (label, f"{label}-seed1"):
            curve = runs.get(run_label, {}).get("eval_accuracy", {})
            if curve:
                steps = sorted(curve, key=int)
                ends.append((curve[steps[0]], curve[steps[-1]], steps[-1]))
        if not ends:
            continue
        cells = [f"{a:.3f} -> {b:.3f} (step {s})" for a, b, s in ends]
        gain = sum(b - a for a, b, _ in ends) / len(ends)
        spread = max(b for _, b, _ in ends) - min(b for _, b, _ in ends)
        rows.append([label, *cells, *[""] * (2 - len(cells)), f"{gain:+.3f}", f"{spread:.3f}"])
    return lines + _table(["precision", "seed 0", "seed 1", "mean change", "final spread"], rows)


def _levels_section(runs: dict[str, dict]) -> list[str]:
    """Held-out greedy pass@1 of each level at the first and the last evaluation (mixed levels only)."""
    levels = sorted({lv for r in runs.values() for lv in r.get("eval_accuracy_by_level", {})})
    if not levels:
        return []
    rows = []
    for label, r in runs.items():
        cells = []
        for lv in levels:
            curve = r.get("eval_accuracy_by_level", {}).get(lv, {})
            steps = sorted(curve, key=int)
            cells.append(f"{curve[steps[0]]:.3f} -> {curve[steps[-1]]:.3f}" if steps else "n/a")
        rows.append([label, *cells])
    return ["", "## Held-out greedy pass@1 by level (first -> last evaluation)", ""] + _table(
        ["run", *levels], rows
    )


def _curves_section(runs: dict[str, dict], k: int) -> list[str]:
    lines = (
        _seeds_section(runs)
        + _levels_section(runs)
        + ["", "## Held-out accuracy (greedy pass@1) over the steps", ""]
    )
    lines += _table(["step", *runs], _by_step(runs, "eval_accuracy", ".3f"))
    lines += ["", "## Held-out sampled pass@1 over the steps", ""]
    lines += _table(["step", *runs], _by_step(runs, "eval_pass1_sampled", ".3f"))
    lines += ["", "## Greedy held-out answers cut by the token budget over the steps", ""]
    lines += _table(["step", *runs], _by_step(runs, "eval_truncated", ".3f"))
    lines += ["", "## KL of the policy to its start (k3, held-out samples)", ""]
    lines += _table(["step", *runs], _by_step(runs, "eval_kl_to_start", ".2e"))
    rows = _by_step(runs, "reward", ".3f")
    rows.append([f"mean of the last {k}"] + [_fmt(_value(r, "reward_mean"), ".3f") for r in runs.values()])
    lines += ["", "## Reward per step", ""] + _table(["step", *runs], rows)
    lines += ["", "## Held-out pass@k over the steps (k = rl.eval_samples)", ""]
    lines += _table(["step", *runs], _by_step(runs, "eval_pass_at_k", ".3f"))
    note = ("Each cell: groups without signal (groups with no completion right / with all right; a "
            "group of rewards 0 and 0.1 has none right but a signal): a model that learns moves groups "
            "from the first kind to the second.")  # fmt: skip
    signal = []
    for a, b in _windows(runs):
        cells = []
        for r in runs.values():
            keys = ("zero_var_frac", "unsolved_frac", "solved_frac")
            parts = [_window(r.get(key, {}), a, b) for key in keys]
            cells.append(f"{parts[0]} ({parts[1]} / {parts[2]})")
        signal.append([f"mean of steps {a + 1}-{b}", *cells])
    lines += ["", "## Share of groups without signal", "", note, ""]
    return lines + _table(["steps", *runs], signal)


def _windows(runs: dict[str, dict], parts: int = 4) -> list[tuple[int, int]]:
    """The RL steps cut into ``parts`` windows."""
    last = max((int(s) for r in runs.values() for s in r.get("zero_var_frac", {})), default=0)
    cuts = [round(last * i / parts) for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _window(curve: dict[str, float], a: int, b: int) -> str:
    values = [v for s, v in curve.items() if a < int(s) <= b]
    return _fmt(sum(values) / len(values) if values else None, ".2f")


def _mismatch_section(runs: dict[str, dict], k: int) -> list[str]:
    note = "Means; the largest \\|Δ log p\\| and the ratio range are the extremes of those steps."
    lines = ["", f"## Rollout / trainer mismatch over the last {k} steps", "", note, ""]
    header = ["run", "recipe", "activation scale", "correction", *(h for h, _ in MISMATCH.values())]
    rows = []
    for label, r in runs.items():
        figures = [_fmt(_value(r, key), spec) for key, (_, spec) in MISMATCH.items()]
        rows.append([label, r["recipe"], r["activation_scale"], r["correction"], *figures])
    return lines + _table(header, rows)


def _time_section(runs: dict[str, dict], k: int) -> list[str]:
    lines = [
        "",
        f"## Wall time per RL step and throughput (mean of the last {k} steps, the first left out)",
        "",
    ]
    header = ["run", *TIME_SPLIT.values(), "step s", "generation tokens/s", "training tokens/s",
              "an evaluation s (mean)"]  # fmt: skip
    rows = []
    for label, r in runs.items():
        split = [_value(r, key) for key in TIME_SPLIT]
        total = None if None in split else sum(split)
        speed = [_fmt(_value(r, key), ",.0f") for key in ("gen_tokens_per_s", "tokens_per_s")]
        evals = list(r.get("time_eval_s", {}).values())
        eval_s = sum(evals) / len(evals) if evals else None
        rows.append([label, *(_fmt(x, ".3f") for x in [*split, total]), *speed, _fmt(eval_s, ".1f")])
    return lines + _table(header, rows)


def _monitor_section(runs: dict[str, dict]) -> list[str]:
    """The comparison report's noise-monitor section over every run, fp8 (the baseline) first."""
    if "fp8" not in runs:
        return []
    others = {label: r for label, r in runs.items() if label != "fp8"}
    return monitor_section({"baseline": {"label": "fp8", **runs["fp8"]}, "runs": others})


def write_summary(out: Path, jobs: list[Job], sharing: str | None = None) -> dict:
    data = summarize_bench(out, jobs, sharing=sharing)
    (out / "summary.json").write_text(json.dumps(data, indent=2) + "\n")
    (out / "summary.md").write_text(render_summary(data))
    return data


# ----------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/rl-bench"), help="runs, logs and summary")
    p.add_argument("--tiny", action="store_true", help="tiny recipes and sizes on CPU: checks the pipeline")
    p.add_argument("--pretrain-steps", type=int, help="pretraining steps (default 40; --tiny 4)")
    p.add_argument("--sft-steps", type=int, help="SFT steps (default 250; --tiny 2)")
    p.add_argument("--rl-steps", type=int, help="RL steps of each run (default 120; --tiny 3)")
    p.add_argument("--device", help="train.device of every stage (default cuda; --tiny cpu)")
    p.add_argument("--until", choices=("pretrain", "sft"), help="stop after this stage")
    p.add_argument(
        "--rl-seconds", type=float, help="stop the RL runs after this long (the next call resumes)"
    )
    p.add_argument(
        "--seconds", type=float, help="stop the RL runs so that this command ends within this long"
    )
    p.add_argument(
        "--parallel", type=int, help="RL runs at once (default: as many as the GPU's free memory holds)"
    )
    p.add_argument("--mps", choices=("auto", "off"), default="auto",
                   help="auto: the RL runs share the GPU through the CUDA MPS daemon where it starts; "
                        "off: the GPU time-slices between them")  # fmt: skip
    for stage in ("pretrain", "sft", "rl"):
        p.add_argument(f"--{stage}-set", action="append", metavar="KEY=VALUE",
                       help=f"one more override of the {stage} stage (repeatable)")  # fmt: skip
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.out.exists() and not a.out.is_dir():
        print(
            f"error: --out {a.out} is a file; give a directory (new, or one this script wrote)",
            file=sys.stderr,
        )
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    profile = TINY if a.tiny else H200
    stages = plan(a, profile)
    if a.until is not None:
        names = list(stages)
        stages = {name: stages[name] for name in names[: names.index(a.until) + 1]}
    t0, failed, sharing = time.time(), None, None
    for name, jobs in stages.items():
        if failed is not None:
            skip_all(jobs, f"{failed} failed")
            continue
        if name == "report" and not all(j.ok for j in stages["rl"][: len(COMPARED)]):
            skip_all(jobs, "a run of the comparison failed")
        if name == "rl":
            device = a.device or profile.device
            width = a.parallel or runs_at_once(device, len(jobs))
            todo = sum(j.skipped is None for j in jobs)
            with share_gpu(a.mps, device, min(width, todo), child_env(1)) as shared:
                limit = rl_time_limit(a.rl_seconds, a.seconds, time.time() - t0)
                run_jobs(jobs, seconds=limit, parallel=width, env=shared.env)
            sharing = shared.line if todo else None
        else:
            run_jobs(jobs)
        if not all(j.ok for j in jobs) and name in ("pretrain", "sft"):
            failed = name
    every = [j for jobs in stages.values() for j in jobs]
    write_summary(a.out, every, sharing)
    summary = a.out / "summary.md"
    print(f"\n{summary.read_text()}\nsummary: {summary} ({time.time() - t0:.0f} s)")
    bad = [j.name for j in every if not j.ok]
    if bad:
        print(f"failed or skipped: {', '.join(bad)} (logs under {a.out / 'logs'})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
