"""The emulated NVFP4 GEMM with its epilogue in the same kernel: out = bf16((a · bᵀ) · s).

a [M, K] and b [N, K] hold exact BF16 block values (code · block scale), s the FP32 output scale
1/S_enc(a) · 1/S_enc(b) on the device (one, or one per row of a). The product accumulates in FP32 on
the tensor cores, is multiplied by s in FP32 and rounded once to BF16: the two roundings of
``scale_output.scale_to_bf16(gemm.mm_fp32_out(a, bᵀ), s)``, its torch twin, without writing the FP32
product to memory and reading it back. Only the accumulation order differs from the twin's (as it does
between any two GEMMs, a Blackwell tensor core included).
"""

import os

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels import scaled_gemm_tma
from inkling_fp4.numerics.kernels.common import load_fp32
from inkling_fp4.numerics.kernels.scale_output import scaled_bf16

CUDA_BLOCK_K = 64
"""Every CUDA tiling's BLOCK_K: a contraction that it divides needs no mask in the K loop."""
CONFIGS = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": CUDA_BLOCK_K}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": CUDA_BLOCK_K}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": CUDA_BLOCK_K}, num_warps=8, num_stages=4),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": CUDA_BLOCK_K}, num_warps=4, num_stages=4),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": CUDA_BLOCK_K}, num_warps=4, num_stages=4),
]
"""Tilings tried once per GEMM shape on CUDA (Hopper's wgmma wants 64-row multiples and 4+ warps)."""
INTERPRETER_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}
TMA_FED = True
"""Whether operands that TMA can load go to the persistent TMA-fed kernel (``scaled_gemm_tma.py``)
instead of this pointer-fed one (the same bits but for the order of the sums). The hybrid-350m NVFP4
step took 233.2 ms with it against 239.3 ms without (H100, 2026-12-07, ``bench_pretrain.py --tma-gemm``);
``scripts/bench_scaled_gemm.py`` times both feeds per shape."""


@triton.jit
def _scaled_gemm_kernel(
    a_ptr, b_ptr, scale_ptr, out_ptr, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, stride_om,
    M_BUCKET, ROW_SCALE: tl.constexpr, NATIVE_BF16: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr = 8,
):  # fmt: skip
    # programs walk GROUP_M row tiles down a column of tiles before moving right: b's tiles stay in L2
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    first_m = (pid // in_group) * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % in_group) % rows_in_group
    tile_n = (pid % in_group) // rows_in_group

    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    # the edge tiles read rows and columns again (wrapped) instead of masking every load; the store masks
    a_rows, b_cols = (rows % M).to(tl.int64), (cols % N).to(tl.int64)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak  # [BM, BK]
    b_ptrs = b_ptr + b_cols[None, :] * stride_bn + ks[:, None] * stride_bk  # [BK, BN]: bᵀ
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        if not NATIVE_BF16:  # the interpreter's dot misreads BF16: widen on the bits (exact), FP32 dot
            a, b = load_fp32(a_ptrs, k_ok[None, :]), load_fp32(b_ptrs, k_ok[:, None])
            acc = tl.dot(a, b, acc, input_precision="ieee")
        elif EVEN_K:
            acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)  # FP32 accumulation of exact BF16 products
        else:
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    out = scaled_bf16(acc, scale_ptr, rows, M, ROW_SCALE, NATIVE_BF16)  # the epilogue of scale_output.py
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out, mask=mask)


_tuned = triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K", "ROW_SCALE"])(_scaled_gemm_kernel)
"""Tuned once per (power-of-two bucket of M, N, K): a sampler's or packed trainer's varying row counts
do not each pay for a tuning."""


def scaled_gemm(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, size: tuple[int, int] | None = None):
    """bf16((a [M, K] · b [N, K]ᵀ) · scale) [M, N], ``scale`` FP32 of one element or one per row of a;
    ``size`` takes the top-left (rows, cols) of the product only (the rest is padding)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"scaled_gemm takes 2-D BF16 operands, got {a.dtype} {tuple(a.shape)}, "
                         f"{b.dtype} {tuple(b.shape)}")  # fmt: skip
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"scaled_gemm: a {tuple(a.shape)} and b {tuple(b.shape)} differ in K")
    m, n = size if size is not None else (a.shape[0], b.shape[0])
    row_scale = scale.numel() != 1
    if scale.dtype != torch.float32 or (row_scale and scale.numel() < m):
        raise ValueError(
            f"scaled_gemm takes one FP32 scale or one per row, got {scale.dtype} x {scale.numel()}"
        )
    scale = scale.reshape(-1)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    bucket = 1 << max(m - 1, 1).bit_length()
    args = (a, b, scale, out, m, n, a.shape[1], a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            out.stride(0), bucket)  # fmt: skip
    k = a.shape[1]
    native = a.is_cuda or os.environ.get("TRITON_INTERPRET") != "1"
    if TMA_FED and scaled_gemm_tma.fits(a, b):
        scaled_gemm_tma.scaled_gemm_tma(a, b, scale, out, m, n, bucket, row_scale, native)
        return out
    if a.is_cuda:
        grid = lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _tuned[grid](*args, ROW_SCALE=row_scale, NATIVE_BF16=True, EVEN_K=k % CUDA_BLOCK_K == 0)
    else:  # the interpreter (TRITON_INTERPRET=1): one small tiling
        t = INTERPRETER_TILE
        grid = (triton.cdiv(m, t["BLOCK_M"]) * triton.cdiv(n, t["BLOCK_N"]),)
        _scaled_gemm_kernel[grid](*args, ROW_SCALE=row_scale, NATIVE_BF16=native,
                                  EVEN_K=k % t["BLOCK_K"] == 0, **t)  # fmt: skip
    return out
