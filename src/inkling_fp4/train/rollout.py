"""The RL stage: sample with the trainer's own forward pass, score, GRPO, on the shared trainer.

One RL step, synchronous and on-policy:

    weights changed since the last sampling?  -> quantize them once more (the sampler holds them)
    prompts <- the task's train stream (P of them), each asked G times with the chat template
    completions, sampler log p <- the sampler, under the run's precision recipe (NVFP4 W4A4 by
                                  default: the trainer's fprop values, not an approximation)
    rewards <- the task's reward (a user's in a worker with a timeout); advantages within each group
    trainer log p <- the trainer's forward on the same rows, without gradient: the mismatch figures
                     against the sampler's, the old policy (or the sampler's own: rl.old_logp), the
                     correction weights (TIS or masking)
    rl.epochs x rl.mini_batches optimizer steps of the clipped surrogate (rl/policy_loss.py)

The trainer counts optimizer steps (``train.steps``); each step takes one mini-batch of
``train.batch_size = P x G / rl.mini_batches`` completions. The task's state (the prompt position,
the RL step, mini-batches not yet trained) is checkpointed with the trainer's, and the sampler draws
from a seed of the RL step, so a resumed run samples what the uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from inkling_fp4.config import RunConfig
from inkling_fp4.data.chat import CHAT_TEMPLATE_JINJA, encode_prompt
from inkling_fp4.data.tokenizer import Tokenizer, check_vocab
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.infer.sampler import Sampler
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.rl import grpo, mismatch
from inkling_fp4.rl.policy_loss import PolicyLossFn
from inkling_fp4.rl.prompts import PromptStream, TaskData, load_task
from inkling_fp4.rl.rollout_batch import RolloutBatch, build_rows, token_logprobs
from inkling_fp4.rl.scoring import RewardRunner
from inkling_fp4.train.checkpoint import load_model_tensors
from inkling_fp4.train.load_run import load_run_checkpoint
from inkling_fp4.train.pretrain import seed_everything
from inkling_fp4.train.run_dir import TOKENIZER_FILE
from inkling_fp4.train.stages import RunResult, finish, stage_frame
from inkling_fp4.train.trainer import Trainer, autocast_for

DEFAULT_RECIPE = "rl-tiny"


class RolloutTask:
    """Rollouts as the trainer's task (see the module docstring)."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, tokenizer: Tokenizer, data: TaskData, ref=None):
        self.cfg, self.rl, self.trainer, self.tokenizer, self.data = cfg, cfg.rl, trainer, tokenizer, data
        self.loss_fn = PolicyLossFn(cfg.rl)
        self.stream = PromptStream(data.train, cfg.train.seed)
        self.runner = RewardRunner(data.reward, cfg.rl.reward_timeout, isolate=not data.builtin)
        self.ref = ref
        self.queue: list[RolloutBatch] = []
        self.rl_step = 0
        self.figures: dict = {}
        self._sampler: Sampler | None = None
        self._weights_at: int | None = None
        self._trained_since = None

    # -- the trainer's protocol ------------------------------------------------------------------

    def next_batches(self, micro: int, accum: int) -> list[RolloutBatch]:
        self.loss_fn.new_step()
        if not self.queue:
            self._roll()
        mini = self.queue.pop(0)
        return [mini.rows(slice(i * micro, (i + 1) * micro)) for i in range(accum)]

    def real_tokens(self, batches: list[RolloutBatch]) -> int:
        pad = self.tokenizer.pad
        return sum(int((b.input_ids != pad).sum()) for b in batches)

    def step_metrics(self) -> dict:
        figures, self.figures = self.figures, {}
        return {**figures, **self.loss_fn.figures()}

    def evaluate(self, trainer: Trainer) -> dict:
        """Greedy pass@1 on the task's held-out problems, with the policy as it stands."""
        sampler = self._sampler_now()
        prompts = [self._encode(p.text) for p in self.data.eval]
        saved = sampler.cfg
        try:
            sampler.cfg = dataclasses.replace(saved, temperature=0.0)
            completions = sampler.generate(prompts)
        finally:
            sampler.cfg = saved
        scores = self.runner.score([p.text for p in self.data.eval], [c.text for c in completions],
                                   [p.answer for p in self.data.eval])  # fmt: skip
        rewards = np.array(scores.rewards)
        return {"eval_accuracy": float((rewards >= 1.0).mean()), "eval_reward": float(rewards.mean()),
                "eval_problems": len(prompts)}  # fmt: skip

    def state_dict(self) -> dict:
        return {"prompts": self.stream.state_dict(), "rl_step": self.rl_step,
                "queue": [b.state() for b in self.queue]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state["prompts"])
        self.rl_step = int(state["rl_step"])
        self.queue = [RolloutBatch(**b) for b in state["queue"]]

    # -- one RL step's rollouts ------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, [{"role": "user", "content": text}])

    def _sampler_now(self) -> Sampler:
        """The sampler over the trainer's model and policy, its weights quantized for this step."""
        trainer = self.trainer
        if self._sampler is None:
            context = self.cfg.sampler.max_context or self.cfg.data.seq_len
            self._sampler = Sampler(trainer.model, self.tokenizer, self.cfg.sampler, trainer.policy,
                                    context=context)  # fmt: skip
            self._weights_at = trainer.step_count
        elif self._weights_at != trainer.step_count:
            self._sampler.weights_updated()
            self._weights_at = trainer.step_count
        return self._sampler

    @torch.no_grad()
    def _trainer_logp(self, rows: RolloutBatch, model) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of the targets and the entropy [B, L] under ``model``'s forward, in micro batches."""
        device, micro = self.trainer.device, self.trainer.micro
        logp, ent = [], []
        with autocast_for(device):
            for i in range(0, rows.input_ids.shape[0], micro):
                ids = rows.input_ids[i : i + micro].to(device)
                lp, en = token_logprobs(model(ids), rows.targets[i : i + micro].to(device), entropy=True)
                logp.append(lp.cpu())
                ent.append(en.cpu())
        return torch.cat(logp), torch.cat(ent)

    def _roll(self) -> None:
        rl, cfg, trainer = self.rl, self.cfg, self.trainer
        t0 = time.perf_counter()
        train_s = t0 - self._trained_since if self._trained_since is not None else 0.0
        sampler = self._sampler_now()
        t1 = time.perf_counter()
        P, G = rl.prompts_per_step, rl.group_size
        problems = self.stream.take(P)
        prompts = [self._encode(p.text) for p in problems for _ in range(G)]
        done_before = sampler.stats.new_tokens, sampler.stats.seconds
        completions = sampler.generate(prompts, seed=cfg.sampler.seed * 1_000_003 + self.rl_step)
        gen_tokens = sampler.stats.new_tokens - done_before[0]
        gen_s = sampler.stats.seconds - done_before[1]
        t2 = time.perf_counter()
        texts = [p.text for p in problems for _ in range(G)]
        answers = [p.answer for p in problems for _ in range(G)]
        scores = self.runner.score(texts, [c.text for c in completions], answers)
        t3 = time.perf_counter()

        rewards_NG = torch.tensor(scores.rewards, dtype=torch.float32).view(P, G)
        adv_B = grpo.group_advantages(rewards_NG, rl.scale_rewards).view(-1)
        zero_var_N = grpo.zero_variance_groups(rewards_NG)
        input_ids, targets, completion_mask, s_logp = build_rows(
            prompts, [c.tokens for c in completions], [c.logprobs for c in completions], self.tokenizer.pad
        )
        truncated_B = torch.tensor([c.finish_reason == "length" for c in completions])
        mask = completion_mask.clone()
        if rl.mask_truncated:
            mask &= ~truncated_B[:, None]
        if rl.drop_zero_variance:
            mask &= ~zero_var_N.repeat_interleave(G)[:, None]
        rows = RolloutBatch(input_ids, targets, mask, adv_B, s_logp, s_logp, torch.zeros_like(s_logp))
        t_logp, entropy = self._trainer_logp(rows, trainer.fwd_model)
        rows.old_logp = t_logp if rl.old_logp == "trainer" else s_logp
        correction = mismatch.correction_weights(t_logp, s_logp, mask, rl.correction, rl.tis_cap)
        if self.ref is not None:
            rows.ref_logp, _ = self._trainer_logp(rows, self.ref)
        self._queue_mini_batches(rows, correction)

        lengths = torch.tensor([len(c.tokens) for c in completions], dtype=torch.float32)
        n = completion_mask.sum().clamp(min=1)
        figures = {
            "rl_step": self.rl_step + 1,
            "reward_mean": float(rewards_NG.mean()),
            "reward_std": float(rewards_NG.std()),
            "accuracy": float((rewards_NG >= 1.0).float().mean()),
            "completion_len_mean": float(lengths.mean()),
            "completion_len_max": float(lengths.max()),
            "truncated_frac": float(truncated_B.float().mean()),
            "entropy": float((entropy * completion_mask).sum() / n),
            "zero_var_frac": float(zero_var_N.float().mean()),
            "gen_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
            "time_refresh_s": t1 - t0,
            "time_sample_s": t2 - t1,
            "time_score_s": t3 - t2,
            "time_train_s": train_s,
        }
        for key, value in mismatch.mismatch_stats(t_logp, s_logp, completion_mask, rl.tis_cap).items():
            figures[f"mismatch_{key}"] = value
        failed = {k: v for k, v in scores.outcomes.items() if k != "ok" and v}
        if failed:
            figures["reward_failures"] = dict(failed)
            message = f"reward: {sum(failed.values())} calls scored 0 ({scores.first_error})"
            trainer.log.event(trainer.step_count + 1, "reward_failure", message)
        self.figures = figures
        self.rl_step += 1
        self._trained_since = time.perf_counter()

    def _queue_mini_batches(self, rows: RolloutBatch, correction: torch.Tensor) -> None:
        """rl.epochs passes over the rows, each split into rl.mini_batches in a seeded order."""
        rl, B = self.rl, rows.input_ids.shape[0]
        size = B // rl.mini_batches
        for epoch in range(rl.epochs):
            order = torch.from_numpy(
                np.random.default_rng([self.cfg.train.seed, self.rl_step, epoch]).permutation(B)
            )
            for m in range(rl.mini_batches):
                idx = order[m * size : (m + 1) * size] if rl.mini_batches > 1 else torch.arange(B)
                mini = rows.rows(idx)
                mini.weights = grpo.token_weights(mini.loss_mask, rl.aggregation) * correction[idx]
                self.queue.append(mini)


