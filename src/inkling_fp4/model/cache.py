"""Inference cache for generation: per attention layer the keys and values so far; per Mamba-2 layer
the conv window and the SSM state, FP32 at least (it integrates over the whole sequence; BF16 would
drift); nothing for MLP layers.

Each sequence has its own length (``lengths``); prompts are right-padded. Padding never enters the
cache: it is zeros in the KV cache (masked when read), not part of the conv state, and reaches the SSM
with dt = 0, which neither decays nor feeds the state.

Shape letters: B batch, T max_len, H heads, P head dim, N state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionState:
    k: torch.Tensor
    """[B, T, H_kv, hd] keys of the positions so far (zeros beyond each sequence's length)."""
    v: torch.Tensor
    """[B, T, H_kv, hd] values, like ``k``."""

    def reset(self) -> None:
        self.k.zero_()
        self.v.zero_()


@dataclass
class MambaState:
    conv: torch.Tensor
    """[B, conv_dim, k-1] the last k-1 conv inputs (x||B||C before the conv), oldest first."""
    ssm: torch.Tensor
    """[B, H, P, N] SSM state S, FP32 (FP64 in a cache allocated for FP64)."""
    done: torch.Tensor | None = None
    """[B, G + 1] int32 scratch of the fused decode kernel (finished heads per group, counted modulo H/G,
    then finished groups per row), kept here so a step allocates and clears nothing; None on CPU."""

    def reset(self) -> None:
        self.conv.zero_()
        self.ssm.zero_()
        if self.done is not None:
            self.done.zero_()


@dataclass
class InferenceCache:
    layers: list[AttentionState | MambaState | None]
    """One entry per layer of the pattern (None for MLP layers)."""
    lengths: torch.Tensor
    """[B] int64 tokens held per sequence; the next token of sequence b goes to position lengths[b]."""
    max_len: int
    """Capacity in tokens per sequence."""
    longest: int = 0
    """max(lengths) kept on the host, so decoding needs no device sync to size its attention."""

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def reset(self) -> None:
        for state in self.layers:
            if state is not None:
                state.reset()
        self.lengths.zero_()
        self.longest = 0

    def valid_mask(self, length: int) -> torch.Tensor:
        """[B, length] bool: True at the real (not padded) positions 0 .. lengths[b]-1."""
        return torch.arange(length, device=self.lengths.device)[None, :] < self.lengths[:, None]

    def write_rows(self, rows: torch.Tensor, src: InferenceCache, src_rows: torch.Tensor) -> None:
        """Rows ``rows`` of this cache become rows ``src_rows`` of ``src`` (which may be this cache), KV
        positions past ``src.max_len`` zeroed; ``longest`` stays the caller's to set."""
        if src.max_len > self.max_len:
            raise ValueError(f"write_rows: a cache of max_len {src.max_len} into one of {self.max_len}")
        for mine, theirs in zip(self.layers, src.layers, strict=True):
            if isinstance(mine, AttentionState):
                for dst_t, src_t in ((mine.k, theirs.k), (mine.v, theirs.v)):
                    block = src_t[src_rows]  # [r, src.max_len, H_kv, hd], a copy (src may be self)
                    dst_t[rows, : block.shape[1]] = block
                    if block.shape[1] < dst_t.shape[1]:
                        dst_t[rows, block.shape[1] :] = 0
            elif isinstance(mine, MambaState):
                mine.conv[rows] = theirs.conv[src_rows]
                mine.ssm[rows] = theirs.ssm[src_rows]
                if mine.done is not None:
                    mine.done[rows] = theirs.done[src_rows] if theirs.done is not None else 0
        self.lengths[rows] = src.lengths[src_rows]
