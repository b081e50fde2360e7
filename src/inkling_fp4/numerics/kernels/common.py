"""Shared Triton device functions for the NVFP4 kernels: tensor scale, E4M3 block scale, E2M1 codes.

Each step reproduces the torch reference (the recipe in ``numerics/nvfp4.py``) bit for bit on every GPU
and under ``TRITON_INTERPRET=1``, hence integer and magic-number arithmetic on FP32 bits rather than
``.to(tl.float8e4nv)`` (sm_89+ only; the interpreter's downcasts truncate). Divisions are ``div_rn``:
Triton's ``/`` on FP32 is approximate on CUDA.

NOTE the GPU backend contracts ``a*b + c`` into one FMA, skipping the product's rounding. Every product
here that feeds an addition is exact (a power-of-two factor) or separated from it by a min/compare.
"""

import triton
import triton.language as tl

FLT_MAX = tl.constexpr(3.4028234663852886e38)
E4M3_MAX = tl.constexpr(448.0)
E2M1_MAX = tl.constexpr(6.0)
# 448·6: the largest block amax, in encoded units, that the block scale can represent.
ENCODED_RANGE = tl.constexpr(2688.0)
# Smallest normal E4M3 value 2^-6; below it the scale is k·2^-9 (subnormal).
E4M3_MIN_NORMAL = tl.constexpr(0.015625)
# FP32 exponent bias 127 minus E4M3 bias 7, in units of the 3-bit mantissa field.
E4M3_REBIAS = tl.constexpr(960)
# Adding 2^23 to a value in [0, 2^23) leaves round-half-even(value) in the low mantissa bits.
TWO_POW_23 = tl.constexpr(8388608.0)
TWO_POW_23_BITS = tl.constexpr(0x4B000000)
# Philox4x32 rounds per 128 random bits. Seven rounds already pass BigCrush (Salmon et al., "Parallel
# random numbers: as easy as 1, 2, 3", SC 2011); ten is the conservative default of most libraries.
PHILOX_ROUNDS = tl.constexpr(7)


@triton.jit
def load_fp32(ptrs, mask):
    """Load as FP32, 0 where masked; BF16 widened on its bits: exact for subnormals, unlike the
    interpreter's cast (the hardware's values either way)."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = tl.load(ptrs.to(tl.pointer_type(tl.int16)), mask=mask, other=0).to(tl.int32)
        return ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def tensor_scales(amax):
    """Global amax (FP32 scalar) -> (S_enc, 1/S_enc), as the reference computes them."""
    s_enc = tl.math.div_rn(tl.full(amax.shape, ENCODED_RANGE, tl.float32), amax)
    s_enc = tl.minimum(s_enc, FLT_MAX)
    s_enc = tl.where(amax == 0.0, 1.0, s_enc)
    decode_scale = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s_enc)
    return s_enc, decode_scale


@triton.jit
def store_decode_scale(decode_ptr, decode_scale, partner_ptr, PARTNER: tl.constexpr):
    """Program (0, 0) stores 1/S_enc at ``decode_ptr[0]`` and, with ``PARTNER``, the output scale of a
    GEMM with another NVFP4 operand, ``1/S_enc · partner`` (``partner_ptr``: its decode scale), at [1]."""
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(decode_ptr, decode_scale)
        if PARTNER:
            tl.store(decode_ptr + 1, decode_scale * tl.load(partner_ptr))


@triton.jit
def bf16_round(y, NATIVE: tl.constexpr):
    """FP32 -> the nearest BF16 value (half to even), as FP32; NaN stays NaN. Without ``NATIVE`` the bit
    pattern is rounded, for the interpreter, whose cast truncates."""
    if NATIVE:
        return y.to(tl.bfloat16).to(tl.float32)
    bits = y.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    return tl.where(y == y, rounded.to(tl.float32, bitcast=True), y)


@triton.jit
def e4m3_round(v):
    """Non-negative FP32 ``v`` <= 448 -> (E4M3 byte as int32, its FP32 value), round half to even.
    Normal range: round the mantissa bits to 3 (a carry moves into the exponent). Subnormal (v < 2^-6):
    v = k·2^-9 with k = rne(v·2^9) in 0..8, and k is the byte."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal_byte = (rounded >> 20) - E4M3_REBIAS
    normal_value = (rounded & -1048576).to(tl.float32, bitcast=True)  # -1048576 == 0xFFF00000
    k = (v * 512.0 + TWO_POW_23).to(tl.int32, bitcast=True) - TWO_POW_23_BITS
    subnormal = v < E4M3_MIN_NORMAL
    byte = tl.where(subnormal, k, normal_byte)
    value = tl.where(subnormal, k.to(tl.float32) * 0.001953125, normal_value)
    return byte, value


