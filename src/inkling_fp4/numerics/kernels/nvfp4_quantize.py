"""NVFP4 quantization along rows (1x16 blocks, or 16x16 tiles for weights): the second pass.

A program owns x [BLOCK_M, BLOCK_N] = [BLOCK_M, G, 16]; each block is loaded as two 8-element halves,
so one thread holds a whole block and needs no exchange with others. It writes packed codes [M, N/2]
with E4M3 scale bytes [M, N/16], and/or BF16 block values [M, N] (``code · block_scale``, exact: what an
emulated GEMM multiplies). The amax comes through a pointer, so S_enc is derived on the device; the
first program also stores 1/S_enc for the GEMM's output.

``ROW_SCALED``: one amax and tensor scale per row, as ``nvfp4.quantize_rows``. ``TILE_2D``: one scale
per 16x16 tile (rows past M count as zeros), stored once per row in the 1x16 layout.
"""

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels import seeds
from inkling_fp4.numerics.kernels.common import (
    block_values,
    encode_blocks,
    packed_codes,
    replay_seed,
    store_decode_scale,
    tensor_scales,
)

# The tile of the 1x16 pass: (block_m, block_n, num_warps), the best of ``bench_quant.py --sweep``. A
# module attribute, so that a benchmark can time a step under another (``bench_pretrain --tiles``).
ROW_TILE = (8, 256, 2)


@triton.jit(do_not_specialize=["seed"])
def _quantize_rows_kernel(
    x_ptr, amax_ptr, seed, seed_ptr, codes_ptr, scales_ptr, values_ptr, decode_ptr, partner_ptr, M, N,
    stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILE_2D: tl.constexpr, STOCHASTIC: tl.constexpr,
    SEED_PTR: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, WRITE_DECODE: tl.constexpr,
    PARTNER: tl.constexpr, ROW_SCALED: tl.constexpr = False,
):  # fmt: skip
    if SEED_PTR:  # replayed by a CUDA graph: the seed from the device word (see seeds.py)
        seed = replay_seed(seed_ptr, seed)
    G: tl.constexpr = BLOCK_N // 16
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.program_id(1) * G + tl.arange(0, G)
    block_mask = (rows < M)[:, None] & (blocks < N // 16)[None, :]  # [BLOCK_M, G]
    mask = block_mask[:, :, None]
    row_start = rows.to(tl.int64)[:, None, None]
    # lo, hi: [BLOCK_M, G, 8], elements 0-7 and 8-15 of each block
    lo_ptrs = x_ptr + row_start * stride_xm + (blocks[:, None] * 16 + tl.arange(0, 8)[None, :])[None]
    lo = tl.load(lo_ptrs, mask=mask, other=0.0).to(tl.float32)
    hi = tl.load(lo_ptrs + 8, mask=mask, other=0.0).to(tl.float32)

    block_amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))  # [BLOCK_M, G]
    if TILE_2D:
        tile_amax = tl.max(tl.reshape(block_amax, [BLOCK_M // 16, 16, G]), axis=1)  # [BLOCK_M/16, G]
        block_amax = tl.reshape(tl.broadcast_to(tile_amax[:, None, :], [BLOCK_M // 16, 16, G]), [BLOCK_M, G])
    if ROW_SCALED:  # one tensor scale per row: s_enc, decode_scale [BLOCK_M, 1]
        s_enc, decode_scale = tensor_scales(tl.load(amax_ptr + rows, mask=rows < M, other=0.0)[:, None])
    else:
        s_enc, decode_scale = tensor_scales(tl.load(amax_ptr))
    if WRITE_DECODE:  # the tensor decode scale 1/S_enc for the GEMM output, written once
        store_decode_scale(decode_ptr, decode_scale, partner_ptr, PARTNER)
    block_index = rows[:, None] * (N // 16) + blocks[None, :]
    scale_byte, scale, code_lo, code_hi, value_lo, value_hi = encode_blocks(
        lo, hi, block_amax, s_enc, decode_scale, seed, block_index, STOCHASTIC
    )

    if WRITE_CODES:
        byte_cols = (blocks[:, None] * 8 + tl.arange(0, 8)[None, :])[None]  # [1, G, 8]
        packed = packed_codes(code_lo, code_hi, BLOCK_M, G)
        tl.store(codes_ptr + row_start * (N // 2) + byte_cols, packed, mask=mask)
        scale_ptrs = scales_ptr + rows.to(tl.int64)[:, None] * (N // 16) + blocks[None, :]
        tl.store(scale_ptrs, scale_byte.to(tl.uint8), mask=block_mask)
    if WRITE_VALUES:
        cols = (blocks[:, None] * 16 + tl.arange(0, 16)[None, :])[None]  # [1, G, 16]
        values = block_values(value_lo, value_hi, scale, BLOCK_M, G)
        tl.store(values_ptr + row_start * N + cols, values.to(values_ptr.dtype.element_ty), mask=mask)


def quantize_rows(
    x: torch.Tensor,
    amax: torch.Tensor,
    *,
    block_2d: bool,
    seed: int | seeds.DeviceSeed | None,
    codes: torch.Tensor | None,
    scales: torch.Tensor | None,
    values: torch.Tensor | None,
    decode: torch.Tensor | None = None,
    partner: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    row_scaled: bool = False,
) -> None:
    """Launch the row quantizer on x [M, N] (unit last-dim stride, N % 16 == 0) given its amax (FP32 [1];
    [M] with ``row_scaled``). Writes whichever of ``codes`` [M, N/2] with ``scales`` [M, N/16], ``values``
    [M, N] and ``decode`` (1/S_enc; with ``partner``, also ``1/S_enc · partner``) are given; ``seed`` (a
    Philox seed or a device seed) turns on stochastic rounding. The tile: :data:`ROW_TILE` for 1x16
    blocks, 16 rows and 4 warps for 16x16 tiles, where not given."""
    if block_2d:
        block_m, block_n = block_m or 16, block_n or 256
        num_warps = num_warps or (4 if block_m >= 16 else 2)
    else:
        given = (block_m, block_n, num_warps)
        block_m, block_n, num_warps = (d if g is None else g for d, g in zip(ROW_TILE, given, strict=True))
    if row_scaled and (block_2d or decode is not None or seed is not None):
        raise ValueError("quantize_rows: row_scaled takes no block_2d, decode or seed")
    if block_2d and block_m % 16:
        raise ValueError(f"quantize_rows: block_m={block_m} must be a multiple of 16 in 2-D mode")
    m, n = x.shape
    if n % 16 or x.stride(1) != 1:
        raise ValueError(
            f"quantize_rows: x of shape {tuple(x.shape)} needs unit-stride rows of 16·k elements"
        )
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    seed_arg, seed_ptr, from_ptr = seeds.launch_args(seed, amax)
    _quantize_rows_kernel[grid](
        x, amax, seed_arg, seed_ptr,
        amax if codes is None else codes,
        amax if scales is None else scales,
        amax if values is None else values,
        amax if decode is None else decode,
        amax if partner is None else partner,
        m, n, x.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, TILE_2D=block_2d, STOCHASTIC=seed is not None, SEED_PTR=from_ptr,
        WRITE_CODES=codes is not None, WRITE_VALUES=values is not None, WRITE_DECODE=decode is not None,
        PARTNER=partner is not None, ROW_SCALED=row_scaled, num_warps=num_warps,
    )  # fmt: skip
