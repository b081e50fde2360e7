"""Mamba-2's output norm and out_proj under delayed-scaled FP8: the norm writes out_proj's x as FP8.

The gated norm's output h has one reader, out_proj (the norm's backward recomputes from its inputs), so
its kernel stores h as FP8 bytes (``numerics/kernels/fp8_epilogue.py``): same bits as unfused
(``tests/test_out_proj_fp8.py``). The norm and out_proj are one autograd function.

Shape letters: M tokens, E d_inner (out_proj's in_features), D d_model, H heads, P head dim.
"""

from __future__ import annotations

import torch

from inkling_fp4.model.compiled import fast_forms_on
from inkling_fp4.model.grad_slab import FP8Scaling
from inkling_fp4.model.norm import skip_gated_rms_norm
from inkling_fp4.numerics import fp8
from inkling_fp4.precision.gemm import Operand
from inkling_fp4.precision.linear_gemms import LinearGEMMs, save_operands, saved_operands
from inkling_fp4.precision.quant_linear import QuantLinear


def applies(out_proj: QuantLinear, z: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """Whether :func:`skip_gated_norm_out_proj` runs: a training forward on the GPU kernels, a BF16 norm
    output, delayed FP8 pairs, and 16 | tokens, 16 | E."""
    grads = z.requires_grad or out_proj.weight.requires_grad
    tokens = z.numel() // z.shape[-1]
    sizes = tokens % 16 == 0 and out_proj.in_features % 16 == 0
    on = torch.is_grad_enabled() and grads and out_dtype == torch.bfloat16 and sizes and fast_forms_on(z)
    return on and out_proj.delayed_fp8_pairs()


def skip_gated_norm_out_proj(
    y: torch.Tensor,
    x: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    out_proj: QuantLinear,
    dz_into=None,
    dy_fp8=None,
) -> torch.Tensor:
    """``out_proj(skip_gated_rms_norm(y, x, D, z, ...))`` -> [..., D], the norm's output only as FP8.
    ``dz_into``: where the norm's backward writes dz; ``dy_fp8``: the output's gradient slab."""
    tokens = z.numel() // z.shape[-1]
    gemms = out_proj.gemms(tokens, z.device)
    out = _NormOutProjFn.apply(
        y, x, D, z, norm_weight, out_proj.weight, gemms, n_groups, eps, dz_into, dy_fp8
    )
    return out.view(*z.shape[:-1], out_proj.out_features)


class _NormOutProjFn(torch.autograd.Function):
    """The gated norm and out_proj's three GEMMs; the norm's output exists only as FP8."""

    @staticmethod
    def forward(ctx, y, x, D, z, norm_weight, weight, gemms: LinearGEMMs, n_groups, eps, dz_into, dy_fp8):
        M, E, _ = gemms.shape
        spec = gemms.recipe.fprop.a
        dtype = torch.float8_e5m2 if spec.format == "e5m2" else torch.float8_e4m3fn
        used, record = gemms.delayed.x_used.reshape(1), gemms.delayed.x_record.reshape(1)
        saved = {"y": y, "x": x, "D": D, "z": z, "norm_weight": norm_weight}
        if fast_forms_on(z):  # the kernel stores h's bytes [M, E], scaled by the delayed amax
            from inkling_fp4.model.glue_kernels.gated_norm_kernels import gated_forward  # needs triton

            scaling = FP8Scaling(used, record, spec.format == "e5m2")
            h_bytes, saved["rstd"] = gated_forward(
                y, x, D, z, norm_weight, n_groups, eps, torch.bfloat16, fp8_out=scaling
            )
            rows, cols = fp8.tensorwise_pair_from_rows(h_bytes.view(M, E).view(dtype), used)
        else:  # the reference in BF16, then quantized: the same bytes
            h = skip_gated_rms_norm.reference(y, x, D, z, norm_weight, n_groups, eps, torch.bfloat16)
            rows, cols = fp8.quantize_tensorwise_pair(
                h.reshape(M, E), dtype, check=False, amax=used, record=record
            )
        pair = (Operand(rows, spec), Operand(cols, gemms.recipe.wgrad.b))  # h and hᵀ
        need_dw = ctx.needs_input_grad[5]
        out, saved_linear = gemms.forward(None, weight, need_dx=True, need_dw=need_dw, pair_x=pair)
        save_operands(ctx, saved | {f"linear.{k}": v for k, v in saved_linear.items()})
        ctx.gemms, ctx.n_groups, ctx.eps, ctx.dz_into, ctx.dy_fp8 = gemms, n_groups, eps, dz_into, dy_fp8
        return out  # [M, D] BF16

    @staticmethod
    def backward(ctx, dout):
        saved = saved_operands(ctx)
        linear = {k.removeprefix("linear."): v for k, v in saved.items() if k.startswith("linear.")}
        dh, dweight = ctx.gemms.backward(linear, dout, torch.bfloat16, dy_fp8=ctx.dy_fp8)  # dh: [M, E] BF16
        y, x, D, z, norm_weight = (saved[k] for k in ("y", "x", "D", "z", "norm_weight"))
        dh = dh.view(z.shape)
        if "rstd" in saved:
            from inkling_fp4.model.glue_kernels.gated_norm_kernels import gated_backward  # needs triton

            dy, dx, dD, dz, dnorm = gated_backward(y, x, D, z, norm_weight, saved["rstd"], dh, ctx.dz_into)
        else:  # through the reference (dz as values: a slab's split quantizes them into its block)
            with torch.enable_grad():
                leaves = [t.detach().requires_grad_(True) for t in (y, x, D, z, norm_weight)]
                h = skip_gated_rms_norm.reference(*leaves, ctx.n_groups, ctx.eps, torch.bfloat16)
                dy, dx, dD, dz, dnorm = torch.autograd.grad(h, leaves, dh)
        return dy, dx, dD, dz, dnorm, dweight, None, None, None, None, None