@triton.jit
def block_scale(block_amax, s_enc):
    """Block amax (FP32) and S_enc -> (E4M3 scale byte as int32, FP32 scale value)."""
    byte, scale = e4m3_round(tl.minimum(block_amax * (s_enc * (1.0 / 6.0)), E4M3_MAX))
    return byte, scale


@triton.jit
def encode_scale(scale, decode_scale):
    """FP32 block scale -> ``min(1 / (scale · (1/S_enc)), FLT_MAX)`` (FLT_MAX for a zero scale)."""
    one = tl.full(scale.shape, 1.0, tl.float32)
    return tl.minimum(tl.math.div_rn(one, scale * decode_scale), FLT_MAX)


@triton.jit
def _grid_exponent(v):
    """FP32 exponent field of ``v`` in [0, 6], raised to 127: 127 below 2, 128 in [2, 4), 129 above.
    The E2M1 grid step is then 2^(e - 128), and the code of the range's first grid point is 2·e - 254."""
    return tl.maximum(v.to(tl.int32, bitcast=True) >> 23, 127)


@triton.jit
def sign_nibble(x):
    """The E2M1 sign bit (8 or 0) from the FP32 sign bit: -0 and negatives that round to 0 keep it."""
    return (x.to(tl.int32, bitcast=True) >> 28) & 8


