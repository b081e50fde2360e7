"""Mamba-2's in_proj under delayed-scaled FP8: its output gradient is written as FP8 by the consumers.

The three backward kernels that consume in_proj's output (gated norm, conv, dt's softplus) write its
gradient into one slab (``model/grad_slab.py``) as FP8 bytes (``numerics/kernels/fp8_epilogue.py``)
instead of BF16 for the quantizer to re-read. Same bits as unfused (``tests/test_in_proj_fp8.py``).
The split's backward takes from each consumer its placeholder (bytes written), None (zeroed) or BF16
values (quantized into the block: the same bytes).

Shape letters: M tokens, D d_model, W in_proj's width.
"""

from __future__ import annotations

import torch

from inkling_fp4.model.compiled import fast_forms_on
from inkling_fp4.model.grad_slab import FP8Scaling, GradSlab
from inkling_fp4.precision.linear_gemms import LinearGEMMs, save_operands, saved_operands
from inkling_fp4.precision.quant_linear import QuantLinear


def applies(in_proj: QuantLinear, u: torch.Tensor) -> bool:
    """Whether :func:`in_proj_split` runs: a training forward on the GPU kernels, delayed FP8 pairs, and
    16 | tokens, 16 | width."""
    grads = u.requires_grad or in_proj.weight.requires_grad
    tokens = u.numel() // u.shape[-1]
    sizes = tokens % 16 == 0 and in_proj.out_features % 16 == 0
    return torch.is_grad_enabled() and grads and fast_forms_on(u) and sizes and in_proj.delayed_fp8_pairs()


def in_proj_split(
    in_proj: QuantLinear, u: torch.Tensor, widths: list[int], pair_x: tuple | None = None
) -> tuple[tuple[torch.Tensor, ...], GradSlab]:
    """``in_proj(u).split(widths, -1)`` for u [..., D], and the FP8 :class:`GradSlab` the pieces'
    consumers write their gradients into. ``pair_x``: u already quantized."""
    u2d = u.reshape(-1, in_proj.in_features)  # u2d: [M, D]
    gemms = in_proj.gemms(u2d.shape[0], u.device)
    spec = in_proj.recipe.dgrad.a
    dy_amax, dy_record = gemms.delayed.dy_used, gemms.delayed.dy_record
    # the split's shape and dtype (in_proj's BF16 output), without memory
    like = torch.empty((), device=u.device, dtype=torch.bfloat16).expand(*u.shape[:-1], in_proj.out_features)
    scaling = FP8Scaling(dy_amax.reshape(1), dy_record.reshape(1), spec.format == "e5m2")
    slab = GradSlab(like, list(widths), scaling)
    blocks = _InProjSplitFn.apply(u2d, in_proj.weight, gemms, list(widths), slab, tuple(u.shape[:-1]), pair_x)
    return blocks, slab


class _InProjSplitFn(torch.autograd.Function):
    """in_proj (its three GEMMs) and the split of its output; the output's gradient comes as FP8."""

    @staticmethod
    def forward(ctx, u2d, weight, gemms: LinearGEMMs, widths, slab: GradSlab, lead, pair_x):
        need_dx, need_dw = ctx.needs_input_grad[:2]
        y, saved = gemms.forward(u2d, weight, need_dx=need_dx, need_dw=need_dw, pair_x=pair_x)  # y: [M, W]
        save_operands(ctx, saved)
        ctx.gemms, ctx.slab, ctx.x_dtype = gemms, slab, u2d.dtype
        ctx.set_materialize_grads(False)
        return tuple(y.view(*lead, y.shape[-1]).split(widths, -1))

    @staticmethod
    def backward(ctx, *grads):
        slab, gemms = ctx.slab, ctx.gemms
        if all(g is None for g in grads):
            slab.buffer = None
            return None, None, None, None, None, None, None
        pair = slab.fp8_operands(grads, gemms.recipe.dgrad.a, gemms.recipe.wgrad.a)  # dy, dyᵀ
        dx, dw = gemms.backward(saved_operands(ctx), None, ctx.x_dtype, pair_dy=pair)
        return dx, dw, None, None, None, None, None
