"""A fresh random seed per test run, printed so that a failure can be replayed."""

from __future__ import annotations

import random

import torch


def fresh_generator() -> torch.Generator:
    """Seed torch's global generator with a new random seed (printed: pytest shows it on failure) and
    return a CPU generator seeded the same."""
    seed = random.randrange(2**31)
    print(f"seed = {seed}")
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)
