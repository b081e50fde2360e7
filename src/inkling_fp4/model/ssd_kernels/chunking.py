"""The chunk layout shared by the SSD kernels and their torch twins: padding and document masks.

The kernels see a sequence of length l as c = ceil(l / q) chunks of q positions. Positions past l behave
as dt = 0 (no decay, no input), so a padded chunk ends with the state of its last real token.

Packed documents are described by a segment index per position (0, 1, ... stepping where ``doc_ids``
changes, padded with its last value). Three masks follow from it, per chunk:

    same[t, s]  = seg_t == seg_s          inputs of s reach output t only inside one document
    m_in[t]     = seg_t == seg_start      the state entering the chunk reaches output t
    m_out[s]    = seg_s == seg_end        input s reaches the state leaving the chunk
    carry       = seg_start == seg_end    the entering state survives to the leaving state

where seg_start is the segment of the position before the chunk (the first document for chunk 0: the
initial state belongs to it) and seg_end the segment of the chunk's last position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inkling_fp4.model.packing import segment_ids


def num_chunks(length: int, chunk_size: int) -> int:
    return -(-length // chunk_size)


def padded_segments(doc_ids: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """doc_ids: [b, l] -> int32 segment index [b, L], L = c*q, padded with the last segment."""
    seg = segment_ids(doc_ids).to(torch.int32)
    pad = (-seg.shape[1]) % chunk_size
    return torch.cat([seg, seg[:, -1:].expand(-1, pad)], 1).contiguous()


def to_chunks(t: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[b, l, ...] -> [b, c, q, ...], zero-padded along l."""
    pad = (-t.shape[1]) % chunk_size
    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.view(t.shape[0], -1, chunk_size, *t.shape[2:])


def from_chunks(t: torch.Tensor, length: int) -> torch.Tensor:
    """[b, c, q, ...] -> [b, l, ...]."""
    return t.reshape(t.shape[0], -1, *t.shape[3:])[:, :length]


def heads_from_groups(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., g, n] -> [..., h, n]: head h reads group h // (h / g)."""
    return t.repeat_interleave(heads // t.shape[-2], dim=-2)


def chunk_masks(
    seg: torch.Tensor | None, batch: int, chunks: int, chunk_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The masks of the module docstring as bool tensors, causality included in ``same``:
    same [b, c, t, s] (s <= t), m_in [b, c, t], m_out [b, c, s], carry [b, c]."""
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=device).tril()
    if seg is None:
        ones = torch.ones(batch, chunks, chunk_size, dtype=torch.bool, device=device)
        return causal.expand(batch, chunks, -1, -1), ones, ones, ones[..., 0]
    s = seg.view(batch, chunks, chunk_size)
    seg_start = torch.cat([s[:, :1, 0], s[:, :-1, -1]], 1)  # [b, c]
    seg_end = s[:, :, -1]  # [b, c]
    same = (s[..., :, None] == s[..., None, :]) & causal
    return same, s == seg_start[..., None], s == seg_end[..., None], seg_start == seg_end


def assert_buffers(*tensors: torch.Tensor | None) -> None:
    """The kernels index their own buffers (dt_t, G, seg, states and their gradients) as contiguous."""
    for t in tensors:
        assert t is None or t.is_contiguous(), f"SSD buffer {tuple(t.shape)} is not contiguous"


def ref_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The twins compute in FP32, or FP64 when any input is FP64."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32
