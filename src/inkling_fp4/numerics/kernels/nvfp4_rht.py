"""Fused wgrad operand: ``quantize(rht(x.t()))`` for x [M, N] without materializing ``x.t()``.

The wgrad's NVFP4 operands are blocked along the token dim M after a 16-point random Hadamard transform
R = diag(s)·H16/4 along it (``hadamard.py``). A 16-token group is one 1x16 output block, so a program
loads a group's 16 rows (coalesced along features) and joins them, each thread then holding all 16
tokens of its features: y [BLOCK_N, 16]. The transform is the fast Walsh-Hadamard butterfly on
in-thread pairs, the signs a compile-time bit mask folded into the first multiply by ±1/4; y is rounded
once to BF16, as the reference ``rht``.

Exactness: the ±1/4 products are exact, so y is the exact sum whenever it fits FP32 (for BF16 input,
magnitudes in a group spanning less than 2^12), and any summation order gives the reference's BF16 y.
FP32 input with a wider spread may differ from the reference in the last BF16 bit of a few values.

Two launches: ``AMAX_ONLY`` reduces the global amax of y (and with ``X_AMAX`` also ``max |x|`` from the
same loads, x and dy being quantized along rows too), then the same code recomputes y and quantizes it.
With ``ROW_VALUES`` the second launch also writes x's own 1x16 row quantization (BF16 block values):
the fprop operand of the x whose RHT it quantizes for the wgrad (or dy's dgrad operand beside its
wgrad one), from the same read. A row block's 16 features lie in 16 threads here, so its amax is a
cross-thread max; its stochastic-rounding bytes come from one Philox call per block, as the row kernel's.
"""

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels import seeds
from inkling_fp4.numerics.kernels.amax import zeroed_words
from inkling_fp4.numerics.kernels.common import (
    PHILOX_ROUNDS,
    bf16_round,
    block_scale,
    block_values,
    e2m1_nearest,
    e2m1_stochastic,
    encode_blocks,
    encode_scale,
    packed_codes,
    replay_seed,
    store_decode_scale,
    tensor_scales,
)


@triton.jit
def _load_pair(ptrs, step, mask):
    return tl.join(tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + step, mask=mask, other=0.0))


@triton.jit
def _load_token_group(ptrs, stride, mask, BLOCK_N: tl.constexpr):
    """Rows x[m0 + i, features] for i in 0..15 -> FP32 [BLOCK_N, 16], a feature's tokens in one thread.
    Joining row k with k + 8, then k + 4, k + 2, k + 1 puts token 8s + 4t + 2u + v at (s, t, u, v)."""
    step = 8 * stride
    a0 = _load_pair(ptrs, step, mask)
    a1 = _load_pair(ptrs + stride, step, mask)
    a2 = _load_pair(ptrs + 2 * stride, step, mask)
    a3 = _load_pair(ptrs + 3 * stride, step, mask)
    a4 = _load_pair(ptrs + 4 * stride, step, mask)
    a5 = _load_pair(ptrs + 5 * stride, step, mask)
    a6 = _load_pair(ptrs + 6 * stride, step, mask)
    a7 = _load_pair(ptrs + 7 * stride, step, mask)
    b0 = tl.join(a0, a4)
    b1 = tl.join(a1, a5)
    b2 = tl.join(a2, a6)
    b3 = tl.join(a3, a7)
    x = tl.join(tl.join(b0, b2), tl.join(b1, b3))
    return tl.reshape(x, [BLOCK_N, 16]).to(tl.float32)


@triton.jit
def _load_token_group_wide(ptrs, stride, mask, BLOCK_N: tl.constexpr):
    """:func:`_load_token_group` as one [16 tokens, BLOCK_N] load (each thread a vector of features),
    transposed by the compiler (through shared memory) to [BLOCK_N, 16]: the same values in fewer,
    wider loads."""
    tokens = tl.arange(0, 16).to(tl.int64)[:, None]
    x = tl.load(ptrs[None, :] + tokens * stride, mask=mask[None, :], other=0.0)  # [16, BLOCK_N]
    return tl.trans(x).to(tl.float32)


