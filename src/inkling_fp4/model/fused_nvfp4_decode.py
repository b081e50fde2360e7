"""The decode step's pre-norm writing the NVFP4 operand of the mixer's first linear (row scales).

At decode sizes an emulated NVFP4 GEMM is launch-bound: beside the GEMM, the row quantizer is one more
launch per linear (BENCHMARKS.md, decode). The block's norm kernel owns whole rows already, so it also
writes their NVFP4 block values and scales (``glue_kernels.norm_kernels.norm_nvfp4_rows``) and hands
them to the one linear that reads the norm's output (in_proj, qkv_proj or up_proj), which then skips
its quantizer: one launch fewer per block, the same bits (tests/test_nvfp4_decode_norm.py).
:func:`fuse_nvfp4_decode` swaps the block class in once; where the path does not apply (another
recipe, tensor scales, no held weights, no Triton) the block steps as the plain one does.
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4.model.attention import Attention
from inkling_fp4.model.hybrid import Block
from inkling_fp4.model.mamba2 import Mamba2Mixer
from inkling_fp4.model.mlp import MLP
from inkling_fp4.model.norm import output_dtype
from inkling_fp4.precision import fused_kernels
from inkling_fp4.precision.decode_fprop import QuantizedRows, takes_rows
from inkling_fp4.precision.quant_linear import QuantLinear

FIRST_LINEAR = {Mamba2Mixer: "in_proj", Attention: "qkv_proj", MLP: "up_proj"}
"""The linear that reads the block norm's output, per mixer class."""


def first_linear(mixer: nn.Module) -> QuantLinear | None:
    name = next((n for cls, n in FIRST_LINEAR.items() if isinstance(mixer, cls)), None)
    return None if name is None else getattr(mixer, name)


def applies(linear: QuantLinear | None, x: torch.Tensor, h_dtype: torch.dtype) -> bool:
    """A no-grad step whose first linear takes NVFP4 rows from a BF16 norm output, on the kernels."""
    if linear is None or torch.is_grad_enabled() or linear.recipe is None or linear.recipe.fprop is None:
        return False
    if fused_kernels.fused_for(x) is None or output_dtype(h_dtype, x.device) != torch.bfloat16:
        return False
    return x.dim() == 2 and takes_rows(x, linear.frozen_weight(), linear.recipe.fprop.a)


class NVFP4DecodeBlock(Block):
    def step(self, x: torch.Tensor, pending: torch.Tensor | None, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`Block.step`; the norm also quantizes its output for the mixer's first linear."""
        linear = first_linear(self.mixer)
        h_dtype = x.dtype if pending is None else torch.promote_types(x.dtype, pending.dtype)
        if not applies(linear, x, h_dtype):
            return super().step(x, pending, cache)
        from inkling_fp4.model.glue_kernels.norm_kernels import norm_nvfp4_rows  # needs triton

        wq = linear.frozen_weight()
        h, normed, values, out_scale, amax = norm_nvfp4_rows(x, pending, self.norm.weight, self.norm.eps,
                                                             wq.decode_scale)  # fmt: skip
        linear.hand_over(normed, QuantizedRows(values, out_scale, amax))
        return (x if h is None else h), self.mixer.step(normed, cache)


def fuse_nvfp4_decode(model: nn.Module) -> nn.Module:
    """Give ``model``'s plain blocks the class above, in place (idempotent; other block classes stay)."""
    for module in model.modules():
        if type(module) is Block:
            module.__class__ = NVFP4DecodeBlock
    return model
