"""The RL stage: sample with the trainer's own forward pass, score, GRPO, on the shared trainer.

One RL step, synchronous and on-policy:

    weights changed since the last sampling?  -> quantize them again (the sampler holds them)
    prompts <- the task's train stream (P of them), each asked G times with the chat template
    completions, sampler log p <- the sampler, in the run's precision recipe (NVFP4 W4A4 by
                                  default: the trainer's fprop values, not an approximation)
    rewards <- the task's reward (a user's in a worker with a timeout); advantages within each group
    trainer log p <- the trainer's forward on the same rows, without gradient: the mismatch figures,
                     the old policy (or the sampler's: rl.old_logp), the correction weights
    rl.epochs x rl.mini_batches optimizer steps of the clipped surrogate (rl/policy_loss.py)

With one update per rollout and the trainer's old policy (the default) there is no separate
recompute: the training forward's own log p, detached, is the old policy, gives the correction
weights and, after the step, the mismatch and entropy figures (one forward of the rows fewer).

Each trainer step (``train.steps``) takes one mini-batch of ``train.batch_size = P x G /
rl.mini_batches`` completions. The task's state (prompt position, RL step, mini-batches not yet
trained) is checkpointed with the trainer's and the samples' seed is of the RL step, so a resumed run
samples what the uninterrupted one would have.

Under torchrun (DDP) every rank draws the same P prompts and samples its contiguous P / W of them
(whole groups); what needs the whole batch (rewards, the loss's token counts, every logged figure)
is taken over all ranks (rl/ranks.py), so a step is the one process's and every rank's weights,
hence its sampler's, stay identical.
"""

from __future__ import annotations

import functools
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from inkling_fp4 import distributed as D
from inkling_fp4.config import RunConfig
from inkling_fp4.data.chat import CHAT_TEMPLATE_JINJA, encode_prompt
from inkling_fp4.data.tokenizer import Tokenizer, check_vocab
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.infer.sampler import Sampler
from inkling_fp4.interop.load_run import base_weights, load_run_checkpoint
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision.autocast import autocast_for
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.rl import grpo, mismatch, ranks
from inkling_fp4.rl.config import TASKS
from inkling_fp4.rl.curriculum import LevelCurriculum
from inkling_fp4.rl.dynamic_sampling import kept_groups
from inkling_fp4.rl.policy_loss import PolicyLossFn
from inkling_fp4.rl.prompts import Prompt, PromptStream, TaskData, load_task
from inkling_fp4.rl.rollout_batch import RolloutBatch, build_rows, row_lengths
from inkling_fp4.rl.scoring import RewardRunner, Scores
from inkling_fp4.runs.checkpoint import build_model
from inkling_fp4.runs.directory import TOKENIZER_FILE
from inkling_fp4.runs.metrics import METRICS_FILE
from inkling_fp4.train.frame import RunResult, finish, stage_frame
from inkling_fp4.train.rollout_eval import completion_logprobs, held_out_figures, summary_line
from inkling_fp4.trainer.determinism import seed_everything
from inkling_fp4.trainer.trainer import Trainer

DEFAULT_RECIPE = "rl-tiny"


