"""Reward functions that raise, hang, return NaN or junk: reward 0, counted, and the run goes on."""

import math
import sys
import time

import pytest

from inkling_fp4.errors import ConfigError
from inkling_fp4.rl.rewards import numeric
from inkling_fp4.rl.scoring import RewardRunner, load_reward


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