@triton.jit
def _halves(y, BLOCK_N: tl.constexpr):
    """[BLOCK_N, 16] -> (elements 0..7, elements 8..15), each [BLOCK_N, 8]."""
    return tl.split(tl.permute(tl.reshape(y, [BLOCK_N, 2, 8]), [0, 2, 1]))


@triton.jit
def _rht_group(col_ptrs, group, M, stride_xm, feature_ok, SIGN_BITS: tl.constexpr, BLOCK_N: tl.constexpr,
               NATIVE_BF16: tl.constexpr, WIDE_LOADS: tl.constexpr = False):  # fmt: skip
    """rht along the 16 tokens of ``group`` ([1]) for the features at ``col_ptrs`` ([BLOCK_N]) ->
    (x, y), both FP32 [BLOCK_N, 16], y holding BF16 values."""
    m0 = group * 16
    ptrs, mask = col_ptrs + m0.to(tl.int64) * stride_xm, feature_ok & (m0 < M)
    if WIDE_LOADS:
        x = _load_token_group_wide(ptrs, stride_xm, mask, BLOCK_N)
    else:
        x = _load_token_group(ptrs, stride_xm, mask, BLOCK_N)
    # diag(s)/4 first (exact), then H16 by four butterfly stages out[2k + s] = in[k] ± in[k + 8]
    token = tl.arange(0, 16)[None, :]
    y = x * tl.where(((SIGN_BITS >> token) & 1) != 0, -0.25, 0.25)
    for _ in tl.static_range(4):
        a, b = _halves(y, BLOCK_N)
        y = tl.reshape(tl.join(a + b, a - b), [BLOCK_N, 16])
    return x, bf16_round(y, NATIVE_BF16)


@triton.jit
def _running_abs_max(running, t):
    """max(running, |t|) elementwise, NaN counting as +Inf (the amax a NaN/Inf check reads)."""
    t = tl.abs(t)
    return tl.maximum(running, tl.where(t == t, t, float("inf")))


