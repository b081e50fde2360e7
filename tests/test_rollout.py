"""fp4train rollout end to end on CPU: exact resume, the sampler's weights after each step, rewards
that fail, every metric logged, refusals."""

import json
import math
import sys

import pytest
import torch

from inkling_fp4.errors import UserError
from inkling_fp4.precision import gemm
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.train import rollout
from inkling_fp4.train.from_run_config import from_run_config
from test_run_dir import cli, one_line, pretrained, tree_hash

pytestmark = pytest.mark.slow

RL = ["rl.prompts_per_step=2", "rl.group_size=4", "train.batch_size=8", "train.micro_batch_size=4",
      "sampler.max_new_tokens=12", "rl.eval_prompts=4", "eval.every=3", "log.progress=false",
      "rl.levels=[1]", "train.checkpoint_every=0"]  # fmt: skip
METRICS = ("reward_mean", "reward_std", "accuracy", "completion_len_mean", "completion_len_max",
           "truncated_frac", "entropy", "clip_low", "clip_high", "zero_var_frac", "unsolved_frac",
           "solved_frac", "gen_tokens_per_s", "tokens_per_s", "time_sample_s", "time_score_s",
           "time_train_s", "time_refresh_s",
           "mismatch_k3", "mismatch_abs_mean", "mismatch_abs_max", "mismatch_ratio_min",
           "mismatch_ratio_mean", "mismatch_ratio_max", "mismatch_frac_over_cap")  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pretrained(tmp_path_factory, 4)


def rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_rl(base, run_dir, *overrides, resume=False):
    cfg = from_run_config(
        None, [*RL, *overrides], base, stage="rollout", default_recipe=rollout.DEFAULT_RECIPE
    )
    rollout.run(cfg, run_dir, resume=resume)
    return rows(run_dir)