# ----------------------------------------------------------------------------------------------
# the run


def check_geometry(cfg: RunConfig) -> None:
    rl = cfg.rl
    rows = rl.prompts_per_step * rl.group_size
    if rows % rl.mini_batches or cfg.train.batch_size != rows // rl.mini_batches:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} must be the completions of one mini-batch: "
            f"rl.prompts_per_step x rl.group_size / rl.mini_batches = {rows} / {rl.mini_batches}; "
            f"set train.batch_size={rows // rl.mini_batches}"
        )


def run(cfg: RunConfig, run_dir: Path, resume: bool = False, baseline: Path | None = None) -> RunResult:
    """RL from ``cfg.init_from`` on ``cfg.rl.task`` into ``run_dir`` (continuing with ``resume``)."""
    if cfg.init_from is None:
        raise ConfigError("init_from is not set: pass --from RUN (an sft or pretrain run or checkpoint)")
    check_geometry(cfg)
    with stage_frame(cfg, run_dir, resume) as (dist, start):
        cfg = start.cfg
        if dist.world_size > 1:
            raise UserError("fp4train rollout runs in one process (several GPUs are not built yet); run it "
                            "without torchrun")  # fmt: skip
        seed_everything(cfg.train.seed)
        _, base_model, base_tokenizer, ckpt = load_run_checkpoint(cfg.init_from)
        tokenizer = base_tokenizer if start.fresh else Tokenizer.from_file(Path(run_dir) / TOKENIZER_FILE)
        check_vocab(tokenizer, cfg.model.vocab_size)
        data = load_task(cfg.rl, cfg.train.seed)
        base_tensors = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
        with torch.device(dist.device):
            model = HybridLM(cfg.model)
        load_model_tensors(model, base_tensors, dist.device)
        ref = None
        if cfg.rl.kl_coef > 0:  # the frozen initial policy, in the run's precision
            with torch.device(dist.device):
                ref = HybridLM(cfg.model)
            load_model_tensors(ref, base_tensors, dist.device)
            PrecisionPolicy(cfg.precision, cfg.model.n_layers).apply(ref)
            ref.requires_grad_(False)
        del base_model, base_tensors
        trainer = Trainer(cfg, run_dir, dist, model, baseline)
        task = RolloutTask(cfg, trainer, tokenizer, data, ref)
        describe = [
            f"init: weights, model and tokenizer from {ckpt.path} (step {ckpt.step}); optimizer: fresh AdamW",
            f"task: {data.name}, {len(data.train)} train prompts, {len(data.eval)} held out; "
            f"{cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} completions per RL step, "
            f"{cfg.rl.epochs} epoch(s) x {cfg.rl.mini_batches} mini-batch(es); sampler: "
            f"{cfg.sampler.precision} precision, temperature {cfg.sampler.temperature:g}, "
            f"{cfg.sampler.max_new_tokens} new tokens at most; correction {cfg.rl.correction}",
        ]
        return finish(trainer, task, start, tokenizer, describe, {"chat_template.jinja": CHAT_TEMPLATE_JINJA})
