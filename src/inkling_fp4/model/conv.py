"""The depthwise causal conv of the Mamba-2 mixer, with document resets, and its fused form.

    out_t = silu(bias + sum_{s=0}^{k-1} weight[:, k-1-s] * x_{t-s})      (PyTorch's Conv1d orientation)

A tap that would reach back into a previous document is zeroed: exactly a fresh zero-padded conv per
document. The fused form is the same function through ``torch.compile``.

Shape letters: B batch, L length, C channels (x||B||C), k kernel width.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from inkling_fp4.model.norm import at_least_fp32


def causal_conv(
    xBC: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    seg: torch.Tensor | None = None,
    prev: torch.Tensor | None = None,
) -> torch.Tensor:
    """Depthwise causal conv, summed tap by tap in FP32 (FP64 for FP64 inputs), before the SiLU.
    xBC: [B, L, C]; weight: [C, k]; bias: [C]; seg: [B, L] or None; prev: [B, C, k-1] the inputs before
    position 0 (zeros when None) -> [B, L, C]."""
    Bsz, L, C = xBC.shape
    k = weight.shape[1]
    if prev is None:
        prev = xBC.new_zeros(Bsz, C, k - 1)
    xp = at_least_fp32(torch.cat([prev.transpose(1, 2).to(xBC.dtype), xBC], 1))  # [B, k-1+L, C]
    if seg is not None:
        # positions before 0 belong to the first document (they are its carried-in state)
        seg_p = torch.cat([seg[:, :1].expand(Bsz, k - 1), seg], 1)  # [B, k-1+L]
    out = at_least_fp32(bias).expand(Bsz, L, C)
    for s in range(k):
        tap = xp[:, k - 1 - s : k - 1 - s + L]  # x_{t-s}: [B, L, C]
        if seg is not None and s > 0:
            tap = tap * (seg_p[:, k - 1 - s : k - 1 - s + L] == seg)[..., None]
        out = out + tap * weight[:, k - 1 - s]
    return out


def conv_silu(xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seg: torch.Tensor | None = None):
    """silu(causal_conv(xBC)) in xBC's dtype: [B, L, C] -> [B, L, C]."""
    return F.silu(causal_conv(xBC, weight, bias, seg=seg)).to(xBC.dtype)


@functools.cache
def fused_conv_silu():
    """:func:`conv_silu` compiled by ``torch.compile`` (forward and backward fused; built on first use)."""
    return torch.compile(conv_silu, dynamic=True)
