"""scripts/bench_rl.py end to end on CPU with the tiny recipes (--tiny): every stage runs, the summary's
numbers are those of the runs' metrics.jsonl; a failing stage is reported and the script exits 1."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_rl.py"
PRECISIONS = {  # summary label -> (run dir under --out, recipe, activation scale, correction)
    "fp8": ("rl-compare/fp8", "fp8", "tensor", "tis"),
    "nvfp4-tensor": ("rl-compare/nvfp4", "nvfp4", "tensor", "tis"),
    "nvfp4-row": ("rl-compare/nvfp4-row", "nvfp4", "row", "tis"),
    "bf16": ("rl-compare/bf16", "bf16", "tensor", "tis"),
}
RUNS = {**PRECISIONS, **{f"{k}-seed1": (f"{v[0]}-seed1", *v[1:]) for k, v in PRECISIONS.items()}}


def bench(tmp_path, *args):
    """Run the script with --tiny into tmp_path/out; a reward of the completion's length (an
    untrained model never answers right) from a module on the children's PYTHONPATH."""
    (tmp_path / "len_reward.py").write_text("def reward(prompt, completion, answer):\n"
                                            "    return (len(completion) % 5) / 4\n")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = tmp_path / "out"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--pretrain-set", cache, "--rl-set",
           "rl.reward=len_reward:reward", *args]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    return done, out


def logged(run_dir, key):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[key] for r in rows if key in r and "event" not in r}


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """The script stage by stage on one --out: ``--until pretrain``, ``--until sft``, then the whole
    (reusing both). Each call's summary and the stages' directories under --out after it."""
    tmp = tmp_path_factory.mktemp("bench")
    calls = []
    for args in (["--until", "pretrain"], ["--until", "sft"], ["--rl-set", "rl.levels=[1,2]"]):
        done, out = bench(tmp, *args)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        there = [name for name in ("pretrain", "sft", "rl-compare") if (out / name).exists()]
        calls.append((json.loads((out / "summary.json").read_text()), there))
    return calls, out


def test_until_stops_after_a_stage_and_the_next_call_reuses_it(staged):
    ((first, after_first), (second, after_second), _), _ = staged
    assert [j["name"] for j in first["jobs"]] == ["pretrain"] and first["jobs"][0]["status"] == "ok"
    assert after_first == ["pretrain"]
    status = {j["name"]: j["status"] for j in second["jobs"]}
    assert status["pretrain"].startswith("skipped: done") and status["sft"] == "ok"
    assert after_second == ["pretrain", "sft"]
    assert {r["missing"] for r in second["runs"].values()} == {"not started"}


