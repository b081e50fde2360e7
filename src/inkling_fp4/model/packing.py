"""Document boundaries of a packed batch, computed once per forward and shared by every layer.

A packed row must give the outputs of its documents run one by one: attention uses a block-diagonal
causal mask, the Mamba-2 conv and scan reset their state where ``doc_ids`` [B, L] changes (ids may
repeat across non-adjacent documents).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_ALWAYS_MASKED = [False]


def segment_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, l] document ids -> [b, l] int64 segment index 0, 1, ... that steps where ``doc_ids`` changes."""
    step = torch.zeros_like(doc_ids, dtype=torch.long)
    step[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).long()
    return step.cumsum(-1)


@contextlib.contextmanager
def always_masked() -> Iterator[None]:
    """Within this context every batch with ``doc_ids`` takes the masked path, with no host sync to choose:
    for a CUDA graph capture (its kernels must serve every later batch) and its eager warm-up."""
    previous = _ALWAYS_MASKED[0]
    _ALWAYS_MASKED[0] = True
    try:
        yield
    finally:
        _ALWAYS_MASKED[0] = previous


@dataclass
class Packing:
    seg: torch.Tensor
    """[B, L] int64 segment index per token, stepping by one at each document boundary."""
    attn_mask: torch.Tensor | None
    """[B, 1, L, L] bool, True where query i may attend to key j: j <= i and the same document
    (None when the model has no attention layer)."""

    @staticmethod
    def from_doc_ids(doc_ids: torch.Tensor | None, attention: bool = True) -> Packing | None:
        """None when there is nothing to mask (no doc_ids, or one document per row), so the fast paths run;
        one host sync decides that, except within :func:`always_masked`. ``attention=False`` skips the B·L²
        mask for models without attention layers."""
        if doc_ids is None:
            return None
        seg = segment_ids(doc_ids)
        if not _ALWAYS_MASKED[0] and not bool(seg[:, -1].any()):
            return None
        if not attention:
            return Packing(seg=seg, attn_mask=None)
        L = seg.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=seg.device).tril()
        same_doc = seg[:, :, None] == seg[:, None, :]  # [B, L, L]
        return Packing(seg=seg, attn_mask=(same_doc & causal)[:, None])
