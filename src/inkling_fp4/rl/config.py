"""RL configuration: the task, the groups, the GRPO variant, the mismatch correction.

The defaults follow TRL's GRPOTrainer and verl where they agree: groups of 8, advantages scaled by
the group's std (GRPO), DAPO's clip-higher (eps_low 0.2, eps_high 0.28), token-mean aggregation
(every token weighs the same, so long completions are not down-weighted), no KL penalty,
zero-variance groups kept (advantage 0: they only dilute the mean) and counted, and completions cut by
the token budget scored like any other.
"""

from __future__ import annotations

from dataclasses import dataclass

from inkling_fp4.rl.grpo import AGGREGATIONS, LEVELS, SCALES
from inkling_fp4.rl.mismatch import CORRECTIONS
from inkling_fp4.rl.mismatch import LEVELS as CORRECTION_LEVELS

TASKS = ("arithmetic", "countdown")
VERIFIERS = ("numeric", "exact")
OLD_LOGP = ("trainer", "sampler")


@dataclass
class RLConfig:
    task: str = "arithmetic"
    """Built-in task (arithmetic | countdown), or a jsonl file of {prompt, answer} records (``--data``)."""
    reward: str | None = None
    """``MODULE:FUNCTION(prompt, completion, answer) -> float`` to use instead of the task's."""
    verifier: str = "numeric"
    """For a jsonl task: numeric (the final number, exact rationals) or exact (the text after ####)."""
    levels: list[int] | None = None
    """Difficulty levels of the built-in task (None: all)."""
    prompts_per_step: int = 8
    """Prompts sampled per RL step; each gets ``group_size`` completions."""
    group_size: int = 8
    """Completions per prompt (G): the group whose rewards are normalised together."""
    oversample: int = 1
    """DAPO's dynamic sampling: sample this many times ``prompts_per_step`` prompts and train on
    ``prompts_per_step`` of their groups, those with unequal rewards first (``rl/dynamic_sampling.py``).
    The step's reward, accuracy and group figures are of every sampled group."""
    curriculum: str = "none"
    """none: a built-in task's levels come in its fixed mix. signal: each step draws the levels in
    proportion to the share of their recent groups that carried a signal (``rl/curriculum.py``)."""
    curriculum_floor: float = 0.2
    """Under ``curriculum=signal``, the part of every step split evenly between the levels."""
    epochs: int = 1
    """Passes over each step's rollouts (1: strictly on-policy)."""
    mini_batches: int = 1
    """Optimizer updates per epoch (the rollouts split into this many mini-batches)."""
    scale_rewards: str = "group"
    """Advantage = reward - group mean, over the std of the group, the batch, or none (Dr. GRPO)."""
    eps_low: float = 0.2
    """Lower clip of the ratio: 1 - eps_low."""
    eps_high: float = 0.28
    """Upper clip of the ratio: 1 + eps_high (> eps_low: DAPO's clip-higher)."""
    aggregation: str = "token-mean"
    """token-mean | seq-mean-token-mean | seq-mean-token-sum (see rl/grpo.py)."""
    ratio_level: str = "token"
    """token (GRPO) or sequence (GSPO's length-normalised sequence ratio)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL penalty to the frozen initial policy (0: no reference model)."""
    entropy_coef: float = 0.0
    """Coefficient of an entropy bonus on the completion tokens (0: none)."""
    pack: bool = False
    """The trainer's forwards read completions packed end to end in rows of ``data.seq_len`` tokens
    (``rl/packed_rows.py``) instead of padded: the same values, and on one H200 half the trainer side of
    an RL step of rl-hybrid-125m (BENCHMARKS.md), which turns it on; the CPU recipe keeps padded rows."""
    mask_truncated: bool = False
    """On: completions cut by the token limit get no loss and stay out of their group's baseline (their
    reward judges an unfinished answer). Off (TRL's default): a cut completion is scored like any other.
    Masking makes running out the budget free, and a policy that can search learns to (docs/RL.md)."""
    drop_zero_variance: bool = False
    """Drop groups whose rewards are all equal from the update (counted either way)."""
    correction: str = "tis"
    """Rollout / trainer mismatch correction (rl/mismatch.py): none | tis | mask."""
    correction_level: str = "token"
    """token: a weight per token; sequence: one per completion (TRL's sequence_truncate / sequence_mask)."""
    tis_cap: float = 2.0
    """Cap of the importance ratio (TIS), and the bounds [1 / cap, cap] outside which ``mask`` drops."""
    old_logp: str = "trainer"
    """The old policy's log-probabilities: the trainer's (recomputed before the first update, or the
    training forward's own with one update per rollout) or the sampler's (bypass: the clipped ratio
    is the importance weight, so ``tis`` is refused)."""
    reward_timeout: float = 5.0
    """Seconds a user reward function may take per completion before it scores 0."""
    eval_prompts: int = 64
    """Held-out problems per evaluation."""
    eval_samples: int = 8
    """Sampled completions per held-out problem, for pass@1, pass@k and the KL to the starting policy
    (0: greedy pass@1 only)."""
    eval_temperature: float | None = None
    """Temperature of those sampled completions and of the KL to the start (None: the rollouts'). Set
    it to 1.0 to read pass@k of the policy itself while the rollouts sample it cooler."""
    eval_samples_at: str = "every"
    """Which evaluations sample: every one, or the ends only (step 0 and the last step; the ones
    between give greedy pass@1, at about a ninth of the cost with 8 samples)."""

    def __post_init__(self):
        checks = [
            (self.verifier in VERIFIERS, f"rl.verifier must be one of {', '.join(VERIFIERS)}"),
            (self.scale_rewards in SCALES, f"rl.scale_rewards must be one of {', '.join(SCALES)}"),
            (self.aggregation in AGGREGATIONS, f"rl.aggregation must be one of {', '.join(AGGREGATIONS)}"),
            (self.ratio_level in LEVELS, f"rl.ratio_level must be one of {', '.join(LEVELS)}"),
            (self.correction in CORRECTIONS, f"rl.correction must be one of {', '.join(CORRECTIONS)}"),
            (
                self.correction_level in CORRECTION_LEVELS,
                f"rl.correction_level must be one of {', '.join(CORRECTION_LEVELS)}",
            ),
            (
                not (self.old_logp == "sampler" and self.correction == "tis"),
                "rl.correction=tis with rl.old_logp=sampler would weight by the ratio twice (the clipped "
                "ratio is already p_trainer / p_sampler); set rl.correction=none, or mask to drop what "
                "lies beyond rl.tis_cap",
            ),
            (self.old_logp in OLD_LOGP, f"rl.old_logp must be one of {', '.join(OLD_LOGP)}"),
            (
                self.prompts_per_step >= 1 and self.group_size >= 2,
                "rl.prompts_per_step >= 1, rl.group_size >= 2",
            ),
            (self.oversample >= 1, "rl.oversample must be >= 1 (1: train on every sampled group)"),
            (self.curriculum in ("none", "signal"), "rl.curriculum must be none or signal"),
            (0 <= self.curriculum_floor <= 1, "rl.curriculum_floor must lie in [0, 1]"),
            (self.epochs >= 1 and self.mini_batches >= 1, "rl.epochs and rl.mini_batches must be >= 1"),
            (0 <= self.eps_low < 1 and self.eps_high >= 0, "rl.eps_low in [0, 1) and rl.eps_high >= 0"),
            (self.kl_coef >= 0 and self.entropy_coef >= 0, "rl.kl_coef and rl.entropy_coef must be >= 0"),
            (self.tis_cap > 1, "rl.tis_cap must be > 1"),
            (self.reward_timeout > 0, "rl.reward_timeout must be > 0 seconds"),
            (self.eval_prompts >= 1, "rl.eval_prompts must be >= 1"),
            (self.eval_samples >= 0, "rl.eval_samples must be >= 0"),
            (self.eval_samples_at in ("every", "ends"), "rl.eval_samples_at must be every or ends"),
            (
                self.eval_temperature is None or self.eval_temperature > 0,
                "rl.eval_temperature must be > 0 (null: the rollouts' temperature)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
