"""QuantLinear: the one linear layer of the model, whose GEMMs follow a precision recipe.

Every matrix multiply in the model's blocks goes through this class so that a recipe (and its
per-layer policy) applies without touching model code. ``recipe`` is set by the precision policy;
``None`` means high precision (BF16 compute where the input is BF16).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class QuantLinear(nn.Module):
    """``y = x @ W.T`` with W: [out_features, in_features], no bias (Nemotron-H has none)."""

    def __init__(self, in_features: int, out_features: int, *, layer_idx: int, name: str = ""):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.layer_idx = layer_idx
        self.name = name
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.recipe = None
        nn.init.normal_(self.weight, std=1.0 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))

    def extra_repr(self) -> str:
        r = getattr(self.recipe, "name", "bf16") if self.recipe is not None else "bf16"
        return f"{self.in_features}->{self.out_features}, layer={self.layer_idx}, precision={r}"
