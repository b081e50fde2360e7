"""fp4train rollout in two processes on the CPU (gloo) through torchrun: each rank samples its share of
every step's prompts, both train the same policy, the logged figures are those of the whole batch,
the first step is one process's step over the same global batch, and a resumed run continues
exactly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inkling_fp4.distributed import DistInfo
from inkling_fp4.errors import UserError
from inkling_fp4.interop.load_run import load_run_checkpoint, run_config
from inkling_fp4.rl import grpo, mismatch
from inkling_fp4.rl.policy_loss import PolicyLossFn
from inkling_fp4.rl.prompts import PromptStream, load_task
from inkling_fp4.rl.rollout_batch import RolloutBatch
from inkling_fp4.runs.checkpoint import load_model_tensors
from inkling_fp4.train import rollout
from inkling_fp4.train.from_run_config import from_run_config
from inkling_fp4.trainer.trainer import Trainer
from test_rollout import METRICS, rows
from test_rollout import base as base  # the module's 4-step pretrain run (a fixture)

pytestmark = pytest.mark.slow

HELPER = Path(__file__).with_name("rollout_ranks.py")
P, G = 4, 4
# the per-sequence aggregation and the batch std need the other rank's rows; completions of several
# lengths (a stop string) make a rank's own token count per row differ from the mini-batch's; two
# mini-batches of two micro batches per rank; the final evaluation's 3 held-out problems split 1 / 2
RL = [f"rl.prompts_per_step={P}", f"rl.group_size={G}", "rl.mini_batches=2", "train.batch_size=8",
      "train.micro_batch_size=2", "rl.aggregation=seq-mean-token-mean", "rl.scale_rewards=batch",
      "sampler.max_new_tokens=12", "sampler.stop=[e]", "rl.eval_prompts=3", "eval.every=0",
      "eval.at_start=false", "log.progress=false", "train.checkpoint_every=0", "rl.mask_truncated=false",
      "rl.reward=spread_rewards:reward"]  # fmt: skip
STEPS = 4  # optimizer steps: 2 RL steps of 2 mini-batches


def _torchrun(tmp, *args, record: Path | None = None):
    """``fp4train rollout ARGS`` in two processes (recording each rank's doings under ``record``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += [str(HELPER), str(record)] if record is not None else ["-m", "inkling_fp4"]
    paths = [str(tmp), *filter(None, [os.environ.get("PYTHONPATH")])]  # the task's reward module
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run([*cmd, "rollout", *args], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """A jsonl task of distinct prompts (so the ranks' shares can be told apart) and a reward that
    spreads within a group (so advantages, loss and gradients are not 0)."""
    tmp = tmp_path_factory.mktemp("task")
    (tmp / "qa.jsonl").write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)})
                                          + "\n" for i in range(40)))  # fmt: skip
    (tmp / "spread_rewards.py").write_text(
        "def reward(prompt, completion, answer):\n    return (sum(map(ord, completion)) % 5) / 4\n"
    )
    return tmp


@pytest.fixture(scope="module")
def two_ranks(base, task_dir, tmp_path_factory):
    """A 2-process run of STEPS steps and each rank's record of it."""
    run, record = tmp_path_factory.mktemp("runs") / "ddp", tmp_path_factory.mktemp("record")
    data = ["--data", str(task_dir / "qa.jsonl")]
    out = _torchrun(task_dir, "--from", str(base), *data, "--run-dir", str(run), *RL, f"train.steps={STEPS}",
                    record=record)  # fmt: skip
    assert out.count("run directory:") == 1 and "(2 prompts per process)" in out  # rank 0 speaks
    ranks = [torch.load(record / f"rank{r}.pt") for r in (0, 1)]
    return run, ranks