@triton.jit
def stored_rows_abs_max(x_ptr, first_row, first_feature, end_feature, M, stride_xm, SIGN_BITS: tl.constexpr,
                        ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NATIVE_BF16: tl.constexpr):  # fmt: skip
    """(``max |rht(xᵀ)|``, ``max |x|``) over rows ``first_row`` .. + ROWS (a multiple of 16, from a
    16-token boundary) and features ``first_feature`` .. + BLOCK_N below ``end_feature`` of x [M, N]
    (row stride ``stride_xm``): the words :func:`rht_t_abs_max` reduces, from a producer's own output
    tile (the amax pass it saves). The butterfly is :func:`_rht_group`'s, so the values are the same
    bits; NaN/Inf counts as +Inf. A producer calls it after ``tl.debug_barrier()``: its threads read
    what the others stored."""
    features = first_feature + tl.arange(0, BLOCK_N)
    feature_ok = features < end_feature
    col_ptrs = x_ptr + features.to(tl.int64)
    running = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    running_x = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for g in tl.static_range(ROWS // 16):
        group = first_row // 16 + g + tl.arange(0, 1)
        x, y = _rht_group(col_ptrs, group, M, stride_xm, feature_ok, SIGN_BITS, BLOCK_N, NATIVE_BF16)
        running = _running_abs_max(running, y)
        running_x = _running_abs_max(running_x, x)
    return tl.max(tl.max(running, axis=1), axis=0), tl.max(tl.max(running_x, axis=1), axis=0)


@triton.jit
def store_amax_pair(x_ptr, first_row, first_feature, end_feature, M, N, stride_xm, pair_ptr,
                    SIGN_BITS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    NATIVE_BF16: tl.constexpr):  # fmt: skip
    """:func:`stored_rows_abs_max` over features ``first_feature`` .. ``end_feature`` (the program's own
    columns: no other program's stores are read) of x [M, N] (row stride ``stride_xm``, unit column
    stride), maxed into ``pair_ptr`` [2] as :func:`rht_t_abs_max` lays them out: [rht amax, x amax]."""
    rht_max = tl.zeros([1], dtype=tl.float32)
    x_max = tl.zeros([1], dtype=tl.float32)
    end = tl.minimum(end_feature, N)
    for feature in range(first_feature, end, BLOCK_N):
        a, b = stored_rows_abs_max(
            x_ptr, first_row, feature, end, M, stride_xm, SIGN_BITS, ROWS, BLOCK_N, NATIVE_BF16
        )
        rht_max = tl.maximum(rht_max, a)
        x_max = tl.maximum(x_max, b)
    word = tl.arange(0, 1)
    tl.atomic_max(pair_ptr + word, rht_max)
    tl.atomic_max(pair_ptr + 1 + word, x_max)


@triton.jit
def _concat(a, b, R: tl.constexpr, K: tl.constexpr):
    """[R, K] and [R, K] -> [R, 2K] (a first), without leaving the thread."""
    return tl.reshape(tl.permute(tl.join(a, b), [0, 2, 1]), [R, 2 * K])


@triton.jit
def _spread(t, BLOCK_N: tl.constexpr):
    """[BLOCK_N/16, 16] per (row block, token) -> [BLOCK_N, 16], each row block's value on its 16 features."""
    return tl.reshape(tl.broadcast_to(t[:, None, :], [BLOCK_N // 16, 16, 16]), [BLOCK_N, 16])


@triton.jit
def _row_random_bytes(group, N, row_seed, BLOCK_N: tl.constexpr):
    """The row kernel's stochastic-rounding bytes, as [BLOCK_N features, 16 tokens]: a row block's 16
    bytes from one Philox call on its index (token · N/16 + block), feature j taking byte j."""
    tokens = group * 16 + tl.arange(0, 16)[None, :]  # [1, 16]
    blocks = (tl.program_id(1) * BLOCK_N) // 16 + tl.arange(0, BLOCK_N // 16)[:, None]  # [BLOCK_N/16, 1]
    r0, r1, r2, r3 = tl.randint4x(row_seed, tokens * (N // 16) + blocks, PHILOX_ROUNDS)  # [BLOCK_N/16, 16]
    j = tl.arange(0, 16)[None, :, None]  # a feature's place in its block
    word = tl.where(j < 8, tl.where(j < 4, r0[:, None, :], r1[:, None, :]),
                    tl.where(j < 12, r2[:, None, :], r3[:, None, :]))  # fmt: skip
    return tl.reshape((word >> ((j & 3) * 8)) & 0xFF, [BLOCK_N, 16]).to(tl.int32)


@triton.jit
def _store_row_values(x, group, features, feature_ok, M, N, row_ptr, row_s_enc, row_decode, row_seed,
                      BLOCK_N: tl.constexpr, ROW_STOCHASTIC: tl.constexpr):  # fmt: skip
    """x [BLOCK_N features, 16 tokens] quantized along its features in 1x16 blocks -> BF16 block values
    at row_ptr [M, N]: the row quantizer's bits (``nvfp4_quantize``), its draws for stochastic rounding."""
    block_amax = tl.max(tl.reshape(tl.abs(x), [BLOCK_N // 16, 16, 16]), axis=1)  # [BLOCK_N/16, 16]
    _, scale = block_scale(block_amax, row_s_enc)
    encode = _spread(encode_scale(scale, row_decode), BLOCK_N)
    if ROW_STOCHASTIC:
        _, value = e2m1_stochastic(x, encode, _row_random_bytes(group, N, row_seed, BLOCK_N))
    else:
        _, value = e2m1_nearest(x, encode)
    tokens = group * 16 + tl.arange(0, 16)[None, :]  # [1, 16]
    ptrs = row_ptr + tokens.to(tl.int64) * N + features[:, None]
    mask = feature_ok[:, None] & (tokens < M)
    tl.store(ptrs, (value * _spread(scale, BLOCK_N)).to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _encode_group(col_ptrs, group, features, feature_ok, M, N, stride_xm, s_enc, decode_scale, seed,
                  row_ptr, row_s_enc, row_decode, row_seed, SIGN_BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                  NATIVE_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, ROW_VALUES: tl.constexpr,
                  ROW_STOCHASTIC: tl.constexpr, WIDE_LOADS: tl.constexpr = False):  # fmt: skip
    """One 16-token group (``group``: [1]) -> its output block column: packed codes [BLOCK_N, 8],
    scale bytes [BLOCK_N, 1] and block values [BLOCK_N, 16]; with ``ROW_VALUES`` x's row values stored."""
    x, y = _rht_group(col_ptrs, group, M, stride_xm, feature_ok, SIGN_BITS, BLOCK_N, NATIVE_BF16, WIDE_LOADS)
    if ROW_VALUES:
        _store_row_values(x, group, features, feature_ok, M, N, row_ptr, row_s_enc, row_decode, row_seed,
                          BLOCK_N, ROW_STOCHASTIC)  # fmt: skip
    lo, hi = _halves(y, BLOCK_N)
    lo = tl.reshape(lo, [BLOCK_N, 1, 8])
    hi = tl.reshape(hi, [BLOCK_N, 1, 8])
    block_amax = tl.maximum(tl.max(tl.abs(lo), axis=2), tl.max(tl.abs(hi), axis=2))  # [BLOCK_N, 1]
    block_index = features[:, None] * (M // 16) + group[None, :]
    scale_byte, scale, code_lo, code_hi, value_lo, value_hi = encode_blocks(
        lo, hi, block_amax, s_enc, decode_scale, seed, block_index, STOCHASTIC
    )
    codes = tl.reshape(packed_codes(code_lo, code_hi, BLOCK_N, 1), [BLOCK_N, 8])
    values = tl.reshape(block_values(value_lo, value_hi, scale, BLOCK_N, 1), [BLOCK_N, 16])
    return codes, scale_byte.to(tl.uint8), values


@triton.jit
def _encode_pair(col_ptrs, group, features, feature_ok, M, N, stride_xm, s_enc, decode_scale, seed,
                 row_ptr, row_s_enc, row_decode, row_seed, SIGN_BITS: tl.constexpr, BLOCK_N: tl.constexpr,
                 NATIVE_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, ROW_VALUES: tl.constexpr,
                 ROW_STOCHASTIC: tl.constexpr, WIDE_LOADS: tl.constexpr = False):  # fmt: skip
    """Groups ``group`` and ``group + 1`` side by side: codes [BLOCK_N, 16], scales [BLOCK_N, 2],
    values [BLOCK_N, 32]."""
    codes0, scales0, values0 = _encode_group(col_ptrs, group, features, feature_ok, M, N, stride_xm, s_enc,
                                             decode_scale, seed, row_ptr, row_s_enc, row_decode, row_seed,
                                             SIGN_BITS, BLOCK_N, NATIVE_BF16, STOCHASTIC, ROW_VALUES,
                                             ROW_STOCHASTIC, WIDE_LOADS)  # fmt: skip
    codes1, scales1, values1 = _encode_group(col_ptrs, group + 1, features, feature_ok, M, N, stride_xm,
                                             s_enc, decode_scale, seed, row_ptr, row_s_enc, row_decode,
                                             row_seed, SIGN_BITS, BLOCK_N, NATIVE_BF16, STOCHASTIC,
                                             ROW_VALUES, ROW_STOCHASTIC, WIDE_LOADS)  # fmt: skip
    return (
        _concat(codes0, codes1, BLOCK_N, 8),
        _concat(scales0, scales1, BLOCK_N, 1),
        _concat(values0, values1, BLOCK_N, 16),
    )


@triton.jit(do_not_specialize=["seed", "row_seed"])
def _rht_kernel(
    x_ptr, amax_ptr, seed, seed_ptr, codes_ptr, scales_ptr, values_ptr, decode_ptr, partner_ptr, row_ptr,
    row_amax_ptr, row_decode_ptr, row_partner_ptr, row_seed, row_seed_ptr, M, N, stride_xm, stride_xn,
    SIGN_BITS: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, AMAX_ONLY: tl.constexpr,
    NATIVE_BF16: tl.constexpr, STOCHASTIC: tl.constexpr, SEED_PTR: tl.constexpr, WRITE_CODES: tl.constexpr,
    WRITE_VALUES: tl.constexpr, WRITE_DECODE: tl.constexpr, PARTNER: tl.constexpr, X_AMAX: tl.constexpr,
    ROW_VALUES: tl.constexpr, ROW_STOCHASTIC: tl.constexpr, ROW_SEED_PTR: tl.constexpr,
    ROW_PARTNER: tl.constexpr, WIDE_LOADS: tl.constexpr = False,
):  # fmt: skip
    if SEED_PTR:  # replayed by a CUDA graph: the seed from the device word (see seeds.py)
        seed = replay_seed(seed_ptr, seed)
    if ROW_SEED_PTR:
        row_seed = replay_seed(row_seed_ptr, row_seed)
    features = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    feature_ok = features < N
    col_ptrs = x_ptr + features.to(tl.int64) * stride_xn
    first = tl.program_id(0) * GROUPS  # the program's first 16-token group
    if AMAX_ONLY:
        running = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        running_x = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
        for g in range(GROUPS):
            group = first + g + tl.arange(0, 1)
            x, y = _rht_group(
                col_ptrs, group, M, stride_xm, feature_ok, SIGN_BITS, BLOCK_N, NATIVE_BF16, WIDE_LOADS
            )
            running = _running_abs_max(running, y)
            if X_AMAX:
                running_x = _running_abs_max(running_x, x)
        tl.atomic_max(amax_ptr, tl.max(tl.max(running, axis=1), axis=0))
        if X_AMAX:  # the plain amax of x, from the same loads, into the word after rht's
            tl.atomic_max(amax_ptr + 1, tl.max(tl.max(running_x, axis=1), axis=0))
    else:
        s_enc, decode_scale = tensor_scales(tl.load(amax_ptr))
        if WRITE_DECODE:  # the tensor decode scale 1/S_enc for the GEMM output, written once
            store_decode_scale(decode_ptr, decode_scale, partner_ptr, PARTNER)
        row_s_enc, row_decode = s_enc, decode_scale
        if ROW_VALUES:  # x's own row quantization: its tensor scales, its decode scale written once
            row_s_enc, row_decode = tensor_scales(tl.load(row_amax_ptr))
            store_decode_scale(row_decode_ptr, row_decode, row_partner_ptr, ROW_PARTNER)
        # GROUPS (1, 2 or 4) consecutive output blocks of each feature row are gathered in the thread
        # so that each row segment is written at once.
        group = first + tl.arange(0, 1)
        if GROUPS == 1:
            codes, scales, values = _encode_group(col_ptrs, group, features, feature_ok, M, N, stride_xm,
                                                  s_enc, decode_scale, seed, row_ptr, row_s_enc, row_decode,
                                                  row_seed, SIGN_BITS, BLOCK_N, NATIVE_BF16, STOCHASTIC,
                                                  ROW_VALUES, ROW_STOCHASTIC, WIDE_LOADS)  # fmt: skip
        else:
            codes, scales, values = _encode_pair(col_ptrs, group, features, feature_ok, M, N, stride_xm,
                                                 s_enc, decode_scale, seed, row_ptr, row_s_enc, row_decode,
                                                 row_seed, SIGN_BITS, BLOCK_N, NATIVE_BF16, STOCHASTIC,
                                                 ROW_VALUES, ROW_STOCHASTIC, WIDE_LOADS)  # fmt: skip
            if GROUPS == 4:
                codes2, scales2, values2 = _encode_pair(col_ptrs, group + 2, features, feature_ok, M, N,
                                                        stride_xm, s_enc, decode_scale, seed, row_ptr,
                                                        row_s_enc, row_decode, row_seed, SIGN_BITS, BLOCK_N,
                                                        NATIVE_BF16, STOCHASTIC, ROW_VALUES,
                                                        ROW_STOCHASTIC, WIDE_LOADS)  # fmt: skip
                codes = _concat(codes, codes2, BLOCK_N, 16)
                scales = _concat(scales, scales2, BLOCK_N, 2)
                values = _concat(values, values2, BLOCK_N, 32)

        out_rows = features.to(tl.int64)[:, None]
        if WRITE_CODES:
            byte_cols = first * 8 + tl.arange(0, 8 * GROUPS)[None, :]
            byte_mask = feature_ok[:, None] & (byte_cols < M // 2)
            tl.store(codes_ptr + out_rows * (M // 2) + byte_cols, codes, mask=byte_mask)
            block_cols = first + tl.arange(0, GROUPS)[None, :]
            block_mask = feature_ok[:, None] & (block_cols < M // 16)
            tl.store(scales_ptr + out_rows * (M // 16) + block_cols, scales, mask=block_mask)
        if WRITE_VALUES:
            cols = first * 16 + tl.arange(0, 16 * GROUPS)[None, :]
            value_mask = feature_ok[:, None] & (cols < M)
            tl.store(
                values_ptr + out_rows * M + cols, values.to(values_ptr.dtype.element_ty), mask=value_mask
            )


# Tiles of the two launches: (block_n, groups, num_warps), the best of ``bench_quant.py --sweep``.
# Module attributes, so that a benchmark can time a step under other tiles (``bench_pretrain --tiles``).
AMAX_TILE = (256, 8, 4)
QUANTIZE_TILE = (64, 2, 2)
WIDE_LOADS = False
"""Whether the two launches load a 16-token group as one [16, BLOCK_N] tile transposed by the compiler
(:func:`_load_token_group_wide`) instead of sixteen row loads joined in the thread (the same values).
Off: the hybrid-350m NVFP4 step took 263.3 ms with it against 239.3 ms without (H100, 2026-12-07,
``bench_pretrain.py --rht-loads wide|rows``)."""


def sign_bits(signs: torch.Tensor) -> int:
    """RHT sign vector (16 values of ±1) -> bit mask, bit i set where ``signs[i] == -1``."""
    values = signs.tolist()
    if len(values) != 16 or any(v not in (1.0, -1.0) for v in values):
        raise ValueError(f"rht signs must be 16 values of +-1, got {values}")
    return sum(1 << i for i, v in enumerate(values) if v < 0)


def native_bf16() -> bool:
    """False under the interpreter, whose FP32 -> BF16 cast truncates (``common.bf16_round``)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


class RowValues(NamedTuple):
    """x's own 1x16 row quantization written by the RHT pass (``quantize_rht_t_tiles(rows=...)``)."""

    values: torch.Tensor  # [M, N] BF16 block values
    amax: torch.Tensor  # FP32 [1]: max |x|
    decode: torch.Tensor  # FP32 [1] for 1/S_enc, [2] with ``partner`` (and 1/S_enc · partner)
    seed: int | seeds.DeviceSeed | None = None  # stochastic rounding (the row kernel's draws)
    partner: torch.Tensor | None = None  # the other GEMM operand's decode scale


def _tile(default: tuple[int, int, int], *given: int | None) -> tuple[int, int, int]:
    return tuple(d if g is None else g for d, g in zip(default, given, strict=True))


def _token_blocked_shape(x: torch.Tensor) -> tuple[int, int]:
    m, n = x.shape
    if m % 16:
        raise ValueError(
            f"rht kernels: x of shape {tuple(x.shape)} needs a token dim that is a multiple of 16"
        )
    return m, n


def rht_t_abs_max(
    x: torch.Tensor,
    signs: int,
    *,
    with_x_amax: bool = False,
    block_n: int | None = None,
    groups: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """``max |rht(x.t())|`` for x [M, N] (M % 16 == 0) as FP32 [1], +Inf for NaN/Inf; with
    ``with_x_amax`` FP32 [2], ``[max |rht(x.t())|, max |x|]`` from the same read. ``signs``: a
    :func:`sign_bits` mask; the tile is :data:`AMAX_TILE` where not given."""
    block_n, groups, num_warps = _tile(AMAX_TILE, block_n, groups, num_warps)
    m, n = _token_blocked_shape(x)
    amax = zeroed_words(2 if with_x_amax else 1, x.device)
    grid = (triton.cdiv(m // 16, groups), triton.cdiv(n, block_n))
    _rht_kernel[grid](
        x, amax, 0, amax, amax, amax, amax, amax, amax, amax, amax, amax, amax, 0, amax, m, n, *x.stride(),
        SIGN_BITS=signs, BLOCK_N=block_n, GROUPS=groups, AMAX_ONLY=True, NATIVE_BF16=native_bf16(),
        STOCHASTIC=False, SEED_PTR=False, WRITE_CODES=False, WRITE_VALUES=False, WRITE_DECODE=False,
        PARTNER=False, X_AMAX=with_x_amax, ROW_VALUES=False, ROW_STOCHASTIC=False, ROW_SEED_PTR=False,
        ROW_PARTNER=False, WIDE_LOADS=WIDE_LOADS, num_warps=num_warps,
    )  # fmt: skip
    return amax


def quantize_rht_t_tiles(
    x: torch.Tensor,
    signs: int,
    amax: torch.Tensor,
    *,
    seed: int | seeds.DeviceSeed | None,
    codes: torch.Tensor | None,
    scales: torch.Tensor | None,
    values: torch.Tensor | None,
    decode: torch.Tensor | None = None,
    partner: torch.Tensor | None = None,
    rows: RowValues | None = None,
    block_n: int | None = None,
    groups: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Quantize rht(x.t()) for x [M, N] given its amax, into whichever of ``codes`` [N, M/2], ``scales``
    [N, M/16], ``values`` [N, M] and ``decode`` (1/S_enc, and ``1/S_enc · partner``) are given, as
    ``nvfp4_quantize.quantize_rows`` does for rows; the tile is :data:`QUANTIZE_TILE` where not given.
    ``rows``: also x's own 1x16 row values, from the same read (N % 16 == 0)."""
    block_n, groups, num_warps = _tile(QUANTIZE_TILE, block_n, groups, num_warps)
    if groups not in (1, 2, 4):
        raise ValueError(f"quantize_rht_t_tiles: groups={groups} must be 1, 2 or 4")
    m, n = _token_blocked_shape(x)
    if rows is not None and (n % 16 or block_n % 16):
        raise ValueError(f"quantize_rht_t_tiles: row values need N={n} and block_n={block_n} multiples of 16")
    write_codes = codes is not None
    write_values = values is not None
    grid = (triton.cdiv(m // 16, groups), triton.cdiv(n, block_n))
    seed_arg, seed_ptr, from_ptr = seeds.launch_args(seed, amax)
    write_rows = rows is not None
    rows = rows or RowValues(amax, amax, amax)  # placeholders where no row values are written
    row_seed, row_seed_ptr, row_from_ptr = seeds.launch_args(rows.seed, amax)
    _rht_kernel[grid](
        x, amax, seed_arg, seed_ptr,
        codes if write_codes else amax,
        scales if write_codes else amax,
        values if write_values else amax,
        amax if decode is None else decode,
        amax if partner is None else partner,
        rows.values, rows.amax, rows.decode, amax if rows.partner is None else rows.partner, row_seed,
        row_seed_ptr, m, n, *x.stride(),
        SIGN_BITS=signs, BLOCK_N=block_n, GROUPS=groups, AMAX_ONLY=False, NATIVE_BF16=native_bf16(),
        STOCHASTIC=seed is not None, SEED_PTR=from_ptr, WRITE_CODES=write_codes, WRITE_VALUES=write_values,
        WRITE_DECODE=decode is not None, PARTNER=partner is not None, X_AMAX=False,
        ROW_VALUES=write_rows, ROW_STOCHASTIC=rows.seed is not None, ROW_SEED_PTR=row_from_ptr,
        ROW_PARTNER=rows.partner is not None, WIDE_LOADS=WIDE_LOADS, num_warps=num_warps,
    )  # fmt: skip
