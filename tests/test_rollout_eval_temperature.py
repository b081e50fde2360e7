"""rl.eval_temperature: the held-out sampled figures are drawn at it (the rollouts' when unset), the
greedy ones at 0, and the sampler keeps its own temperature for the rollouts after."""

import dataclasses
from types import SimpleNamespace

import pytest

from inkling_fp4 import distributed as D
from inkling_fp4.rl.config import RLConfig
from inkling_fp4.rl.prompts import Prompt
from inkling_fp4.rl.scoring import RewardRunner
from inkling_fp4.train.rollout_eval import held_out_figures


@dataclasses.dataclass
class _Cfg:
    temperature: float


class _RecordingSampler:
    """Answers right exactly when it samples at ``right_at``; records each call's temperature."""

    def __init__(self, temperature: float, right_at: float):
        self.cfg, self.right_at, self.calls = _Cfg(temperature), right_at, []

    def generate(self, token_prompts, seed=None):
        self.calls.append(self.cfg.temperature)
        right = self.cfg.temperature == self.right_at
        return [
            SimpleNamespace(text="a" if right else "wrong", tokens=[0], finish_reason="eos")
            for _ in token_prompts
        ]


@pytest.mark.parametrize("eval_temperature, drawn_at", [(None, 0.5), (1.0, 1.0), (0.7, 0.7)])
def test_sampled_figures_are_drawn_at_the_eval_temperature(eval_temperature, drawn_at):
    held = [Prompt("p0", "a"), Prompt("p1", "a")]
    runner = RewardRunner(lambda prompt, completion, answer: float(completion == answer), isolate=False)
    sampler = _RecordingSampler(temperature=0.5, right_at=drawn_at)
    figures = held_out_figures(sampler, held, lambda t: [1], runner, D.DistInfo(), 3,
                               temperature=eval_temperature)  # fmt: skip
    assert sampler.calls == [0.0, drawn_at]  # greedy first, then the k samples
    assert figures["eval_pass1_sampled"] == 1.0 and figures["eval_accuracy"] == 0.0
    assert sampler.cfg.temperature == 0.5  # the rollouts' temperature is left as it was


def test_a_non_positive_eval_temperature_is_refused():
    with pytest.raises(ValueError, match="rl.eval_temperature must be > 0"):
        RLConfig(eval_temperature=0.0)
    assert RLConfig(eval_temperature=None).eval_temperature is None