class RolloutTask:
    """Rollouts as the trainer's task (see the module docstring)."""

    def __init__(self, cfg: RunConfig, trainer: Trainer, tokenizer: Tokenizer, data: TaskData, ref=None,
                 start_tensors: dict | None = None):  # fmt: skip
        self.cfg, self.rl, self.trainer, self.tokenizer, self.data = cfg, cfg.rl, trainer, tokenizer, data
        self.dist = trainer.dist
        on_policy = cfg.rl.old_logp == "trainer" and updates_per_rollout(cfg.rl) == 1
        self.pack = (cfg.data.seq_len, self.tokenizer.pad or 0) if cfg.rl.pack else None
        """(row length, pad id) of the trainer's packed forwards, or None: rows padded to the longest."""
        # on-policy: no recompute pass, the training forward gives the correction and the figures
        self.loss_fn = PolicyLossFn(cfg.rl, cfg.sampler.temperature, on_policy, self.pack, on_policy)
        self.stream = PromptStream(data.train, cfg.train.seed)
        self.curriculum = None
        if cfg.rl.curriculum == "signal":
            self.curriculum = LevelCurriculum(
                data.train, data.levels, cfg.train.seed, cfg.rl.curriculum_floor
            )
        self._step_levels: list = []
        """The levels of every rank's prompts of the step, in prompt order (what the curriculum sees)."""
        self.runner = RewardRunner(data.reward, cfg.rl.reward_timeout, isolate=not data.builtin)
        self.ref = ref
        self.start_tensors = start_tensors
        """The starting weights on the host, for the KL to the start at evaluations (None: ``ref``'s)."""
        self.queue: list[RolloutBatch] = []
        self.rl_step = 0
        self.figures: dict = {}
        self._awaiting: tuple[torch.Tensor, torch.Tensor] | None = None
        """(sampler log p, completion mask) [B, L] of the rows whose figures the training forward gives."""
        self._sampler: Sampler | None = None
        self._weights_at: int | None = None
        self._trained_since = None
        self._eval_s = 0.0
        """Seconds of evaluation since the last rollout: not training time (see ``time_train_s``)."""

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
        if self._awaiting is not None:  # the figures of the step's training forward
            seen = self.loss_fn.forward_figures()
            if not D.any_rank(seen is None, self.dist):  # a forward failed before any row: none anywhere
                t_logp, entropy = (x.cpu() for x in seen)
                s_logp, mask = (x[: len(t_logp)] for x in self._awaiting)  # the rows it reached
                figures.update(self._logp_figures(t_logp, entropy, s_logp, mask))
            self._awaiting = None
        sum_ranks = functools.partial(ranks.sum_ranks, dist=self.dist) if self.dist.active else None
        return {**figures, **self.loss_fn.figures(sum_ranks)}

    def evaluate(self, trainer: Trainer) -> dict:
        """The held-out figures of train/rollout_eval.py; their time is not training time."""
        t0 = time.perf_counter()
        sampler = self._sampler_now()
        held = ranks.rank_share(self.data.eval, self.dist)
        ends = trainer.step_count in (0, self.cfg.train.steps)
        samples = self.rl.eval_samples if self.rl.eval_samples_at == "every" or ends else 0
        start = self.ref if samples else None  # the KL to the start is taken on the samples
        if start is None and samples and self.start_tensors is not None:
            start = frozen_policy(self.cfg, self.start_tensors, trainer.device)
        kl_models = (trainer.fwd_model, start) if start is not None else None
        figures = held_out_figures(sampler, held, self._encode, self.runner, self.dist, samples,
                                   kl_models, trainer.micro, autocast_for(trainer.device),
                                   self.rl.eval_temperature)  # fmt: skip
        del start
        seconds = time.perf_counter() - t0
        self._eval_s += seconds
        return {**figures, "time_eval_s": seconds}

    def state_dict(self) -> dict:
        prompts = self.stream if self.curriculum is None else self.curriculum
        return {"prompts": prompts.state_dict(), "rl_step": self.rl_step,
                "queue": [b.state() for b in self.queue]}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        (self.stream if self.curriculum is None else self.curriculum).load_state_dict(state["prompts"])
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

    def _trainer_logp(self, rows: RolloutBatch, model) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of the targets and the entropy [B, L] under ``model``'s forward, in micro batches."""
        trainer = self.trainer
        return completion_logprobs(model, rows.input_ids, rows.targets, trainer.micro, trainer.device,
                                   autocast_for(trainer.device), self.cfg.sampler.temperature,
                                   rows.lengths, self.pack)  # fmt: skip

    def _step_prompts(self) -> list[Prompt]:
        """This rank's share of the step's P x oversample prompts; every rank draws them all, so the
        streams stay in step."""
        n = self.rl.prompts_per_step * self.rl.oversample
        step = self.stream.take(n) if self.curriculum is None else self.curriculum.take(n)
        self._step_levels = [p.level for p in step]
        return ranks.rank_share(step, self.dist)

    def _sampling_seed(self) -> int:
        """The seed of this step's samples on this rank: of the step, so a resumed run draws what the
        uninterrupted one did; of the rank (rank 0's is the one process's), so ranks draw independent
        samples. Ranks are 2**20 apart: the CPU generator keeps 32 bits of a seed (rank << 32 would
        give every rank the same samples)."""
        return self.cfg.sampler.seed * 1_000_003 + self.rl_step + (self.dist.rank << 20)

    def _roll(self) -> None:
        rl, trainer = self.rl, self.trainer
        t0 = time.perf_counter()
        # since the last rollout was scored: its log-prob recompute, the optimizer steps, logging and
        # checkpoints, but not the held-out evaluation
        train_s = t0 - self._trained_since - self._eval_s if self._trained_since is not None else 0.0
        self._eval_s = 0.0
        sampler = self._sampler_now()
        t1 = time.perf_counter()
        G = rl.group_size
        problems = self._step_prompts()  # this rank's S / W prompts (S = P x oversample)
        prompts = [self._encode(p.text) for p in problems for _ in range(G)]
        done_before = sampler.stats.new_tokens, sampler.stats.seconds
        completions = sampler.generate(prompts, seed=self._sampling_seed())
        gen_tokens = sampler.stats.new_tokens - done_before[0]
        gen_s = sampler.stats.seconds - done_before[1]
        t2 = time.perf_counter()
        texts = [p.text for p in problems for _ in range(G)]
        answers = [p.answer for p in problems for _ in range(G)]
        scores = self.runner.score(texts, [c.text for c in completions], answers)
        t3 = time.perf_counter()

        # every rank's completions in the step's prompt order: the one process's [S, G] batch
        rewards_SG, lengths_S, truncated_S = ranks.all_completions(
            scores.rewards, [len(c.tokens) for c in completions],
            [c.finish_reason == "length" for c in completions], G, self.dist,
        )  # fmt: skip
        gathered = time.perf_counter()  # a rank that waited here for a slower one was not training
        # the completions the loss trains: under rl.mask_truncated, not those the budget cut
        counted_SG = ~truncated_S.view(-1, G) if rl.mask_truncated else None
        zero_var_S = grpo.zero_variance_groups(rewards_SG, counted_SG)
        level_mix = self._level_mix(zero_var_S)
        rewards_PG, truncated, zero_var_P, counted_PG = rewards_SG, truncated_S, zero_var_S, counted_SG
        if rl.oversample > 1:  # train on P of the S groups, those with a signal first
            kept = kept_groups(zero_var_S, self.dist.world_size, rl.prompts_per_step)
            first = ranks.rank_share(range(rewards_SG.shape[0]), self.dist).start
            own = [i - first for i in ranks.rank_share(kept, self.dist)]
            prompts = [prompts[i * G + g] for i in own for g in range(G)]
            completions = [completions[i * G + g] for i in own for g in range(G)]
            rewards_PG = rewards_SG[kept]
            truncated = truncated_S.view(-1, G)[kept].reshape(-1)
            zero_var_P = zero_var_S[kept]
            counted_PG = None if counted_SG is None else counted_SG[kept]
        adv_PG = grpo.group_advantages(rewards_PG, rl.scale_rewards, counted_NG=counted_PG)
        adv_B = ranks.rank_share(adv_PG, self.dist).reshape(-1)
        input_ids, targets, completion_mask, s_logp = build_rows(
            prompts, [c.tokens for c in completions], [c.logprobs for c in completions], self.tokenizer.pad
        )
        mask = completion_mask.clone()
        if rl.mask_truncated:
            mask &= ~ranks.rank_share(truncated, self.dist)[:, None]
        if rl.drop_zero_variance:
            mask &= ~ranks.rank_share(zero_var_P, self.dist).repeat_interleave(G)[:, None]
        rows = RolloutBatch(input_ids, targets, mask, adv_B, s_logp, s_logp, torch.zeros_like(s_logp),
                            lengths=row_lengths(prompts, [c.tokens for c in completions]))  # fmt: skip
        if self.loss_fn.correct_from_forward:  # the training forward gives the correction and the figures
            t_logp = entropy = correction = None
            self._awaiting = (s_logp, completion_mask)
        else:
            t_logp, entropy = self._trainer_logp(rows, trainer.fwd_model)
            rows.old_logp = t_logp if rl.old_logp == "trainer" else s_logp
            correction = mismatch.correction_weights(
                t_logp, s_logp, mask, rl.correction, rl.tis_cap, rl.correction_level, rl.old_logp == "trainer"
            )
        if self.ref is not None:
            rows.ref_logp, _ = self._trainer_logp(rows, self.ref)
        self._queue_mini_batches(rows, correction)

        gen_tokens = int(ranks.sum_ranks(torch.tensor([gen_tokens], dtype=torch.float64), self.dist)[0])
        # the ranks sample, score and train side by side: a step takes as long as its slowest rank
        spans = ranks.max_ranks([gen_s, t1 - t0, t2 - t1, t3 - t2, train_s], self.dist)
        gen_s, refresh_s, sample_s, score_s, train_s = spans
        figures = {  # of every sampled group: with oversampling, the kept ones are not the policy's
            "rl_step": self.rl_step + 1,
            "reward_mean": float(rewards_SG.mean()),
            "reward_std": float(rewards_SG.std()),
            "accuracy": float((rewards_SG >= 1.0).float().mean()),
            "completion_len_mean": float(lengths_S.mean()),
            "completion_len_max": float(lengths_S.max()),
            "truncated_frac": float(truncated_S.float().mean()),
            "zero_var_frac": float(zero_var_S.float().mean()),
            # the two ends of learning: groups with no completion right (reward < 1), and all right
            "unsolved_frac": float((rewards_SG < 1.0).all(dim=1).float().mean()),
            "solved_frac": float((rewards_SG >= 1.0).all(dim=1).float().mean()),
            "adv_abs_mean": float(adv_PG.abs().mean()),
            "gen_tokens_per_s": gen_tokens / gen_s if gen_s > 0 else 0.0,
            "time_refresh_s": refresh_s,
            "time_sample_s": sample_s,
            "time_score_s": score_s,
            "time_train_s": train_s,
        }
        figures.update(level_mix)
        if rl.oversample > 1:
            figures["trained_zero_var_frac"] = float(zero_var_P.float().mean())
        if t_logp is not None:
            figures.update(self._logp_figures(t_logp, entropy, s_logp, completion_mask))
        self._reward_failures(scores, figures)
        self.figures = figures
        self.rl_step += 1
        self._trained_since = gathered  # the log-prob recompute above counts as training

    def _level_mix(self, zero_var_S: torch.Tensor) -> dict:
        """Under the curriculum: each level's share of the step's groups and the share of its groups
        without signal, after which the curriculum takes the step's groups into account."""
        if self.curriculum is None:
            return {}
        no_signal = zero_var_S.tolist()
        figures = {}
        for lv in self.curriculum.levels:
            flags = [ns for g, ns in zip(self._step_levels, no_signal, strict=True) if g == lv]
            figures[f"level{lv}_frac"] = len(flags) / len(no_signal)
            if flags:
                figures[f"zero_var_frac_level{lv}"] = sum(flags) / len(flags)
        self.curriculum.observe(self._step_levels, no_signal)
        return figures

    def _logp_figures(self, t_logp, entropy, s_logp, completion_mask) -> dict:
        """The entropy and the mismatch of the trainer's log p against the sampler's, all ranks'."""
        drift = ranks.mismatch_figures(t_logp, s_logp, completion_mask, self.rl.tis_cap, self.dist)
        return {
            "entropy": ranks.token_mean(entropy, completion_mask, self.dist),
            **{f"mismatch_{key}": value for key, value in drift.items()},
        }

    def _queue_mini_batches(self, rows: RolloutBatch, correction: torch.Tensor | None) -> None:
        """rl.epochs passes over the rows, each split into rl.mini_batches in a seeded order. Each rank
        splits its own rows, so a mini-batch is every rank's m-th piece; its token weights count the
        trained tokens and rows of all those pieces (what the trainer's loss is divided by)."""
        rl, B = self.rl, rows.input_ids.shape[0]
        size = B // rl.mini_batches
        picks = []
        for epoch in range(rl.epochs):
            order = torch.from_numpy(
                np.random.default_rng([self.cfg.train.seed, self.rl_step, epoch]).permutation(B)
            )
            for m in range(rl.mini_batches):
                picks.append(order[m * size : (m + 1) * size] if rl.mini_batches > 1 else torch.arange(B))
        minis = [rows.rows(idx) for idx in picks]
        counts = torch.tensor([float(mini.loss_mask.sum()) for mini in minis], dtype=torch.float64)
        tokens = ranks.sum_ranks(counts, self.dist)  # [epochs x mini_batches], all ranks
        for mini, idx, n in zip(minis, picks, tokens.tolist(), strict=True):
            mini.weights = grpo.token_weights(mini.loss_mask, rl.aggregation, n, size * self.dist.world_size)
            mini.correction = None if correction is None else correction[idx]
            self.queue.append(mini)

    def _reward_failures(self, scores: Scores, figures: dict) -> None:
        """Reward calls that scored 0 on any rank: counted in ``figures``, and an event (rank 0 logs)."""
        outcomes, first_error = Counter(), None
        for counts, error in D.gather_objects((scores.outcomes, scores.first_error), self.dist):
            outcomes.update(counts)
            first_error = first_error or error
        failed = {k: v for k, v in outcomes.items() if k != "ok" and v}
        if failed:
            figures["reward_failures"] = dict(failed)
            kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(failed.items()))
            message = f"reward: {sum(failed.values())} calls scored 0 ({kinds}; first {first_error})"
            self.trainer.log.event(self.trainer.step_count + 1, "reward_failure", message)


