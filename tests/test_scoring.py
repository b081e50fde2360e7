"""Reward functions that raise, hang, return NaN or junk, or end their own process: reward 0, counted,
and the run goes on."""

import ctypes
import math
import os
import signal
import sys
import time

import pytest

from inkling_fp4.errors import ConfigError
from inkling_fp4.rl.rewards import numeric
from inkling_fp4.rl.scoring import RewardRunner, load_reward
from inkling_fp4.trainer.interrupt import StopSignal


def flaky(prompt, completion, answer):
    if completion == "raise":
        raise RuntimeError("boom")
    if completion == "hang":
        while True:
            time.sleep(0.01)
    if completion == "nan":
        return math.nan
    if completion == "text":
        return "1.0"
    return float(completion == answer)


@pytest.mark.parametrize("isolate", [True, False])
def test_failures_score_zero_and_are_counted(isolate):
    runner = RewardRunner(flaky, timeout_s=0.5, isolate=isolate)
    completions = ["7", "raise", "nan", "text", "8", "7"] + (["hang", "7"] if isolate else [])
    t0 = time.perf_counter()
    scores = runner.score(["p"] * len(completions), completions, ["7"] * len(completions))
    runner.close()
    assert time.perf_counter() - t0 < 5
    expected = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0] + ([0.0, 1.0] if isolate else [])
    assert scores.rewards == expected  # after a hang the next call runs in a fresh worker
    assert scores.outcomes["raised"] == 1 and scores.outcomes["invalid"] == 2
    assert scores.outcomes["timeout"] == (1 if isolate else 0)
    assert scores.first_error.startswith("raised: RuntimeError: boom")


def ending(prompt, completion, answer):
    """Each completion names what the function does to its own process."""
    if completion == "sys.exit":
        sys.exit(3)
    if completion == "os._exit":
        os._exit(4)
    if completion in ("SIGKILL", "SIGTERM", "SIGINT"):
        os.kill(os.getpid(), signal.Signals[completion])
    if completion == "KeyboardInterrupt":
        raise KeyboardInterrupt
    if completion == "segfault":
        ctypes.string_at(0)
    return 1.0


@pytest.mark.parametrize(
    "completion, outcome, words",
    [
        ("sys.exit", "exited", "sys.exit(3)"),
        ("os._exit", "exited", "exited with status 4"),
        ("SIGKILL", "crashed", "killed by SIGKILL"),
        ("SIGTERM", "crashed", "killed by SIGTERM"),
        ("segfault", "crashed", "killed by SIGSEGV"),
        ("KeyboardInterrupt", "interrupted", "KeyboardInterrupt"),
    ],
)
def test_a_reward_that_ends_its_process_scores_zero_and_a_fresh_worker_goes_on(completion, outcome, words):
    runner = RewardRunner(ending, timeout_s=5.0)
    try:
        scores = runner.score(["p"] * 4, ["ok", completion, "ok", completion], ["a"] * 4)
    finally:
        runner.close()
    assert scores.rewards == [1.0, 0.0, 1.0, 0.0]  # the calls after each one are answered
    assert scores.outcomes == {"ok": 2, outcome: 2}
    assert scores.first_error.startswith(f"{outcome}: ") and words in scores.first_error, scores.first_error


def test_the_worker_ignores_the_runs_ctrl_c_and_keeps_no_handler_of_the_run(capfd):
    """The worker is forked inside the training loop, whose SIGINT / SIGTERM handlers it inherits: a
    Ctrl-C (it reaches the whole process group) must not stop it nor print the run's message there,
    and a SIGTERM ends it."""
    stop = StopSignal()
    runner = RewardRunner(ending, timeout_s=5.0)
    try:
        scores = runner.score(["p"] * 3, ["SIGINT", "SIGTERM", "ok"], ["a"] * 3)
    finally:
        runner.close()
        stop.restore()
    assert scores.rewards == [1.0, 0.0, 1.0] and scores.outcomes == {"ok": 2, "crashed": 1}
    assert not stop.requested  # the signals were the worker's own
    assert capfd.readouterr().out == ""


def test_builtin_reward_in_process():
    scores = RewardRunner(numeric, isolate=False).score(["q", "q"], ["#### 1/2", "#### 3"], ["0.5", "4"])
    assert scores.rewards == [1.0, 0.0] and scores.outcomes["ok"] == 2


def test_load_reward_refusals(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def good(prompt, completion, answer):\n    return 1.0\n\ndef two(a, b):\n    return 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:good")("p", "c", "a") == 1.0
    for spec, words in [
        ("my_rewards", "MODULE:FUNCTION"),
        ("no_such_module_x:f", "cannot import"),
        ("my_rewards:missing", "no function missing"),
        ("my_rewards:two", "does not take"),
    ]:
        with pytest.raises(ConfigError, match=words) as e:
            load_reward(spec)
        assert "\n" not in str(e.value)
    sys.modules.pop("my_rewards", None)
