"""The held-out figures per level: each level's greedy accuracy and pass@k over its own problems, and
the whole the problem-weighted mean of the levels (a mixed set can hide a level at its ceiling)."""

import dataclasses
from types import SimpleNamespace

import numpy as np

from inkling_fp4 import distributed as D
from inkling_fp4.rl.prompts import Prompt
from inkling_fp4.rl.scoring import RewardRunner
from inkling_fp4.train.rollout_eval import held_out_figures, summary_line


@dataclasses.dataclass
class _Cfg:
    temperature: float = 1.0


class _ScriptedSampler:
    """Answers prompt i right greedily when ``greedy[i]``, its j-th sample right when ``sampled[i, j]``;
    a wrong answer of an odd-numbered prompt runs into the token budget (8 tokens, else 2 + i % 3)."""

    def __init__(self, prompts: list[Prompt], greedy: np.ndarray, sampled: np.ndarray):
        self.cfg, self.prompts, self.greedy, self.sampled = _Cfg(), prompts, greedy, sampled

    def generate(self, token_prompts, seed=None):
        k = len(token_prompts) // len(self.prompts)
        out = []
        for n, _ in enumerate(token_prompts):
            i, j = divmod(n, k)
            right = self.greedy[i] if self.cfg.temperature == 0.0 else self.sampled[i, j]
            cut = not right and i % 2 == 1
            out.append(SimpleNamespace(text=self.prompts[i].answer if right else "wrong",
                                       tokens=[0] * (8 if cut else 2 + i % 3),
                                       finish_reason="length" if cut else "eos"))  # fmt: skip
        return out


def test_each_levels_figures_are_of_its_own_problems():
    rng = np.random.default_rng()
    n, k = 40, 4
    levels = rng.integers(1, 4, n)
    levels[:3] = [1, 2, 3]  # every level present
    held = [Prompt(f"p{i}", f"a{i}", int(lv)) for i, lv in enumerate(levels)]
    greedy, sampled = rng.random(n) < 0.4, rng.random((n, k)) < 0.3
    runner = RewardRunner(lambda prompt, completion, answer: float(completion == answer), isolate=False)
    figures = held_out_figures(_ScriptedSampler(held, greedy, sampled), held, lambda t: [1], runner,
                               D.DistInfo(), k)  # fmt: skip
    for lv in (1, 2, 3):
        mine = levels == lv
        assert figures[f"eval_accuracy_level{lv}"] == greedy[mine].mean()
        assert figures[f"eval_pass_at_k_level{lv}"] == sampled[mine].any(1).mean()
    shares = [(levels == lv).mean() for lv in (1, 2, 3)]
    whole = sum(s * figures[f"eval_accuracy_level{lv}"] for s, lv in zip(shares, (1, 2, 3), strict=True))
    assert abs(whole - figures["eval_accuracy"]) < 1e-12
    cut = ~greedy & (np.arange(n) % 2 == 1)  # the greedy answers the budget cut, and their lengths
    assert figures["eval_truncated"] == cut.mean()
    assert figures["eval_completion_len"] == np.where(cut, 8, 2 + np.arange(n) % 3).mean()

    line = summary_line([{"step": 0, **figures}, {"step": 1, "reward_mean": 0.5, "zero_var_frac": 0.5},
                         {"step": 1, **figures}])  # fmt: skip
    assert f"by level 1: {figures['eval_accuracy_level1']:.3f} -> " in line


def test_one_level_or_none_adds_no_per_level_figure():
    held = [Prompt("p0", "a0", 2), Prompt("p1", "a1", 2)]
    plain = [Prompt("p0", "a0"), Prompt("p1", "a1")]
    runner = RewardRunner(lambda prompt, completion, answer: float(completion == answer), isolate=False)
    for prompts in (held, plain):
        sampler = _ScriptedSampler(prompts, np.array([True, False]), np.ones((2, 2), bool))
        figures = held_out_figures(sampler, prompts, lambda t: [1], runner, D.DistInfo(), 2)
        assert figures["eval_accuracy"] == 0.5
        assert not [key for key in figures if "level" in key]
