"""An RL step's batch figures over every rank: each figure (logged, or needed by the advantages and
token weights) equals the one-process figure over all ranks' completions.

Each rank samples a contiguous share of the step's prompts (:func:`rank_share`, whole groups), so
gathering in rank order restores the prompt order. In one process every function is the identity.
"""

from __future__ import annotations

import torch

from inkling_fp4 import distributed as D
from inkling_fp4.rl import mismatch


def rank_share(items, dist: D.DistInfo):
    """This rank's contiguous share of ``items`` (a list, or a tensor along dim 0); sizes differ by <= 1."""
    n, r, w = len(items), dist.rank, dist.world_size
    return items[r * n // w : (r + 1) * n // w]


def sum_ranks(x: torch.Tensor, dist: D.DistInfo) -> torch.Tensor:
    """A host tensor summed over the ranks (itself in one process)."""
    if not dist.active:
        return x
    return D.all_reduce_sum(x.to(dist.device), dist).cpu()


def max_ranks(values: list[float], dist: D.DistInfo) -> list[float]:
    """Host figures, each the max over the ranks (themselves in one process)."""
    if not dist.active:
        return values
    x = torch.tensor(values, dtype=torch.float64, device=dist.device)
    D.all_reduce_max(x, dist)
    return x.tolist()


def all_completions(
    rewards: list[float], lengths: list[int], truncated: list[bool], group_size: int, dist: D.DistInfo
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's per-completion figures -> (rewards [P, G], lengths [P x G], truncated [P x G]) of
    every rank's completions, in the step's prompt order."""
    per_B3 = torch.tensor([list(row) for row in zip(rewards, lengths, truncated, strict=True)],
                          dtype=torch.float64).reshape(-1, 3)  # fmt: skip
    if dist.active:
        per_B3 = D.all_gather_rows(per_B3.to(dist.device), dist).cpu()
    r, n, t = per_B3.float().unbind(1)
    return r.view(-1, group_size), n, t.bool()


def token_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor, dist: D.DistInfo) -> float:
    """The mean of ``x`` over the masked tokens of every rank."""
    sums = sum_ranks(torch.stack([(x_BT * mask_BT).sum(), mask_BT.sum().float()]), dist)
    return float(sums[0] / sums[1].clamp(min=1))


def mismatch_figures(
    t_logp: torch.Tensor, s_logp: torch.Tensor, mask: torch.Tensor, cap: float, dist: D.DistInfo
) -> dict[str, float]:
    """The mismatch figures (``rl/mismatch.py``) over the completion tokens of every rank."""
    sums, maxima = mismatch.mismatch_parts(t_logp, s_logp, mask, cap)
    if dist.active:
        sums = sum_ranks(sums, dist)
        maxima = torch.tensor(max_ranks(maxima.tolist(), dist), dtype=torch.float64)
    return mismatch.stats_from_parts(sums, maxima)
