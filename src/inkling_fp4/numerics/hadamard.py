"""The 16-point random Hadamard transform (RHT) matrix used on NVFP4 wgrad operands.

A few outlier tokens would blow up the block scales of dYᵀ and Xᵀ in ``dW = dYᵀ·X``; multiplying both by
the same orthogonal R along the tokens spreads outliers over 16 elements and leaves the product
unchanged: ``(dYᵀ R)(Xᵀ R)ᵀ = dYᵀ X`` (paper section 4.2).

R = diag(s) · H16 / 4, applied as ``x_blocks @ R`` (the signs multiply the input first): Transformer
Engine's convention, so the wgrad operands equal TE's bit for bit. H16 is Sylvester's,
``H[i, j] = (-1)^popcount(i & j)``. The fixed sign vector is TE's wgrad one.
"""

from __future__ import annotations

import torch

RHT_SIZE = 16

# Transformer Engine's fixed wgrad sign vector.
FIXED_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard_matrix(n: int = RHT_SIZE) -> torch.Tensor:
    """Unnormalized Sylvester Hadamard matrix [n, n] of ±1 (float32); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard_matrix: n={n} is not a power of two")
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h


def rht_signs(kind: str = "fixed", seed: int = 0) -> torch.Tensor:
    """The RHT sign vector: float32 [16] of ±1. ``kind`` is "fixed" (TE's) or "random" (from ``seed``)."""
    if kind == "fixed":
        return torch.tensor(FIXED_SIGNS, dtype=torch.float32)
    if kind == "random":
        generator = torch.Generator().manual_seed(seed)
        bits = torch.randint(0, 2, (RHT_SIZE,), generator=generator)
        return (bits * 2 - 1).to(torch.float32)
    raise ValueError(f'rht_signs: kind must be "fixed" or "random", got {kind!r}')


def rht_matrix(signs: torch.Tensor | None = None) -> torch.Tensor:
    """R = diag(signs) · H16 / 4 (float32 [16, 16], orthogonal; entries ±0.25, exact in BF16)."""
    s = rht_signs("fixed") if signs is None else signs.detach().to("cpu", torch.float32)
    if s.shape != (RHT_SIZE,) or not bool(((s == 1) | (s == -1)).all()):
        raise ValueError(f"rht_matrix: signs must be 16 values of +-1, got shape {tuple(s.shape)}")
    return s[:, None] * hadamard_matrix(RHT_SIZE) / 4.0
