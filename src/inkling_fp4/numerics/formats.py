"""Element and scale formats: E2M1 (FP4), E4M3 and E8M0, as bit-exact torch code.

E2M1 (OCP MX spec v1.0, section 5.3.3): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit, no
Inf/NaN. The eight magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6; code ``c`` (0..7) is the index into
that list and bit 3 is the sign, so the 16 codes are ``s·8 + c``; two per byte, even element low.

Round to nearest: half to even on the *code*: midpoints 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4,
5→4; above 5 saturates to 6. The sign bit is the input's (as the hardware cvt), so -0 and a negative
value that rounds to zero encode as code 8 (-0).

Stochastic rounding: ``floor((|v| + u·step)/step)·step`` capped at 6, sign restored, with ``u = r/256``
for an 8-bit random ``r`` and the grid step (0.5 below 2, 1 below 4, else 2); evaluated exactly as
``floor(a) + [frac(a) >= 1 - u]``, ``a = |v|/step``. Unbiased up to a bias toward zero below ``step/256``.

E4M3: NVFP4's block scale; torch's cast does not saturate on every version, so :func:`e4m3_round`
clamps first. E8M0: MX's power-of-two scale as a uint8 biased exponent (bias 127, 255 = NaN), since
``torch.float8_e8m0fnu`` is not usable on every supported torch.
"""

from __future__ import annotations

import functools

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FLT_MAX = torch.finfo(torch.float32).max

# Index = code magnitude (0..7).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# code = #{t : |v| > t}: ">" at the midpoints that round down (the even code is below: 0.25, 1.25,
# 2.5, 5) and ">=" at those that round up (the even code is above: 0.75, 1.75, 3.5).
_ROUND_DOWN_AT = (0.25, 1.25, 2.5, 5.0)
_ROUND_UP_AT = (0.75, 1.75, 3.5)
_VALUES16 = torch.tensor(E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES), dtype=torch.float32)
# All 256 packed bytes -> (low element, high element).
_PAIR_VALUES = torch.stack([_VALUES16.repeat(16), _VALUES16.repeat_interleave(16)], dim=-1)


@functools.lru_cache(maxsize=16)
def _table(pairs: bool, device: torch.device) -> torch.Tensor:
    """The decode table (per code [16], or per packed byte [256, 2]) on ``device``, built once."""
    return (_PAIR_VALUES if pairs else _VALUES16).to(device)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """Round FP32 ``v`` to E2M1 codes (uint8, 0..15), half to even, saturating at ±6."""
    v = v.float()
    magnitude = v.abs()
    # NOTE: comparisons summed into uint8 are ~4x faster on CPU than torch.bucketize.
    codes = torch.zeros_like(magnitude, dtype=torch.uint8)
    for t in _ROUND_DOWN_AT:
        codes += magnitude > t
    for t in _ROUND_UP_AT:
        codes += magnitude >= t
    return codes | (torch.signbit(v).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) to values; code 8 decodes to -0.0."""
    table = _table(False, codes.device)
    return table.index_select(0, codes.flatten().int()).view(codes.shape).to(dtype)


def random_bytes(
    shape: torch.Size | tuple[int, ...], device: torch.device, generator: torch.Generator | None = None
) -> torch.Tensor:
    """8 random bits per element (uint8), from ``generator`` (seedable) or torch's default one."""
    return torch.randint(0, 256, tuple(shape), generator=generator, device=device, dtype=torch.uint8)


def _grid_step_exponent(magnitude: torch.Tensor) -> torch.Tensor:
    """Biased FP32 exponent of the E2M1 grid step at ``magnitude`` in [0, 6] (2^-1, 2^0, 2^1), from bits."""
    return (magnitude.view(torch.int32) >> 23).clamp_(127, 129) - 1


def e2m1_encode_stochastic(v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Stochastically round FP32 ``v`` (already clamped to ±6) to E2M1 codes using 8-bit randoms ``r``."""
    v = v.float()
    magnitude = v.abs().clamp_(max=E2M1_MAX)
    step_exp = _grid_step_exponent(magnitude)
    step = (step_exp << 23).view(torch.float32)
    a = magnitude * ((254 - step_exp) << 23).view(torch.float32)  # |v| / step, exact
    whole = torch.floor(a)
    # frac(a) >= 1 - r/256  <=>  256·frac(a) >= 256 - r   (both sides exact in FP32)
    round_up = (a - whole) * 256.0 >= 256.0 - r.float()
    rounded = ((whole + round_up) * step).clamp_(max=E2M1_MAX)
    return e2m1_encode(torch.copysign(rounded, v))


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., N] (N even) -> bytes [..., N//2]; element 2i in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., N//2] -> uint8 codes [..., N]."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def decode_packed(packed: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 bytes [..., N//2] -> FP32 values [..., N] in one table lookup."""
    table = _table(True, packed.device)  # [256, 2]
    return table.index_select(0, packed.flatten().int()).view(*packed.shape[:-1], 2 * packed.shape[-1])


def e4m3_round(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3 with one round-half-even, saturating at ±448 (NaN stays NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """The raw uint8 bit patterns of an E4M3 tensor (for exact comparisons and storage)."""
    return x.view(torch.uint8)


E8M0_BIAS = 127
E8M0_MIN_EXP = -127
E8M0_MAX_EXP = 127
E8M0_NAN = 255


def e8m0_from_exponent(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents -> E8M0 bytes (uint8), clamped to the representable 2^-127..2^127."""
    return (exponent.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP) + E8M0_BIAS).to(torch.uint8)


def e8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> FP32 powers of two built from bits (2^-127 is subnormal); byte 255 -> NaN."""
    biased = scale_bytes.to(torch.int32)
    bits = torch.where(biased == 0, torch.full_like(biased, 1 << 22), biased << 23)
    values = bits.view(torch.float32)
    return torch.where(biased == E8M0_NAN, torch.full_like(values, float("nan")), values)


def pow2_float(exponent: torch.Tensor) -> torch.Tensor:
    """Exact FP32 ``2^exponent`` for integer exponents in [-127, 127]."""
    return e8m0_to_float(e8m0_from_exponent(exponent))


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2(x))`` of non-negative FP32 values from the exponent bits; zero and subnormals give
    -127, the E8M0 floor."""
    biased = (x.float().view(torch.int32) >> 23) & 0xFF
    return biased - E8M0_BIAS
