"""Rollout / trainer mismatch: how far the sampler's log-probabilities are from the trainer's, and the
corrections for it.

Sampler and trainer compute log p of the same token with the same weights but not the same
arithmetic (another batch, and NVFP4's tensor activation scale is a batch amax; other kernels; a
cache), so "on-policy" samples are slightly off-policy. Per token, d = logp_trainer - logp_sampler:

    k3      mean of exp(-d) + d - 1: the k3 estimate of KL(sampler || trainer) (>= 0)
    |d|     mean and max of |d|
    ratio   exp(d): min / mean / max, and the fraction beyond the cap

Corrections (TRL's ``vllm_importance_sampling_mode`` settings) weight each token's loss by w (no
gradient); at sequence level w is one per completion, from its summed d:

    tis     truncated importance sampling: w = min(exp(d), cap) (bounded variance)
    mask    masked importance sampling: w = exp(d) inside [1/cap, cap], else 0 (token or completion dropped)
    none    w = 1: the samples are treated as on-policy

With ``rl.old_logp=sampler`` (bypass) the clipped ratio already is p_trainer / p_sampler, so no second
weight may multiply it: ``mask`` only drops (w = 0 or 1), and ``tis`` is refused by the config.

Shapes: B completions, T completion tokens (padded; ``mask_BT`` marks real ones).
"""

from __future__ import annotations

import torch

CORRECTIONS = ("none", "tis", "mask")
LEVELS = ("token", "sequence")


def mismatch_stats(
    trainer_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float
) -> dict[str, float]:
    """The figures of the module docstring over the masked tokens (0 for an empty mask)."""
    return stats_from_parts(*mismatch_parts(trainer_logp_BT, sampler_logp_BT, mask_BT, cap))


def mismatch_parts(
    trainer_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The figures as pieces ranks can combine, float64: sums [5] of 1, k3, |d|, ratio and "beyond the
    cap" over the masked tokens; maxima [3] of |d|, ratio and -ratio."""
    m = mask_BT.bool()
    if not m.any():  # the identities of the sums and maxima
        return torch.zeros(5, dtype=torch.float64), torch.tensor([0.0, 0.0, -torch.inf], dtype=torch.float64)
    d = (trainer_logp_BT.double() - sampler_logp_BT.double())[m]
    ratio = torch.exp(d)
    sums = torch.stack([
        torch.tensor(float(d.numel()), dtype=torch.float64), (torch.exp(-d) + d - 1).sum(), d.abs().sum(),
        ratio.sum(), ((ratio > cap) | (ratio < 1 / cap)).double().sum(),
    ])  # fmt: skip
    return sums, torch.stack([d.abs().max(), ratio.max(), (-ratio).max()])


def stats_from_parts(sums_5: torch.Tensor, maxima_3: torch.Tensor) -> dict[str, float]:
    """The figures of the module docstring from :func:`mismatch_parts` (0 when no token is masked)."""
    n = sums_5[0]
    if n == 0:
        keys = ("k3", "abs_mean", "abs_max", "ratio_min", "ratio_mean", "ratio_max", "frac_over_cap")
        return dict.fromkeys(keys, 0.0)
    return {
        "k3": float(sums_5[1] / n),
        "abs_mean": float(sums_5[2] / n),
        "abs_max": float(maxima_3[0]),
        "ratio_min": float(-maxima_3[2]),
        "ratio_mean": float(sums_5[3] / n),
        "ratio_max": float(maxima_3[1]),
        "frac_over_cap": float(sums_5[4] / n),
    }


def correction_weights(
    trainer_logp_BT: torch.Tensor,
    sampler_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    cap: float,
    level: str = "token",
    reweight: bool = True,
) -> torch.Tensor:
    """[B, T] per-token loss weights (no gradient) of ``mode`` at ``level`` (see the module docstring);
    ``reweight`` False (bypass) keeps only the 0 / 1 rejection of ``mask``."""
    if mode not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, not {mode!r}")
    if level not in LEVELS:
        raise ValueError(f"correction level must be one of {LEVELS}, not {level!r}")
    mask = mask_BT.to(torch.float32)
    if mode == "none":
        return mask
    d_BT = (trainer_logp_BT.detach().double() - sampler_logp_BT.double()) * mask
    d = d_BT.sum(dim=1, keepdim=True) if level == "sequence" else d_BT  # [B, 1] or [B, T]
    ratio = torch.exp(d)
    if mode == "tis":
        if not reweight:
            raise ValueError("tis reweights by the ratio, which the clipped ratio of the bypass mode holds")
        return (torch.clamp(ratio, max=cap) * mask).to(torch.float32)
    inside = (ratio <= cap) & (ratio >= 1 / cap)
    w = torch.where(inside, ratio if reweight else torch.ones_like(ratio), torch.zeros_like(ratio))
    return (w * mask).to(torch.float32)