def test_two_processes_train_the_same_policy_on_their_shares_of_the_prompts(two_ranks, task_dir, monkeypatch):
    run, (r0, r1) = two_ranks
    # (a) one policy: the same weights on both ranks at every sampling (each RL step, the final
    # evaluation) and at the end, and they did change
    assert len(r0["sampled_with"]) == 3 and r0["sampled_with"] == r1["sampled_with"]
    assert r0["final"] == r1["final"] and r0["final"] != r0["sampled_with"][0]
    # (b) the ranks' shares are disjoint and together the one process's prompts of each step, in order
    monkeypatch.syspath_prepend(str(task_dir))
    cfg = run_config(run)
    stream = PromptStream(load_task(cfg.rl, cfg.train.seed).train, cfg.train.seed)
    for mine, theirs in zip(r0["prompts"], r1["prompts"], strict=True):
        assert len(mine) == len(theirs) == P // 2 and not set(mine) & set(theirs)
        assert mine + theirs == [p.text for p in stream.take(P)]
    # ... each with its own samples: the generators of the ranks' sampling seeds differ at every step
    assert len(r0["draws"]) == 2 and all(a != b for a, b in zip(r0["draws"], r1["draws"], strict=True))
    # (c) every figure, once per step (rank 0 writes), of the whole batch: the rewards of both ranks,
    # the advantages scaled by their std
    logged = rows(run)
    rl_steps = [r for r in logged if "reward_mean" in r]
    assert [r["step"] for r in logged if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["rl_step"] for r in rl_steps] == [1, 2]
    for r in rl_steps:
        missing = [k for k in METRICS if k not in r]
        assert not missing, missing
    for k, r in enumerate(rl_steps):
        rewards_PG = torch.tensor(r0["rewards"][k] + r1["rewards"][k]).view(P, G)
        assert r["reward_mean"] == pytest.approx(float(rewards_PG.mean()), rel=1e-6)
        assert r["reward_std"] == pytest.approx(float(rewards_PG.std()), rel=1e-6)
        assert r["zero_var_frac"] == float(grpo.zero_variance_groups(rewards_PG).float().mean())
        right_PG = rewards_PG >= 1.0
        assert r["unsolved_frac"] == float((~right_PG.any(1)).float().mean())
        assert r["solved_frac"] == float(right_PG.all(1).float().mean())
        advantages = torch.cat([r0["advantages"][k], r1["advantages"][k]])
        assert torch.equal(advantages, grpo.group_advantages(rewards_PG, "batch").view(-1))
        # the mismatch and entropy figures over both ranks' completion tokens, as one [1, N] batch
        t, s = (torch.cat([r0["mismatch"][k][i], r1["mismatch"][k][i]])[None] for i in (0, 1))
        whole = mismatch.stats_from_parts(*mismatch.mismatch_parts(t, s, torch.ones_like(t, dtype=torch.bool),
                                                                   cfg.rl.tis_cap))  # fmt: skip
        assert len(whole) > 3 and all(r[f"mismatch_{key}"] == pytest.approx(v, rel=1e-5, abs=1e-9)
                                      for key, v in whole.items())  # fmt: skip
        entropy = torch.cat([r0["entropy"][k], r1["entropy"][k]])
        assert r["entropy"] == pytest.approx(float(entropy.double().mean()), rel=1e-5)
    evals = [r for r in logged if "eval_accuracy" in r]
    assert [(r["step"], r["eval_problems"]) for r in evals] == [(STEPS, 3)]


def test_the_first_step_is_one_processs_step_over_the_same_global_batch(two_ranks, tmp_path):
    """Both ranks' micro batches of step 1 (one mini-batch), their token weights computed anew as one
    process computes them over the whole mini-batch, trained in one process from the same weights:
    the same loss up to the order of the float sums (the trainer divides by the global token count,
    the seq-mean weights count both ranks' rows); the gradient's norm up to that and to stochastic
    rounding, which draws from another stream on rank 1."""
    run, (r0, r1) = two_ranks
    cfg = run_config(run)
    batches = [RolloutBatch(**b) for b in r0["first_step"] + r1["first_step"]]
    weights, corrections = one_process_weights(batches, cfg.rl)
    assert all(torch.allclose(b.weights, w, rtol=1e-6) for b, w in zip(batches, weights, strict=True))
    assert all(torch.allclose(b.correction, c, rtol=1e-6) for b, c in zip(batches, corrections, strict=True))
    for b, w, c in zip(batches, weights, corrections, strict=True):
        b.weights, b.correction = w, c
    _, base_model, tokenizer, _ = load_run_checkpoint(cfg.init_from)
    model = rollout.HybridLM(cfg.model)
    load_model_tensors(model, base_model.state_dict(), torch.device("cpu"))
    trainer = Trainer(cfg, tmp_path, DistInfo(), model)
    trainer.build()
    trainer.open_log([], [])
    assert len(batches) == trainer.accum == 4
    on_policy = rollout.updates_per_rollout(cfg.rl) == 1 and cfg.rl.old_logp == "trainer"
    pack = (cfg.data.seq_len, tokenizer.pad or 0) if cfg.rl.pack else None  # as the run's forward reads them
    one = trainer.step(batches, PolicyLossFn(cfg.rl, cfg.sampler.temperature, on_policy, pack))
    trainer.close()
    two = next(r for r in rows(run) if r.get("step") == 1 and "loss" in r)
    assert abs(one.loss) > 1e-4 and one.loss == pytest.approx(two["loss"], rel=1e-5)
    assert one.grad_norm == pytest.approx(two["grad_norm"], rel=1e-3)


