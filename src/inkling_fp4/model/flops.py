"""Model FLOPs per token, for MFU: what the model needs, forward and backward, counted once.

    flops/token = 6 * (matmul parameters)                      every QuantLinear and the LM head
                + n_attention * 6 * H * E * L                  causal QK^T and AV
                + n_mamba * 3 * (G Q N + H Q P + 4 H P N)      the SSD scan

- Matmuls: 2 FLOPs per weight per token forward, 4 backward (dgrad + wgrad). The embedding is a
  lookup and counts nothing; norms, activations and the conv are elementwise and not counted.
- Attention, causal: query t reads t+1 keys, L/2 on average; QK^T and AV cost 2 * H * E FLOPs per
  (query, key) pair each, so 2 * 2 * H * E * L/2 forward, times 3 for forward + backward.
- SSD (chunk length Q = min(chunk_size, L)), forward per token: the intra-chunk scores C B^T
  (2 G N per pair, causal half: G Q N), their product with dt x (H Q P), the chunk states B^T (dt x)
  and the read-out C S (2 H P N each); times 3 for forward + backward. The O(L / Q) inter-chunk
  recurrence is negligible.
This is the useful work, not what kernels execute (a chunked kernel also computes the masked upper
half of each chunk), so MFU stays comparable across implementations.

Shape letters: L sequence length, H heads, E attention head dim, P Mamba head dim, G groups, N state.
"""

from __future__ import annotations

from inkling_fp4.model.config import ModelConfig


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one attention layer's score and value products."""
    return 6.0 * cfg.n_heads * cfg.attn_head_dim * seq_len


def ssd_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token of one Mamba-2 layer's SSD scan."""
    Q = min(cfg.chunk_size, seq_len)
    H, P, G, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.d_state
    return 3.0 * (G * Q * N + H * Q * P + 4 * H * P * N)


def flops_per_token(cfg: ModelConfig, matmul_params: int, seq_len: int) -> float:
    """Training FLOPs per token at ``seq_len`` for a model with ``matmul_params`` GEMM weights."""
    return (
        6.0 * matmul_params
        + cfg.pattern.count("*") * attention_flops_per_token(cfg, seq_len)
        + cfg.pattern.count("M") * ssd_flops_per_token(cfg, seq_len)
    )
