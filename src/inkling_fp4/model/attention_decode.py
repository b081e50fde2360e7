"""Decode attention with grouped-query heads: one new query per sequence against its cached keys.

    cache[b, len[b]] <- (k_b, v_b)                                   # this token's key and value
    y[b, h] = softmax_t(q[b, h] . k_cache[b, t, h // R] / sqrt(Dh)) v_cache[b, t, h // R],  t <= len[b]

The query heads are grouped ([B, K, R, Dh]): repeating the K/V heads R times would copy the cache every
step. Lengths are read from the device, so the step keeps one shape (CUDA graphs).

Shape letters: B batch, T cache length, H query heads, K kv heads, R = H / K, Dh head dim.
"""

from __future__ import annotations

import torch

from inkling_fp4.model.compiled import fast_forms_on
from inkling_fp4.model.norm import at_least_fp32


def gqa_decode_ref(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    span: int | None = None,
) -> torch.Tensor:
    """The torch twin of the kernel. q: [B, H, Dh]; k_new, v_new: [B, K, Dh]; caches: [B, T, K, Dh];
    lengths: [B] -> y [B, H, Dh], after writing k_new, v_new at ``lengths``. ``span``: attend positions
    < span only (saves work on CPU)."""
    Bsz, H, Dh = q.shape
    K = k_new.shape[1]
    rows = torch.arange(Bsz, device=q.device)
    k_cache[rows, lengths] = k_new.to(k_cache.dtype)
    v_cache[rows, lengths] = v_new.to(v_cache.dtype)
    T = k_cache.shape[1] if span is None else span
    cdt = torch.promote_types(at_least_fp32(q).dtype, k_cache.dtype)
    qg = q.unflatten(1, (K, H // K)).to(cdt)  # [B, K, R, Dh]: no copy of K/V per query head
    keys, values = k_cache[:, :T].to(cdt), v_cache[:, :T].to(cdt)  # [B, T, K, Dh]
    scores = torch.einsum("bkrd,btkd->bkrt", qg, keys) * Dh**-0.5  # [B, K, R, T]
    visible = torch.arange(T, device=q.device)[None, :] <= lengths[:, None]  # [B, T]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    y = torch.einsum("bkrt,btkd->bkrd", scores.softmax(-1), values)  # [B, K, R, Dh]
    return y.flatten(1, 2).to(q.dtype)


def gqa_decode(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    span: int | None = None,
) -> torch.Tensor:
    """:func:`gqa_decode_ref`, as the Triton kernel on CUDA (which ignores ``span``)."""
    if fast_forms_on(q) and k_cache.dtype in (torch.float32, torch.bfloat16, torch.float16):
        from inkling_fp4.model.decode_kernels import gqa_decode_triton  # needs triton

        return gqa_decode_triton(q, k_new, v_new, k_cache, v_cache, lengths)
    return gqa_decode_ref(q, k_new, v_new, k_cache, v_cache, lengths, span)
