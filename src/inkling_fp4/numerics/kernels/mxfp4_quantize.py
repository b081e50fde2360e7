"""MXFP4 quantization along rows on CUDA through Triton: one pass, the codes of ``numerics/mxfp4.py``.

MX has no tensor scale, so each 32-element block is read once and written once, where the torch
reference makes a dozen full-size temporaries. The E8M0 byte is ``clamp(biased_exponent(amax) - 2, 0,
254)`` (the reference's ``floor(log2 amax) - 2``), the amax being the integer max of the sign-cleared
FP32 bit patterns: exact in any order, and NaN cannot vanish from it as from a float max. A block
holding NaN or Inf gets the NaN byte 255, which the reference never writes (``mxfp4.quantize`` raises).

The same pass can write the block values ``E2M1 value · 2^shared_exp`` (what an emulated GEMM
multiplies), exact in BF16: built from bits, which unlike the interpreter's cast is right for subnormals.

Layout: a program owns [BLOCK_M, BLOCK_N] = [BLOCK_M, G, 32]. Stochastic rounding takes 32 random bytes
per block from two Philox calls keyed by (seed, 2·block index + 0/1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels import seeds
from inkling_fp4.numerics.kernels.common import (
    PHILOX_ROUNDS,
    concat_last,
    e2m1_nearest,
    e2m1_stochastic,
    half_block_bytes,
    load_fp32,
    replay_seed,
)
from inkling_fp4.numerics.kernels.seeds import draw_seed

BLOCK = 32
E8M0_NAN = tl.constexpr(255)
FP32_POW2_M127_BITS = tl.constexpr(0x00400000)  # 2^-127: the FP32 subnormal with only bit 22 set
FP32_QUIET_NAN_BITS = tl.constexpr(0x7FC00000)
VALUE_DTYPES = (torch.bfloat16, torch.float32)


@triton.jit
def _block_random_bytes(seed, block_index, R: tl.constexpr, G: tl.constexpr):
    """32 random bytes per block [R, G, 32] (int32 0..255) from two Philox calls."""
    a0, a1, a2, a3 = tl.randint4x(seed, 2 * block_index, PHILOX_ROUNDS)
    b0, b1, b2, b3 = tl.randint4x(seed, 2 * block_index + 1, PHILOX_ROUNDS)
    first = concat_last(half_block_bytes(a0, a1), half_block_bytes(a2, a3), R, G, 8)
    second = concat_last(half_block_bytes(b0, b1), half_block_bytes(b2, b3), R, G, 8)
    return concat_last(first, second, R, G, 16)


@triton.jit
def _e8m0_value(scale_byte):
    """E8M0 byte (int32) -> FP32 ``2^(byte - 127)`` from its bits, exact; byte 255 -> NaN."""
    bits = tl.where(scale_byte == 0, FP32_POW2_M127_BITS, scale_byte << 23)
    bits = tl.where(scale_byte == E8M0_NAN, FP32_QUIET_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _store_values(ptrs, values, mask):
    """Store FP32 ``values`` the destination holds exactly; BF16 as the upper 16 bits of the FP32 pattern."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = (values.to(tl.int32, bitcast=True) >> 16).to(tl.int16)
        tl.store(ptrs.to(tl.pointer_type(tl.int16)), bits, mask=mask)
    else:
        tl.store(ptrs, values.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _quantize_rows_kernel(
    x_ptr, seed, seed_ptr, codes_ptr, scales_ptr, values_ptr, M, N, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STOCHASTIC: tl.constexpr, SEED_PTR: tl.constexpr,
    WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr,
):  # fmt: skip
    if SEED_PTR:  # replayed by a CUDA graph: the seed from the device word (see seeds.py)
        seed = replay_seed(seed_ptr, seed)
    G: tl.constexpr = BLOCK_N // 32
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.program_id(1) * G + tl.arange(0, G)
    block_mask = (rows < M)[:, None] & (blocks < N // 32)[None, :]  # [BLOCK_M, G]
    mask = block_mask[:, :, None]
    row_start = rows.to(tl.int64)[:, None, None]
    cols = (blocks[:, None] * 32 + tl.arange(0, 32)[None, :])[None]  # [1, G, 32]
    x = load_fp32(x_ptr + row_start * stride_xm + cols, mask)  # [BLOCK_M, G, 32]

    magnitude_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    biased = tl.max(magnitude_bits, axis=2) >> 23  # [BLOCK_M, G]: FP32 exponent field of the block amax
    scale_byte = tl.where(biased == 255, E8M0_NAN, tl.maximum(biased - 2, 0))
    # 1/X = 2^-shared_exp = 2^(127 - byte): exponent field 254 - byte, in [2, 254] for finite blocks
    inverse = (tl.maximum(254 - scale_byte, 1) << 23).to(tl.float32, bitcast=True)
    encode = inverse[:, :, None]
    if STOCHASTIC:
        block_index = rows[:, None] * (N // 32) + blocks[None, :]
        codes, e2m1 = e2m1_stochastic(x, encode, _block_random_bytes(seed, block_index, BLOCK_M, G))
    else:
        codes, e2m1 = e2m1_nearest(x, encode)  # e2m1: [BLOCK_M, G, 32] signed E2M1 values

    if WRITE_CODES:
        low, high = tl.split(tl.reshape(codes, [BLOCK_M, G, 16, 2]))  # element 2i in the low nibble
        packed = (low + high * 16).to(tl.uint8)  # [BLOCK_M, G, 16]
        byte_cols = (blocks[:, None] * 16 + tl.arange(0, 16)[None, :])[None]  # [1, G, 16]
        tl.store(codes_ptr + row_start * (N // 2) + byte_cols, packed, mask=mask)
        scale_ptrs = scales_ptr + rows.to(tl.int64)[:, None] * (N // 32) + blocks[None, :]
        tl.store(scale_ptrs, scale_byte.to(tl.uint8), mask=block_mask)
    if WRITE_VALUES:
        values = e2m1 * _e8m0_value(scale_byte)[:, :, None]  # [BLOCK_M, G, 32], exact (see top)
        _store_values(values_ptr + row_start * N + cols, values, mask)


def quantize_rows(
    x: torch.Tensor,
    codes: torch.Tensor | None,
    scales: torch.Tensor | None,
    *,
    seed: int | seeds.DeviceSeed | None,
    values: torch.Tensor | None = None,
    block_m: int = 8,
    block_n: int = 256,
    num_warps: int = 2,
) -> None:
    """Launch on x [M, N] (unit last-dim stride, N % 32 == 0), writing ``codes`` [M, N/2] with ``scales``
    [M, N/32] and/or ``values`` [M, N]; ``seed`` turns on stochastic rounding."""
    m, n = x.shape
    if n % BLOCK or x.stride(1) != 1 or block_n % BLOCK:
        raise ValueError(
            f"mxfp4 quantize_rows: x of shape {tuple(x.shape)} needs unit-stride rows of 32·k elements "
            f"and block_n={block_n} a multiple of 32"
        )
    if (codes is None) != (scales is None) or (codes is None and values is None):
        raise ValueError("mxfp4 quantize_rows: pass codes with scales, values, or both")
    if values is not None and (values.dtype not in VALUE_DTYPES or not values.is_contiguous()):
        raise ValueError(f"mxfp4 quantize_rows: values must be contiguous BF16 or FP32, got {values.dtype}")
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    seed_arg, seed_ptr, from_ptr = seeds.launch_args(seed, x)
    _quantize_rows_kernel[grid](
        x, seed_arg, seed_ptr,
        x if codes is None else codes, x if scales is None else scales, x if values is None else values,
        m, n, x.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, STOCHASTIC=seed is not None, SEED_PTR=from_ptr,
        WRITE_CODES=codes is not None, WRITE_VALUES=values is not None, num_warps=num_warps,
    )  # fmt: skip


def quantize_with_values(
    x: torch.Tensor,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    *,
    keep_codes: bool = True,
    values_dtype: torch.dtype | None = torch.bfloat16,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """MXFP4-quantize x [..., N] along its last dim in one pass, no host sync -> (codes [..., N/2], E8M0
    scale bytes [..., N/32], block values [..., N]), None where not asked for. Bit for bit the reference's
    for round to nearest; blocks holding NaN/Inf get scale byte 255 and NaN values (the caller checks)."""
    if values_dtype is not None and values_dtype not in VALUE_DTYPES:
        raise ValueError(f"mxfp4 quantize_with_values: values_dtype must be BF16 or FP32, got {values_dtype}")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    codes = scales = values = None
    if keep_codes:
        codes = torch.empty((m, n // 2), dtype=torch.uint8, device=x.device)
        scales = torch.empty((m, n // BLOCK), dtype=torch.uint8, device=x.device)
    if values_dtype is not None:
        values = torch.empty((m, n), dtype=values_dtype, device=x.device)
    if m and n and (keep_codes or values is not None):
        seed = draw_seed(generator) if stochastic else None
        quantize_rows(x2, codes, scales, seed=seed, values=values)
    lead = x.shape[:-1]
    if keep_codes:
        codes, scales = codes.reshape(*lead, n // 2), scales.reshape(*lead, n // BLOCK)
    return codes, scales, None if values is None else values.reshape(x.shape)


def quantize(
    x: torch.Tensor, stochastic: bool = False, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, E8M0 scale bytes) of x [..., N]: :func:`quantize_with_values` without values."""
    codes, scales, _ = quantize_with_values(x, stochastic, generator, keep_codes=True, values_dtype=None)
    return codes, scales
