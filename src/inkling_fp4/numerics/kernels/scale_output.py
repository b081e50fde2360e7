"""The emulated NVFP4 GEMM's epilogue in one pass: out = bf16(acc · s).

acc is the GEMM's FP32 product [M, N] (row-strided when cropped from a padded GEMM), s the FP32 output
scale 1/S_enc(a) · 1/S_enc(b) on the device. Two roundings, as a Blackwell tensor core's epilogue: the
FP32 product, then to BF16. ``torch.mul`` with a BF16 ``out`` does the same through a slow,
non-vectorized path.
"""

import os

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels.common import bf16_round


@triton.jit
def scaled_bf16(acc, scale_ptr, rows, M, ROW_SCALE: tl.constexpr, NATIVE_BF16: tl.constexpr):
    """acc FP32 [BLOCK_M, BLOCK_N] (rows ``rows`` of M) times the scale (one, or one per row), rounded
    once to BF16: the epilogue here and in ``scaled_gemm.py``."""
    if ROW_SCALE:  # one scale per row [M]
        y = acc * tl.load(scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
    else:
        y = acc * tl.load(scale_ptr)
    if NATIVE_BF16:
        return y.to(tl.bfloat16)  # cvt.rn: to nearest even
    # the interpreter's cast truncates (and loses subnormals): round the bits, keep the top half
    bits = bf16_round(y, False).to(tl.int32, bitcast=True)
    return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _scale_to_bf16_kernel(
    acc_ptr, scale_ptr, out_ptr, M, N, stride_am, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE_BF16: tl.constexpr, ROW_SCALE: tl.constexpr = False,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    r = rows.to(tl.int64)[:, None]
    acc = tl.load(acc_ptr + r * stride_am + cols[None, :], mask=mask, other=0.0)
    out = scaled_bf16(acc, scale_ptr, rows, M, ROW_SCALE, NATIVE_BF16)
    tl.store(out_ptr + r * stride_om + cols[None, :], out, mask=mask)


def scale_to_bf16(
    acc: torch.Tensor, scale: torch.Tensor, *, block_m: int = 16, block_n: int = 256, num_warps: int = 4
) -> torch.Tensor:
    """acc FP32 [M, N] times ``scale`` (one element, or [M] per row), rounded once to BF16: bit for bit
    ``torch.mul(acc, scale, out=<BF16 [M, N]>)``."""
    m = acc.shape[0] if acc.dim() else 0
    if acc.dtype != torch.float32 or scale.dtype != torch.float32 or scale.numel() not in (1, m):
        raise ValueError(
            f"scale_to_bf16 takes an FP32 product [M, N] and one FP32 scale or M of them, got "
            f"{acc.dtype} {tuple(acc.shape)} and {scale.dtype} x {scale.numel()}"
        )
    if acc.dim() != 2 or (acc.shape[1] > 1 and acc.stride(1) != 1):
        raise ValueError(
            f"scale_to_bf16 needs a 2-D product with unit column stride, got {tuple(acc.stride())}"
        )
    m, n = acc.shape
    out = torch.empty(m, n, dtype=torch.bfloat16, device=acc.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scale_to_bf16_kernel[grid](
        acc, scale, out, m, n, acc.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, NATIVE_BF16=os.environ.get("TRITON_INTERPRET") != "1",
        ROW_SCALE=scale.numel() != 1, num_warps=num_warps,
    )  # fmt: skip
    return out
