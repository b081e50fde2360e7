"""The MLP block of Nemotron-H: squared ReLU, ``down(relu(up(x))^2)``, no gate, no biases.

Squared ReLU (So et al., "Primer", 2021): two GEMMs instead of a gated unit's three, and sparse
activations.

Shape letters: B batch, L length, D d_model, F ffn width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inkling_fp4.model.compiled import cuda_kernel
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.precision.quant_linear import QuantLinear


@cuda_kernel("pointwise_kernels.squared_relu")
def squared_relu(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2 elementwise, in h's dtype (one Triton kernel per direction on CUDA).

    NOTE a product, not ``square()``: autocast runs ``pow`` in FP32, which would make this [tokens, ffn]
    activation and its gradient FP32. A BF16 product rounded once to BF16 is the same value."""
    r = F.relu(h)
    return r * r


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.up_proj = QuantLinear(cfg.d_model, cfg.ffn_dim, layer_idx=layer_idx, name="mlp.up_proj")
        self.down_proj = QuantLinear(cfg.ffn_dim, cfg.d_model, layer_idx=layer_idx, name="mlp.down_proj")

    def output_projections(self) -> list[QuantLinear]:
        return [self.down_proj]

    def forward(self, x: torch.Tensor, packing=None) -> torch.Tensor:
        """x: [..., D] -> [..., D]. ``packing`` is ignored: an MLP mixes no positions."""
        return self.down_proj(squared_relu(self.up_proj(x)))  # [..., F] in between

    def allocate_state(self, batch: int, max_len: int, device, dtype) -> None:
        return None

    def prefill(self, x: torch.Tensor, cache) -> torch.Tensor:
        return self(x)

    def step(self, x: torch.Tensor, cache) -> torch.Tensor:
        return self(x)
