"""MXFP4 (OCP MX v1.0 section 6.3) against a float64 brute-force second computation."""

import math

import numpy as np
import pytest
import torch

from fp_reference import e2m1_codes, e2m1_neighbours, e2m1_values, unpack
from inkling_fp4.errors import NumericsError
from inkling_fp4.numerics import mxfp4


def _mx_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes [M, N], E8M0 bytes [M, N/32]) in float64: shared_exp = floor(log2 amax) - 2."""
    x = np.asarray(x, dtype=np.float64)
    m, n = x.shape
    blocks = x.reshape(m, n // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    _, exponent = np.frexp(amax)  # amax = mantissa · 2^exponent, mantissa in [0.5, 1)
    shared = np.where(amax == 0, -127, np.clip(exponent - 1 - 2, -127, 127))
    v = np.clip(blocks / np.exp2(shared)[..., None], -6, 6)
    return e2m1_codes(v.reshape(m, n)), (shared + 127).astype(np.uint8)


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    signs = torch.where(torch.rand(16, 128, generator=g) < 0.5, -1.0, 1.0)
    saturating = torch.full((4, 32), 7.9)
    saturating[:, 0] = 15.0  # X = 2^(3-2) = 2: 15/2 = 7.5 -> 6 (saturation), 7.9/2 = 3.95 -> 4
    ties = torch.tensor([4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4).repeat(2, 1)
    return {
        "normal_fp32": torch.randn(32, 64, generator=g),
        "normal_bf16": torch.randn(32, 64, generator=g).bfloat16(),
        "normal_fp16": torch.randn(32, 64, generator=g).half(),
        "huge_range": signs * torch.pow(10.0, torch.empty(16, 128).uniform_(-38, 38, generator=g)),
        "zeros_and_signed_zeros": torch.tensor([0.0, -0.0]).repeat(4, 32),
        "fp32_subnormals": torch.randn(8, 64, generator=g) * 1e-40,
        "tiny_normals": torch.randn(8, 64, generator=g) * 2.0**-124,
        "saturating": saturating,
        "element_ties": ties,
        "powers_of_two": torch.exp2(torch.randint(-130, 127, (8, 64), generator=g).float()),
    }


INPUTS = _inputs()


@pytest.mark.parametrize("case", sorted(INPUTS))
def test_codes_and_scales_match_brute_force(case):
    x = INPUTS[case]
    t = mxfp4.quantize(x)
    codes, scale_bytes = _mx_reference(x.float().numpy())
    assert np.array_equal(t.scales.numpy(), scale_bytes)
    assert np.array_equal(unpack(t.codes.numpy()), codes)
    expected = e2m1_values(codes) * np.exp2(scale_bytes.astype(np.float64) - 127).repeat(32, axis=-1)
    assert np.array_equal(t.dequantize().double().numpy(), expected)  # exact in FP32
    assert torch.equal(t.block_values(torch.bfloat16).float(), t.dequantize())  # and in BF16
    assert t.decode_scale.item() == 1.0


def test_scale_rule_examples():
    x = torch.zeros(3, 32)
    x[0, 0] = 4.0  # floor(log2 4) - 2 = 0: byte 127, element 4
    x[1, 0] = 7.99  # floor(log2 7.99) - 2 = 0: 7.99 saturates to 6
    t = mxfp4.quantize(x)
    assert t.scales[:, 0].tolist() == [127, 127, 0]  # an all-zero block gets the smallest scale
    assert t.dequantize()[:2, 0].tolist() == [4.0, 6.0]


def test_leading_dims_and_stochastic_rounding():
    x = torch.randn(2, 3, 64)
    t = mxfp4.quantize(x)
    assert t.codes.shape == (2, 3, 32) and t.scales.shape == (2, 3, 2)
    rows = 4096
    base = torch.randn(1, 32) * 2
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    s = mxfp4.quantize(base.repeat(rows, 1), stochastic=True, generator=generator)
    assert (s.scales == mxfp4.quantize(base).scales[0]).all()
    scale = 2.0 ** (int(s.scales[0, 0]) - 127)
    v = np.clip(base[0].double().numpy() / scale, -6, 6)  # MX saturates (6, 8) before rounding
    q = e2m1_values(unpack(s.codes.numpy()))
    lower, upper = e2m1_neighbours(v)
    assert np.all((q == lower) | (q == upper))
    step = np.abs(upper - lower)
    sigma = step / 2
    assert np.all(np.abs(q.mean(0) - v) <= 5 * sigma / math.sqrt(rows) + step / 256)


def test_bad_inputs():
    with pytest.raises(NumericsError, match=r"\(4, 48\).*block size 32"):
        mxfp4.quantize(torch.randn(4, 48))
    x = torch.randn(4, 32)
    x[1, 1] = float("inf")
    with pytest.raises(NumericsError, match=r"'w'.*inf at index \(1, 1\)"):
        mxfp4.quantize(x, name="w")