# ----------------------------------------------------------------------------------------------
# the run


def frozen_policy(cfg: RunConfig, tensors: dict, device: torch.device) -> HybridLM:
    """A frozen model of ``tensors`` in the run's precision: the starting policy (KL penalty, KL to start)."""
    model = build_model(cfg.model, device, tensors)
    PrecisionPolicy(cfg.precision, cfg.model.n_layers).apply(model)
    return model.requires_grad_(False)


def updates_per_rollout(rl) -> int:
    return rl.epochs * rl.mini_batches


def check_config(cfg: RunConfig) -> None:
    """What the RL step needs of the sections together (each section checks itself)."""
    rl = cfg.rl
    if cfg.sampler.temperature <= 0:
        raise ConfigError(
            f"sampler.temperature={cfg.sampler.temperature:g} samples greedily: every completion of a "
            "group is the same and GRPO has no signal; set sampler.temperature > 0 (1.0: the policy itself)"
        )
    if cfg.precision.fp8_scaling == "delayed" and updates_per_rollout(rl) > 1:
        raise ConfigError(
            "precision.fp8_scaling=delayed with several updates per rollout: the old log p is recomputed "
            "without autograd, which scales from current amaxes, so the first ratio would not be 1; set "
            "rl.epochs=1 and rl.mini_batches=1, or precision.fp8_scaling=current"
        )
    if rl.curriculum == "signal" and (
        rl.task not in TASKS or (rl.levels is not None and len(set(rl.levels)) < 2)
    ):
        what = f"rl.levels={rl.levels}" if rl.task in TASKS else f"the jsonl task {rl.task} has no levels"
        raise ConfigError(
            f"rl.curriculum=signal mixes a built-in task's levels, and {what}; set rl.curriculum=none, "
            "or rl.levels to two levels or more (null: all)"
        )
    rows = rl.prompts_per_step * rl.group_size
    if rows % rl.mini_batches or cfg.train.batch_size != rows // rl.mini_batches:
        raise ConfigError(
            f"train.batch_size={cfg.train.batch_size} must be the completions of one mini-batch: "
            f"rl.prompts_per_step x rl.group_size / rl.mini_batches = {rows} / {rl.mini_batches}; "
            f"set train.batch_size={rows // rl.mini_batches}"
        )


