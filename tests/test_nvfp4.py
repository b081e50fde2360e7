"""NVFP4 quantize: codes and E4M3 scale bytes bit-exact against an independent numpy/brute-force
re-implementation of the recipe, on random and adversarial inputs; 2D tiles; stochastic rounding."""

import math

import numpy as np
import pytest
import torch

from fp_reference import E4M3_TABLE, e2m1_neighbours, e2m1_values, nvfp4_reference, sr_expected, unpack
from inkling_fp4.errors import NumericsError
from inkling_fp4.numerics import nvfp4
from inkling_fp4.numerics.formats import e4m3_bytes


def _random_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    normal = torch.randn(48, 64, generator=g)
    outliers = normal.clone()
    outliers[3, 5], outliers[17, 40] = 300.0, -2e4
    signs = torch.where(torch.rand(32, 96, generator=g) < 0.5, -1.0, 1.0)
    huge_range = signs * torch.pow(10.0, torch.empty(32, 96).uniform_(-30, 30, generator=g))
    equal_blocks = torch.full((16, 64), 0.3)
    equal_blocks[:, 16:32] = -7.5
    equal_blocks[:, 32:48] = 0.0
    equal_blocks[4, 48:] = -0.0
    # S_enc·(1/6) == 1 when amax == 448, so block amaxes at E4M3 midpoints hit scale ties exactly.
    grid = E4M3_TABLE[:127]
    ties = torch.tensor((grid[:-1] + grid[1:]) / 2, dtype=torch.float32)
    tie_blocks = torch.zeros(128, 16)  # 126 tie blocks, one anchor block, one zero block
    tie_blocks[: ties.numel(), 0] = ties
    tie_blocks[: ties.numel(), 1:] = ties[:, None] * torch.rand(ties.numel(), 15, generator=g)
    tie_blocks[-2, 0] = 448.0
    subnormal_scales = torch.tensor([2.0**-9, 1.5 * 2.0**-9, 2.5 * 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-6])
    subnormal_blocks = torch.zeros(16, 32)
    subnormal_blocks[: subnormal_scales.numel(), 0] = subnormal_scales
    subnormal_blocks[0, 16] = 448.0
    return {
        "normal_fp32": normal,
        "normal_bf16": normal.bfloat16(),
        "normal_fp16": normal.half(),
        "outliers_bf16": outliers.bfloat16(),
        "huge_range_fp32": huge_range,
        "huge_range_bf16": huge_range.bfloat16(),
        "zeros": torch.zeros(16, 32),
        "signed_zeros": torch.tensor([0.0, -0.0]).repeat(16, 16),
        "equal_blocks": equal_blocks,
        "scale_ties": tie_blocks.reshape(64, 32),
        "subnormal_scales": subnormal_blocks,
        "fp32_subnormal_amax": torch.randn(16, 32, generator=g) * 1e-40,
        "near_flt_max": torch.randn(16, 32, generator=g) * 4e37,
    }


INPUTS = _random_inputs()


def _check_against_reference(x: torch.Tensor, t: nvfp4.NVFP4Tensor, block_2d: bool) -> None:
    codes, scale_bytes, amax, s_dec, _ = nvfp4_reference(x.float().numpy(), block_2d)
    assert np.array_equal(e4m3_bytes(t.scales).numpy(), scale_bytes)
    assert np.array_equal(unpack(t.codes.numpy()), codes)
    assert t.amax.dtype == torch.float32 and t.amax.item() == amax
    assert t.decode_scale.item() == s_dec
    # dequantize = (code · scale) · S_dec in FP32; block values exact in BF16 and FP16.
    block = (
        e2m1_values(codes).reshape(*codes.shape[:-1], -1, 16) * E4M3_TABLE[scale_bytes][..., None]
    ).reshape(codes.shape)
    assert np.array_equal(t.block_values(torch.float32).numpy(), block.astype(np.float32))
    assert torch.equal(t.block_values(torch.bfloat16).float(), t.block_values(torch.float32))
    assert torch.equal(t.block_values(torch.float16).float(), t.block_values(torch.float32))
    assert np.array_equal(t.dequantize().numpy(), block.astype(np.float32) * s_dec)
    assert torch.isfinite(t.dequantize()).all()


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_codes_and_scales_match_reference_1d(case):
    x = INPUTS[case]
    _check_against_reference(x, nvfp4.quantize(x), block_2d=False)


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_codes_and_scales_match_reference_2d(case):
    x = INPUTS[case]
    t = nvfp4.quantize(x, block_2d=True)
    _check_against_reference(x, t, block_2d=True)


