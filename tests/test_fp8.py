"""FP8 current scaling (tensorwise, 1×128, 128×128) against numpy float32 scales and brute-force
rounding over the E4M3 / E5M2 tables decoded from their bit layouts."""

import numpy as np
import pytest
import torch

from fp_reference import E4M3_TABLE, E5M2_TABLE, FLT_MAX, fp8_round
from inkling_fp4.errors import NumericsError
from inkling_fp4.numerics import fp8

TABLES = {torch.float8_e4m3fn: E4M3_TABLE, torch.float8_e5m2: E5M2_TABLE}
MAXES = {torch.float8_e4m3fn: np.float32(448), torch.float8_e5m2: np.float32(57344)}


def _scales(amax: np.ndarray, fp8_max: np.float32) -> np.ndarray:
    with np.errstate(divide="ignore", over="ignore"):
        return np.where(amax == 0, np.float32(1), np.minimum(fp8_max / amax, FLT_MAX)).astype(np.float32)


def _expected(x: np.ndarray, scale: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    with np.errstate(over="ignore"):
        scaled = np.clip(x * scale, -MAXES[dtype], MAXES[dtype])
    codes, _ = fp8_round(scaled, TABLES[dtype])
    return codes


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    signs = torch.where(torch.rand(130, 256, generator=g) < 0.5, -1.0, 1.0)
    with_zero_block = torch.randn(130, 256, generator=g)
    with_zero_block[:, :128] = 0.0
    return {
        "normal_fp32": torch.randn(130, 256, generator=g),
        "normal_bf16": torch.randn(130, 256, generator=g).bfloat16(),
        "normal_fp16": torch.randn(130, 256, generator=g).half(),
        "huge_range": signs * torch.pow(10.0, torch.empty(130, 256).uniform_(-30, 30, generator=g)),
        "zero_block": with_zero_block,
        "tiny_amax": torch.randn(130, 256, generator=g) * 1e-40,
    }


INPUTS = _inputs()
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def test_reference_tables_agree_with_torch_dtypes():
    for dtype, table in TABLES.items():
        decoded = torch.arange(256, dtype=torch.uint8).view(dtype).double().numpy()
        finite = np.isfinite(table)
        assert np.array_equal(decoded[finite], table[finite])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_tensorwise(case, dtype):
    x = INPUTS[case]
    t = fp8.quantize_tensorwise(x, dtype=dtype)
    xf = x.float().numpy()
    scale = _scales(np.float32(np.abs(xf).max()), MAXES[dtype])
    assert t.data.dtype == dtype and t.data.shape == x.shape
    assert t.scale_inv.item() == np.float32(1) / scale
    assert np.array_equal(t.data.view(torch.uint8).numpy(), _expected(xf, scale, dtype))
    assert torch.equal(t.dequantize(), t.data.float() * t.scale_inv)
    assert torch.isfinite(t.dequantize()).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_blockwise_1x128(case, dtype):
    x = INPUTS[case]
    t = fp8.quantize_blockwise(x, block=(1, 128), dtype=dtype)
    xf = x.float().numpy()
    amax = np.abs(xf).reshape(130, 2, 128).max(-1)
    scale = _scales(amax, MAXES[dtype])
    assert t.scale_inv.shape == (130, 2) and t.block == (1, 128)
    assert np.array_equal(t.scale_inv.numpy(), np.float32(1) / scale)
    expected = _expected(xf.reshape(130, 2, 128), scale[..., None], dtype).reshape(130, 256)
    assert np.array_equal(t.data.view(torch.uint8).numpy(), expected)
    assert torch.equal(t.dequantize(), t.data.float() * t.scale_inv.repeat_interleave(128, -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(INPUTS))
def test_blockwise_128x128_with_partial_last_tile(case, dtype):
    x = INPUTS[case]  # 130 rows: the second row tile has 2 rows
    t = fp8.quantize_blockwise(x, block=(128, 128), dtype=dtype)
    xf = x.float().numpy()
    tiles = [np.abs(xf[r : r + 128]).reshape(-1, 2, 128).max(axis=(0, 2)) for r in (0, 128)]
    scale = _scales(np.stack(tiles), MAXES[dtype])  # [2, 2]
    assert t.scale_inv.shape == (2, 2)
    assert np.array_equal(t.scale_inv.numpy(), np.float32(1) / scale)
    per_element = np.repeat(np.repeat(scale, 128, axis=0)[:130], 128, axis=1)
    assert np.array_equal(t.data.view(torch.uint8).numpy(), _expected(xf, per_element, dtype))
    full = np.repeat(np.repeat(t.scale_inv.numpy(), 128, axis=0)[:130], 128, axis=1)
    assert np.array_equal(t.dequantize().numpy(), t.data.float().numpy() * full)


def test_zero_block_gets_unit_scale_and_saturation_never_overflows():
    t = fp8.quantize_blockwise(INPUTS["zero_block"], block=(1, 128))
    assert (t.scale_inv[:, 0] == 1).all() and (t.data[:, :128].float() == 0).all()
    # x · (max/amax) can round above max; the clamp keeps every E5M2 value finite.
    amax = torch.rand(4096) * 100 + 1e-3
    t = fp8.quantize_blockwise(amax[:, None].repeat(1, 128), block=(1, 128), dtype=torch.float8_e5m2)
    assert torch.isfinite(t.data.float()).all()


def test_bad_inputs():
    with pytest.raises(NumericsError, match=r"\(4, 100\).*block size 128"):
        fp8.quantize_blockwise(torch.randn(4, 100))
    with pytest.raises(NumericsError, match="2-D"):
        fp8.quantize_blockwise(torch.randn(2, 4, 128), block=(128, 128))
    with pytest.raises(NumericsError, match="float8_e4m3fn or torch.float8_e5m2"):
        fp8.quantize_tensorwise(torch.randn(4, 4), dtype=torch.bfloat16)
    x = torch.randn(3, 128)
    x[0, 5] = float("nan")
    with pytest.raises(NumericsError, match=r"'grad'.*\(3, 128\).*nan at index \(0, 5\)"):
        fp8.quantize_tensorwise(x, name="grad")
    with pytest.raises(NumericsError, match="non-finite"):
        fp8.quantize_blockwise(x, block=(128, 128))
    with pytest.raises(NumericsError, match="dtype"):
        fp8.quantize_tensorwise(torch.ones(4, dtype=torch.int64))
