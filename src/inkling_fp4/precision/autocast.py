"""The autocast every forward pass runs under, training and sampling alike."""

from __future__ import annotations

import contextlib

import torch


def autocast_for(device: torch.device):
    """BF16 autocast on CUDA; on CPU QuantLinear computes in BF16 by itself and the rest stays FP32."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