def test_bench_rl_on_cpu_summarises_what_its_runs_logged(staged):
    (*_, (data, _)), out = staged
    assert [j["name"] for j in data["jobs"]] == ["pretrain", "sft", *RUNS, "report"]
    assert all(j["status"].startswith("skipped: done") for j in data["jobs"][:2])  # the earlier calls'
    assert all(j["status"] == "ok" and Path(j["log"]).stat().st_size > 0 for j in data["jobs"][2:])
    assert data["gpu_sharing"] == "not at all (the runs are on cpu)"
    assert "shared the GPU: not at all (the runs are on cpu)." in (out / "summary.md").read_text()
    assert (
        "--only fp8 " in data["jobs"][2]["command"] + " "
        and "--only bf16-seed1" in data["jobs"][9]["command"]
    )
    assert "--with bf16,nvfp4-row --noise" in data["jobs"][2]["command"]
    assert data["report"] == str(out / "rl-compare" / "report" / "report.md")
    report = json.loads((out / "rl-compare" / "report" / "report.json").read_text())
    assert data["headlines"] == [r["headline"] for r in report["runs"].values()]
    k = data["window_steps"]
    assert k == 1  # a quarter of 3 steps
    compared = {
        "fp8": report["baseline"],
        **{
            label: report["runs"][run.removeprefix("rl-compare/")]
            for label, (run, *_) in RUNS.items()
            if label != "fp8"
        },
    }
    for label, (run, recipe, scale, correction) in RUNS.items():
        r, run_dir = data["runs"][label], out / run
        assert (r["run_dir"], r["recipe"], r["activation_scale"], r["correction"]) == (
            str(run_dir), recipe, scale, correction
        )  # fmt: skip
        assert r["eval_accuracy"] == {str(s): v for s, v in logged(run_dir, "eval_accuracy").items()}
        assert r["reward"] == {str(s): v for s, v in logged(run_dir, "reward_mean").items()}
        evals = {str(s): v for s, v in logged(run_dir, "time_eval_s").items()}
        assert evals and evals.keys() == r["eval_accuracy"].keys() and r["time_eval_s"] == evals
        for lv in ("level1", "level2"):  # held-out greedy pass@1 per level, as logged
            logged_lv = {str(s): v for s, v in logged(run_dir, f"eval_accuracy_{lv}").items()}
            assert logged_lv and r["eval_accuracy_by_level"][lv] == logged_lv, lv
        for key in ("unsolved_frac", "solved_frac", "eval_pass_at_k"):  # logged, so summarised too
            assert r[key] and r[key] == {str(s): v for s, v in logged(run_dir, key).items()}, key
        for key in ("mismatch_k3", "mismatch_abs_mean", "mismatch_abs_max", "mismatch_frac_over_cap"):
            values = logged(run_dir, key)
            assert r["figures"][key]["value"] == pytest.approx(values[max(values)])  # the last k=1 step
        if label in compared:  # the summary reads the monitor as the comparison's report does
            assert r["monitor"] == compared[label]["monitor"]
        for key in ("time_sample_s", "time_train_s", "gen_tokens_per_s"):
            values = logged(run_dir, key)  # the first step left out: steps 2 and 3, of which the last
            assert r["figures"][key]["value"] == pytest.approx(np.mean([values[3]]))
    md = (out / "summary.md").read_text()
    for label, (run, *_) in PRECISIONS.items():  # the seeds table: first and last evaluation of each seed
        cells = []
        for run_dir in (out / run, out / f"{run}-seed1"):
            acc = logged(run_dir, "eval_accuracy")
            cells.append(f"{acc[min(acc)]:.3f} -> {acc[max(acc)]:.3f} (step {max(acc)})")
        assert f"| {label} | {cells[0]} | {cells[1]} |" in md
    assert "## Held-out greedy pass@1 by level (first -> last evaluation)\n\n| run | level1 | level2 |" in md
    assert "## Share of groups without signal" in md and "(n/a / n/a)" not in md
    assert "## Rollout / trainer mismatch" in md and "| nvfp4-row | nvfp4 | row | tis |" in md
    assert "## Noise monitor" in md and "skipped no update and moved no run to BF16" in md
    assert report["headline"] in md and report["headline"] == data["seed_verdicts"][0]


def test_bench_rl_reports_a_failed_stage_and_exits_1_and_no_stale_report(tmp_path):
    """A failing stage is reported and the script exits 1; a report.json an earlier call left under
    --out is not reported as this call's."""
    stale = tmp_path / "out" / "rl-compare" / "report" / "report.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"runs": {"nvfp4": {"headline": "from an earlier call"}}}))
    done, out = bench(tmp_path, "--pretrain-set", "model.d_model=-1")
    assert done.returncode == 1
    assert "failed or skipped: pretrain, sft" in done.stderr
    data = json.loads((out / "summary.json").read_text())
    status = {j["name"]: j["status"] for j in data["jobs"]}
    assert status["pretrain"] == "failed (exit 2)" and status["report"] == "skipped: pretrain failed"
    assert all("missing" in r for r in data["runs"].values())
    assert data["headlines"] == [] and data["report"] is None
    assert "model.d_model" in (out / "logs" / "pretrain.log").read_text()
    assert "| pretrain | failed (exit 2) |" in (out / "summary.md").read_text()


