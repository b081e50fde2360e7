"""log.profile_steps: a run profiles the steps it is given into <run>/profile/ (a trace Perfetto reads
and a per-step table of ops), says so in its log, and refuses a range that is not one in one line."""

import json
import re

import pytest

from test_rollout import RL
from test_run_dir import cli, one_line, pretrained


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pretrained(tmp_path_factory, 2)


def _profile(run):
    trace = json.loads((run / "profile" / "trace.json").read_text())
    return trace["traceEvents"], (run / "profile" / "kernels.md").read_text()


def test_pretrain_profiles_the_steps_it_is_given(tmp_path_factory):
    run = pretrained(tmp_path_factory, 4, "log.profile_steps=[2, 3]")
    events, table = _profile(run)
    assert table.startswith("# Profile of steps 2-3 (2 steps, ")
    # the steps' own work: the optimizer ran once a profiled step, so 1 call a step
    optimizer = [line for line in table.splitlines() if "Optimizer.step" in line]
    assert optimizer and all(re.search(r"ms\s+1\s", line) for line in optimizer), table
    assert any(e.get("name", "").startswith("aten::") for e in events)
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if r.get("event") == "profile"] == [3]


def test_a_rollout_profiles_its_sampling_and_training(base, tmp_path):
    run = tmp_path / "rl"
    code, out, err = cli(["rollout", "--from", str(base), "--run-dir", str(run), *RL, "train.steps=2",
                          "eval.every=0", "eval.at_start=false", "log.profile_steps=[2, 2]"])  # fmt: skip
    assert code == 0, err
    assert f"profile: {run / 'profile'}/kernels.md" in out
    _, table = _profile(run)
    assert table.startswith("# Profile of steps 2-2 (1 steps, ")


def test_a_run_stopped_inside_the_range_writes_what_it_profiled(tmp_path_factory):
    run = pretrained(tmp_path_factory, 3, "log.profile_steps=[2, 9]")
    _, table = _profile(run)
    assert table.startswith("# Profile of steps 2-3 (2 steps, ")


@pytest.mark.parametrize("value", ["[3, 2]", "[0, 2]", "[2]", "[1.5, 2]", "5"])
def test_a_range_that_is_not_one_is_refused_in_one_line(tmp_path, value):
    code, _, err = cli(["pretrain", "--run-dir", str(tmp_path / "x"), f"log.profile_steps={value}"])
    assert code == 2 and "log.profile_steps" in one_line(err)
    assert not (tmp_path / "x").exists()
