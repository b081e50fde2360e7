"""The RL stage's held-out evaluation: what tells a policy that learns from one that drifts.

On the task's held-out problems, with the policy as it stands:

    eval_accuracy       greedy pass@1: the argmax answer is right (what ``generate`` at T = 0 gives)
    eval_truncated, eval_completion_len
                        the share of greedy answers cut by the token budget and their mean length
                        in tokens (a greedy policy that loops or searches past the budget scores 0)
    eval_pass1_sampled  the mean reward of k completions per problem at ``temperature`` (the
                        rollouts' unless ``rl.eval_temperature`` says otherwise)
    eval_pass_at_k      the share of problems with at least one right answer among those k
    eval_accuracy_level<L>, eval_pass_at_k_level<L>
                        the same per level of a built-in task, when the problems span several
                        (a mixed set can hide one level at its ceiling and another with room to learn)
    eval_kl_to_start    k3 estimate of KL(policy || starting policy), both at that temperature, per
                        token of the first sampled
                        completion of each problem (draws of the policy, as the estimate needs; one
                        per problem keeps its two forwards to the size of the greedy batch)
    eval_reward_failures  reward calls that failed and scored 0, by kind (only when some did)

Before RL, pass@k well above pass@1 says there is something to sharpen; pass@1 rising towards pass@k
with a moderate KL says RL sharpens; greedy accuracy falling while the KL grows says the updates are
noise. Each rank answers its share; the figures are of all problems.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from inkling_fp4 import distributed as D
from inkling_fp4.infer.sampler import Sampler
from inkling_fp4.rl import ranks
from inkling_fp4.rl.policy_loss import forward_logprobs
from inkling_fp4.rl.prompts import Prompt
from inkling_fp4.rl.rollout_batch import build_rows
from inkling_fp4.rl.scoring import RewardRunner

EVAL_SEED = 7_777_777
"""The sampling seed of every evaluation (common random numbers along the curve)."""


@torch.no_grad()
def completion_logprobs(
    model, input_ids: torch.Tensor, targets: torch.Tensor, micro: int, device, autocast, temperature: float,
    lengths: torch.Tensor | None = None, pack: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """log p of the targets and the entropy [B, L] (host FP32) of logits / T under ``model``'s forward,
    in micro batches; packed as the training forward is (``pack``: (row length, pad id))."""
    logp, ent = [], []
    with autocast:
        for i in range(0, input_ids.shape[0], micro):
            ids, tgt = input_ids[i : i + micro].to(device), targets[i : i + micro].to(device)
            n = None if lengths is None else lengths[i : i + micro]
            lp, en = forward_logprobs(model, ids, tgt, True, temperature, n, pack)
            logp.append(lp.cpu())
            ent.append(en.cpu())
    return torch.cat(logp), torch.cat(ent)


def held_out_figures(
    sampler: Sampler,
    held: list[Prompt],
    encode: Callable[[str], list[int]],
    runner: RewardRunner,
    dist: D.DistInfo,
    k: int,
    kl_models: tuple | None = None,
    micro: int = 64,
    autocast=None,
    temperature: float | None = None,
) -> dict:
    """The figures of the module docstring for this rank's share ``held`` of the held-out problems.
    ``kl_models``: (policy's training forward, starting policy) for the KL, or None to skip it;
    ``temperature``: of the sampled figures (None: the sampler's, i.e. the rollouts')."""
    prompts = [encode(p.text) for p in held]
    texts, answers = [p.text for p in held], [p.answer for p in held]
    greedy = _generate_at(sampler, 0.0, prompts) if prompts else []
    outcomes = Counter()  # how the reward calls ended, greedy and sampled (failures score 0)
    greedy_scores = runner.score(texts, [c.text for c in greedy], answers)
    outcomes.update(greedy_scores.outcomes)
    rewards = np.array([r for part in D.gather_objects(greedy_scores.rewards, dist) for r in part])
    levels = np.array([lv for part in D.gather_objects([p.level for p in held], dist) for lv in part])
    by_level = sorted({lv for lv in levels if lv is not None})
    by_level = by_level if len(by_level) > 1 else []
    cut = [(c.finish_reason == "length", len(c.tokens)) for c in greedy]
    cut = np.array([pair for part in D.gather_objects(cut, dist) for pair in part]).reshape(-1, 2)
    figures = {"eval_accuracy": float((rewards >= 1.0).mean()), "eval_reward": float(rewards.mean()),
               "eval_problems": len(rewards), "eval_truncated": float(cut[:, 0].mean()),
               "eval_completion_len": float(cut[:, 1].mean())}  # fmt: skip
    for lv in by_level:
        figures[f"eval_accuracy_level{lv}"] = float((rewards[levels == lv] >= 1.0).mean())
    if k >= 1:
        repeated = [p for p in prompts for _ in range(k)]
        T = sampler.cfg.temperature if temperature is None else temperature
        sampled = _generate_at(sampler, T, repeated, seed=EVAL_SEED) if repeated else []
        scores = runner.score([t for t in texts for _ in range(k)], [c.text for c in sampled],
                              [a for a in answers for _ in range(k)])  # fmt: skip
        outcomes.update(scores.outcomes)
        parts = D.gather_objects(scores.rewards, dist)
        per_problem = np.array([r for part in parts for r in part]).reshape(-1, k) >= 1.0
        figures["eval_pass1_sampled"] = float(per_problem.mean())
        figures["eval_pass_at_k"], figures["eval_k"] = float(per_problem.any(1).mean()), k
        for lv in by_level:  # per_problem [problems, k] in the order of levels
            figures[f"eval_pass_at_k_level{lv}"] = float(per_problem[levels == lv].any(1).mean())
        if kl_models is not None:
            kl = _kl_to_start(sampled[::k], prompts, kl_models, sampler, dist, micro, autocast, T)
            figures["eval_kl_to_start"] = kl
    total = Counter()
    for part in D.gather_objects(dict(outcomes), dist):
        total.update(part)
    failed = {kind: n for kind, n in sorted(total.items()) if kind != "ok" and n}
    if failed:
        figures["eval_reward_failures"] = failed
    return figures


def _generate_at(sampler: Sampler, temperature: float, prompts: list[list[int]], seed=None) -> list:
    """The sampler's completions at ``temperature``, its own setting restored after."""
    saved = sampler.cfg
    try:
        sampler.cfg = dataclasses.replace(saved, temperature=temperature)
        return sampler.generate(prompts, seed=seed)
    finally:
        sampler.cfg = saved


def _kl_to_start(completions, prompts, models, sampler: Sampler, dist, micro, autocast, T: float) -> float:
    """Mean k3 of KL(policy || start) at temperature ``T`` over the completion tokens of every rank."""
    pad = sampler.tokenizer.pad
    sums = torch.zeros(2, dtype=torch.float64)
    if completions:
        ids, targets, mask, _ = build_rows(prompts, [c.tokens for c in completions],
                                           [c.logprobs for c in completions], pad)  # fmt: skip
        device = sampler.device
        policy, start = (completion_logprobs(m, ids, targets, micro, device, autocast, T)[0] for m in models)
        d = (start.double() - policy.double())[mask]
        count = torch.tensor(float(d.numel()), dtype=torch.float64)
        sums = torch.stack([(torch.exp(d) - d - 1).sum(), count])
    total = ranks.sum_ranks(sums, dist)
    return float(total[0] / total[1].clamp(min=1))


def summary_line(rows: list[dict], window: int = 3) -> str | None:
    """The RL run's outcome in one line from its metrics rows: held-out figures at the first and last
    evaluation, reward and groups without signal over the first and last ``window`` steps; None
    before any evaluation or step."""
    evals = [r for r in rows if "eval_accuracy" in r]
    steps = [r for r in rows if "reward_mean" in r]
    if not evals or not steps:
        return None
    a, b = evals[0], evals[-1]
    n = min(window, max(1, len(steps) // 2))

    def mean(key, part):
        return sum(r[key] for r in part) / len(part)

    parts = [f"held-out greedy pass@1 {a['eval_accuracy']:.3f} -> {b['eval_accuracy']:.3f} "
             f"(step {a['step']} -> {b['step']}, {b['eval_problems']} problems)"]  # fmt: skip
    levels = [key for key in b if key.startswith("eval_accuracy_level") and key in a]
    if levels:
        each = [f"{key.removeprefix('eval_accuracy_level')}: {a[key]:.3f} -> {b[key]:.3f}" for key in levels]
        parts.append("by level " + ", ".join(each))
    if "eval_pass_at_k" in a and "eval_pass_at_k" in b:
        k = b["eval_k"]
        parts.append(f"sampled pass@1 {a['eval_pass1_sampled']:.3f} -> {b['eval_pass1_sampled']:.3f}, "
                     f"pass@{k} {a['eval_pass_at_k']:.3f} -> {b['eval_pass_at_k']:.3f}")  # fmt: skip
    parts.append(f"reward {mean('reward_mean', steps[:n]):.3f} (first {n} steps) -> "
                 f"{mean('reward_mean', steps[-n:]):.3f} (last {n})")  # fmt: skip

    def change(key):
        return f"{mean(key, steps[:n]):.0%} -> {mean(key, steps[-n:]):.0%}"

    signal = f"groups without signal {change('zero_var_frac')}"
    if all("unsolved_frac" in r for r in steps):  # groups with none right, and with all right
        signal += f" (none right {change('unsolved_frac')}, all right {change('solved_frac')})"
    parts.append(signal)
    return "rl: " + "; ".join(parts)