def test_rollout_logs_every_metric_and_resumes_bit_exact(base, tmp_path):
    straight = train_rl(base, tmp_path / "a", "train.steps=6")
    steps = [r for r in straight if "reward_mean" in r]
    assert [r["step"] for r in steps] == list(range(1, 7)) and [r["rl_step"] for r in steps] == list(
        range(1, 7)
    )
    for r in steps:
        missing = [k for k in METRICS if k not in r]
        assert not missing, missing
        assert 0 <= r["reward_mean"] <= 1 and r["mismatch_k3"] >= 0 and r["completion_len_max"] <= 12
    evals = [r for r in straight if "eval_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3, 6] and all(0 <= r["eval_accuracy"] <= 1 for r in evals)
    train_rl(base, tmp_path / "b", "train.steps=6", "train.stop_after=3")
    parted = train_rl(base, tmp_path / "b", "train.steps=6", resume=True)

    def trained(rs):
        return [
            (r["step"], r["loss"], r["grad_norm"], r["reward_mean"], r["mismatch_k3"])
            for r in rs
            if "loss" in r
        ]

    assert trained(straight) == trained(parted)  # floats compared exactly


def test_sampler_weights_are_the_trainers_quantized_after_each_step(base, tmp_path, monkeypatch):
    """Before each RL step's sampling, every quantized layer holds W quantized as it stands after the
    previous optimizer step: the same BF16 block values a fresh quantization gives."""
    real = rollout.RolloutTask._sampler_now
    checked = []

    def checking(self):
        sampler = real(self)
        for m in self.trainer.model.modules():
            if isinstance(m, QuantLinear) and m.recipe is not None and m.recipe.fprop is not None:
                held = m.frozen_weight()
                assert held is not None, m.full_name
                with torch.no_grad():
                    fresh = gemm.quantize(m.weight, m.recipe.fprop.b, codes=False, values=True)
                    fresh_values = (
                        fresh.values if fresh.values is not None else fresh.q.block_values(torch.bfloat16)
                    )
                assert torch.equal(held.values, fresh_values), m.full_name
                checked.append(self.trainer.step_count)
        return sampler

    monkeypatch.setattr(rollout.RolloutTask, "_sampler_now", checking)
    train_rl(base, tmp_path / "w", "train.steps=3", "eval.every=0")
    assert sorted(set(checked)) == [0, 1, 2, 3]  # before steps 1, 2 and 3, and the final evaluation


def test_rewards_that_raise_or_return_nan_score_zero_and_the_run_goes_on(base, tmp_path, monkeypatch):
    (tmp_path / "bad_rewards.py").write_text(
        "import math\n\ncalls = {'n': 0}\n\n\ndef reward(prompt, completion, answer):\n"
        "    calls['n'] += 1\n    if calls['n'] % 3 == 0:\n        raise ValueError('bad reward')\n"
        "    return math.nan if calls['n'] % 3 == 1 else 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    got = train_rl(base, tmp_path / "r", "train.steps=2", "eval.every=2", "rl.reward=bad_rewards:reward")
    steps = [r for r in got if "reward_mean" in r]
    assert len(steps) == 2 and all(math.isfinite(r["reward_mean"]) for r in steps)
    failures = steps[0]["reward_failures"]
    assert failures["raised"] > 0 and failures["invalid"] > 0
    evals = [r for r in got if "eval_accuracy" in r]  # held-out scoring counts its failures too
    assert [r["step"] for r in evals] == [0, 2] and all(
        r["eval_reward_failures"]["raised"] > 0 and r["eval_reward_failures"]["invalid"] > 0 for r in evals
    )
    assert any(r.get("event") == "reward_failure" and "bad reward" in r["message"] for r in got)


ENDING_REWARD = """
import ctypes, os, signal, sys
from pathlib import Path

CALLS = Path(__file__).with_name("calls.txt")  # a file: each fresh worker starts from the parent's state


def reward(prompt, completion, answer):
    n = int(CALLS.read_text()) if CALLS.exists() else 0
    CALLS.write_text(str(n + 1))
    if n == 0:
        os._exit(1)
    if n == 1:
        sys.exit(2)
    if n in (2, 3):
        os.kill(os.getpid(), (signal.SIGKILL, signal.SIGTERM)[n - 2])
    if n == 4:
        ctypes.string_at(0)
    if n == 5:
        raise KeyboardInterrupt
    return 1.0
"""


def test_cli_rollout_survives_a_reward_that_ends_its_process(base, tmp_path, monkeypatch):
    """The first step's calls exit, are killed, segfault and raise KeyboardInterrupt: each scores 0,
    counted by kind; the run finishes (exit 0) with the base run untouched."""
    (tmp_path / "ending_rewards.py").write_text(ENDING_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = tree_hash(base)
    run = tmp_path / "r"
    code, out, err = cli(["rollout", "--from", str(base), "--reward", "ending_rewards:reward", "--run-dir",
                          str(run), *RL, "train.steps=2", "eval.every=0", "eval.at_start=false"])  # fmt: skip
    assert code == 0 and "Traceback" not in out + err and "Aborted" not in err, err
    got = rows(run)
    assert [r["reward_failures"] for r in got if "reward_failures" in r] == [
        {"exited": 2, "crashed": 3, "interrupted": 1}
    ]
    assert [r["step"] for r in got if "loss" in r] == [1, 2] and (run / "checkpoints" / "step_2").is_dir()
    assert "reward: 6 calls scored 0 (3 crashed, 2 exited, 1 interrupted; first exited: " in out
    assert tree_hash(base) == before
    sys.modules.pop("ending_rewards", None)


def test_one_rl_step_moves_log_p_the_way_of_the_advantages(base, tmp_path, monkeypatch):
    """End to end through sampling, scoring, the rows and the policy loss: after the first optimizer
    step the trainer's log p of completions with a positive advantage has risen and of those with a
    negative one has fallen (a reward with some spread in every group: the fraction of spaces)."""
    (tmp_path / "spaces.py").write_text(
        "def reward(prompt, completion, answer):\n"
        "    return completion.count(' ') / max(1, len(completion))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = {}
    queue, roll = rollout.RolloutTask._queue_mini_batches, rollout.RolloutTask._roll

    def queued(self, rows, correction):
        if "rows" not in seen:  # the trainer's log p before the first update
            seen["rows"] = rows
            seen["before"], _ = self._trainer_logp(rows, self.trainer.fwd_model)
        return queue(self, rows, correction)

    def rolled(self):
        if "rows" in seen and "after" not in seen:  # the second rollout: the first step is done
            seen["after"], _ = self._trainer_logp(seen["rows"], self.trainer.fwd_model)
        return roll(self)

    monkeypatch.setattr(rollout.RolloutTask, "_queue_mini_batches", queued)
    monkeypatch.setattr(rollout.RolloutTask, "_roll", rolled)
    train_rl(base, tmp_path / "r", "train.steps=2", "eval.every=0", "eval.at_start=false",
             "rl.reward=spaces:reward", "rl.prompts_per_step=4", "rl.group_size=8", "train.batch_size=32",
             "train.micro_batch_size=16", "sampler.max_new_tokens=16", "optim.lr=0.01",
             "train.warmup_steps=1")  # fmt: skip
    rows = seen["rows"]
    mask = rows.loss_mask.float()
    moved = ((seen["after"] - seen["before"]) * mask).sum(1) / mask.sum(1).clamp(min=1)  # [B] mean d log p
    adv = rows.advantages
    assert (adv > 0).sum() >= 4 and (adv < 0).sum() >= 4
    assert moved[adv > 0].mean() > 0.02 and moved[adv < 0].mean() < -0.02, moved
    assert torch.corrcoef(torch.stack([adv.float(), moved.float()]))[0, 1] > 0.5


def test_the_train_time_of_a_step_leaves_the_evaluation_out(base, tmp_path, monkeypatch):
    """time_train_s runs from the end of the last rollout's scoring to this rollout; an evaluation in
    between is not training time. The stage's clock is real time plus an hour per evaluation, so an
    evaluation counted as training would show as an hour, whatever the machine's load."""
    import time
    from types import SimpleNamespace

    hour, evaluations = 3600.0, []
    monkeypatch.setattr(
        rollout, "time", SimpleNamespace(perf_counter=lambda: time.perf_counter() + hour * len(evaluations))
    )
    evaluate = rollout.held_out_figures

    def slow(*args, **kwargs):
        evaluations.append(1)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(rollout, "held_out_figures", slow)
    got = train_rl(base, tmp_path / "r", "train.steps=3", "eval.every=1", "eval.at_start=false")
    steps = [r for r in got if "time_train_s" in r]
    assert len(steps) == 3 and len([r for r in got if "eval_accuracy" in r]) == 3 == len(evaluations)
    assert all(0 <= r["time_train_s"] < hour for r in steps), [r["time_train_s"] for r in steps]
    assert steps[1]["time_train_s"] > 0  # the recompute and the optimizer step are counted


def test_steps_without_signal_do_not_arm_the_monitor_against_the_next(base, tmp_path, monkeypatch):
    """Steps on which every group's rewards are equal have loss and gradient exactly 0. The monitor
    must neither call the first step with a signal after them a spike nor fall back to BF16: it keeps
    zero steps out of its history and tests the RL loss for finiteness only."""
    calls = []

    def reward(prompt, completion, answer):  # 0 for 4 steps (8 completions each), then 1, 0, 1, 0 ...
        calls.append(1)
        return float(len(calls) > 32 and len(calls) % 2)

    real = rollout.load_task

    def task(cfg, seed):
        data = real(cfg, seed)
        data.reward = reward
        return data

    monkeypatch.setattr(rollout, "load_task", task)
    got = train_rl(base, tmp_path / "r", "train.steps=8", "eval.every=0", "eval.at_start=false",
                   "monitor.warmup=2", "monitor.window=10")  # fmt: skip
    steps = [r for r in got if "reward_mean" in r]
    assert [r["grad_norm"] for r in steps[:4]] == [0.0] * 4 and all(r["grad_norm"] > 0 for r in steps[4:])
    events = [r["event"] for r in got if "event" in r]
    assert not [e for e in events if e in ("loss_spike", "grad_spike", "monitor_fallback")], events


def test_cli_refusals(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["rollout", *RL])
    assert code == 2 and "fp4train pretrain" in one_line(err)
    code, _, err = cli(["rollout", "--from", str(base), "--task", "arithmetic", "--data", "x.jsonl"])
    assert code == 2 and "--task and --data" in one_line(err)
    code, _, err = cli(["rollout", "--from", str(base), *RL, "train.batch_size=12"])
    assert code == 2 and "train.batch_size=8" in one_line(err) and not (tmp_path / "runs").exists()
    code, _, err = cli(["rollout", "--from", str(base), "--data", "missing.jsonl", *RL])
    assert code == 2 and "missing.jsonl" in one_line(err) and not (tmp_path / "runs").exists()
    code, _, err = cli(["rollout", "--from", str(base), "--reward", "nowhere:f", *RL])
    assert code == 2 and "cannot import nowhere" in one_line(err)


def test_cli_rollout_on_a_jsonl_task_with_resume(base, tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                            for i in range(20)))  # fmt: skip
    run = tmp_path / "qa"
    code, out, err = cli(["rollout", "--from", str(base), "--data", str(data), "--run-dir", str(run), *RL,
                          "train.steps=2", "eval.every=0"])  # fmt: skip
    assert code == 0, err
    assert "task: qa.jsonl, 18 train prompts, 2 held out" in out
    before = tree_hash(run)
    code, _, err = cli(["rollout", "--resume", "--run-dir", str(run), "rl.group_size=2"])
    assert code == 2 and "rl.group_size" in one_line(err) and tree_hash(run) == before
    with pytest.raises(UserError):
        rollout.check_config(
            from_run_config(
                None, [*RL, "rl.mini_batches=3"], base, stage="rollout", default_recipe=rollout.DEFAULT_RECIPE
            )
        )


def test_print_config_shows_the_rollout_config_and_writes_nothing(base, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(["rollout", "--from", str(base), "--print-config", "--task", "countdown"])
    assert code == 0, err
    assert "stage: rollout" in out and "task: countdown" in out and not (tmp_path / "runs").exists()


def test_packed_forwards_give_the_padded_runs_first_step(base, tmp_path):
    """rl.pack=true: the same rollouts (sampling comes first) and, through the packed forwards, the
    first step's loss and mismatch of the padded run up to float rounding (BF16 recipe, CPU)."""
    kw = ("train.steps=1", "eval.every=0", "eval.at_start=false", "precision.recipe=bf16")
    padded = [r for r in train_rl(base, tmp_path / "padded", *kw) if "loss" in r]
    packed = [r for r in train_rl(base, tmp_path / "packed", *kw, "rl.pack=true") if "loss" in r]
    assert packed[0]["reward_mean"] == padded[0]["reward_mean"]
    for key in ("loss", "entropy"):
        assert packed[0][key] == pytest.approx(padded[0][key], rel=1e-5, abs=1e-9), key
    # the mismatch is itself a BF16 rounding difference (~1e-4): the forwards' rounding moves it by a
    # part in 1e4 to 1e3 of itself, a wrong packing by orders of magnitude
    assert packed[0]["mismatch_abs_mean"] == pytest.approx(padded[0]["mismatch_abs_mean"], rel=1e-2)


def test_one_forward_a_step_gives_the_recompute_passs_figures_and_update(base, tmp_path, monkeypatch):
    """With one update per rollout the training forward's own log p (detached) is the old policy, the
    correction's trainer log p and the source of the mismatch and entropy figures: a step runs the
    model once per micro batch instead of twice, and logs and trains what the separate recompute
    pass gave (a cap so tight that the correction reweights tokens; a reward with spread in every
    group, so every step has a gradient)."""
    (tmp_path / "spaces.py").write_text(
        "def reward(prompt, completion, answer):\n"
        "    return completion.count(' ') / max(1, len(completion))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ("train.steps=3", "eval.every=0", "eval.at_start=false", "rl.correction=tis", "rl.tis_cap=1.00001",
            "rl.reward=spaces:reward", "optim.lr=0.01", "train.warmup_steps=1")  # fmt: skip
    calls = {"n": 0}
    forward = rollout.HybridLM.forward

    def counted(self, *a, **k):
        calls["n"] += 1
        return forward(self, *a, **k)

    monkeypatch.setattr(rollout.HybridLM, "forward", counted)
    one = train_rl(base, tmp_path / "one", *args)
    one_calls, calls["n"] = calls["n"], 0
    init = rollout.RolloutTask.__init__

    def recomputing(self, *a, **k):  # the separate recompute pass the default leaves out
        init(self, *a, **k)
        self.loss_fn.correct_from_forward = False

    monkeypatch.setattr(rollout.RolloutTask, "__init__", recomputing)
    two = train_rl(base, tmp_path / "two", *args)
    micro_batches = 3 * 2  # steps x (train.batch_size / train.micro_batch_size)
    assert calls["n"] - one_calls == micro_batches  # the recompute's forwards, and only those
    steps_one, steps_two = ([r for r in rs if "reward_mean" in r] for rs in (one, two))
    assert len(steps_one) == len(steps_two) == 3
    assert all(r["mismatch_frac_over_cap"] > 0 and r["grad_norm"] > 0 for r in steps_one)
    for a, b in zip(steps_one, steps_two, strict=True):
        for key in ("loss", "grad_norm", "entropy", "reward_mean", *(k for k in METRICS if "mismatch" in k)):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key


def test_the_kl_to_the_start_reads_one_sampled_completion_per_problem(base, tmp_path, monkeypatch):
    """Its two forwards (policy and start) take the first of each problem's k samples: an unbiased k3
    estimate at the size of the greedy batch; 0 before any update, above 0 after some."""
    from inkling_fp4.train import rollout_eval

    seen, kl = [], rollout_eval._kl_to_start

    def counted(completions, prompts, *args):
        seen.append((len(completions), len(prompts), prompts))
        return kl(completions, prompts, *args)

    monkeypatch.setattr(rollout_eval, "_kl_to_start", counted)
    logged = train_rl(base, tmp_path / "r", "train.steps=3", "eval.at_start=true", "rl.eval_samples=3",
                      "optim.lr=0.01")  # fmt: skip
    evals = [r for r in logged if "eval_kl_to_start" in r]
    assert [r["step"] for r in evals] == [0, 3] and len(seen) == 2
    assert all(n == m == 4 and len(set(map(tuple, p))) == 4 for n, m, p in seen)  # 4 distinct problems
    assert evals[0]["eval_kl_to_start"] == 0.0 and evals[1]["eval_kl_to_start"] > 0.0


def test_sampled_figures_only_at_the_ends_when_asked(base, tmp_path, monkeypatch):
    """rl.eval_samples_at=ends: the evaluations at step 0 and at the last step sample (pass@k, the KL
    to the start), those between give greedy pass@1 alone and build no starting policy."""
    from inkling_fp4.train import rollout, rollout_eval

    samples = []
    figures = rollout_eval.held_out_figures

    def counted(sampler, held, encode, runner, dist, k, kl_models, *args):
        samples.append((k, kl_models is not None))
        return figures(sampler, held, encode, runner, dist, k, kl_models, *args)

    monkeypatch.setattr(rollout, "held_out_figures", counted)
    logged = train_rl(base, tmp_path / "r", "train.steps=4", "eval.every=2", "eval.at_start=true",
                      "rl.eval_samples=2", "rl.eval_samples_at=ends")  # fmt: skip
    evals = {r["step"]: r for r in logged if "eval_accuracy" in r}
    assert sorted(evals) == [0, 2, 4] and samples == [(2, True), (0, False), (2, True)]
    assert ["eval_pass_at_k" in evals[s] for s in (0, 2, 4)] == [True, False, True]
    assert "eval_kl_to_start" in evals[4] and "eval_kl_to_start" not in evals[2]


PARITY_REWARD = """
def reward(prompt, completion, answer):
    if int(float(answer)) % 2 == 0:
        return 0.0  # no signal: every completion of these prompts scores the same
    return float(len(completion) % 2)
"""


def test_dynamic_sampling_trains_the_groups_with_a_signal_first(base, tmp_path, monkeypatch):
    """rl.oversample=2: each step samples 4 prompts' groups and trains 2, those with unequal rewards
    first, so the trained share without signal is what is left once the signal groups run out; the
    step's figures are of all 4, and a resumed run draws what the uninterrupted one did."""
    (tmp_path / "parity_rewards.py").write_text(PARITY_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["train.steps=4", "rl.oversample=2", "rl.reward=parity_rewards:reward", "eval.every=0"]
    straight = train_rl(base, tmp_path / "a", *args)
    steps = [r for r in straight if "reward_mean" in r]
    assert len(steps) == 4
    S, P = 4, 2
    for r in steps:
        no_signal = round(r["zero_var_frac"] * S)
        assert r["trained_zero_var_frac"] * P == max(0, no_signal - (S - P)), r
    assert any(0 < r["zero_var_frac"] < 1 for r in steps)  # the choice mattered somewhere
    train_rl(base, tmp_path / "b", *args, "train.stop_after=2")
    parted = train_rl(base, tmp_path / "b", *args, resume=True)

    def trained(rs):
        keys = ("step", "loss", "reward_mean", "trained_zero_var_frac")
        return [tuple(r[k] for k in keys) for r in rs if "loss" in r]

    assert trained(straight) == trained(parted)


@pytest.mark.parametrize("masked", [False, True])
def test_completions_cut_by_the_budget_in_the_loss_and_the_baseline_or_out_of_both(
    masked, base, tmp_path, monkeypatch
):
    """By default a completion the token budget cut is scored like any other: its loss and its place in
    its group's baseline. Under rl.mask_truncated=true it has neither, so it lifts no finished answer;
    the finished ones' advantages are those of their group without it."""
    (tmp_path / "spread_rewards.py").write_text(
        "def reward(prompt, completion, answer):\n    return (sum(map(ord, completion)) % 5) / 4\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    seen, cut = [], []
    queue = rollout.RolloutTask._queue_mini_batches
    monkeypatch.setattr(
        rollout.RolloutTask,
        "_queue_mini_batches",
        lambda self, rows, correction: seen.append(rows) or queue(self, rows, correction),
    )
    gather = rollout.ranks.all_completions
    monkeypatch.setattr(rollout.ranks, "all_completions",
                        lambda *a: (lambda out: cut.append(out[2]) or out)(gather(*a)))  # fmt: skip
    real, calls = rollout.grpo.group_advantages, []
    monkeypatch.setattr(rollout.grpo, "group_advantages",
                        lambda r, scale, **kw: calls.append((r, kw)) or real(r, scale, **kw))  # fmt: skip
    train_rl(base, tmp_path / "r", "train.steps=3", "eval.every=0", "eval.at_start=false",
             "rl.reward=spread_rewards:reward", "sampler.max_new_tokens=3", "sampler.stop=[e]",
             "rl.group_size=8", "rl.prompts_per_step=4", "train.batch_size=32", "train.micro_batch_size=16",
             *(["rl.mask_truncated=true"] if masked else []))  # fmt: skip
    mixed = 0
    for rows, (rewards_PG, kw), cut_S in zip(seen, calls, cut, strict=True):
        finished_PG = ~cut_S.view(rewards_PG.shape)
        adv_PG = rows.advantages.view(rewards_PG.shape)
        if not masked:
            assert kw["counted_NG"] is None and rows.loss_mask.any(1).all()
            assert torch.equal(adv_PG, real(rewards_PG, "group"))
            mixed += int((adv_PG[~finished_PG] != 0).sum())  # cut completions that move the policy
            continue
        assert torch.equal(rows.loss_mask.any(1).view(rewards_PG.shape), finished_PG)  # a cut one: no loss
        assert torch.equal(kw["counted_NG"], finished_PG)
        assert torch.equal(adv_PG[~finished_PG], torch.zeros(int((~finished_PG).sum())))
        for i in range(rewards_PG.shape[0]):
            alone = real(rewards_PG[i, finished_PG[i]][None], "group")[0]
            assert torch.allclose(adv_PG[i, finished_PG[i]], alone, atol=1e-6)
            mixed += bool(finished_PG[i].any() and not finished_PG[i].all() and alone.abs().sum() > 0)
    assert mixed >= 2  # cut completions with an advantage / groups of cut and finished with a signal


def test_the_log_says_rl_steps_run_eagerly_where_graphs_would_be_on(base, tmp_path, monkeypatch):
    """RL's loss is its own (Trainer.step replays graphs only for the model's loss): on a GPU where
    nothing else blocks a graph, the log says the steps run eagerly, not that they are replayed."""
    from inkling_fp4.trainer import trainer

    monkeypatch.setattr(trainer, "graph_blocker", lambda *args: None)  # as on one GPU
    got = train_rl(base, tmp_path / "g", "train.steps=1", "train.cuda_graph=true", "eval.at_start=false")
    events = [r["message"] for r in got if r.get("event") == "cuda_graph"]
    assert events == ["cuda graph: step 0: off: the stage's own loss runs eagerly (its batches change shape "
                      "from step to step)"]  # fmt: skip


LEVEL_REWARD = """
import re

def reward(prompt, completion, answer):
    if any(int(n) >= 10 for n in re.findall(r"\\d+", prompt.split(".")[0])):
        return 0.0  # level 2 (two-digit operands): no signal
    return float(len(completion) % 2)
"""


def test_the_signal_curriculum_moves_to_the_level_with_a_signal_and_resumes_exactly(
    base, tmp_path, monkeypatch
):
    """rl.curriculum=signal over arithmetic levels 1 and 2, level 2 never rewarded: the first step's
    mix is even, later steps draw more level 1, every step logs the mix; a resumed run draws and
    trains what the uninterrupted one did. One level or a jsonl task is refused before anything runs."""
    (tmp_path / "level_rewards.py").write_text(LEVEL_REWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["train.steps=6", "rl.levels=[1,2]", "rl.curriculum=signal", "rl.prompts_per_step=8",
            "rl.group_size=2", "train.batch_size=16", "train.micro_batch_size=8",
            "rl.reward=level_rewards:reward", "eval.every=0"]  # fmt: skip
    straight = train_rl(base, tmp_path / "a", *args)
    steps = [r for r in straight if "reward_mean" in r]
    assert [r["level1_frac"] for r in steps][0] == 0.5
    assert all(r["level1_frac"] + r["level2_frac"] == 1.0 and r["zero_var_frac_level2"] == 1.0 for r in steps)
    assert steps[-1]["level1_frac"] >= 0.75
    train_rl(base, tmp_path / "b", *args, "train.stop_after=3")
    parted = train_rl(base, tmp_path / "b", *args, resume=True)

    def trained(rs):
        keys = ("step", "loss", "reward_mean", "level1_frac")
        return [tuple(r[k] for k in keys) for r in rs if "loss" in r]

    assert trained(straight) == trained(parted)
    for bad in (["rl.levels=[1]"], ["rl.task=" + str(tmp_path / "task.jsonl")]):
        with pytest.raises(UserError, match="set rl.curriculum=none"):
            train_rl(base, tmp_path / "c", *args, *bad)
        assert not (tmp_path / "c").exists()