def check_ranks(cfg: RunConfig, world: int) -> None:
    """What several processes need: whole replicas to sample with (DDP, not FSDP2's shards) and an
    equal share of every step's prompts per rank."""
    if world == 1:
        return
    if cfg.train.parallel == "fsdp":
        raise UserError("fp4train rollout samples with each rank's whole copy of the policy, which "
                        "train.parallel=fsdp shards; set train.parallel=ddp")  # fmt: skip
    rl = cfg.rl
    if rl.prompts_per_step % world:
        prompts = -(-rl.prompts_per_step // world) * world
        raise UserError(
            f"rl.prompts_per_step={rl.prompts_per_step} must be a multiple of the {world} processes (each "
            f"samples an equal share of a step's prompts); set rl.prompts_per_step={prompts} and "
            f"train.batch_size={prompts * rl.group_size // rl.mini_batches}, or run a number of processes "
            f"that divides {rl.prompts_per_step}"
        )


def run(cfg: RunConfig, run_dir: Path, resume: bool = False, baseline: Path | None = None) -> RunResult:
    """RL from ``cfg.init_from`` on ``cfg.rl.task`` into ``run_dir`` (continuing with ``resume``)."""
    if cfg.init_from is None:
        raise ConfigError("init_from is not set: pass --from RUN (an sft or pretrain run or checkpoint)")
    check_config(cfg)
    with stage_frame(cfg, run_dir, resume, baseline) as (dist, start):
        cfg = start.cfg
        check_ranks(cfg, dist.world_size)
        seed_everything(cfg.train.seed)
        _, base_model, base_tokenizer, ckpt = load_run_checkpoint(cfg.init_from)
        tokenizer = base_tokenizer if start.fresh else Tokenizer.from_file(Path(run_dir) / TOKENIZER_FILE)
        check_vocab(tokenizer, cfg.model.vocab_size)
        data = load_task(cfg.rl, cfg.train.seed)
        base_tensors, _ = base_weights(base_model)
        model = build_model(cfg.model, dist.device, base_tensors)
        ref = frozen_policy(cfg, base_tensors, dist.device) if cfg.rl.kl_coef > 0 else None
        start_tensors = base_tensors if ref is None and cfg.rl.eval_samples > 0 else None
        del base_model, base_tensors
        trainer = Trainer(cfg, run_dir, dist, model, baseline)
        task = RolloutTask(cfg, trainer, tokenizer, data, ref, start_tensors)
        shares = f" ({cfg.rl.prompts_per_step // dist.world_size} prompts per process)" if dist.active else ""
        describe = [
            f"init: weights, model and tokenizer from {ckpt.path} (step {ckpt.step}); optimizer: fresh AdamW",
            f"task: {data.name}, {len(data.train)} train prompts, {len(data.eval)} held out; "
            f"{cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} completions per RL step{shares}, "
            f"{cfg.rl.epochs} epoch(s) x {cfg.rl.mini_batches} mini-batch(es); sampler: "
            f"{cfg.sampler.precision} precision, temperature {cfg.sampler.temperature:g}, "
            f"{cfg.sampler.max_new_tokens} new tokens at most; correction {cfg.rl.correction}",
        ]
        result = finish(
            trainer, task, start, tokenizer, describe, {"chat_template.jinja": CHAT_TEMPLATE_JINJA}
        )
    if dist.is_main:
        line = summary_line(_metrics_rows(Path(run_dir)))
        if line is not None:
            print(line, flush=True)
    return result


def _metrics_rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows (a line cut short by a kill is left out)."""
    rows = []
    for line in (run_dir / METRICS_FILE).read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
