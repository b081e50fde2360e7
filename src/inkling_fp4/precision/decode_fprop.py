"""The no-grad NVFP4 fprop at decode sizes as one fused kernel, where it applies.

At decode M (the batch rows) is small and W is held quantized, so the unfused fprop is launch-bound;
``numerics/kernels/nvfp4_decode_gemm.py`` gives the same values in fewer launches. Where it does not
apply (e.g. more than ``MAX_ROWS`` rows) :func:`decode_fprop` returns None and the caller runs the
unfused reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from inkling_fp4.precision import finite_guard, fused_kernels, gemm
from inkling_fp4.precision.recipes import OperandQuant

GEMM = "auto"
"""The GEMM after the quantize pass: ``triton`` (output scale in its epilogue), ``cublas`` (FP32 GEMM,
then the scale-and-round kernel: same values, one launch more) or ``auto``: cuBLAS for more than 64
rows and more than 2048 columns (LM head, in_proj, up_proj), where it is faster (BENCHMARKS.md)."""


class QuantizedRows(NamedTuple):
    """x's NVFP4 operand with one scale per row as x's producer wrote it (``model/fused_nvfp4_decode.py``):
    the row quantizer's outputs, so the GEMM runs without its launch."""

    values: torch.Tensor
    """The block values [M, K], BF16."""
    out_scale: torch.Tensor
    """1/S_enc(row) · 1/S_enc(W) [M], FP32: W's decode scale already folded in."""
    amax: torch.Tensor
    """The largest row amax [1] (+Inf for NaN/Inf): what the deferred NaN/Inf check reads."""


def takes_rows(x2d: torch.Tensor, wq: gemm.Operand | None, spec: OperandQuant) -> bool:
    """Whether :func:`decode_fprop` runs for x2d with row scales, so x's producer may quantize it."""
    return spec.row_scaled and _applies(x2d, wq, spec)


def _applies(x2d: torch.Tensor, wq: gemm.Operand | None, spec: OperandQuant) -> bool:
    if wq is None or wq.spec.format != "nvfp4" or wq.values is None or wq.decode_scale is None:
        return False
    if spec.format != "nvfp4" or spec.block != (1, 16) or spec.stochastic or spec.rht:
        return False
    if fused_kernels.fused_for(x2d) is None:  # no Triton for this device (the kernels module imports it)
        return False
    from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import MAX_ROWS  # needs triton

    m, k = x2d.shape
    return (
        0 < m <= MAX_ROWS
        and k % 16 == 0
        and wq.values.dtype == torch.bfloat16
        and wq.values.shape[1] == k
        and wq.decode_scale.numel() == 1
        and not wq.transposed
    )


def decode_fprop(
    x2d: torch.Tensor, wq: gemm.Operand | None, spec: OperandQuant, n: int, name: str,
    rows: QuantizedRows | None = None,
) -> torch.Tensor | None:  # fmt: skip
    """y BF16 [M, n] = Q(x2d) · W_heldᵀ with its output scale; None where the kernel does not apply.
    The x amax goes to the deferred NaN/Inf check. ``rows``: Q(x2d) as x's producer wrote it (row
    scales only)."""
    if not _applies(x2d, wq, spec):
        return None
    from inkling_fp4.numerics.kernels import nvfp4_decode_gemm as kernels  # needs triton

    x = x2d if x2d.stride(1) == 1 else x2d.contiguous()
    if rows is not None and spec.row_scaled:
        xv, out_scale, amax = rows
    elif spec.row_scaled:  # xv [M, K] BF16, out_scale [M]; amax [1]: the largest row amax
        xv, out_scale, amax = kernels.quantize_rows_whole(x, wq.decode_scale)
    else:  # the amax pass, then the quantize pass, which also writes 1/S_enc(x) · 1/S_enc(W)
        bv = fused_kernels.fused_for(x).fake_quantize(x, check_finite=False, scale_with=wq.decode_scale)
        xv, out_scale, amax = bv.values, bv.output_scale, bv.amax
    label = f"NVFP4 operand '{name} x'"
    finite_guard.record(amax, label)
    if finite_guard.eager():
        finite_guard.raise_if_non_finite()
    w = wq.values[:n]  # [n, K] (the held tiles pad N to 16)
    if GEMM == "triton" or (GEMM == "auto" and (x.shape[0] <= 64 or n <= 2048)):
        return kernels.scaled_gemm(xv, w, out_scale)
    from inkling_fp4.numerics.kernels.scale_output import scale_to_bf16  # needs triton

    return scale_to_bf16(gemm.mm_fp32_out(xv, w.t()), out_scale)
