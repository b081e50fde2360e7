"""Independent references for the number-format tests (numpy only, no code shared with the package).

Tables are decoded from the bit layouts; rounding is a brute-force nearest-value search in float64
with ties broken toward the even index (the even code / mantissa); the NVFP4 recipe is re-done in
numpy float32 arithmetic (IEEE, one rounding per operation, like the spec).
"""

from __future__ import annotations

import numpy as np

FLT_MAX = np.float32(np.finfo(np.float32).max)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def minifloat_table(exp_bits: int, man_bits: int, bias: int, ieee_specials: bool) -> np.ndarray:
    """All 2^(1+e+m) values of a small float format (float64; NaN where the code is NaN or Inf).

    ``ieee_specials``: the all-ones exponent is Inf/NaN (E5M2); otherwise only the all-ones code is
    NaN (E4M3 "fn")."""
    n = 1 << (1 + exp_bits + man_bits)
    values = np.empty(n)
    for code in range(n):
        sign = -1.0 if code >> (exp_bits + man_bits) else 1.0
        e = (code >> man_bits) & ((1 << exp_bits) - 1)
        m = code & ((1 << man_bits) - 1)
        all_ones = e == (1 << exp_bits) - 1
        if (ieee_specials and all_ones) or (all_ones and m == (1 << man_bits) - 1):
            values[code] = np.nan
        elif e == 0:
            values[code] = sign * m / (1 << man_bits) * 2.0 ** (1 - bias)
        else:
            values[code] = sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
    return values


E4M3_TABLE = minifloat_table(4, 3, 7, ieee_specials=False)
E5M2_TABLE = minifloat_table(5, 2, 15, ieee_specials=True)


def positive_grid(table: np.ndarray) -> np.ndarray:
    """The finite non-negative values of a table, whose index is also the code."""
    half = table[: len(table) // 2]
    return half[np.isfinite(half)]


def nearest_even(magnitude: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index into the ascending ``grid`` of the nearest value to each |x| (ties to the even index);
    magnitudes above the grid's top saturate to it. The two grid values around |x| are found by
    bisection and compared in float64 (exact for every float32 input)."""
    m = np.minimum(np.asarray(magnitude, dtype=np.float64), grid[-1])
    upper = np.clip(np.searchsorted(grid, m, side="left"), 0, len(grid) - 1)
    lower = np.maximum(upper - 1, 0)
    d_lower, d_upper = m - grid[lower], grid[upper] - m
    pick_upper = (d_upper < d_lower) | ((d_upper == d_lower) & (upper % 2 == 0))
    return np.where(pick_upper, upper, lower)


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    """E2M1 codes (sign bit 8 from the sign bit of v) by brute force, saturating at 6."""
    v = np.asarray(v, dtype=np.float64)
    return (nearest_even(np.abs(v), E2M1_GRID) | np.where(np.signbit(v), 8, 0)).astype(np.uint8)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    codes = np.asarray(codes, dtype=np.int64)
    return np.where(codes & 8, -1.0, 1.0) * E2M1_GRID[codes & 7]


def fp8_round(x: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes, float64 values) of x rounded to the nearest finite table value, saturating."""
    grid = positive_grid(table)
    index = nearest_even(np.abs(x), grid)
    negative = np.signbit(np.asarray(x, dtype=np.float64))
    codes = (index | np.where(negative, len(table) // 2, 0)).astype(np.uint8)
    return codes, np.where(negative, -grid[index], grid[index])


def unpack(packed: np.ndarray) -> np.ndarray:
    """Bytes [..., K] -> nibbles [..., 2K], low nibble first."""
    packed = np.asarray(packed, dtype=np.uint8)
    return np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


def _tiles(magnitude: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """Max over (rows, cols) tiles of a 2-D array, padding rows with zeros -> [ceil(M/rows), N/cols]."""
    m, n = magnitude.shape
    pad = -m % rows
    padded = np.concatenate([magnitude, np.zeros((pad, n), magnitude.dtype)]) if pad else magnitude
    return padded.reshape(-1, rows, n // cols, cols).max(axis=(1, 3))


def nvfp4_reference(x: np.ndarray, block_2d: bool = False):
    """The NVFP4 recipe in numpy float32 + brute-force rounding, for 2-D float32 ``x``.

    Returns (codes uint8 [M, N] unpacked, scale bytes uint8 [M, N/16], amax, s_dec, encoded values)."""
    x = np.asarray(x, dtype=np.float32)
    m, n = x.shape
    with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
        magnitude = np.abs(x)
        amax = np.float32(magnitude.max()) if x.size else np.float32(0)
        s_enc = np.float32(1) if amax == 0 else np.minimum(np.float32(2688) / amax, FLT_MAX)
        s_dec = np.float32(1) / s_enc
        if block_2d:
            block_amax = np.repeat(_tiles(magnitude, 16, 16), 16, axis=0)[:m]
        else:
            block_amax = magnitude.reshape(m, n // 16, 16).max(axis=-1)
        raw = np.minimum(block_amax * (s_enc * (np.float32(1) / np.float32(6))), np.float32(448))
        scale_bytes, scale_values = fp8_round(raw, E4M3_TABLE)
        scale32 = scale_values.astype(np.float32)
        encode = np.minimum(np.float32(1) / (scale32 * s_dec), FLT_MAX)
        v = np.clip(x.reshape(m, n // 16, 16) * encode[..., None], np.float32(-6), np.float32(6))
    return e2m1_codes(v.reshape(m, n)), scale_bytes, amax, s_dec, v.reshape(m, n)


def e2m1_neighbours(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The grid values just below and above |v| (equal when |v| is on the grid), signed like v."""
    magnitude = np.abs(np.asarray(v, dtype=np.float64))
    upper_index = np.searchsorted(E2M1_GRID, magnitude, side="left")
    upper = E2M1_GRID[np.minimum(upper_index, 7)]
    lower = E2M1_GRID[np.maximum(np.searchsorted(E2M1_GRID, magnitude, side="right") - 1, 0)]
    sign = np.where(np.signbit(v), -1.0, 1.0)
    return sign * lower, sign * upper


def sr_expected(v: np.ndarray) -> np.ndarray:
    """Exact mean of 8-bit stochastic rounding of |v|: step·(floor(a) + floor(256·frac(a))/256)."""
    magnitude = np.abs(np.asarray(v, dtype=np.float64))
    step = np.where(magnitude < 2, 0.5, np.where(magnitude < 4, 1.0, 2.0))
    a = magnitude / step
    whole = np.floor(a)
    return np.sign(v) * step * (whole + np.floor(256 * (a - whole)) / 256)
