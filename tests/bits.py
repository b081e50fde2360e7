"""Bit-for-bit comparison of tensors, FP8 ones included (compared as their bytes)."""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def same_bits(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Assert equal shapes and equal values element for element (FP8 as bytes, so NaN codes compare
    too), naming the first differing element."""
    got, ref = got.cpu(), ref.cpu()
    if got.dtype in FP8_DTYPES:
        got, ref = got.view(torch.uint8), ref.view(torch.uint8)
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    bad = (got != ref).nonzero()
    assert len(bad) == 0, f"{what}: {len(bad)} elements differ, first at {bad[0].tolist()}"