def test_bench_rl_refuses_an_out_that_is_a_file(tmp_path):
    (tmp_path / "out").write_text("")
    done, _ = bench(tmp_path)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "is a file" in done.stderr


def test_rl_seconds_stops_the_runs_still_going_and_says_they_resume(tmp_path, monkeypatch):
    """--rl-seconds: SIGTERM to every run still going at the deadline (each checkpoints and stops),
    reported as stopped, not failed; a run that ended before it keeps its status."""
    import signal

    sys.path.insert(0, str(SCRIPT.parent))
    import bench_rl

    class Proc:
        def __init__(self, command, **kwargs):
            self.slow, self.returncode = "slow" in command, None

        def poll(self):
            if not self.slow:
                self.returncode = 0
            return self.returncode

        def send_signal(self, sig):
            assert sig == signal.SIGTERM
            self.returncode = 143

    monkeypatch.setattr(bench_rl.subprocess, "Popen", Proc)
    jobs = [bench_rl.Job(name, [name], tmp_path / f"{name}.log") for name in ("quick", "slow")]
    bench_rl.run_jobs(jobs, echo=lambda _: None, seconds=0.5)
    assert [j.status() for j in jobs] == ["ok", "stopped at the time limit (run again to resume)"]
    assert [j.ok for j in jobs] == [True, False]  # the report waits for the stopped run


def test_seconds_leaves_the_rl_runs_what_the_budget_has_left_after_the_stop_margin():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_rl

    margin = bench_rl.STOP_MARGIN_S
    assert bench_rl.rl_time_limit(None, None, 100.0) is None
    assert bench_rl.rl_time_limit(200.0, None, 100.0) == 200.0
    assert bench_rl.rl_time_limit(None, 560.0, 300.0) == 560.0 - 300.0 - margin
    assert bench_rl.rl_time_limit(100.0, 560.0, 300.0) == 100.0  # the tighter of the two
    assert bench_rl.rl_time_limit(None, 560.0, 540.0) == 0.0  # the base took it all: stop at once
    assert bench_rl.parse_args(["--seconds", "560"]).seconds == 560.0


