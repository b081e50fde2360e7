"""Grouped-query causal self-attention, as in Nemotron-H: no positional embedding, no biases.

No RoPE: the Mamba-2 layers before attention already encode order. ``n_kv_heads`` key/value heads
are each shared by ``n_heads / n_kv_heads`` query heads; Q, K and V come from one fused projection.
Unpacked batches use ``is_causal=True`` (flash kernels); packed ones the block-diagonal mask of
``model/packing.py``. NOTE SDPA's flash kernels take no mask, so packed batches run the
memory-efficient kernel, and the mask costs B·L² bytes. Only the two projections are QuantLinear.

Shape letters: B batch, L length, D d_model, H query heads, K kv heads, E head dim, T cached length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inkling_fp4.model.attention_decode import gqa_decode
from inkling_fp4.model.cache import AttentionState, InferenceCache
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.packing import Packing
from inkling_fp4.precision.quant_linear import QuantLinear


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.attn_head_dim
        qkv_width = (cfg.n_heads + 2 * cfg.n_kv_heads) * self.head_dim
        self.qkv_proj = QuantLinear(cfg.d_model, qkv_width, layer_idx=layer_idx, name="attn.qkv_proj")
        self.o_proj = QuantLinear(
            cfg.n_heads * self.head_dim, cfg.d_model, layer_idx=layer_idx, name="attn.o_proj"
        )

    def output_projections(self) -> list[QuantLinear]:
        return [self.o_proj]

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [..., D] -> q: [..., H, E], k, v: [..., K, E]."""
        return self._heads(self.qkv_proj(x))

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """qkv_proj's output [..., (H + 2K) E] -> q: [..., H, E], k, v: [..., K, E]."""
        q, k, v = qkv.split(
            [self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim, self.n_kv_heads * self.head_dim],
            -1,
        )
        return (
            q.unflatten(-1, (self.n_heads, self.head_dim)),
            k.unflatten(-1, (self.n_kv_heads, self.head_dim)),
            v.unflatten(-1, (self.n_kv_heads, self.head_dim)),
        )

    def _attend(self, q, k, v, attn_mask: torch.Tensor | None) -> torch.Tensor:
        """q: [B, Lq, H, E], k, v: [B, Lk, K, E] -> [B, Lq, H E]; causal when attn_mask is None."""
        rep = self.n_heads // self.n_kv_heads
        # K/V heads are repeated explicitly rather than through SDPA's enable_gqa, which not every
        # fused kernel accepts (a silent fall back to the math kernel would cost O(L^2) memory).
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, E]
        k = k.repeat_interleave(rep, dim=1).to(q.dtype)  # [B, H, Lk, E]
        v = v.repeat_interleave(rep, dim=1).to(q.dtype)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        return y.transpose(1, 2).flatten(2)  # [B, Lq, H E]

    def forward(self, x: torch.Tensor, packing: Packing | None = None):
        """x: [B, L, D] -> [B, L, D]."""
        q, k, v = self._qkv(x)
        return self.o_proj(self._attend(q, k, v, None if packing is None else packing.attn_mask))

    def allocate_state(self, batch: int, max_len: int, device, dtype) -> AttentionState:
        shape = (batch, max_len, self.n_kv_heads, self.head_dim)
        return AttentionState(
            k=torch.zeros(shape, device=device, dtype=dtype), v=torch.zeros(shape, device=device, dtype=dtype)
        )

    def prefill(self, x: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """x: [B, L, D] right-padded prompts -> [B, L, D]; fills the KV cache. Right padding cannot reach a
        real position through a causal mask; padded keys/values are stored as zeros and never read."""
        state: AttentionState = cache.layers[self.layer_idx]
        q, k, v = self._qkv(x)
        L = x.shape[1]
        valid = cache.valid_mask(L)[..., None, None]  # [B, L, 1, 1]
        state.k[:, :L] = (k * valid).to(state.k.dtype)
        state.v[:, :L] = (v * valid).to(state.v.dtype)
        return self.o_proj(self._attend(q, k, v, None))

    def step(self, x: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """x: [B, D] one new token per sequence, at position cache.lengths[b] -> [B, D]."""
        state: AttentionState = cache.layers[self.layer_idx]
        q, k, v = self._qkv(x)  # q: [B, H, E], k, v: [B, K, E]
        y = gqa_decode(q, k, v, state.k, state.v, cache.lengths, span=cache.longest + 1)  # [B, H, E]
        return self.o_proj(y.flatten(1))  # [B, D]
