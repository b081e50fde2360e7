"""GRPO and its common variants: group advantages, the clipped policy loss, its aggregation, KL.

Notation (per completion i of a group, per token t of it):

    A_i        advantage: r_i - mean(r_group), divided by std(r_group) (``scale=group``, GRPO),
               by the std over the whole batch (``scale=batch``), or not at all (``scale=none``,
               Dr. GRPO: dividing by a small group std up-weights near-solved prompts); the std
               is the unbiased one plus 1e-4, as TRL's; mean and std over the completions the loss
               trains (those cut by the token budget left out under ``rl.mask_truncated``)
    rho_it     exp(logp_it - old_logp_it): the ratio of the policy being trained to the policy that
               sampled (``level=token``), or GSPO's sequence ratio exp(mean_t (logp - old_logp)) shared
               by every token of the completion (``level=sequence``)
    L_it       -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)
               (PPO's pessimistic bound; eps_high > eps_low is DAPO's clip-higher, which leaves
               low-probability tokens room to grow)
    KL_it      k3 = exp(ref - logp) - (ref - logp) - 1 >= 0, an unbiased, low-variance estimate of
               KL(pi || pi_ref) per token (Schulman's k3)

Aggregation of L over the tokens of the batch (``mask`` marks completion tokens):

    token-mean             sum_it L_it / sum_it 1         (DAPO; each token weighs the same)
    seq-mean-token-mean    mean_i (sum_t L_it / T_i)      (GRPO's paper; each completion the same)
    seq-mean-token-sum     mean_i (sum_t L_it)            (Dr. GRPO with a constant length: no
                                                          length bias from the per-sequence mean)

Shapes: B completions (G per group, B = N groups x G), T completion tokens (padded, ``mask_BT``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALES = ("group", "batch", "none")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LEVELS = ("token", "sequence")


def group_advantages(
    rewards_NG: torch.Tensor, scale: str = "group", eps: float = 1e-4, counted_NG: torch.Tensor | None = None
) -> torch.Tensor:
    """[N groups, G] rewards -> [N, G] advantages (see the module docstring). A group whose rewards
    are all equal gets advantage 0 whatever the scale: it carries no signal.

    ``counted_NG`` (bool, None: all): the completions the baseline is of. The others (those cut by
    the token budget, which the loss leaves out) get advantage 0 and move no one else's: counted in
    the mean, a cut-off completion's reward 0 would lift every finished answer of its group above
    the baseline, wrong ones included, and teach the policy to stop early."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, not {scale!r}")
    r = rewards_NG.double()
    c = torch.ones_like(r) if counted_NG is None else counted_NG.to(r.dtype)
    n = c.sum(dim=1, keepdim=True)
    # sums of 0/1 multiples are exact, so a group of equal rewards centres to exactly 0
    centred = (r - (r * c).sum(dim=1, keepdim=True) / n.clamp(min=1)) * c
    if scale == "none" or r.shape[1] < 2:
        return centred.to(rewards_NG.dtype)
    if scale == "group":  # the unbiased std of each group's counted rewards
        std = ((centred**2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    else:  # of every counted reward of the batch
        all_mean = (r * c).sum() / c.sum().clamp(min=1)
        std = (((r - all_mean) ** 2 * c).sum() / (c.sum() - 1).clamp(min=1)).sqrt().expand(r.shape[0], 1)
    scaled = torch.where(std > 0, centred / (std + eps), torch.zeros_like(centred))
    return scaled.to(rewards_NG.dtype)


def zero_variance_groups(rewards_NG: torch.Tensor, counted_NG: torch.Tensor | None = None) -> torch.Tensor:
    """[N] bool: groups whose counted rewards (``counted_NG``, None: all) are all equal, no learning
    signal (a group with fewer than two counted has none either)."""
    if counted_NG is None:
        counted_NG = torch.ones_like(rewards_NG, dtype=torch.bool)
    top = torch.where(counted_NG, rewards_NG, -torch.inf).amax(dim=1)
    bottom = torch.where(counted_NG, rewards_NG, torch.inf).amin(dim=1)
    return ~(top > bottom)


def log_ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor, level: str):
    """log rho [B, T]: per token, or GSPO's per-sequence mean broadcast over the sequence's tokens."""
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}, not {level!r}")
    diff = (logp_BT - old_logp_BT) * mask_BT
    if level == "token":
        return diff
    seq_B1 = diff.sum(dim=1, keepdim=True) / mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    return seq_B1.expand_as(diff) * mask_BT


@dataclass
class PolicyLoss:
    loss_BT: torch.Tensor
    """Per-token clipped loss L_it (0 outside the mask)."""
    clipped_low_BT: torch.Tensor
    """Tokens where the lower clip bound is the active term (rho < 1 - eps_low, A < 0)."""
    clipped_high_BT: torch.Tensor
    """Tokens where the upper clip bound is the active term (rho > 1 + eps_high, A > 0)."""


def clipped_policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    adv_B: torch.Tensor,
    mask_BT: torch.Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    level: str = "token",
) -> PolicyLoss:
    """PPO / GRPO's clipped surrogate, per token (see the module docstring)."""
    mask = mask_BT.to(logp_BT.dtype)
    rho = torch.exp(log_ratio(logp_BT, old_logp_BT, mask, level))
    adv = adv_B[:, None].to(logp_BT.dtype)
    unclipped = rho * adv
    clipped = torch.clamp(rho, 1 - eps_low, 1 + eps_high) * adv
    loss = -torch.minimum(unclipped, clipped) * mask
    active = (clipped < unclipped) & mask.bool()  # the clip bound is what min() picked
    return PolicyLoss(
        loss, active & (adv < 0) & (rho < 1 - eps_low), active & (adv > 0) & (rho > 1 + eps_high)
    )


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str) -> torch.Tensor:
    """The batch's loss from per-token losses (see the module docstring)."""
    mask = mask_BT.to(loss_BT.dtype)
    if mode == "token-mean":
        return (loss_BT * mask).sum() / mask.sum().clamp(min=1)
    per_seq = (loss_BT * mask).sum(dim=1)
    if mode == "seq-mean-token-mean":
        return (per_seq / mask.sum(dim=1).clamp(min=1)).mean()
    if mode == "seq-mean-token-sum":
        return per_seq.mean()
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {mode!r}")


def token_weights(
    mask_BT: torch.Tensor, mode: str, tokens: float | None = None, rows: int | None = None
) -> torch.Tensor:
    """[B, T] weights w with sum(w * L) / sum(mask) == ``aggregate(L, mask, mode)``: the shared trainer's
    form (a summed loss divided by the trained-token count).

    Split over ranks, pass the whole batch's ``tokens`` and ``rows``, since the trainer divides each
    rank's summed loss by the token count of all ranks."""
    mask = mask_BT.to(torch.float64)
    n = (mask.sum() if tokens is None else torch.tensor(float(tokens), dtype=torch.float64)).clamp(min=1)
    rows = mask.shape[0] if rows is None else rows
    if mode == "token-mean":
        w = mask
    elif mode == "seq-mean-token-mean":
        w = mask * n / (rows * mask.sum(dim=1, keepdim=True).clamp(min=1))
    elif mode == "seq-mean-token-sum":
        w = mask * n / rows
    else:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, not {mode!r}")
    return w.to(torch.float32)


def k3_kl(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(d) - d - 1 with d = ref - logp (>= 0)."""
    d = ref_logp_BT - logp_BT
    return torch.exp(d) - d - 1
