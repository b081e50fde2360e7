"""The model's layers with the fused FP8 training paths, swapped in once by :func:`fuse_fp8`.

Under delayed-scaled FP8 the producers of the linears' operands write them as FP8 (the other
modules of this package) and gradients flow back as FP8 slabs; these subclasses carry the extra
arguments (``fp8_in``, ``dy_fp8``, ``pending_grad``). Each fused path checks its module's
``applies`` and otherwise runs the plain code, so a converted model computes what the plain one
does, bit for bit (tests/fused_fp8.py).
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4.model.attention import Attention
from inkling_fp4.model.fused_fp8 import in_proj as in_proj_fp8
from inkling_fp4.model.fused_fp8 import mlp as mlp_fp8
from inkling_fp4.model.fused_fp8 import norm as norm_fp8
from inkling_fp4.model.fused_fp8 import out_proj as out_proj_fp8
from inkling_fp4.model.fused_fp8 import residual as residual_fp8
from inkling_fp4.model.grad_slab import GradSlab
from inkling_fp4.model.hybrid import Block, HybridLM
from inkling_fp4.model.mamba2 import Mamba2Mixer, output_dtype, skip_gated_rms_norm
from inkling_fp4.model.mlp import MLP, squared_relu
from inkling_fp4.model.packing import Packing
from inkling_fp4.precision.quant_linear import QuantLinear


class FusedFP8HybridLM(HybridLM):
    def forward_hidden(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`HybridLM.forward_hidden`, each block also handing the next its FP8 gradient slab."""
        packing = Packing.from_doc_ids(doc_ids, attention="*" in self.cfg.pattern)
        x = self.embed(input_ids)  # [B, L, D]
        pending = pending_grad = None
        for block in self.layers:
            x, pending, pending_grad = block(x, packing, pending, pending_grad)
        if pending is None:
            return self.norm_f(x)
        return self.norm_f.add_and_norm(x, pending, None if pending_grad is None else pending_grad.into(0))[1]


class FusedFP8Block(Block):
    def forward(
        self,
        x: torch.Tensor,
        packing: Packing | None = None,
        pending: torch.Tensor | None = None,
        pending_grad: GradSlab | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, GradSlab | None]:
        """As :meth:`Block.forward`; ``pending_grad``: where the previous block's output gradient goes as FP8.
        Returns this block's own slab third (None where none applies)."""
        h_dtype = x.dtype if pending is None else torch.promote_types(x.dtype, pending.dtype)
        dy_into = None if pending_grad is None else pending_grad.into(0)
        (out_linear,) = self.mixer.output_projections()
        out_grad = None  # the next norm's backward writes the output's gradient as FP8
        if residual_fp8.applies(out_linear, x):
            out_grad = residual_fp8.output_grad(out_linear, x)
        linear = self.mixer.input_linear()
        if norm_fp8.applies(linear, x, h_dtype):  # the norm writes the mixer's x as FP8
            x, placeholder, fp8_in = norm_fp8.norm(self.norm, x, pending, linear, dy_into)
            return x, self.mixer(placeholder, packing, fp8_in, out_grad), out_grad
        if pending is None:
            return x, self.mixer(self.norm(x), packing, None, out_grad), out_grad
        x, normed = self.norm.add_and_norm(x, pending, dy_into)
        return x, self.mixer(normed, packing, None, out_grad), out_grad


class FusedFP8Mamba2(Mamba2Mixer):
    _fp8_in: tuple | None = None
    _dy_fp8: GradSlab | None = None

    def input_linear(self) -> QuantLinear:
        return self.in_proj

    def forward(self, u: torch.Tensor, packing: Packing | None = None, fp8_in=None, dy_fp8=None):
        """As :meth:`Mamba2Mixer.forward`; ``fp8_in``: u quantized for in_proj; ``dy_fp8``: out_proj's
        gradient slab. Both stay on the module for the forward, where ``_project_in`` and ``_output`` read
        them."""
        self._fp8_in, self._dy_fp8 = fp8_in, dy_fp8
        try:
            return super().forward(u, packing)
        finally:
            self._fp8_in = self._dy_fp8 = None

    def _project_in(self, u: torch.Tensor):
        if in_proj_fp8.applies(self.in_proj, u):  # the consumers write in_proj's dy as FP8
            parts, slab = in_proj_fp8.in_proj_split(self.in_proj, u, self.in_widths, self._fp8_in)
            return parts, [slab.into(i) for i in range(3)]
        return self._split_for_grad(self.in_proj(u, self._fp8_in))  # [B, L, 2E + 2GN + H] split

    def _output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, dz_into=None) -> torch.Tensor:
        summed = torch.promote_types(torch.promote_types(y.dtype, x.dtype), self.D.dtype)
        out_dtype, norm = output_dtype(summed, y.device), self.norm
        if out_proj_fp8.applies(self.out_proj, z, out_dtype):  # the norm writes out_proj's x as FP8
            return out_proj_fp8.skip_gated_norm_out_proj(
                y, x, self.D, z, norm.weight, self.G, norm.eps, self.out_proj, dz_into, self._dy_fp8
            )
        h = skip_gated_rms_norm(y, x, self.D, z, norm.weight, self.G, norm.eps, out_dtype, dz_into=dz_into)
        return self.out_proj(h, dy_fp8=self._dy_fp8)


class FusedFP8MLP(MLP):
    def input_linear(self) -> QuantLinear:
        return self.up_proj

    def forward(self, x: torch.Tensor, packing=None, fp8_in=None, dy_fp8=None) -> torch.Tensor:
        """As :meth:`MLP.forward`, with ``fp8_in`` for up_proj and ``dy_fp8`` for down_proj."""
        if mlp_fp8.applies(self.up_proj, self.down_proj, x):  # one fused path
            return mlp_fp8.squared_relu_mlp(self.up_proj, self.down_proj, x, fp8_in, dy_fp8)
        h = squared_relu(self.up_proj(x, fp8_in))  # [..., F]
        return self.down_proj(h, dy_fp8=dy_fp8)  # [..., D]


class FusedFP8Attention(Attention):
    def input_linear(self) -> QuantLinear:
        return self.qkv_proj

    def forward(self, x: torch.Tensor, packing: Packing | None = None, fp8_in=None, dy_fp8=None):
        """As :meth:`Attention.forward`, with ``fp8_in`` for qkv_proj and ``dy_fp8`` for o_proj."""
        q, k, v = self._heads(self.qkv_proj(x, fp8_in))
        y = self._attend(q, k, v, None if packing is None else packing.attn_mask)
        return self.o_proj(y, dy_fp8=dy_fp8)


FUSED = {HybridLM: FusedFP8HybridLM, Block: FusedFP8Block, Mamba2Mixer: FusedFP8Mamba2, MLP: FusedFP8MLP,
         Attention: FusedFP8Attention}  # fmt: skip
"""Each plain layer class -> its fused FP8 variant (same parameters, buffers and state dict)."""


def fuse_fp8(model: nn.Module) -> nn.Module:
    """Give ``model`` and its layers their fused FP8 classes, in place (idempotent). Call it before
    wrapping the model: FSDP subclasses the class it finds."""
    for module in model.modules():
        fused = FUSED.get(type(module))
        if fused is not None:
            module.__class__ = fused
    return model