def test_adversarial_cases_cover_what_they_claim():
    scales = e4m3_bytes(nvfp4.quantize(INPUTS["subnormal_scales"]).scales)[:, 0].tolist()
    assert scales[:5] == [1, 2, 2, 0, 2]  # 2^-9, tie -> 2^-8, tie -> 2^-8, tie -> 0, 3·2^-10 -> 2^-8
    huge = nvfp4.quantize(INPUTS["huge_range_fp32"])
    assert (e4m3_bytes(huge.scales) == 0).any() and (e4m3_bytes(huge.scales) != 0).any()
    assert (
        nvfp4.quantize(INPUTS["fp32_subnormal_amax"]).decode_scale.item()
        == np.float32(1) / np.finfo(np.float32).max
    )


def test_e2m1_midpoints_at_several_block_scales():
    # amax = 2688/4 makes S_enc = 4 exactly; a block anchored at 6·2^k/4 gets scale 2^k exactly,
    # so x = m·2^k/4 encodes to exactly m.
    midpoints = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    for k in (-9, -6, 0, 3, 6):
        unit = 2.0**k / 4
        block = [6 * unit] + [m * unit for m in midpoints] + [-m * unit for m in midpoints[:7]]
        x = torch.tensor([block, [672.0] + [0.0] * 15])
        t = nvfp4.quantize(x)
        assert t.scales[0, 0].float().item() == 2.0**k
        values = t.block_values(torch.float32)[0] / 2.0**k
        assert values.tolist() == [6.0] + expected + [-e for e in expected[:7]]


def test_zero_tensor_and_zero_blocks():
    t = nvfp4.quantize(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert t.amax.item() == 0 and t.decode_scale.item() == 1.0
    assert (e4m3_bytes(t.scales) == 0).all() and (t.codes == 0).all()
    assert (t.dequantize() == 0).all()


def test_underflowing_blocks_decode_to_exact_zero():
    x = torch.zeros(2, 32)
    x[0, :16] = torch.linspace(-1e-5, 1e-5, 16)  # block amax · S_enc/6 < 2^-10: scale 0
    x[1, 16] = 1e4
    t = nvfp4.quantize(x)
    assert e4m3_bytes(t.scales)[0, 0].item() == 0
    assert (t.dequantize()[0, :16] == 0).all() and torch.isfinite(t.dequantize()).all()
    # Codes are deterministic: the tiny values are multiplied by FLT_MAX and saturate to ±6.
    codes = unpack(t.codes.numpy())[0, :16]
    assert set(codes.tolist()) <= {7, 15}
    _check_against_reference(x, t, block_2d=False)


def test_signed_zero_codes():
    x = torch.tensor([[0.0, -0.0] * 8, [1.0] * 16])
    codes = unpack(nvfp4.quantize(x).codes.numpy())[0]
    assert codes.tolist() == [0, 8] * 8
    values = nvfp4.quantize(x).dequantize()[0]
    assert (values == 0).all() and torch.signbit(values).tolist() == [False, True] * 8


def test_2d_tiles_share_one_scale_and_transpose_consistently():
    w = torch.randn(48, 64)
    w[5, 7] = 40.0
    t = nvfp4.quantize(w, block_2d=True)
    tile_scales = e4m3_bytes(t.scales).reshape(3, 16, 4)
    assert (tile_scales == tile_scales[:, :1, :]).all()
    tt = nvfp4.quantize(w.t().contiguous(), block_2d=True)
    assert torch.equal(t.dequantize(), tt.dequantize().t())
    assert torch.equal(t.block_values(), tt.block_values().t())


def test_2d_partial_last_tile():
    w = torch.randn(40, 32)
    t = nvfp4.quantize(w, block_2d=True)
    assert t.scales.shape == (40, 2)
    assert (e4m3_bytes(t.scales)[32:] == e4m3_bytes(t.scales)[32]).all()
    _check_against_reference(w, t, block_2d=True)


def test_leading_dims_are_kept():
    x = torch.randn(2, 3, 32)
    t = nvfp4.quantize(x)
    assert t.codes.shape == (2, 3, 16) and t.scales.shape == (2, 3, 2) and t.shape == x.shape
    flat = nvfp4.quantize(x.reshape(6, 32))
    assert torch.equal(t.codes.reshape(6, 16), flat.codes)
    assert torch.equal(t.dequantize().reshape(6, 32), flat.dequantize())
    w = torch.randn(32, 48)
    assert torch.equal(nvfp4.quantize(w.t()).codes, nvfp4.quantize(w.t().contiguous()).codes)


def test_dispatch_on_cpu_is_the_reference():
    x = torch.randn(16, 64)
    a, b = nvfp4.quantize(x, block_2d=True), nvfp4.quantize_ref(x, block_2d=True)
    assert torch.equal(a.codes, b.codes) and torch.equal(e4m3_bytes(a.scales), e4m3_bytes(b.scales))


def test_stochastic_rounding_neighbours_scales_and_mean():
    rows = 4096
    base = torch.randn(1, 64) * 3
    base[0, 0] = 10.0
    x = base.repeat(rows, 1)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    t = nvfp4.quantize(x, stochastic=True, generator=generator)
    rtn = nvfp4.quantize(x)
    assert torch.equal(e4m3_bytes(t.scales), e4m3_bytes(rtn.scales))
    _, _, _, _, v = nvfp4_reference(base.numpy())
    q = e2m1_values(unpack(t.codes.numpy()))  # [rows, 64] in encoded units
    lower, upper = e2m1_neighbours(v[0])
    assert np.all((q == lower) | (q == upper))
    expected = sr_expected(v[0])
    p = np.where(upper != lower, (expected - lower) / np.where(upper != lower, upper - lower, 1), 0)
    sigma = np.abs(upper - lower) * np.sqrt(p * (1 - p))
    assert np.all(np.abs(q.mean(0) - expected) <= 5 * sigma / math.sqrt(rows) + 1e-12)
    assert np.all(np.abs(expected - v[0]) < np.abs(upper - lower) / 256 + 1e-12)


def test_stochastic_is_reproducible_and_seed_dependent():
    x = torch.randn(16, 64)
    a = nvfp4.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(1))
    b = nvfp4.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(1))
    c = nvfp4.quantize(x, stochastic=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a.codes, b.codes) and not torch.equal(a.codes, c.codes)


