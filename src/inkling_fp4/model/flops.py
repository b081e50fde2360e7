"""Model FLOPs per token, for MFU: what the model needs, forward and backward, counted once.

    flops/token = 6 * (matmul parameters)                      every QuantLinear and the LM head
                + n_attention * 6 * H * E * L                  causal QK^T and AV
                + n_mamba * 3 * (G Q N + H Q P + 4 H P N)      the SSD scan

Matmuls: 2 FLOPs per weight forward, 4 backward. Attention: L/2 keys per query on average. SSD, with
Q = min(chunk_size, L): the causal half of the intra-chunk scores, their product with dt x, and the
chunk states and read-out; the inter-chunk recurrence is negligible. This counts the useful work, not
what kernels execute, so MFU stays comparable across implementations.

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
