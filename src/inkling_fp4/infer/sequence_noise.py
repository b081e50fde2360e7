"""The sampler's random draws as a function of (seed, sequence, step, token id), not of a stream.

Why: a ``torch.Generator`` hands out numbers in batch order, so a sequence's draws would depend on
its neighbours and its row, which continuous batching changes all the time. Here the Exp(1) draw of
token v at step t of sequence i is a hash of (seed, i, t, v), so a completion depends only on the
prompt, its index in the call and the seed.

Hash: splitmix64's finaliser (as in Java's SplittableRandom) in three rounds, in int64 arithmetic
(which wraps modulo 2^64). The top 24 bits give u = (k + 1/2) / 2^24 in (0, 1), exact in FP32, so
E = -log u is positive and finite.

Shape letters: B batch, V vocabulary.
"""

from __future__ import annotations

import functools

import torch

from inkling_fp4.numerics.kernels import seeds

MASK64 = (1 << 64) - 1


def _signed(c: int) -> int:
    """The int64 whose bits are ``c mod 2^64``."""
    c &= MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN = _signed(seeds.PHI)
MIX1 = _signed(seeds.MIX1)
MIX2 = _signed(seeds.MIX2)
SEED_SALT = _signed(0xD1B54A32D192ED03)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic)."""
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def uniform_bits(seed: int, sequence_B: torch.Tensor, step_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] int64 in [0, 2^24): the 24-bit draw of every token id of each row's (sequence, step)."""
    seed_key = _signed(seed * SEED_SALT + GOLDEN)
    row_B = mix(mix(sequence_B.long() * GOLDEN + seed_key) + step_B.long() * GOLDEN)  # [B]
    return _shr(mix(row_B[:, None] + _token_keys(vocab, row_B.device)[None, :]), 40)  # [B, V]


@functools.lru_cache(maxsize=8)
def _token_keys(vocab: int, device: torch.device) -> torch.Tensor:
    """[V] int64: token id x the golden ratio, built once per vocabulary and device."""
    return torch.arange(vocab, device=device, dtype=torch.long) * GOLDEN


def exponential_noise(seed: int, sequence_B: torch.Tensor, step_B: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] FP32 Exp(1) draws, one per (row's sequence, row's step, token id), for the exponential race."""
    u = (uniform_bits(seed, sequence_B, step_B, vocab).float() + 0.5) * 2.0**-24  # (0, 1), [B, V]
    return -torch.log(u)