def test_parallel_caps_the_runs_at_once_and_starts_the_next_as_one_ends(tmp_path, monkeypatch):
    """--parallel 2 over four runs: never more than two alive, every run goes; at the deadline the
    runs alive are stopped and those not yet started are reported stopped (the next call runs them)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_rl

    alive, most = [], [0]

    class Proc:
        def __init__(self, command, **kwargs):
            self.name, self.returncode, self.polls = command[-1], None, 0
            alive.append(self)
            most[0] = max(most[0], len(alive))

        def poll(self):
            self.polls += 1
            if self.returncode is None and "slow" not in self.name and self.polls > 2:
                self.returncode = 0
                alive.remove(self)
            return self.returncode

        def send_signal(self, sig):
            self.returncode = 143
            alive.remove(self)

    monkeypatch.setattr(bench_rl.subprocess, "Popen", Proc)
    jobs = [bench_rl.Job(n, [n], tmp_path / f"{n}.log") for n in ("a", "b", "c", "d")]
    bench_rl.run_jobs(jobs, echo=lambda _: None, parallel=2)
    assert most[0] == 2 and all(j.status() == "ok" for j in jobs)

    most[0] = 0
    jobs = [bench_rl.Job(n, [n], tmp_path / f"{n}.log") for n in ("slow1", "slow2", "c", "d")]
    bench_rl.run_jobs(jobs, echo=lambda _: None, seconds=0.5, parallel=2)
    assert most[0] == 2
    assert [j.proc is None for j in jobs] == [False, False, True, True]
    assert all(j.status() == "stopped at the time limit (run again to resume)" for j in jobs)
    assert not any(j.ok for j in jobs)


def test_a_run_out_of_gpu_memory_beside_others_starts_again_with_one_fewer_at_once(tmp_path, monkeypatch):
    """A run that ends on fp4train's out-of-memory line while others run waits for one of them to end,
    then starts again (its log keeps the failure), and no more than the survivors run at once from
    then on; one alone on the GPU, or failing otherwise, is reported failed."""
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_rl

    alive, most_after, failed_once = [], [0], set()

    class Proc:
        def __init__(self, command, stdout, **kwargs):
            self.name, self.returncode, self.polls, self.log = command[-1], None, 0, Path(stdout.name)
            alive.append(self)
            if failed_once:
                most_after[0] = max(most_after[0], len(alive))

        def poll(self):
            self.polls += 1
            if self.returncode is None and self.name.startswith("big") and self.name not in failed_once:
                failed_once.add(self.name)
                with open(self.log, "a") as f:  # as the child would, on its own descriptor
                    f.write("error: out of GPU memory (tried to allocate 688.00 mib): lower ...\n")
                self.returncode = 1
            elif self.returncode is None and self.name == "broken":
                self.returncode = 2
            elif self.returncode is None and self.polls > 3:
                self.returncode = 0
            if self.returncode is not None and self in alive:
                alive.remove(self)
            return self.returncode

    monkeypatch.setattr(bench_rl.subprocess, "Popen", Proc)
    jobs = [bench_rl.Job(n, [n], tmp_path / f"{n}.log") for n in ("a", "b", "big", "c")]
    lines = []
    bench_rl.run_jobs(jobs, echo=lines.append, parallel=4)
    assert [j.ok for j in jobs] == [True] * 4 and [j.retried for j in jobs] == [0, 0, 1, 0]
    assert jobs[2].status() == "ok (started 2 times: out of GPU memory beside other runs)"
    assert most_after[0] <= 3  # a, b and c were running when big failed: three at once from then on
    assert any("big: out of GPU memory beside 3 runs" in line for line in lines)
    assert "out of GPU memory" in (tmp_path / "big.log").read_text()  # the retry appended to it
    assert jobs[2].to_dict()["retried"] == 1

    failed_once.clear()
    alone = [bench_rl.Job("big-alone", ["big-alone"], tmp_path / "alone.log")]
    bench_rl.run_jobs(alone, echo=lambda _: None)
    assert alone[0].status() == "failed (exit 1)" and alone[0].retried == 0
    other = [bench_rl.Job("broken", ["broken"], tmp_path / "broken.log"),
             bench_rl.Job("a", ["a"], tmp_path / "a2.log")]  # fmt: skip
    bench_rl.run_jobs(other, echo=lambda _: None)
    assert [j.status() for j in other] == ["failed (exit 2)", "ok"] and other[0].retried == 0


def test_runs_at_once_is_what_the_free_memory_holds(monkeypatch):
    """Off CUDA every run; on CUDA the free memory a child process reports over RUN_GPU_GIB (at least
    one), every run where it finds no CUDA."""
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_rl

    assert bench_rl.runs_at_once("cpu", 8) == 8
    monkeypatch.setattr(bench_rl, "FREE_MEMORY", f"print({int(40 * 2**30)})")
    assert bench_rl.runs_at_once("cuda", 8) == int(40 // bench_rl.RUN_GPU_GIB)
    monkeypatch.setattr(bench_rl, "FREE_MEMORY", "print(1)")
    assert bench_rl.runs_at_once("cuda", 8) == 1
    monkeypatch.setattr(bench_rl, "FREE_MEMORY", "print(-1)")
    assert bench_rl.runs_at_once("cuda", 8) == 8
    assert bench_rl.parse_args(["--parallel", "4"]).parallel == 4


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """A stand-in for nvidia-cuda-mps-control on PATH: ``-d`` records the pipe directory it was given
    and logs one client connection, as the daemon's control.log does; anything else records the
    command read from stdin (``quit``)."""
    calls = tmp_path / "calls"
    binary = tmp_path / "bin" / "nvidia-cuda-mps-control"
    binary.parent.mkdir()
    binary.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-d" ]; then\n'
        '  echo "start $CUDA_MPS_PIPE_DIRECTORY" >> "$CALLS"\n'
        '  echo "[2026-12-06 03:00:00.000 Control 7] NEW CLIENT 8 from user 0: Server already exists"'
        ' > "$CUDA_MPS_LOG_DIRECTORY/control.log"\n'
        "else\n"
        '  read command; echo "$command $CUDA_MPS_PIPE_DIRECTORY" >> "$CALLS"\n'
        "fi\n"
    )
    binary.chmod(0o755)
    monkeypatch.setenv("PATH", f"{binary.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CALLS", str(calls))
    sys.path.insert(0, str(SCRIPT.parent))
    import shared_gpu

    return shared_gpu, calls


def test_mps_daemon_is_started_for_the_runs_handed_to_them_and_quit(fake_mps, monkeypatch):
    """Several runs on CUDA: the daemon starts on a directory of its own, a probe client finds it
    through the variables the runs get, its log's client connections are counted, and stop quits it
    and removes the directory."""
    shared_gpu, calls = fake_mps
    import bench_rl

    probe = "import os, sys; sys.exit(0 if os.path.isdir(os.environ['CUDA_MPS_PIPE_DIRECTORY']) else 3)"
    monkeypatch.setattr(shared_gpu, "MPS_PROBE", probe)
    with shared_gpu.share_gpu("auto", "cuda", 8, bench_rl.child_env(1), echo=lambda _: None) as shared:
        assert shared.line == "MPS (the runs' kernels side by side)"
        pipe = Path(shared.env["CUDA_MPS_PIPE_DIRECTORY"])
        assert pipe.is_dir() and calls.read_text().splitlines() == [f"start {pipe}"]  # not quit yet
        run_env = bench_rl.child_env(2, shared.env)
        assert run_env["CUDA_MPS_PIPE_DIRECTORY"] == str(pipe)
        assert run_env["CUDA_MPS_LOG_DIRECTORY"] == str(pipe.parent / "log")
    assert shared.line == "MPS (the runs' kernels side by side); 1 client connections"
    assert calls.read_text().splitlines() == [f"start {pipe}", f"quit {pipe}"]
    assert not pipe.parent.exists()


def test_mps_falls_back_to_time_slicing_where_it_cannot_serve_the_runs(fake_mps, monkeypatch):
    """A probe client that fails turns MPS off (the daemon quit, the reason in the line); so do
    --mps off, one run at a time, CPU runs and a driver without the daemon."""
    shared_gpu, calls = fake_mps
    env = dict(os.environ)
    monkeypatch.setattr(shared_gpu, "MPS_PROBE", "import sys; sys.exit('no CUDA-capable device is detected')")
    with shared_gpu.share_gpu("auto", "cuda", 4, env, echo=lambda _: None) as shared:
        assert shared.env == {}  # the runs get nothing of the daemon, already quit
        assert [c.split()[0] for c in calls.read_text().splitlines()] == ["start", "quit"]
    assert "no CUDA-capable device is detected" in shared.line and shared.line.startswith("time-sliced")
    calls.unlink()
    assert shared_gpu.start_mps("off", "cuda", 8, env)[0] is None
    assert shared_gpu.start_mps("auto", "cuda", 1, env) == (None, "one run at a time")
    assert shared_gpu.start_mps("auto", "cpu", 8, env) == (None, "not at all (the runs are on cpu)")
    assert not calls.exists()  # none of those started a daemon
    monkeypatch.setenv("PATH", os.defpath.replace("/bin", "/nonexistent-bin"))
    mps, line = shared_gpu.start_mps("auto", "cuda", 8, env)
    assert mps is None and "not on PATH" in line
    import bench_rl

    assert bench_rl.parse_args([]).mps == "auto" and bench_rl.parse_args(["--mps", "off"]).mps == "off"
