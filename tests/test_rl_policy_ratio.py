"""The ratio and the corrections of an RL step as TRL takes them, end to end through fp4train rollout:
the trainer's log p is of the distribution the sampler drew from (logits / T), the on-policy ratio is
exactly 1 (delayed FP8 scaling included), the bypass mode weights by the ratio once, and settings
that make no sense are refused in one line."""

import math

import pytest
import torch

from inkling_fp4.rl import grpo
from inkling_fp4.train import rollout
from test_rollout import RL, base, train_rl  # noqa: F401 (base: the module's tiny pretrain run)
from test_run_dir import cli, one_line, tree_hash

pytestmark = pytest.mark.slow


def test_at_a_temperature_the_trainer_reads_the_samplers_distribution(base, tmp_path):  # noqa: F811
    """At T = 0.7 under BF16 the trainer's and the sampler's log p of each sampled token agree as they
    do at T = 1 (a recompute at T = 1 was off by factors of 2 to 88 in the ratio)."""
    for T in (1.0, 0.7):
        steps = [r for r in train_rl(base, tmp_path / f"t{T}", "train.steps=2", f"sampler.temperature={T}",
                                     "precision.recipe=bf16") if "mismatch_k3" in r]  # fmt: skip
        for r in steps:
            assert r["mismatch_k3"] < 1e-3, (T, r["mismatch_k3"])
            assert 0.9 < r["mismatch_ratio_min"] <= r["mismatch_ratio_max"] < 1.1, (T, r)


def test_the_on_policy_ratio_is_one_under_delayed_fp8(base, tmp_path, monkeypatch):  # noqa: F811
    """One update per rollout: the old log p is the training forward's own, so rho = 1 exactly even
    where a no-grad forward scales otherwise (delayed FP8); several updates per rollout are refused."""
    seen = []
    real = grpo.log_ratio

    def record(logp, old, mask, level):
        out = real(logp, old, mask, level)
        seen.append(out.detach().abs().max().item())
        return out

    monkeypatch.setattr(grpo, "log_ratio", record)
    fp8 = ["precision.recipe=fp8-tensorwise", "precision.fp8_scaling=delayed"]
    train_rl(base, tmp_path / "fp8", "train.steps=3", *fp8)
    assert len(seen) >= 3 and max(seen) == 0.0, seen
    with pytest.raises(rollout.ConfigError, match="fp8_scaling=delayed"):
        train_rl(base, tmp_path / "two", "rl.mini_batches=2", "train.batch_size=4", *fp8)


def test_bypass_weights_by_the_ratio_once(base, tmp_path, monkeypatch):  # noqa: F811
    """rl.old_logp=sampler: the clipped ratio is p_trainer / p_sampler already, so mask's correction
    only drops tokens (weights 0 or 1) and multiplies no second ratio in."""
    corrections = []
    queue = rollout.RolloutTask._queue_mini_batches

    def queued(self, rows, correction):
        corrections.append(correction[rows.loss_mask])
        return queue(self, rows, correction)

    monkeypatch.setattr(rollout.RolloutTask, "_queue_mini_batches", queued)
    train_rl(base, tmp_path / "bypass", "train.steps=2", "rl.old_logp=sampler", "rl.correction=mask")
    values = torch.cat(corrections)
    assert values.numel() > 0 and set(values.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rl.old_logp=sampler", "rl.correction=tis"], "weight by the ratio twice"),
        (["sampler.temperature=0"], "samples greedily"),
    ],
)
def test_settings_without_sense_are_one_line(base, tmp_path, overrides, expected):  # noqa: F811
    before = tree_hash(base)
    code, _, err = cli(["rollout", "--from", str(base), "--run-dir", str(tmp_path / "r"), *RL, *overrides])
    assert code == 2 and expected in one_line(err)
    assert not (tmp_path / "r").exists() and tree_hash(base) == before


def test_the_run_ends_with_its_summary_line(base, tmp_path):  # noqa: F811
    code, out, err = cli(["rollout", "--from", str(base), "--run-dir", str(tmp_path / "r"), *RL,
                          "train.steps=3", "rl.eval_samples=2"])  # fmt: skip
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("rl: "))
    assert "held-out greedy pass@1" in line and "(step 0 -> 3, 4 problems)" in line and "pass@2" in line
    assert "reward" in line and "groups without signal" in line and "none right" in line
    assert not math.isnan(float(line.split("pass@1 ")[1].split(" ")[0]))
