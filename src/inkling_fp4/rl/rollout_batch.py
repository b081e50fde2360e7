"""Sampled completions as training rows, and the log-probabilities a forward pass gives them.

A row is prompt + completion shifted by one: ``input_ids`` are tokens 0 .. n-2, ``targets`` 1 .. n-1;
the loss mask keeps completion targets only (the prompt is never trained). Rows are right-padded to
the longest (causal, so padding never reaches a real position). Per-token tensors are aligned with
``targets``: ``sampler_logp[b, t]`` is the sampler's log p of ``targets[b, t]``.

Shapes: B rows (prompts x G), L the longest row minus one, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor  # [B, L] int64
    targets: torch.Tensor  # [B, L] int64
    loss_mask: torch.Tensor  # [B, L] bool: completion targets that are trained
    advantages: torch.Tensor  # [B] float32
    sampler_logp: torch.Tensor  # [B, L] float32: the sampler's log p of each target (0 elsewhere)
    old_logp: torch.Tensor  # [B, L] float32: the old policy's (trainer's recomputation or the sampler's)
    weights: torch.Tensor  # [B, L] float32: the aggregation's token weights (no gradient)
    ref_logp: torch.Tensor | None = None  # [B, L]: the frozen reference policy's, for the KL penalty
    doc_ids: torch.Tensor | None = None  # one document per row: no packing
    correction: torch.Tensor | None = None  # [B, L] float32: the mismatch correction's weights (None: 1)
    lengths: torch.Tensor | None = None  # [B] int64: each row's real tokens (None: not known, no packing)

    @property
    def num_tokens(self) -> int:
        """Trained target tokens (the trainer divides the summed loss by their count)."""
        return int(self.loss_mask.sum())

    def to(self, device, non_blocking: bool = False) -> RolloutBatch:
        def move(v):
            return v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor) else v

        return RolloutBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def rows(self, index: torch.Tensor | slice) -> RolloutBatch:
        def pick(v):
            return v[index] if isinstance(v, torch.Tensor) else v

        return RolloutBatch(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})

    def state(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def build_rows(
    prompts: list[list[int]], completions: list[list[int]], logprobs: list[list[float]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids [B, L], targets [B, L], completion mask [B, L], sampler log p [B, L])."""
    L = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True)) - 1
    B = len(prompts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    targets = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.bool)
    logp = torch.zeros(B, L, dtype=torch.float32)
    for b, (p, c, lp) in enumerate(zip(prompts, completions, logprobs, strict=True)):
        seq = torch.tensor(p + c, dtype=torch.long)
        n = len(seq) - 1
        input_ids[b, :n], targets[b, :n] = seq[:-1], seq[1:]
        start = len(p) - 1  # the target at position len(p) - 1 is the first completion token
        mask[b, start : start + len(c)] = True
        logp[b, start : start + len(c)] = torch.tensor(lp, dtype=torch.float32)
    return input_ids, targets, mask, logp


def row_lengths(prompts: list[list[int]], completions: list[list[int]]) -> torch.Tensor:
    """[B] int64: the real tokens of each row of :func:`build_rows` (prompt + completion - 1)."""
    return torch.tensor([len(p) + len(c) - 1 for p, c in zip(prompts, completions, strict=True)])


def token_logprobs(
    logits_BLV: torch.Tensor,
    targets_BL: torch.Tensor,
    entropy: bool = False,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p(target) [B, L], entropy [B, L] or None) in FP32 from logits [B, L, V] / ``temperature``:
    the distribution the sampler drew from, before top-k / top-p truncation (as TRL takes it).
    ``entropy_grad`` False: the entropy as a figure only, outside autograd (no [B, L, V] kept for it)."""
    logp_BLV = F.log_softmax(logits_BLV.float() / temperature, dim=-1)
    picked = logp_BLV.gather(-1, targets_BL[..., None])[..., 0]
    if not entropy:
        return picked, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return picked, -(logp_BLV.exp() * logp_BLV).sum(-1)
