"""RL learns: a learning curve over a run, not the direction of one step.

A tiny, barely pretrained model is rewarded when its completion starts with a character whose code
point is a multiple of 3: about a third of its first tokens do at the start, and the policy can move
its first-token distribution towards them in a few steps. Through the whole stage (sampling, scoring
in the reward worker, advantages, the NVFP4 policy loss, AdamW), the mean reward of the last steps
must be well above the first steps'. The same run with the advantages' sign flipped must fall, and
with the advantages zeroed must stay where it was: a curve that rises whatever the gradient says would
be no evidence.
"""

import json

import pytest

from inkling_fp4.rl import grpo
from inkling_fp4.train import rollout
from inkling_fp4.train.from_run_config import from_run_config
from model_helpers import SMALL_RUN
from test_run_dir import cli

pytestmark = pytest.mark.slow

STEPS = 12
RL = ["rl.prompts_per_step=16", "rl.group_size=8", "train.batch_size=128", "train.micro_batch_size=128",
      "sampler.max_new_tokens=2", "sampler.batch_size=128", "rl.mask_truncated=false", "rl.levels=[1]",
      "rl.reward=first_char:reward", "optim.lr=0.03", "train.warmup_steps=1", "eval.every=0",
      "eval.at_start=false", "train.checkpoint_every=0", "log.progress=false", f"train.steps={STEPS}",
      "monitor.enabled=false"]  # fmt: skip
REWARD = (
    "def reward(prompt, completion, answer):\n"
    "    return float(completion[:1] != '' and ord(completion[0]) % 3 == 0)\n"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("learns")
    (root / "first_char.py").write_text(REWARD)
    run = root / "pre"
    code, _, err = cli(["pretrain", "--run-dir", str(run), *SMALL_RUN, f"data.cache_dir={root / 'cache'}",
                        "train.steps=2", "eval.every=0"])  # fmt: skip
    assert code == 0, err
    return run


def curve(base, run_dir, monkeypatch, advantages=None) -> list[float]:
    monkeypatch.syspath_prepend(str(base.parent))
    if advantages is not None:
        real = grpo.group_advantages
        monkeypatch.setattr(grpo, "group_advantages", lambda r, scale, **kw: advantages(real(r, scale, **kw)))
    cfg = from_run_config(None, RL, base, stage="rollout", default_recipe=rollout.DEFAULT_RECIPE)
    rollout.run(cfg, run_dir)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward_mean"] for r in rows if "reward_mean" in r]


def first_last(rewards: list[float], n: int = 4) -> tuple[float, float]:
    return sum(rewards[:n]) / n, sum(rewards[-n:]) / n


def test_rl_raises_the_reward_over_a_run(base, tmp_path, monkeypatch):
    first, last = first_last(curve(base, tmp_path / "rl", monkeypatch))
    assert 0.15 < first < 0.55 and last > first + 0.3, (first, last)


@pytest.mark.parametrize("mutation", ["flipped", "zeroed"])
def test_the_curve_follows_the_gradient(base, tmp_path, monkeypatch, mutation):
    change = (lambda a: -a) if mutation == "flipped" else (lambda a: 0 * a)
    first, last = first_last(curve(base, tmp_path / mutation, monkeypatch, change))
    if mutation == "flipped":
        assert last < first - 0.1, (first, last)
    else:
        assert abs(last - first) < 0.15, (first, last)
