"""scripts/sweep_rl.py: each variant's command, resumed where it started and skipped where it finished,
and a table that reports what each run logged (greedy accuracy by step, first and last quarter)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("sweep_rl", SCRIPTS / "sweep_rl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sweep = _load()


def _write_run(run_dir: Path, rewards: list[float], evals: dict[int, float], steps_done: int | None = None):
    run_dir.mkdir(parents=True)
    rows = [{"step": s, "eval_accuracy": a} for s, a in evals.items()]
    rows += [{"step": i + 1, "reward_mean": r, "entropy": 1.0 - r} for i, r in enumerate(rewards)]
    text = "\n".join(json.dumps(r) for r in rows) + '\n{"step": 9, "rew'  # a line cut short by a kill
    (run_dir / "metrics.jsonl").write_text(text)
    if steps_done is not None:
        state = run_dir / "checkpoints" / f"step_{steps_done}"
        state.mkdir(parents=True)
        (state / "state.json").write_text("{}")


def test_variants_are_parsed_and_a_bad_one_is_named():
    assert sweep.parse_variant("ctrl=") == ("ctrl", [])
    assert sweep.parse_variant("g16=rl.group_size=16 rl.prompts_per_step=16") == (
        "g16",
        ["rl.group_size=16", "rl.prompts_per_step=16"],
    )
    for bad in ("no-equals", "=x=1", "a/b=x=1"):
        with pytest.raises(ValueError, match="NAME=OVERRIDES"):
            sweep.parse_variant(bad)


def test_plan_starts_resumes_and_skips(tmp_path):
    out = tmp_path / "sweep"
    _write_run(out / "started", [0.1], {0: 0.2}, steps_done=1)
    _write_run(out / "done", [0.1, 0.2], {0: 0.2}, steps_done=4)
    a = sweep.parse_args(["--from", "runs/sft", "--out", str(out), "--steps", "4", "--set", "eval.every=2",
                          "--variant", "fresh=sampler.temperature=0.5", "--variant", "started=",
                          "--variant", "done="])  # fmt: skip
    fresh, started, done = sweep.plan(a)
    assert fresh.args[:8] == ["rollout", "--recipe", "rl-hybrid-125m", "--from", "runs/sft", "--run-dir",
                              str(out / "fresh"), "log.progress=false"]  # fmt: skip
    # the common overrides first, the variant's own last (they win)
    assert fresh.args[8:] == ["train.steps=4", "eval.every=2", "sampler.temperature=0.5"]
    assert "--resume" not in fresh.args and fresh.skipped is None
    assert started.args[-1] == "--resume" and started.skipped is None
    assert done.skipped is not None and done.skipped.startswith("done")


def test_the_table_reports_what_each_run_logged(tmp_path):
    rising = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    _write_run(tmp_path / "up", rising, {0: 0.25, 4: 0.375, 8: 0.5})
    _write_run(tmp_path / "flat", [0.5] * 4, {0: 0.25})
    up, flat = sweep.summarize(tmp_path / "up"), sweep.summarize(tmp_path / "flat")
    assert up["eval_accuracy"] == {0: 0.25, 4: 0.375, 8: 0.5} and up["steps_done"] == 8
    assert up["windows"]["reward_mean"] == pytest.approx((0.15, 0.75))  # quarters: steps 1-2, 7-8
    assert up["windows"]["entropy"] == pytest.approx((0.85, 0.25))
    assert "unsolved_frac" not in up["windows"]  # never logged
    text = sweep.render({"up": up, "flat": flat})
    assert "| 8 | 0.500 |  |" in text  # flat has no evaluation at step 8
    assert "| up | 8 | 0.150 -> 0.750 | n/a |" in text
    assert "| flat | 4 | 0.500 -> 0.500 |" in text


def test_a_variant_with_its_own_step_count_is_done_at_its_own_last_step(tmp_path):
    """With rl.mini_batches=4 a variant runs 4 trainer steps per RL step: its step-4 checkpoint of a
    16-step run is a quarter of the way, not the end."""
    out = tmp_path / "sweep"
    _write_run(out / "mb4", [0.1], {0: 0.2}, steps_done=4)
    _write_run(out / "mb4-done", [0.1], {0: 0.2}, steps_done=16)
    a = sweep.parse_args(["--from", "runs/sft", "--out", str(out), "--steps", "4",
                          "--variant", "mb4=rl.mini_batches=4 train.steps=16",
                          "--variant", "mb4-done=rl.mini_batches=4 train.steps=16"])  # fmt: skip
    going, done = sweep.plan(a)
    assert going.skipped is None and going.args[-1] == "--resume"
    assert done.skipped is not None and "step-16" in done.skipped


def test_the_variants_share_the_gpu_as_asked_and_the_line_says_how(tmp_path, monkeypatch, capsys):
    """main hands run_jobs the environment share_gpu gives (nothing when the runs time-slice) and
    prints how the runs share the GPU: --mps off, and runs whose device is the CPU, start no daemon."""
    given = []

    def run_jobs(jobs, seconds=None, env=None):
        given.append(env)
        for job in jobs:
            job.rc = 0

    monkeypatch.setattr(sweep, "run_jobs", run_jobs)
    base = ["--from", str(tmp_path / "base"), "--variant", "a=", "--variant", "b=optim.lr=1e-6"]
    assert sweep.main([*base, "--out", str(tmp_path / "off"), "--mps", "off"]) == 0
    assert "the runs share the GPU: time-sliced (--mps off)" in capsys.readouterr().out
    assert sweep.main([*base, "--out", str(tmp_path / "cpu"), "--set", "train.device=cpu"]) == 0
    assert "the runs share the GPU: not at all (the runs are on cpu)" in capsys.readouterr().out
    assert given == [{}, {}]
