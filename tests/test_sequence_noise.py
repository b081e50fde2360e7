"""The sampler's per-sequence draws (infer/sequence_noise.py): bit-exact to a plain-Python splitmix64
on fresh random and extreme keys, Exp(1) in distribution, independent across tokens, steps,
sequences and seeds, and the exponential race driven by them samples the filtered distribution."""

from __future__ import annotations

import math

import torch

from inkling_fp4.infer.sampling import sample
from inkling_fp4.infer.sequence_noise import MASK64, exponential_noise, uniform_bits

GOLDEN, MIX1, MIX2, SALT = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0xD1B54A32D192ED03


def mix_ref(x: int) -> int:
    x &= MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def bits_ref(seed: int, sequence: int, step: int, token: int) -> int:
    seed_key = seed * SALT + GOLDEN
    row = mix_ref(mix_ref(sequence * GOLDEN + seed_key) + step * GOLDEN)
    return mix_ref(row + token * GOLDEN) >> 40


def test_bits_equal_the_plain_python_hash():
    g = torch.Generator().manual_seed(0)
    sequences = torch.cat([torch.randint(0, 2**40, (6,), generator=g), torch.tensor([0, 2**62, 2**63 - 1])])
    steps = torch.cat([torch.randint(0, 5000, (6,), generator=g), torch.tensor([0, 1, 2**31])])
    for seed in (0, 1, 12345, 2**61 + 7, -3):
        got = uniform_bits(seed, sequences, steps, 50)
        for b in range(len(sequences)):
            for v in (0, 1, 17, 49):
                assert int(got[b, v]) == bits_ref(seed, int(sequences[b]), int(steps[b]), v)


def test_draws_are_exponential_and_independent():
    n_seq, vocab = 512, 512
    seq = torch.arange(n_seq)
    e = exponential_noise(7, seq, torch.zeros(n_seq, dtype=torch.long), vocab)  # [512, 512]
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    flat = e.flatten().double()
    m = flat.numel()
    assert abs(flat.mean() - 1) < 5 / math.sqrt(m) and abs(flat.var() - 1) < 12 / math.sqrt(m)
    # Kolmogorov-Smirnov against Exp(1): the 1% critical value is 1.63 / sqrt(m)
    x = flat.sort().values
    cdf = 1 - torch.exp(-x)
    i = torch.arange(1, m + 1, dtype=torch.float64)
    ks = torch.maximum(i / m - cdf, cdf - (i - 1) / m).max()
    assert ks < 1.63 / math.sqrt(m)
    u = torch.exp(-e.double())  # back to uniforms
    next_step = torch.exp(-exponential_noise(7, seq, torch.ones(n_seq, dtype=torch.long), vocab).double())
    other_seed = torch.exp(-exponential_noise(8, seq, torch.zeros(n_seq, dtype=torch.long), vocab).double())
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u, next_step), (u, other_seed)):
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(r) < 5 / math.sqrt(a.numel())


def test_the_race_with_these_draws_samples_the_distribution():
    """20,000 draws (one sequence per draw) of a 6-token distribution, top-p removing the tail:
    frequencies within a chi-square bound, removed tokens never drawn."""
    logits = torch.log(torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]))
    n = 20_000
    seq = torch.arange(n)
    noise = exponential_noise(3, seq, torch.full((n,), 9), 6)
    tokens, _ = sample(logits.expand(n, 6), temperature=1.0, top_p=0.85, noise=noise)
    counts = torch.bincount(tokens, minlength=6).double()
    assert counts[4:].sum() == 0  # 0.4 + 0.25 + 0.15 < 0.85: the fourth is the last kept
    p = torch.tensor([0.4, 0.25, 0.15, 0.1]) / 0.9
    chi2 = ((counts[:4] - n * p) ** 2 / (n * p)).sum()
    assert chi2 < 16.3  # the 0.1% point of chi-square with 3 degrees of freedom
