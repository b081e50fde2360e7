"""Mamba-2's output norm and out_proj under delayed-scaled FP8: the norm writes out_proj's x as FP8.

Why: the gated norm's output h [tokens, E] (hybrid-350m: 2048 wide) is out_proj's x and nothing else
reads it: the norm's backward recomputes what it needs from y, x, z and its saved rstd. Unfused, the
norm writes h in BF16 and the FP8 quantizer reads it and writes both layouts (the fprop and wgrad
operands). With a delayed scale the norm's kernel stores the FP8 bytes itself, rounding each value to
BF16 first exactly as the BF16 store would, and records the amax
(``numerics/kernels/fp8_epilogue.py``); the wgrad layout is then a transpose of 1-byte elements. Per
Mamba layer and step: 1 byte per element fewer written by the norm, and a read of 1 and a write of 1
instead of the quantizer's read of 2 and write of 2.

The bits are those of the unfused path (the same BF16 values, the same scale, the same recorded amax;
``tests/test_out_proj_fp8.py``). The norm and out_proj are one autograd function; its backward runs
out_proj's dgrad and wgrad, then the norm's backward kernel on out_proj's dx. Off the GPU kernels
(the tests on CPU) it computes the same with the torch reference of the norm.

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
    """Whether :func:`skip_gated_norm_out_proj` runs: a training forward on the GPU kernels, a BF16
    norm output (autocast), out_proj's x and dy delayed FP8 pairs, and sizes the FP8 GEMMs take
    without padding (16 | tokens, 16 | E)."""
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
    """``out_proj(skip_gated_rms_norm(y, x, D, z, norm_weight, n_groups, eps, bfloat16))`` for y, x
    [..., H, P], z [..., E] -> [..., D], with the norm's output as FP8 only. ``dz_into``: where the
    norm's backward writes dz (:mod:`~inkling_fp4.model.grad_slab`), as for the norm alone; ``dy_fp8``:
    the output's gradient slab (``QuantLinear.forward``)."""
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
