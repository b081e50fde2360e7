"""The emulated NVFP4 fprop at decode sizes in two launches: quantize x, then multiply and scale.

    y [M, N] = bf16( (Qv(x) [M, K] · Wv [N, K]ᵀ)  ·  (1/S_enc(x) · 1/S_enc(W)) )

Qv(x) are x's NVFP4 block values (exact in BF16), Wv the weight's held block values
(:meth:`QuantLinear.freeze_weights`). At decode sizes (M = the batch) the unfused fprop's five launches
cost far more than their work. :func:`quantize_rows_whole` (``row`` activation scales) owns whole rows:
each row's amax in a first loop over K, then Qv(x), the row's output scale and the largest row amax
(for the NaN/Inf check); ``tensor`` scales take the amax pass plus ``nvfp4_quantize.quantize_rows``.
:func:`scaled_gemm` then multiplies with the scale and BF16 rounding in its epilogue. Quantizing inside
the GEMM instead would redo every row per column block. The decode step's norm, squared ReLU and Mamba
step write the row operand of their output themselves, in one pass over the rows they hold
(:func:`quantize_rows_in_registers`): the same bits.

Qv(x) and the scales are bit for bit the reference's; only the order of the FP32 sums differs from
cuBLAS's.
"""

import os

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels.amax import zeroed_words
from inkling_fp4.numerics.kernels.common import (
    bf16_round,
    block_values,
    encode_blocks,
    load_fp32,
    tensor_scales,
)

MAX_ROWS = 256
"""Largest M these kernels are used for (decode batches); larger GEMMs (prefill) go to cuBLAS."""