def one_process_weights(batches: list[RolloutBatch], rl) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each micro batch's token weights [b, L_b] as one process gives the mini-batch they make up: the
    aggregation's weights over all its rows, and the mismatch correction's."""
    L = max(b.loss_mask.shape[1] for b in batches)

    def stacked(name):  # [B, L]: the micro batches' rows right-padded with zeros
        parts = [getattr(b, name) for b in batches]
        out = torch.zeros(sum(p.shape[0] for p in parts), L, dtype=parts[0].dtype)
        start = 0
        for p in parts:
            out[start : start + p.shape[0], : p.shape[1]] = p
            start += p.shape[0]
        return out

    # rl.old_logp=trainer: the old log p is the trainer's own, which the correction compares
    mask, t_logp, s_logp = stacked("loss_mask"), stacked("old_logp"), stacked("sampler_logp")
    w_BL = grpo.token_weights(mask, rl.aggregation)
    c_BL = mismatch.correction_weights(t_logp, s_logp, mask, rl.correction, rl.tis_cap, rl.correction_level)
    sizes = [b.loss_mask.shape[0] for b in batches]

    def cut(x_BL):
        return [x[:, : b.loss_mask.shape[1]] for b, x in zip(batches, x_BL.split(sizes), strict=True)]

    return cut(w_BL), cut(c_BL)


def test_two_processes_resume_exactly(two_ranks, base, task_dir, tmp_path):
    run, _ = two_ranks
    parted = tmp_path / "parted"
    common = ["--data", str(task_dir / "qa.jsonl"), "--run-dir", str(parted), *RL, f"train.steps={STEPS}"]
    _torchrun(task_dir, "--from", str(base), *common, "train.stop_after=3")  # a mini-batch left over
    _torchrun(task_dir, "--resume", "--run-dir", str(parted))

    def trained(run_dir):
        return [(r["step"], r["loss"], r["grad_norm"], r.get("reward_mean"), r.get("mismatch_k3"))
                for r in rows(run_dir) if "loss" in r]  # fmt: skip

    assert trained(parted) == trained(run)  # floats compared exactly


def test_refusals_under_several_processes(base):
    def cfg(*overrides):
        overrides = [*RL, *overrides]
        return from_run_config(None, overrides, base, stage="rollout", default_recipe=rollout.DEFAULT_RECIPE)

    rollout.check_ranks(cfg(), 2)
    rollout.check_ranks(cfg("rl.prompts_per_step=3", "train.batch_size=6"), 1)
    with pytest.raises(UserError, match=r"rl.prompts_per_step=3 must be a multiple of the 2 processes.*"
                                        r"set rl.prompts_per_step=4 and train.batch_size=8"):  # fmt: skip
        rollout.check_ranks(cfg("rl.prompts_per_step=3", "train.batch_size=6"), 2)
    with pytest.raises(UserError, match="set train.parallel=ddp"):
        rollout.check_ranks(cfg("train.parallel=fsdp"), 2)


def test_one_update_per_rollout_takes_the_whole_batchs_figures_from_the_training_forwards(
    base, task_dir, tmp_path
):
    """rl.mini_batches=1: no recompute pass; after each step every rank's training forward gives the
    mismatch and entropy figures of its tokens, and the logged figures are those of both ranks'."""
    run, record = tmp_path / "one", tmp_path / "record"
    record.mkdir()
    _torchrun(task_dir, "--from", str(base), "--data", str(task_dir / "qa.jsonl"), "--run-dir", str(run), *RL,
              "rl.mini_batches=1", f"train.batch_size={P * G}", "train.steps=2", record=record)  # fmt: skip
    r0, r1 = (torch.load(record / f"rank{r}.pt") for r in (0, 1))
    cap = run_config(run).rl.tis_cap
    rl_steps = [r for r in rows(run) if "reward_mean" in r]
    assert len(rl_steps) == len(r0["mismatch"]) == len(r1["mismatch"]) == 2
    for k, r in enumerate(rl_steps):
        t, s = (torch.cat([r0["mismatch"][k][i], r1["mismatch"][k][i]])[None] for i in (0, 1))
        everywhere = torch.ones_like(t, dtype=torch.bool)
        whole = mismatch.stats_from_parts(*mismatch.mismatch_parts(t, s, everywhere, cap))
        assert all(r[f"mismatch_{key}"] == pytest.approx(v, rel=1e-5, abs=1e-9) for key, v in whole.items())
        entropy = torch.cat([r0["entropy"][k], r1["entropy"][k]])
        assert len(entropy) == t.shape[1]
        assert r["entropy"] == pytest.approx(float(entropy.double().mean()), rel=1e-5)
    assert r0["final"] == r1["final"]