def test_quantize_rht_t_is_quantize_of_rht_of_transpose():
    x = torch.randn(64, 48, dtype=torch.bfloat16)
    t = nvfp4.quantize_rht_t(x)
    ref = nvfp4.quantize(nvfp4.rht(x.t().contiguous()))
    assert t.shape == (48, 64) and t.codes.shape == (48, 32) and t.scales.shape == (48, 4)
    assert torch.equal(t.codes, ref.codes) and torch.equal(e4m3_bytes(t.scales), e4m3_bytes(ref.scales))
    signs = torch.tensor([1.0, -1.0] * 8)
    s1 = nvfp4.quantize_rht_t(x, signs=signs, stochastic=True, generator=torch.Generator().manual_seed(5))
    s2 = nvfp4.quantize(
        nvfp4.rht(x.t().contiguous(), signs), stochastic=True, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(s1.codes, s2.codes)


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(4, 32)
    x[2, 7] = float("nan")
    with pytest.raises(NumericsError, match=r"'act'.*\(4, 32\).*nan at index \(2, 7\)"):
        nvfp4.quantize(x, name="act")
    x[2, 7] = float("-inf")
    with pytest.raises(NumericsError, match="non-finite"):
        nvfp4.quantize(x.bfloat16(), block_2d=False)
    with pytest.raises(NumericsError, match=r"\(4, 24\).*block size 16"):
        nvfp4.quantize(torch.randn(4, 24))
    with pytest.raises(NumericsError, match="2-D"):
        nvfp4.quantize(torch.randn(2, 16, 32), block_2d=True)
    with pytest.raises(NumericsError, match="dtype"):
        nvfp4.quantize(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(NumericsError, match="dtype"):
        nvfp4.quantize(torch.ones(4, 32, dtype=torch.float64))
    with pytest.raises(NumericsError, match="token dim"):
        nvfp4.quantize_rht_t(torch.randn(24, 32))
    y = torch.randn(32, 16)
    y[30, 1] = float("nan")
    with pytest.raises(NumericsError, match=r"'dy'.*\(32, 16\).*\(30, 1\)"):
        nvfp4.quantize_rht_t(y, name="dy")


def test_empty_tensors():
    assert nvfp4.quantize(torch.zeros(0, 32)).dequantize().shape == (0, 32)
    assert nvfp4.quantize(torch.zeros(0, 32), block_2d=True).codes.shape == (0, 16)
    assert nvfp4.quantize(torch.zeros(4, 0)).block_values().shape == (4, 0)
    assert nvfp4.quantize_rht_t(torch.zeros(0, 32)).shape == (32, 0)
