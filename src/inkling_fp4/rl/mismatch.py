"""Rollout / trainer mismatch: how far the sampler's log-probabilities are from the trainer's, and the
corrections for it.

The sampler and the trainer compute log p of the same sampled token with the same weights, but not
the same arithmetic: another batch (NVFP4's per-tensor activation scale is an amax over the batch),
another kernel, a cache instead of a full forward. So the "on-policy" samples are slightly
off-policy. Measured per token, with d = logp_trainer - logp_sampler over the completion tokens:

    k3      mean of exp(-d) + d - 1: the k3 estimate of KL(sampler || trainer) (>= 0)
    |d|     mean and max of |d|
    ratio   exp(d): min / mean / max, and the fraction beyond the cap

Corrections (``rl.correction``):

    tis     truncated importance sampling: each token's loss weighted by min(exp(d), cap), a
            constant (no gradient through it); unbiased up to the cap, bounded variance beyond it
    mask    sequence masking: a completion with any token whose ratio leaves [1/cap, cap] is
            dropped from the loss
    none    the samples are treated as on-policy

Shapes: B completions, T completion tokens (padded; ``mask_BT`` marks real ones).
"""

from __future__ import annotations

import torch

CORRECTIONS = ("none", "tis", "mask")


def mismatch_stats(
    trainer_logp_BT: torch.Tensor, sampler_logp_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float
) -> dict[str, float]:
    """The figures of the module docstring over the masked tokens (0 for an empty mask)."""
    m = mask_BT.bool()
    if not m.any():
        keys = ("k3", "abs_mean", "abs_max", "ratio_min", "ratio_mean", "ratio_max", "frac_over_cap")
        return dict.fromkeys(keys, 0.0)
    d = (trainer_logp_BT.double() - sampler_logp_BT.double())[m]
    ratio = torch.exp(d)
    return {
        "k3": float((torch.exp(-d) + d - 1).mean()),
        "abs_mean": float(d.abs().mean()),
        "abs_max": float(d.abs().max()),
        "ratio_min": float(ratio.min()),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "frac_over_cap": float(((ratio > cap) | (ratio < 1 / cap)).double().mean()),
    }


def correction_weights(
    trainer_logp_BT: torch.Tensor,
    sampler_logp_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    cap: float,
) -> torch.Tensor:
    """[B, T] per-token loss weights (no gradient) of ``mode`` (see the module docstring)."""
    if mode not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, not {mode!r}")
    mask = mask_BT.to(torch.float32)
    if mode == "none":
        return mask
    d = (trainer_logp_BT.detach().double() - sampler_logp_BT.double()) * mask
    ratio = torch.exp(d)
    if mode == "tis":
        return (torch.clamp(ratio, max=cap) * mask).to(torch.float32)
    outside = ((ratio > cap) | (ratio < 1 / cap)) & mask_BT.bool()
    keep_B1 = ~outside.any(dim=1, keepdim=True)
    return mask * keep_B1.to(torch.float32)
