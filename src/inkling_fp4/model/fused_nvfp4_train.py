"""The training forward's producers reducing the NVFP4 tensor amaxes of the linear after them.

Under the NVFP4 recipe a linear's x becomes two operands (fprop rows, wgrad Q(RHT(xᵀ))), each under a
tensor scale from its own amax, so the linear reads x once just for the two amaxes. The block's
pre-norm, the MLP's squared ReLU and Mamba-2's gated norm hold x as they write it: they reduce both
amaxes from the tile they just stored (with the RHT's own butterfly, so the same bits:
``nvfp4_rht.store_amax_pair``) and hand them to the one linear that reads x (in_proj, qkv_proj or
up_proj; down_proj; out_proj), which then skips that read. In the backward the same goes for the
gradients: the squared ReLU's for up_proj's dy, the three kernels that write in_proj's gradient into
its slab (``grad_slab.py``) each for their block of it, and the next block's norm (or the final norm)
for the output projection's dy (the mixer's output gradient; the blocks hand its list along). Only
attention's output (o_proj's x) and qkv_proj's dy still leave it to the linear.

:func:`fuse_nvfp4_train` swaps the classes in once. Where the path does not apply (another recipe, no
weight gradient, tokens not a multiple of 16, no Triton, ``gemm.PRODUCER_NVFP4_AMAXES`` off) they run
the plain forward. They extend the decode step's classes, so a model the sampler also converts keeps
both fusions.
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4.model.attention import Attention
from inkling_fp4.model.compiled import fast_forms_on, glue_enabled
from inkling_fp4.model.fused_nvfp4_decode import (
    NVFP4DecodeBlock,
    NVFP4DecodeMamba,
    NVFP4DecodeMLP,
    first_linear,
)
from inkling_fp4.model.grad_slab import SlabAmaxes, split_with_grad_slab
from inkling_fp4.model.hybrid import Block, HybridLM
from inkling_fp4.model.mamba2 import Mamba2Mixer
from inkling_fp4.model.mlp import MLP, squared_relu
from inkling_fp4.model.norm import output_dtype, skip_gated_rms_norm
from inkling_fp4.model.packing import Packing
from inkling_fp4.precision.quant_linear import QuantLinear


def amax_signs(
    linear: QuantLinear | None, x: torch.Tensor, out_dtype: torch.dtype, grad: bool = False
) -> int | None:
    """The RHT sign mask for a producer writing ``linear``'s x (``out_dtype``, x's shape; with ``grad``
    the consumer writing its output's gradient) on the glue kernels, or None where the linear reads that
    tensor for its amaxes itself."""
    if linear is None or out_dtype != torch.bfloat16 or not glue_enabled() or torch.compiler.is_compiling():
        return None
    return linear.producer_amax_signs(x, grad)


class NVFP4TrainHybridLM(HybridLM):
    def forward_hidden(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """As :meth:`HybridLM.forward_hidden`, each block handing the next where its output projection's dy
        amaxes go (None where nothing reduces them)."""
        packing = Packing.from_doc_ids(doc_ids, attention="*" in self.cfg.pattern)
        x = self.embed(input_ids)  # [B, L, D]
        pending = pending_amaxes = None
        for block in self.layers:
            x, pending, pending_amaxes = block(x, packing, pending, pending_amaxes)
        if pending is None:
            return self.norm_f(x)
        if pending_amaxes is None:
            return self.norm_f.add_and_norm(x, pending)[1]
        from inkling_fp4.model.glue_kernels.norm_kernels import norm_amax_pair  # needs triton

        return norm_amax_pair(x, pending, self.norm_f.weight, self.norm_f.eps, None, pending_amaxes)[1]


class NVFP4TrainBlock(NVFP4DecodeBlock):
    def forward(
        self,
        x: torch.Tensor,
        packing: Packing | None = None,
        pending: torch.Tensor | None = None,
        pending_amaxes: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """As :meth:`Block.forward`; the norm also reduces its output's amaxes for the first linear and, in
        the backward, ``pending``'s gradient's into ``pending_amaxes`` ((sign bits, the previous output
        projection's ``dy_amaxes``) or None). Returns this block's own such pair third."""
        linear = first_linear(self.mixer)
        (out_linear,) = self.mixer.output_projections()
        h_dtype = x.dtype if pending is None else torch.promote_types(x.dtype, pending.dtype)
        norm_dtype = output_dtype(h_dtype, x.device)  # the next norm's too: the same stream and mixer dtypes
        signs = amax_signs(linear, x, norm_dtype)
        out_signs = amax_signs(out_linear, x, norm_dtype, grad=True)  # the next norm's backward: x's tokens
        out_amaxes = None if out_signs is None else (out_signs, [])
        if out_amaxes is not None:  # the mixer's output projection takes the list (its class default: None)
            self.mixer.out_dy_amaxes = out_amaxes[1]
        try:
            if signs is None and pending_amaxes is None:
                x, out = super().forward(x, packing, pending)
                return x, out, out_amaxes
            from inkling_fp4.model.glue_kernels.norm_kernels import norm_amax_pair  # needs triton

            norm = self.norm
            h, normed, words = norm_amax_pair(x, pending, norm.weight, norm.eps, signs, pending_amaxes)
            if words is not None:
                linear.hand_over_amaxes(normed, words)
            return (x if h is None else h), self.mixer(normed, packing), out_amaxes
        finally:
            if out_amaxes is not None:
                self.mixer.out_dy_amaxes = None


class NVFP4TrainMLP(NVFP4DecodeMLP):
    out_dy_amaxes: list | None = None
    """Where down_proj's dy amaxes go (set by the block around its call; the next norm fills it)."""

    def forward(self, x: torch.Tensor, packing=None) -> torch.Tensor:
        """As :meth:`MLP.forward`; the squared ReLU also reduces its output's amaxes for down_proj, and in
        the backward those of its input's gradient (up_proj's dy, u's one consumer) for up_proj."""
        grad_signs = amax_signs(self.up_proj, x, torch.bfloat16, grad=True)
        dy_amaxes = None if grad_signs is None else []
        u = self.up_proj(x, dy_amaxes=dy_amaxes)  # [..., F]
        signs = amax_signs(self.down_proj, u, u.dtype)
        if signs is None and grad_signs is None:
            h = squared_relu(u)
        else:
            from inkling_fp4.model.glue_kernels import pointwise_kernels  # needs triton

            h, words = pointwise_kernels.squared_relu_amax_pair(u, signs, grad_signs, dy_amaxes)
            if words is not None:
                self.down_proj.hand_over_amaxes(h, words)
        return self.down_proj(h, dy_amaxes=self.out_dy_amaxes)  # [..., D]


class NVFP4TrainMamba(NVFP4DecodeMamba):
    out_dy_amaxes: list | None = None
    """Where out_proj's dy amaxes go (set by the block around its call; the next norm fills it)."""

    def _project_in(self, u: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], list]:
        """As :meth:`Mamba2Mixer._project_in`; in the backward the kernels that write in_proj's gradient
        into its slab (gated norm, conv, dt softplus) also reduce its amaxes for in_proj."""
        grad_signs = amax_signs(self.in_proj, u, torch.bfloat16, grad=True)
        if grad_signs is None or u.dim() != 3 or u.shape[1] % 16:  # groups stay inside a sequence
            return super()._project_in(u)
        dy_amaxes: list = []
        zxbcdt = self.in_proj(u, dy_amaxes=dy_amaxes)  # [B, L, 2E + 2GN + H]
        if not (zxbcdt.requires_grad and fast_forms_on(zxbcdt)):
            return self._split_for_grad(zxbcdt)
        from inkling_fp4.numerics.kernels.amax import zeroed_words  # needs triton

        amaxes = SlabAmaxes(grad_signs, zeroed_words(2, u.device), dy_amaxes)
        parts, slab = split_with_grad_slab(zxbcdt, self.in_widths, amaxes)
        return parts, [slab.into(i) for i in range(3)]

    def _output(self, y: torch.Tensor, x: torch.Tensor, z: torch.Tensor, dz_into=None) -> torch.Tensor:
        """As :meth:`Mamba2Mixer._output`; the gated norm also reduces its output's amaxes for out_proj."""
        summed = torch.promote_types(torch.promote_types(y.dtype, x.dtype), self.D.dtype)
        out_dtype, w, eps = output_dtype(summed, y.device), self.norm.weight, self.norm.eps
        signs = amax_signs(self.out_proj, z, out_dtype)  # h has z's shape [..., E]
        if signs is None:
            h = skip_gated_rms_norm(y, x, self.D, z, w, self.G, eps, out_dtype, dz_into=dz_into)
        else:
            from inkling_fp4.model.glue_kernels import gated_norm_kernels as kernels  # needs triton

            h, words = kernels.skip_gated_norm_amax_pair(y, x, self.D, z, w, self.G, eps, signs, dz_into)
            self.out_proj.hand_over_amaxes(h, words)
        return self.out_proj(h, dy_amaxes=self.out_dy_amaxes)  # [..., D]


class NVFP4TrainAttention(Attention):
    out_dy_amaxes: list | None = None
    """Where o_proj's dy amaxes go (set by the block around its call; the next norm fills it)."""

    def forward(self, x: torch.Tensor, packing: Packing | None = None):
        """As :meth:`Attention.forward`, o_proj's dy amaxes from the next norm."""
        q, k, v = self._qkv(x)
        y = self._attend(q, k, v, None if packing is None else packing.attn_mask)
        return self.o_proj(y, dy_amaxes=self.out_dy_amaxes)


FUSED = {HybridLM: NVFP4TrainHybridLM, Block: NVFP4TrainBlock, NVFP4DecodeBlock: NVFP4TrainBlock,
         MLP: NVFP4TrainMLP, NVFP4DecodeMLP: NVFP4TrainMLP, Mamba2Mixer: NVFP4TrainMamba,
         NVFP4DecodeMamba: NVFP4TrainMamba, Attention: NVFP4TrainAttention}  # fmt: skip
"""Each plain (or decode) class -> its training variant (same parameters; ``forward`` differs)."""


def fuse_nvfp4_train(model: nn.Module) -> nn.Module:
    """Give ``model`` and its layers the classes above, in place (idempotent). Call it before wrapping the
    model: FSDP subclasses the class it finds."""
    for module in model.modules():
        fused = FUSED.get(type(module))
        if fused is not None:
            module.__class__ = fused
    return model
