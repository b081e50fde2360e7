"""Where each GEMM of a quantized linear layer takes its operands from, per (recipe, dx, dW needed).

One quantization serves two GEMMs where the spec allows: W in square tiles or under one scale is the
same operand as Wᵀ, and a tensorwise x or dy the same as its transpose. What depends on the tensors
(FP8 pair kernels, fused NVFP4 kernels) is still decided per call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from inkling_fp4.precision.recipes import TENSORWISE, OperandQuant, Recipe


def symmetric(spec: OperandQuant) -> bool:
    """Whether the operand's quantization is the same for the tensor and its transpose."""
    return spec.block == TENSORWISE or spec.block[0] == spec.block[1]


@dataclass(frozen=True)
class OperandPlan:
    fprop_x: OperandQuant | None
    """x's fprop operand (None: a BF16 fprop)."""
    wgrad_x: OperandQuant | None
    """xᵀ's wgrad operand, when dW is needed and its GEMM quantized."""
    saved_w: str
    """What the dgrad reads as Wᵀ: '' (no dx) | 'bf16' | 'reuse' (the fprop's W, read transposed;
    or both from one FP8 read of W where the shape allows) | 'own' (Wᵀ quantized for the dgrad)."""
    saved_x: str
    """What the wgrad reads as xᵀ: '' (no dW) | 'bf16' | 'reuse' (the fprop's tensorwise x) | 'own'
    (Q(RHT(xᵀ)) or xᵀ in blocks along the tokens; an FP8 pair of x takes precedence per call)."""
    dgrad_dy: OperandQuant | None
    """dy's dgrad operand (None: no dx, or a BF16 dgrad)."""
    wgrad_dy: OperandQuant | None
    """dyᵀ's wgrad operand (None: no dW, or a BF16 wgrad)."""
    reuse_dy: bool
    """dyᵀ is the dgrad's tensorwise dy read transposed."""


@functools.lru_cache(maxsize=256)
def operand_plan(recipe: Recipe, need_dx: bool, need_dw: bool) -> OperandPlan:
    fprop, dgrad, wgrad = recipe.fprop, recipe.dgrad, recipe.wgrad
    saved_w = saved_x = ""
    if need_dx:
        reuse_w = fprop is not None and dgrad is not None and dgrad.b == fprop.b and symmetric(fprop.b)
        saved_w = "bf16" if dgrad is None else "reuse" if reuse_w else "own"
    if need_dw:
        reuse_x = fprop is not None and wgrad is not None and wgrad.b == fprop.a
        saved_x = "bf16" if wgrad is None else "reuse" if reuse_x and fprop.a.block == TENSORWISE else "own"
    dgrad_dy = dgrad.a if need_dx and dgrad is not None else None
    wgrad_dy = wgrad.a if need_dw and wgrad is not None else None
    return OperandPlan(
        fprop_x=fprop.a if fprop is not None else None,
        wgrad_x=wgrad.b if need_dw and wgrad is not None else None,
        saved_w=saved_w,
        saved_x=saved_x,
        dgrad_dy=dgrad_dy,
        wgrad_dy=wgrad_dy,
        reuse_dy=dgrad_dy is not None and wgrad_dy == dgrad_dy and wgrad_dy.block == TENSORWISE,
    )
