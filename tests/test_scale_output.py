"""The emulated NVFP4 GEMM epilogue kernel (numerics/kernels/scale_output.py) against torch.

``scale_to_bf16(acc, s)`` must equal ``torch.mul(acc, s, out=<BF16>)`` bit for bit: the FP32 product
rounded to nearest, then to BF16 to nearest even. Inputs: fresh random products over a wide exponent
range (the seed is printed), exact BF16 ties of both parities, products that land in the FP32
subnormals or overflow to ±Inf, ±0, ±Inf and NaN in the product, tiny and huge scales, and a
row-strided crop (how a padded GEMM's product arrives).
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreted, run_interpreted

pytest.importorskip("triton")

from inkling_fp4.numerics.kernels.scale_output import scale_to_bf16  # noqa: E402


def _reference(acc: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device)
    return torch.mul(acc, scale, out=out)


def _assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal bit patterns, except that a NaN only has to be a NaN (its payload and sign are not the
    format's business: the GPU's conversion writes 0x7FFF, PyTorch's 0x7FC0)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    g, w = got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]
    bad = (g != w).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} mismatches, first at {bad[0].tolist()}"


def _products(device: str, seed: int) -> torch.Tensor:
    """[48, 300] FP32: random magnitudes 2^-140 .. 2^120, then adversarial rows."""
    g = torch.Generator().manual_seed(seed)
    acc = torch.randn(48, 300, generator=g) * torch.exp2(
        torch.randint(-140, 120, (48, 300), generator=g).float()
    )
    ties = torch.tensor([0x3F808000, 0x3F818000, 0x00008000, 0x00018000], dtype=torch.int32)
    ties = torch.cat([ties.view(torch.float32), -ties.view(torch.float32)])
    acc[0, : ties.numel()] = ties  # exactly halfway between two BF16 values
    acc[1, :6] = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 3.0e38])
    acc[2] = torch.randn(300, generator=g) * 1e-38  # FP32 subnormal territory
    return acc.to(device)


SCALES = [1.0, 0.7071067690849304, 3.0e-41, 2.0**-100, 2.0**60, 1.5e38]


def _check_all(device: str) -> None:
    seed = random.randrange(2**31)
    acc = _products(device, seed)
    for s in SCALES:
        scale = torch.tensor([s], dtype=torch.float32, device=device)
        _assert_bitwise(scale_to_bf16(acc, scale), _reference(acc, scale), f"seed={seed} scale={s}")
        crop = acc[:, :257]  # row stride 300: a padded product's crop
        _assert_bitwise(scale_to_bf16(crop, scale), _reference(crop, scale), f"seed={seed} scale={s} crop")


@interpreted
def test_interp_scale_to_bf16_equals_torch_mul():
    _check_all("cpu")


def test_under_triton_interpreter():
    run_interpreted(__file__, "-k", "interp")


def test_scale_to_bf16_refuses_what_it_cannot_take():
    acc = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="one FP32 scale"):
        scale_to_bf16(acc, torch.ones(2))
    with pytest.raises(ValueError, match="unit column stride"):
        scale_to_bf16(acc.t(), torch.ones(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_scale_to_bf16_equals_torch_mul():
    _check_all("cuda")