@triton.jit
def with_sign_of(value, x):
    """Copy the FP32 sign bit of ``x`` onto the non-negative ``value``."""
    sign = x.to(tl.int32, bitcast=True) & -2147483648  # -2147483648 == 0x80000000
    return (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_nearest(x, encode):
    """FP32 ``x`` times its block's encode scale -> (signed code 0..15 as int32, FP32 value ±E2M1).

    Adding the magic number 2^(e - 105), whose FP32 ulp is the grid step, rounds |x·enc| (clamped to 6)
    to the grid half to even; the code is the steps above the magic number plus the range's first code."""
    v = tl.minimum(tl.abs(x) * encode, E2M1_MAX)
    e = _grid_exponent(v)
    magic_bits = (e + 22) << 23
    magic = magic_bits.to(tl.float32, bitcast=True)
    snapped = v + magic
    code = snapped.to(tl.int32, bitcast=True) - magic_bits + 2 * e - 254 + sign_nibble(x)
    return code, with_sign_of(snapped - magic, x)


@triton.jit
def e2m1_stochastic(x, encode, r8):
    """Stochastic rounding of ``x·enc`` with 8-bit randoms ``r8`` (int32 0..255) -> (code, value).

    The reference rounds ``a = |v|/step`` up iff ``256·frac(a) >= 256 - r``, i.e.
    ``k = floor((floor(w) + r) / 256)`` with ``w = 256·a`` (an exact FP32 product in [0, 1024)).
    One FP32 add computes ``Z = rne(w + r - 1/2)`` by adding ``w - 1/2`` to the float whose bits
    are ``0x4B000100 | r`` (= 2^23 + 256 + r): Z is ``floor(w + r)``, or one less when w + r is an
    odd integer, which never changes ``Z >> 8``; the +256 keeps the sum above 2^23 (ulp 1).
    """
    v = tl.minimum(tl.abs(x) * encode, E2M1_MAX)
    e = _grid_exponent(v)
    w = v * ((263 - e) << 23).to(tl.float32, bitcast=True)  # 256·v/step = v·2^(136 - e), exact
    snapped = (w - 0.5) + (r8 | 0x4B000100).to(tl.float32, bitcast=True)
    # k = (Z >> 8) - 1 with Z = bits - 2^23 bits; the range's first code is 2·e - 254
    k = (snapped.to(tl.int32, bitcast=True) >> 8) - 0x4B0001
    code = k + 2 * e - 254 + sign_nibble(x)
    k_float = (k + TWO_POW_23_BITS).to(tl.float32, bitcast=True) - TWO_POW_23
    step = ((e - 1) << 23).to(tl.float32, bitcast=True)
    return code, with_sign_of(k_float * step, x)


@triton.jit
def _pack_pairs(codes, R: tl.constexpr, G: tl.constexpr):
    """int32 codes [R, G, 8] -> uint8 [R, G, 4]; element 2i in the low nibble."""
    low, high = tl.split(tl.reshape(codes, [R, G, 4, 2]))
    return (low + high * 16).to(tl.uint8)


@triton.jit
def concat_last(a, b, R: tl.constexpr, G: tl.constexpr, K: tl.constexpr):
    """[R, G, K] and [R, G, K] -> [R, G, 2K] (a first), without leaving the thread."""
    return tl.reshape(tl.permute(tl.join(a, b), [0, 1, 3, 2]), [R, G, 2 * K])


@triton.jit
def packed_codes(code_lo, code_hi, R: tl.constexpr, G: tl.constexpr):
    """Codes of block halves [R, G, 8] each -> the block's 8 packed bytes, uint8 [R, G, 8]."""
    return concat_last(_pack_pairs(code_lo, R, G), _pack_pairs(code_hi, R, G), R, G, 4)


@triton.jit
def block_values(value_lo, value_hi, scale, R: tl.constexpr, G: tl.constexpr):
    """``code value · block scale`` (exact) of block halves -> FP32 [R, G, 16]."""
    return concat_last(value_lo, value_hi, R, G, 8) * scale[:, :, None]


@triton.jit
def half_block_bytes(word_a, word_b):
    """Two 32-bit random words [R, G] -> eight 8-bit randoms [R, G, 8] (int32 0..255)."""
    j = tl.arange(0, 8)[None, None, :]
    word = tl.where(j < 4, word_a[:, :, None], word_b[:, :, None])
    return ((word >> ((j & 3) * 8)) & 0xFF).to(tl.int32)


@triton.jit
def replay_seed(seed_ptr, delta):
    """The eager seed formula of ``seeds.seed_at`` on the device, for a quantizer replayed by a CUDA
    graph: ``2^32 + mix64(base + delta - 2^32) mod (2^62 - 2^32)`` with ``base`` read from
    ``seed_ptr`` (int64 [1]: the generator's initial_seed · φ + offset, mod 2^64). uint64 products
    wrap mod 2^64, as the host's ``% 2**64``."""
    v = tl.load(seed_ptr).to(tl.uint64, bitcast=True) + (delta - 4294967296).to(tl.uint64, bitcast=True)
    v = (v ^ (v >> 30)) * 0xBF58476D1CE4E5B9
    v = (v ^ (v >> 27)) * 0x94D049BB133111EB
    v = v ^ (v >> 31)
    return (v % 4611686014132420608 + 4294967296).to(tl.int64, bitcast=True)


@triton.jit
def encode_blocks(lo, hi, block_amax, s_enc, decode_scale, seed, block_index, STOCHASTIC: tl.constexpr):
    """Encode 16-element blocks given as halves ``lo`` / ``hi`` [R, G, 8] -> (scale byte [R, G], FP32
    scale [R, G], codes lo/hi [R, G, 8], FP32 values lo/hi). Stochastic rounding takes 16 random bytes
    per block from one Philox call on ``block_index``."""
    scale_byte, scale = block_scale(block_amax, s_enc)
    encode = encode_scale(scale, decode_scale)[:, :, None]
    if STOCHASTIC:
        r0, r1, r2, r3 = tl.randint4x(seed, block_index, PHILOX_ROUNDS)
        code_lo, value_lo = e2m1_stochastic(lo, encode, half_block_bytes(r0, r1))
        code_hi, value_hi = e2m1_stochastic(hi, encode, half_block_bytes(r2, r3))
    else:
        code_lo, value_lo = e2m1_nearest(lo, encode)
        code_hi, value_hi = e2m1_nearest(hi, encode)
    return scale_byte, scale, code_lo, code_hi, value_lo, value_hi
