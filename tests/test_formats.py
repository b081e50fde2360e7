"""E2M1 / E4M3 / E8M0 primitives against brute-force references built from the bit layouts."""

import math

import numpy as np
import torch

from fp_reference import E2M1_GRID, E4M3_TABLE, e2m1_codes, e2m1_neighbours, fp8_round, sr_expected, unpack
from inkling_fp4.numerics import formats

MIDPOINTS = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}


def test_e2m1_every_midpoint_rounds_half_to_even():
    for midpoint, expected in MIDPOINTS.items():
        for sign in (1.0, -1.0):
            v = torch.tensor([sign * midpoint])
            assert formats.e2m1_decode(formats.e2m1_encode(v)).item() == sign * expected
            # One FP32 ulp either side of the midpoint goes to the nearer neighbour.
            above = torch.nextafter(v.abs(), torch.tensor([7.0])) * sign
            below = torch.nextafter(v.abs(), torch.tensor([0.0])) * sign
            up, down = e2m1_neighbours(np.array([sign * midpoint]))[::-1]
            assert formats.e2m1_decode(formats.e2m1_encode(above)).item() == up[0]
            assert formats.e2m1_decode(formats.e2m1_encode(below)).item() == down[0]


def test_e2m1_saturates_above_5():
    v = torch.tensor([5.0001, 5.5, 6.0, 6.5, 100.0, 3e38, -5.2, -1e30])
    assert formats.e2m1_decode(formats.e2m1_encode(v)).tolist() == [6, 6, 6, 6, 6, 6, -6, -6]


def test_e2m1_random_values_match_brute_force():
    v = torch.randn(20000) * 3
    v = torch.cat([v, torch.tensor(E2M1_GRID, dtype=torch.float32), torch.tensor([1e-40, -1e-40, 0.0, -0.0])])
    codes = formats.e2m1_encode(v)
    assert np.array_equal(codes.numpy(), e2m1_codes(v.numpy()))


def test_e2m1_decode_table_and_round_trip_of_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    values = formats.e2m1_decode(codes)
    assert values[:8].tolist() == E2M1_GRID.tolist()
    assert values[8:].tolist() == (-E2M1_GRID).tolist()
    assert torch.equal(formats.e2m1_encode(values), codes)


def test_negative_zero_is_code_8_and_decodes_to_negative_zero():
    v = torch.tensor([-0.0, -0.1, -0.25, 0.0, 0.1])
    codes = formats.e2m1_encode(v)
    assert codes.tolist() == [8, 8, 8, 0, 0]
    decoded = formats.e2m1_decode(codes)
    assert torch.all(decoded == 0)
    assert torch.signbit(decoded).tolist() == [True, True, True, False, False]


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.shape == (7, 32)
    assert torch.equal(formats.unpack_nibbles(packed), codes)
    assert np.array_equal(unpack(packed.numpy()), codes.numpy())  # even element in the low nibble
    assert torch.equal(formats.decode_packed(packed), formats.e2m1_decode(codes))


def test_stochastic_rounding_lands_on_a_neighbour():
    v = (torch.rand(50000) * 12 - 6).clamp(-6, 6)
    v = torch.cat([v, torch.tensor(E2M1_GRID, dtype=torch.float32), torch.tensor([-6.0, -0.0, 1.9999999])])
    r = formats.random_bytes(v.shape, v.device)
    q = formats.e2m1_decode(formats.e2m1_encode_stochastic(v, r)).numpy()
    lower, upper = e2m1_neighbours(v.numpy())
    assert np.all((q == lower) | (q == upper))
    on_grid = np.isin(np.abs(v.numpy()), E2M1_GRID)
    assert np.array_equal(q[on_grid], v.numpy()[on_grid])  # grid values never move


def test_stochastic_rounding_is_unbiased_up_to_8_bit_randoms():
    values = torch.tensor([0.1, 0.3, 0.77, 1.1, 1.9, 2.2, 3.75, 4.5, 5.9, -0.6, -2.8, -5.01])
    n = 20000
    v = values.repeat(n, 1)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    r = formats.random_bytes(v.shape, v.device, generator)
    q = formats.e2m1_decode(formats.e2m1_encode_stochastic(v, r)).double()
    mean = q.mean(0).numpy()
    lower, upper = e2m1_neighbours(values.numpy())
    expected = sr_expected(values.numpy())
    p = (expected - lower) / (upper - lower)
    sigma = np.abs(upper - lower) * np.sqrt(p * (1 - p))
    assert np.all(np.abs(mean - expected) <= 5 * sigma / math.sqrt(n) + 1e-12)
    # 8-bit u = r/256 rounds down with probability floor(256·frac)/256: bias < step/256, toward 0.
    step = np.abs(upper - lower)
    assert np.all(np.abs(expected - values.double().numpy()) < step / 256)
    assert np.all(np.abs(mean - values.double().numpy()) <= 5 * sigma / math.sqrt(n) + step / 256)


def test_stochastic_rounding_is_reproducible_from_a_seed():
    v = torch.randn(1000)
    a = formats.e2m1_encode_stochastic(
        v, formats.random_bytes(v.shape, v.device, torch.Generator().manual_seed(3))
    )
    b = formats.e2m1_encode_stochastic(
        v, formats.random_bytes(v.shape, v.device, torch.Generator().manual_seed(3))
    )
    assert torch.equal(a, b)


def test_e4m3_round_matches_brute_force_with_saturation_and_subnormals():
    grid = E4M3_TABLE[:127]
    ties = (grid[:-1] + grid[1:]) / 2
    x = torch.cat(
        [
            torch.exp2(torch.empty(30000).uniform_(-14, 10)),
            torch.tensor(ties, dtype=torch.float32),
            torch.tensor([0.0, 2.0**-10, 2.0**-9, 1.5 * 2.0**-9, 2.0**-11, 1e-40, 447.9, 448.0, 464.0, 1e6]),
        ]
    )
    x = torch.cat([x, -x])
    expected_bytes, _ = fp8_round(
        np.minimum(np.abs(x.double().numpy()), 448) * np.sign(x.numpy()), E4M3_TABLE
    )
    got = formats.e4m3_bytes(formats.e4m3_round(x)).numpy()
    zero = x.numpy() == 0
    assert np.array_equal(got[~zero], expected_bytes[~zero])
    assert np.all(got[zero & ~np.signbit(x.numpy())] == 0)


def test_e8m0_exact_powers_of_two_and_clamp():
    exponents = torch.arange(-130, 131, dtype=torch.int32)
    scale_bytes = formats.e8m0_from_exponent(exponents)
    clamped = exponents.clamp(-127, 127)
    assert torch.equal(scale_bytes.to(torch.int32), clamped + 127)
    values = formats.e8m0_to_float(scale_bytes)
    assert all(v == math.ldexp(1.0, int(e)) for v, e in zip(values.tolist(), clamped.tolist(), strict=True))
    assert math.isnan(formats.e8m0_to_float(torch.tensor([255], dtype=torch.uint8)).item())


def test_floor_log2_matches_frexp():
    x = torch.cat(
        [torch.exp2(torch.empty(5000).uniform_(-125, 127)), torch.exp2(torch.arange(-126.0, 128.0))]
    )
    expected = [math.frexp(v)[1] - 1 for v in x.tolist()]
    assert formats.floor_log2(x).tolist() == expected
    assert formats.floor_log2(torch.tensor([0.0, 1e-40])).tolist() == [-127, -127]
