"""DAPO's dynamic sampling: sample more prompts than a step trains on, and train on the groups that
carry a signal (rewards not all equal) first.

A group of equal rewards has advantage 0 and adds nothing to the gradient but its tokens; once a
policy solves most problems, or none, most groups are such. Sampling ``oversample`` x the step's
prompts and keeping the step's count, signal first, fills the update with groups it can learn from
at the cost of the extra sampling. Under torchrun each rank keeps its share from its own groups, so
every rank trains as many rows as the others (one process keeps from all).
"""

from __future__ import annotations

import torch


def kept_groups(no_signal_S: torch.Tensor, world: int, keep: int) -> list[int]:
    """The indices (in prompt order) of the ``keep`` groups that train, of ``no_signal_S`` [S] bool
    (``grpo.zero_variance_groups``) over every sampled group of the step, the ranks' shares one after
    another. Each rank's share of S / world groups gives keep / world of them: those with a signal in
    prompt order, then the others."""
    S = no_signal_S.shape[0]
    if S % world or keep % world or keep > S:
        raise ValueError(f"kept_groups: {keep} of {S} groups, {world} ranks: at most all, by equal shares")
    signal_S = (~no_signal_S).tolist()
    share, kept_share = S // world, keep // world
    kept: list[int] = []
    for r in range(world):
        own = range(r * share, (r + 1) * share)
        ranked = [i for i in own if signal_S[i]] + [i for i in own if not signal_S[i]]
        kept += sorted(ranked[:kept_share])
    return kept
