"""Document boundaries of a packed batch, computed once per forward and shared by every layer.

Training packs several documents into one row of ``L`` tokens; ``doc_ids`` [B, L] says which
document each token belongs to. A packed row must give the same outputs as its documents run one
by one, so every mixer that mixes positions respects the boundaries: attention through a
block-diagonal causal mask, the Mamba-2 conv and SSD scan by resetting their state where the
document changes (see :mod:`inkling_fp4.model.mamba2` and :mod:`inkling_fp4.model.ssd`).

Only changes of ``doc_ids`` between neighbours matter (ids may repeat across non-adjacent
documents); they are turned into segment indices 0, 1, 2, ... per row.

Shape letters: B batch, L length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_ALWAYS_MASKED = [False]


def segment_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """[b, l] document ids -> [b, l] int64 segment index 0, 1, ... that steps where ``doc_ids`` changes.

    Only changes matter, so ids may repeat across non-adjacent documents.
    """
    step = torch.zeros_like(doc_ids, dtype=torch.long)
    step[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).long()
    return step.cumsum(-1)


@contextlib.contextmanager
def always_masked() -> Iterator[None]:
    """Within this context every batch with ``doc_ids`` takes the masked path, with no host sync to
    choose: what a CUDA graph capture needs (it may not read the device, and its kernels must serve
    every later batch), and what its eager warm-up needs, so that it autotunes those same kernels."""
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
        """None when there is nothing to mask (no doc_ids, or one document per row): the fast paths
        (``is_causal`` attention, unmasked scan) then run. One host sync decides that per forward,
        except within :func:`always_masked` (the masked path gives the same outputs for one
        document). ``attention=False`` skips the B·L² mask for models without attention layers."""
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
