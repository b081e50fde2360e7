"""Packed NVFP4 (codes + E4M3 scales) -> block values ``code · block_scale`` in BF16.

Operands saved for backward are kept packed (4.5 bits per element); the emulated GEMM that consumes
them needs the BF16 block values back. Both formats are decoded from their bits:

- E2M1 magnitude code c (0..7): c·0.5 for c < 2, else 2^((c>>1) - 1)·(1 + (c&1)/2), built as the
  FP32 bit pattern ``((c>>1) + 126) << 23 | (c&1) << 22``; bit 3 is the sign.
- E4M3 byte b: exponent field e = b>>3, mantissa m = b&7; m·2^-9 when e == 0, else the FP32 pattern
  ``(e + 120) << 23 | m << 20``.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _e2m1_decode(code):
    magnitude = code & 7
    normal = (((magnitude >> 1) + 126) << 23) | ((magnitude & 1) << 22)
    value = tl.where(magnitude < 2, magnitude.to(tl.float32) * 0.5, normal.to(tl.float32, bitcast=True))
    sign = (code & 8) << 28
    return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_decode(byte):
    exponent = byte >> 3
    mantissa = byte & 7
    normal = ((exponent + 120) << 23) | (mantissa << 20)
    return tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))


@triton.jit
def _block_values_kernel(
    codes_ptr, scales_ptr, values_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    G: tl.constexpr = BLOCK_N // 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.program_id(1) * G + tl.arange(0, G)
    row_off = rows.to(tl.int64)[:, None, None]
    block_mask = (rows < M)[:, None] & (blocks < N // 16)[None, :]  # [BLOCK_M, G]
    mask = block_mask[:, :, None]
    byte_cols = blocks[:, None] * 8 + tl.arange(0, 8)[None, :]  # [G, 8]
    # packed: [BLOCK_M, G, 8]
    packed = tl.load(codes_ptr + row_off * (N // 2) + byte_cols[None, :, :], mask=mask, other=0).to(tl.int32)
    scale_bytes = tl.load(
        scales_ptr + rows.to(tl.int64)[:, None] * (N // 16) + blocks[None, :], mask=block_mask
    )
    scale = _e4m3_decode(scale_bytes.to(tl.int32))  # [BLOCK_M, G]
    codes = tl.reshape(tl.join(packed & 15, packed >> 4), [BLOCK_M, G, 16])
    values = _e2m1_decode(codes) * scale[:, :, None]
    cols = blocks[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(values_ptr + row_off * N + cols[None, :, :], values.to(values_ptr.dtype.element_ty), mask=mask)


def block_values_from_codes(
    codes: torch.Tensor,
    scales: torch.Tensor,
    values: torch.Tensor,
    *,
    block_m: int = 16,
    block_n: int = 256,
    num_warps: int = 4,
) -> None:
    """codes uint8 [M, N/2], scales uint8 (E4M3 bytes) [M, N/16] -> ``values`` [M, N] (written)."""
    m, n = values.shape
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _block_values_kernel[grid](
        codes, scales, values, m, n, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps
    )
