"""scripts/bench_user_speed.py on CPU: it runs generate and eval as a user does and reports the speed
lines they print."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from test_run_dir import pretrained

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_user_speed.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A pretrain run of 2 steps that the benches read (--from), shared by the module's tests."""
    return pretrained(tmp_path_factory, 2)


def test_parse_speed_reads_the_last_line_with_and_without_the_set_up():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_user_speed as b

    out = ("12 new tokens in 0.50 s: 24.0 new tokens/s\n"
           "3,000 ignored\n1204 new tokens in 2.00 s: 1,003.3 new tokens/s "
           "(not counting 0.80 s of one-off graph capture and compilation)\n")  # fmt: skip
    assert b.parse_speed(out) == {"new_tokens": 1204, "seconds": 2.0, "tokens_per_s": 1003.3, "setup_s": 0.8}
    assert b.parse_speed("12 new tokens in 0.50 s: 24.0 new tokens/s")["setup_s"] == 0.0
    assert b.parse_speed("no speed here") is None


RL_SETS = ["rl.prompts_per_step=2", "rl.group_size=2", "train.batch_size=4", "train.micro_batch_size=4",
           "sampler.max_new_tokens=4", "rl.levels=[1]", "train.checkpoint_every=0", "train.device=cpu",
           "rl.mask_truncated=false"]  # fmt: skip


def _cmd(run, out):
    return [sys.executable, str(SCRIPT), "--from", str(run), "--out", str(out), "--prompts", "6",
            "--problems", "3", "--samples", "2", "--max-new-tokens", "4", "--device", "cpu",
            "--set", "sampler.max_context=96", "--rl-steps", "3", "--rl-recipe", "rl-tiny",
            *[x for o in RL_SETS for x in ("--rl-set", o)]]  # fmt: skip


@pytest.fixture(scope="module")
def speed(run, tmp_path_factory):
    """One call of the script with --rl-steps (its generate, eval and RL rows), for the tests below."""
    out = tmp_path_factory.mktemp("bench") / "speed"
    done = subprocess.run(_cmd(run, out), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return out


def test_bench_user_speed_on_a_tiny_run(run, speed):
    rows = [r for r in json.loads((speed / "summary.json").read_text()) if "rl" not in r]
    assert [r["name"].split(",")[-1].strip() for r in rows] == ["bf16", "nvfp4-row", "3 problems"]
    for r in rows:  # each figure is the one its command printed
        log = Path(r["log"]).read_text()
        assert r["rc"] == 0 and f"{r['speed']['new_tokens']} new tokens in" in log
    assert len((speed / "generate-bf16.jsonl").read_text().splitlines()) == 6
    assert len((speed / "prompts.txt").read_text().splitlines()) == 6
    again = subprocess.run(_cmd(run, speed), capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "exists" in again.stderr


def test_bench_user_speed_times_rl_steps_alone(speed):
    """--rl-steps: four RL runs one after another (BF16 and NVFP4, padded and packed rows); each row's
    split is the median of its logged steps after the first, and NVFP4 is set against BF16."""
    rows = [r for r in json.loads((speed / "summary.json").read_text()) if "rl" in r]
    assert [r["name"] for r in rows] == [f"rollout 3 steps, {p}, rl.pack={k}" for k in ("false", "true")
                                         for p in ("bf16", "nvfp4")]  # fmt: skip
    for r in rows:
        run_dir = Path(r["command"].split("--run-dir ")[1].split()[0])
        logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        timed = [x for x in logged if "time_train_s" in x][1:]  # the first step left out
        assert r["rc"] == 0 and r["rl"]["steps"] == len(timed) == 2
        for key in ("time_sample_s", "time_train_s"):
            assert r["rl"][key] == statistics.median(x[key] for x in timed)
    for nv, bf in ((rows[1], rows[0]), (rows[3], rows[2])):
        assert nv["rl_x_bf16"] == nv["rl"]["step_s"] / bf["rl"]["step_s"]
    assert "RL steps alone" in (speed / "summary.md").read_text()