def _native() -> bool:
    """Hardware BF16 conversion and tensor-core dots: not under the interpreter (``common.py``)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _row_max(half):
    """max |x| per row of [BLOCK_M, G, 8] -> [BLOCK_M]; NaN counts as +Inf (a hardware max drops it)."""
    magnitude = tl.abs(half)
    magnitude = tl.where(magnitude == magnitude, magnitude, float("inf"))
    return tl.max(tl.max(magnitude, axis=2), axis=1)


@triton.jit
def quantize_whole_rows(
    x_ptr, stride_xm, rows, M, K, w_decode_ptr, values_ptr, out_scale_ptr, max_ptr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Rows ``rows`` [BLOCK_M] of x [M, K]: each row's amax in a first loop over K, then its block values
    (BF16 [M, K] at ``values_ptr``), its output scale ``1/S_enc(row) · w_decode`` and the atomic max of
    the row amaxes (+Inf for NaN/Inf). A device function: norm kernels call it on the rows they wrote."""
    G: tl.constexpr = BLOCK_K // 16
    row_ptr = x_ptr + rows.to(tl.int64)[:, None, None] * stride_xm
    half = tl.arange(0, 8)[None, :]
    running = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # pass 1: each row's amax
        blocks = k0 // 16 + tl.arange(0, G)
        mask = ((rows < M)[:, None] & (blocks < K // 16)[None, :])[:, :, None]
        ptrs = row_ptr + (blocks[:, None] * 16 + half)[None]  # [BLOCK_M, G, 8]
        lo = load_fp32(ptrs, mask)
        hi = load_fp32(ptrs + 8, mask)
        running = tl.maximum(running, tl.maximum(_row_max(lo), _row_max(hi)))
    s_enc, decode = tensor_scales(running[:, None])  # [BLOCK_M, 1]
    tl.atomic_max(max_ptr, tl.max(running, axis=0))  # of all rows: what the NaN/Inf check reads
    tl.store(out_scale_ptr + rows, tl.reshape(decode, [BLOCK_M]) * tl.load(w_decode_ptr), mask=rows < M)
    for k0 in range(0, K, BLOCK_K):  # pass 2: the block values
        blocks = k0 // 16 + tl.arange(0, G)
        block_mask = (rows < M)[:, None] & (blocks < K // 16)[None, :]  # [BLOCK_M, G]
        ptrs = row_ptr + (blocks[:, None] * 16 + half)[None]
        lo = load_fp32(ptrs, block_mask[:, :, None])
        hi = load_fp32(ptrs + 8, block_mask[:, :, None])
        block_amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))
        _, scale, _, _, value_lo, value_hi = encode_blocks(lo, hi, block_amax, s_enc, decode, 0, 0, False)
        cols = (blocks[:, None] * 16 + tl.arange(0, 16)[None, :])[None]  # [1, G, 16]
        v = block_values(value_lo, value_hi, scale, BLOCK_M, G)
        tl.store(values_ptr + rows.to(tl.int64)[:, None, None] * K + cols, v.to(tl.bfloat16),
                 mask=block_mask[:, :, None])  # fmt: skip


@triton.jit
def row_block_mask(rows, M, K, G: tl.constexpr):
    """[BLOCK_M, G]: the real 16-value blocks of rows ``rows``: row < M and block < K/16."""
    return (rows < M)[:, None] & (tl.arange(0, G) < K // 16)[None, :]


@triton.jit
def row_half_offsets(rows, stride_xm, G: tl.constexpr):
    """[BLOCK_M, G, 8] int64 element offsets of the first halves (elements 0-7) of the G blocks of rows
    ``rows``; the second halves are 8 further on."""
    in_row = tl.arange(0, G)[:, None] * 16 + tl.arange(0, 8)[None, :]  # [G, 8]
    return rows.to(tl.int64)[:, None, None] * stride_xm + in_row[None]


@triton.jit
def load_row_halves(x_ptr, stride_xm, rows, M, K, BLOCK_M: tl.constexpr, G: tl.constexpr):
    """Rows ``rows`` [BLOCK_M] of x [M, K] whole, in one load: (lo, hi) FP32 [BLOCK_M, G, 8], elements
    0-7 and 8-15 of each 16-value block; zero past K/16 blocks and past M rows."""
    mask = row_block_mask(rows, M, K, G)[:, :, None]
    ptrs = x_ptr + row_half_offsets(rows, stride_xm, G)
    return load_fp32(ptrs, mask), load_fp32(ptrs + 8, mask)


@triton.jit
def row_halves(x, BLOCK_M: tl.constexpr, G: tl.constexpr):
    """A tile of whole rows [BLOCK_M, 16 G] -> (lo, hi) [BLOCK_M, G, 8], as :func:`load_row_halves` lays
    them out; no value changes, only where it is held."""
    pairs = tl.permute(tl.reshape(x, [BLOCK_M, G, 2, 8]), [0, 1, 3, 2])  # [BLOCK_M, G, 8, 2]: (lo, hi)
    return tl.split(pairs)


@triton.jit
def quantize_rows_in_registers(
    lo, hi, rows, M, K, w_decode_ptr, values_ptr, out_scale_ptr, max_ptr,
    BLOCK_M: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    """:func:`quantize_whole_rows` of rows the caller already holds, in one pass with no read back: a row
    loop of K/256 steps run twice is the whole latency of a decode-sized launch. ``lo`` / ``hi`` [BLOCK_M,
    G, 8] FP32: elements 0-7 and 8-15 of each 16-value block of rows ``rows`` (G: K/16 to a power of two;
    what lies past K/16 blocks or M rows counts as zero). The same arithmetic, so the same bits."""
    block_mask = row_block_mask(rows, M, K, G)  # [BLOCK_M, G]
    lo = tl.where(block_mask[:, :, None], lo, 0.0)
    hi = tl.where(block_mask[:, :, None], hi, 0.0)
    running = tl.maximum(_row_max(lo), _row_max(hi))  # [BLOCK_M]: each row's amax, +Inf for NaN/Inf
    s_enc, decode = tensor_scales(running[:, None])  # [BLOCK_M, 1]
    tl.atomic_max(max_ptr, tl.max(running, axis=0))  # of all rows: what the NaN/Inf check reads
    tl.store(out_scale_ptr + rows, tl.reshape(decode, [BLOCK_M]) * tl.load(w_decode_ptr), mask=rows < M)
    block_amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))  # [BLOCK_M, G]
    _, scale, _, _, value_lo, value_hi = encode_blocks(lo, hi, block_amax, s_enc, decode, 0, 0, False)
    cols = (tl.arange(0, G)[:, None] * 16 + tl.arange(0, 16)[None, :])[None]  # [1, G, 16]
    v = block_values(value_lo, value_hi, scale, BLOCK_M, G)
    tl.store(values_ptr + rows.to(tl.int64)[:, None, None] * K + cols, v.to(tl.bfloat16),
             mask=block_mask[:, :, None])  # fmt: skip


@triton.jit
def _quantize_rows_whole_kernel(
    x_ptr, w_decode_ptr, values_ptr, out_scale_ptr, max_ptr, M, K, stride_xm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, IN_REGISTERS: tl.constexpr, G: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if IN_REGISTERS:
        lo, hi = load_row_halves(x_ptr, stride_xm, rows, M, K, BLOCK_M, G)
        quantize_rows_in_registers(lo, hi, rows, M, K, w_decode_ptr, values_ptr, out_scale_ptr, max_ptr,
                                   BLOCK_M, G)  # fmt: skip
    else:
        quantize_whole_rows(x_ptr, stride_xm, rows, M, K, w_decode_ptr, values_ptr, out_scale_ptr, max_ptr,
                            BLOCK_M, BLOCK_K)  # fmt: skip


def row_blocks(k: int) -> int:
    """G of :func:`quantize_rows_in_registers` for rows of K (16 | K): K/16 blocks, to a power of two.
    Plain Python: ``triton.next_power_of_2`` costs microseconds of host time a call."""
    return 1 << (k // 16 - 1).bit_length()


ROWS_IN_REGISTERS = 8192
"""Widest row a producer quantizes from registers (:func:`quantize_rows_in_registers`); wider rows take
the two loops of :func:`quantize_whole_rows`, which hold only BLOCK_K columns at a time."""


def rows_fit_in_registers(k: int) -> bool:
    """Whether rows of K take the single pass (read at each launch, so a test can force the loops)."""
    return k <= ROWS_IN_REGISTERS


def row_warps(k: int) -> int:
    """Warps of a program that holds one row of K: 4 up to 1024 columns, 8 above (8 values a thread per
    half at K = 4096, 16 at 8192)."""
    return 4 if k <= 1024 else 8


def row_operand(m: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The buffers :func:`quantize_whole_rows` writes for M rows of K: block values [M, K] BF16, output
    scales [M] FP32 and the largest row amax [1] (zeroed, as its atomic max needs)."""
    values = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    return values, torch.empty(m, dtype=torch.float32, device=device), zeroed_words(1, device)


def quantize_rows_whole(
    x: torch.Tensor,
    w_decode: torch.Tensor,
    *,
    block_m: int = 1,
    block_k: int = 256,
    in_registers: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (unit column stride, K % 16 == 0), one scale per row -> (BF16 block values [M, K], output
    scales ``1/S_enc(row) · w_decode`` FP32 [M], the largest row amax [1], +Inf for NaN/Inf).
    ``in_registers``: each row in one load and one pass (:func:`quantize_rows_in_registers`), the same
    bits; the default two loops are the reference the row producers are held to."""
    m, k = x.shape
    values, out_scale, largest = row_operand(m, k, x.device)
    _quantize_rows_whole_kernel[(triton.cdiv(m, block_m),)](
        x, w_decode, values, out_scale, largest, m, k, x.stride(0), BLOCK_M=block_m,
        BLOCK_K=block_k, IN_REGISTERS=in_registers, G=row_blocks(k) if in_registers else 1,
        num_warps=row_warps(k) if in_registers else 2,
    )  # fmt: skip
    return values, out_scale, largest


@triton.jit
def _scaled_gemm_kernel(
    a_ptr, b_ptr, scale_ptr, y_ptr, M, N, K, stride_am, stride_bn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_SCALE: tl.constexpr,
    NATIVE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = a_ptr + rows.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + cols.to(tl.int64)[None, :] * stride_bn  # Bᵀ tile [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + ks[None, :], mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
        b = tl.load(b_cols + ks[:, None], mask=(ks < K)[:, None] & (cols < N)[None, :], other=0.0)
        if NATIVE:
            acc = tl.dot(a, b, acc)  # BF16 x BF16: exact products, FP32 sums
        else:  # the interpreter multiplies BF16 as raw bits: the same exact products in FP32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if ROW_SCALE:
        y = acc * tl.load(scale_ptr + rows, mask=rows < M, other=0.0)[:, None]
    else:
        y = acc * tl.load(scale_ptr)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    out_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    if NATIVE:
        tl.store(out_ptrs, y.to(tl.bfloat16), mask=mask)  # cvt.rn: to nearest even
    else:  # the interpreter's cast truncates: round the bits, keep the top half
        bits = bf16_round(y, False).to(tl.int32, bitcast=True)
        tl.store(out_ptrs, (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), mask=mask)


def _tiles(m: int, n: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps): the whole batch in one row tile up to 64 rows, so the weight is
    read once, and column tiles narrow enough to fill the GPU (``scripts/bench_decode_gemm.py``)."""
    if m > 64:
        return 64, 64, 128, 4
    return max(16, triton.next_power_of_2(m)), 32 if n <= 2048 else 64, 256, 4


def scaled_gemm(
    a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, *, tiles: tuple[int, int, int, int] | None = None
) -> torch.Tensor:
    """bf16(a [M, K] · b [N, K]ᵀ · scale) for BF16 a and b (block values: exact products), FP32 sums;
    ``scale`` FP32: one element, or one per row of a ([M])."""
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k or a.stride(1) != 1 or b.stride(1) != 1 or a.dtype != b.dtype != torch.bfloat16:
        raise ValueError(f"scaled_gemm: BF16 a {tuple(a.shape)} and b {tuple(b.shape)}, unit column stride")
    row_scale = scale.numel() != 1
    if row_scale and scale.numel() != m:
        raise ValueError(f"scaled_gemm: {scale.numel()} scales for {m} rows")
    y = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    block_m, block_n, block_k, warps = tiles or _tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_gemm_kernel[grid](
        a, b, scale, y, m, n, k, a.stride(0), b.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, ROW_SCALE=row_scale, NATIVE=_native(), num_warps=warps,
    )  # fmt: skip
    return y
