"""The block's pre-norm under delayed-scaled FP8: the norm writes the mixer's first x as FP8.

The norm output's only reader is the mixer's first linear, so its kernel stores FP8 bytes directly
(``numerics/kernels/fp8_epilogue.py``). The norm's autograd function returns a placeholder for its
output (zeros, no memory) and the block hands the FP8 pair to the mixer (``fp8_in``); the linear's
input gradient flows back through the placeholder. Same bits as unfused (``tests/test_norm_fp8.py``).

Shape letters: M tokens, D d_model.
"""

from __future__ import annotations

import torch

from inkling_fp4.model import compiled
from inkling_fp4.model.compiled import fast_forms_on
from inkling_fp4.model.grad_slab import FP8Scaling, zeros_placeholder
from inkling_fp4.model.norm import RMSNorm, add_rms_norm, output_dtype, rms_norm
from inkling_fp4.numerics import fp8
from inkling_fp4.precision.gemm import Operand
from inkling_fp4.precision.quant_linear import QuantLinear


def applies(linear: QuantLinear | None, x: torch.Tensor, h_dtype: torch.dtype) -> bool:
    """Whether :func:`norm` runs: a training forward on the GPU kernels, a BF16 norm output, delayed FP8
    pairs, 16 | tokens and 16 | D."""
    if linear is None or not torch.is_grad_enabled():
        return False
    tokens = x.numel() // x.shape[-1]
    sizes = tokens % 16 == 0 and linear.in_features % 16 == 0
    bf16 = output_dtype(h_dtype, x.device) == torch.bfloat16
    return sizes and bf16 and fast_forms_on(x) and linear.delayed_fp8_pairs()


def norm(
    block_norm: RMSNorm, x: torch.Tensor, pending: torch.Tensor | None, linear: QuantLinear, dy_into=None
) -> tuple[torch.Tensor, torch.Tensor, tuple[Operand, Operand]]:
    """(h = x + pending (or x), the norm's output as a placeholder, rms_norm(h)'s FP8 pair for
    ``linear``); ``dy_into``: where the backward writes pending's gradient."""
    gemms_x = linear.recipe.fprop.a, linear.recipe.wgrad.b
    words = linear.delayed_words()
    holder: list = []
    outputs = _NormFP8Fn.apply(
        x, pending, block_norm.weight, block_norm.eps, words.x_used, words.x_record, gemms_x, holder, dy_into
    )
    h, placeholder = outputs if pending is not None else (x, outputs)
    rows, cols = holder
    return h, placeholder, (Operand(rows, gemms_x[0]), Operand(cols, gemms_x[1]))


class _NormFP8Fn(torch.autograd.Function):
    """(add +) rms_norm whose output exists only as FP8 bytes (handed out through ``holder``)."""

    @staticmethod
    def forward(ctx, x, y, weight, eps, used, record, specs, holder, dy_into):
        ctx.set_materialize_grads(False)
        D = x.shape[-1]
        M = x.numel() // D
        dtype = torch.float8_e5m2 if specs[0].format == "e5m2" else torch.float8_e4m3fn
        h_dtype = x.dtype if y is None else torch.promote_types(x.dtype, y.dtype)
        if compiled.fast_forms_on(x):  # the kernel stores the bytes [M, D], scaled by the delayed amax
            from inkling_fp4.model.glue_kernels.norm_kernels import norm_forward  # needs triton

            h = None if y is None else torch.empty(x.shape, device=x.device, dtype=h_dtype)
            scaling = FP8Scaling(used.reshape(1), record.reshape(1), specs[0].format == "e5m2")
            data, rstd = norm_forward(x, y, weight, eps, torch.bfloat16, h, fp8_out=scaling)
            rows, cols = fp8.tensorwise_pair_from_rows(data.view(M, D).view(dtype), used)
            ctx.save_for_backward(x if h is None else h, weight, rstd)
            ctx.reference = False
        else:  # the reference in BF16, then quantized: the same bytes
            if y is None:
                h, normed = None, rms_norm.reference(x, weight, eps, torch.bfloat16)
            else:
                h, normed = add_rms_norm.reference(x, y, weight, eps, torch.bfloat16)
            rows, cols = fp8.quantize_tensorwise_pair(
                normed.reshape(M, D), dtype, check=False, amax=used.reshape(1), record=record.reshape(1)
            )
            ctx.save_for_backward(x, y, weight)  # the backward re-runs the reference's autograd graph
            ctx.reference = True
        holder.extend([rows, cols])
        ctx.eps, ctx.add, ctx.dtypes = eps, y is not None, (x.dtype, None if y is None else y.dtype)
        ctx.dy_into = dy_into
        placeholder = zeros_placeholder(x.shape, torch.bfloat16, x.device)
        return placeholder if h is None else (h, placeholder)

    @staticmethod
    def backward(ctx, *grads):
        x_dtype, y_dtype = ctx.dtypes
        dh, dnormed = grads if ctx.add else (None, grads[0])
        rest = (None,) * 6  # eps, the two words, the specs, the holder, dy_into
        if dnormed is None:  # only h was used: its gradient passes straight through the add
            return (None, None, None, *rest) if dh is None else (dh.to(x_dtype), dh.to(y_dtype), None, *rest)
        if not ctx.reference:
            from inkling_fp4.model.glue_kernels.norm_kernels import norm_backward  # needs triton

            h, weight, rstd = ctx.saved_tensors  # h: x itself without the add
            dy_into = ctx.dy_into if ctx.add else None
            dx, dy, dweight = norm_backward(h, weight, rstd, dnormed, dh, x_dtype, y_dtype, dy_into)
            return dx, dy if ctx.add else None, dweight, *rest
        x, y, weight = ctx.saved_tensors  # through the reference's own graph: the same sums, same order
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(True) for t in (x, y, weight)]
            if ctx.add:
                h, normed = add_rms_norm.reference(*leaves, ctx.eps, torch.bfloat16)
            else:
                h, normed = None, rms_norm.reference(leaves[0], leaves[2], ctx.eps, torch.bfloat16)
            outputs, upstream = (
                [normed] + ([] if dh is None else [h]),
                [dnormed] + ([] if dh is None else [dh]),
            )
            wrt = [t for t in leaves if t is not None]
            found = iter(torch.autograd.grad(outputs, wrt, upstream))
        dx, dy, dweight = (None if t is None else next(found) for t in leaves)
        return dx, dy, dweight, *rest
