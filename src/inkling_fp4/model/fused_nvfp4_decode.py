"""The decode step's producers writing the NVFP4 operand of the linear after them (row scales).

At decode sizes an emulated NVFP4 GEMM is launch-bound: beside the GEMM, the row quantizer is one more
launch per linear (BENCHMARKS.md, decode). The block's norm kernel owns whole rows already, so it also
writes their NVFP4 block values and scales (``glue_kernels.norm_kernels.norm_nvfp4_rows``) and hands
them to the one linear that reads the norm's output (in_proj, qkv_proj or up_proj), which then skips
its quantizer; the MLP's squared ReLU does the same for down_proj, and the fused Mamba-2 step (whose
row's last program quantizes the whole gated-norm row) for out_proj. One launch fewer per block, per
MLP and per Mamba layer, the same bits (tests/test_nvfp4_decode_norm.py). Attention's output is written
a head at a time by its decode kernel, so o_proj still quantizes its own input.
:func:`fuse_nvfp4_decode` swaps the classes in once; where the path does not apply (another recipe,
tensor scales, no held weights, no Triton) they step as the plain ones do.
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4.model.attention import Attention
from inkling_fp4.model.compiled import glue_enabled
from inkling_fp4.model.hybrid import Block
from inkling_fp4.model.mamba2 import Mamba2Mixer
from inkling_fp4.model.mamba2_decode import fused_decode_applies, mamba_decode
from inkling_fp4.model.mlp import MLP, squared_relu
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
    if not glue_enabled() or torch.compiler.is_compiling():  # the plain PyTorch forms asked for
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


class NVFP4DecodeMLP(MLP):
    def step(self, x: torch.Tensor, cache) -> torch.Tensor:
        """As :meth:`MLP.step`; the squared ReLU also quantizes its output for down_proj."""
        u = self.up_proj(x)  # [B, F]: takes the pre-norm's rows where they were handed over
        if not applies(self.down_proj, u, u.dtype):
            return self.down_proj(squared_relu(u))
        from inkling_fp4.model.glue_kernels.pointwise_kernels import squared_relu_nvfp4_rows  # needs triton

        h, values, out_scale, amax = squared_relu_nvfp4_rows(u, self.down_proj.frozen_weight().decode_scale)
        self.down_proj.hand_over(h, QuantizedRows(values, out_scale, amax))
        return self.down_proj(h)  # [B, D]


class NVFP4DecodeMamba(Mamba2Mixer):
    def step(self, u: torch.Tensor, cache) -> torch.Tensor:
        """As :meth:`Mamba2Mixer.step`; the fused step also quantizes its output rows for out_proj."""
        state = cache.layers[self.layer_idx]
        zxbcdt = self.in_proj(u)  # [B, 2E + 2GN + H]: takes the pre-norm's rows where they were handed over
        args = self.decode_args(zxbcdt, state)
        # applies() asks for a BF16 output (args[-1]) of h's shape [B, E]
        if not (fused_decode_applies(zxbcdt, state.conv, state.ssm)
                and applies(self.out_proj, zxbcdt[:, : self.H * self.P], args[-1])):  # fmt: skip
            return self._step_from(zxbcdt, state)
        w_decode = self.out_proj.frozen_weight().decode_scale
        h, values, out_scale, amax = mamba_decode(*args, dt_min_clamp=self.dt_min_clamp, done=state.done,
                                                  w_decode=w_decode)  # fmt: skip
        self.out_proj.hand_over(h, QuantizedRows(values, out_scale, amax))
        return self.out_proj(h)  # [B, D]


FUSED = {Block: NVFP4DecodeBlock, MLP: NVFP4DecodeMLP, Mamba2Mixer: NVFP4DecodeMamba}
"""Each plain class -> its decode variant (same parameters; only ``step`` differs)."""


def _decodes_nvfp4_rows(linear: QuantLinear) -> bool:
    recipe = linear.recipe
    spec = None if recipe is None or recipe.fprop is None else recipe.fprop.a
    return spec is not None and spec.format == "nvfp4" and spec.row_scaled


def fuse_nvfp4_decode(model: nn.Module) -> nn.Module:
    """Give ``model``'s plain blocks and MLPs the classes above, in place, if any of its linears takes
    NVFP4 rows (idempotent; other classes stay, so a conversion made before, as fuse_fp8's, is kept)."""
    if not any(_decodes_nvfp4_rows(m) for m in model.modules() if isinstance(m, QuantLinear)):
        return model
    for module in model.modules():
        fused = FUSED.get(type(module))
        if fused is not None:
            module.__class__ = fused
    return model
