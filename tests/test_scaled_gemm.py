"""The emulated NVFP4 GEMM with its epilogue fused (numerics/kernels/scaled_gemm.py) against its torch
twin, ``bf16(mm_fp32_out(a, bᵀ) · s)``.

Where every partial sum is exact in FP32 (block values of a few exponents), the two must agree bit
for bit whatever the scale: tiny, huge (overflow to ±Inf), FP32-subnormal products, NaN, per row.
On NVFP4 block values of fresh random tensors (the seed is printed) only the accumulation order
differs: each output within one BF16 step of the twin's, nearly all bitwise. Also transposed operand
views, a crop of a padded product and shapes that no tile divides; each through the pointer-fed kernel
and the TMA-fed one (``scaled_gemm_tma.py``, where the operands' strides let TMA load them).
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreted_parent, kernel_test

pytest.importorskip("triton")

from inkling_fp4.numerics.nvfp4 import quantize_ref  # noqa: E402
from inkling_fp4.precision.gemm import mm_fp32_out  # noqa: E402

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK_SCALES = torch.tensor([0.5, 0.625, 1.0, 1.75, 2.0, 3.5])
"""E4M3 values that are multiples of 1/8: every product a multiple of 2^-8, every sum exact in FP32."""
SCALES = [1.0, 0.7071067690849304, 3.0e-41, 2.0**-130, 2.0**100, 1.5e38, float("nan")]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _twin(a, b, scale, size=None):
    acc = mm_fp32_out(a, b.t())
    if size is not None:
        acc = acc[: size[0], : size[1]]
    scale = scale.reshape(-1)[: acc.shape[0], None] if scale.numel() != 1 else scale
    return torch.mul(acc, scale, out=torch.empty(acc.shape, dtype=torch.bfloat16, device=acc.device))


def _exact_values(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    """[rows, k] BF16 code · block scale values whose products and sums are exact in FP32."""
    codes = E2M1[torch.randint(0, 8, (rows, k), generator=g)]
    signs = torch.where(torch.rand(rows, k, generator=g) < 0.5, -1.0, 1.0)
    blocks = BLOCK_SCALES[torch.randint(0, len(BLOCK_SCALES), (rows, k // 16), generator=g)]
    return (codes * signs * blocks.repeat_interleave(16, dim=1)).to(torch.bfloat16)


def _assert_bitwise(got, want, what):
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN positions differ"
    bad = (got.view(torch.int16)[~nan] != want.view(torch.int16)[~nan]).sum().item()
    assert bad == 0, f"{what}: {bad} of {want.numel()} outputs differ"


@pytest.fixture(params=[False, True], ids=["pointer-fed", "tma-fed"])
def tma_fed(request, monkeypatch):
    from inkling_fp4.numerics.kernels import scaled_gemm

    monkeypatch.setattr(scaled_gemm, "TMA_FED", request.param)
    return request.param


@kernel_test
def test_exact_sums_equal_the_twin_bit_for_bit(tma_fed):
    from inkling_fp4.numerics.kernels import scaled_gemm_tma
    from inkling_fp4.numerics.kernels.scaled_gemm import scaled_gemm

    dev, seed = _device(), random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    a, b = _exact_values(70, 96, g).to(dev), _exact_values(45, 96, g).to(dev)  # no tile divides 70, 45
    # K = 96 rows of 192 bytes: TMA takes a, b and bᵀ's view of a [96, 48] tensor
    bt = _exact_values(48, 96, g).to(dev).t().contiguous().t()
    assert scaled_gemm_tma.fits(a, b) and scaled_gemm_tma.fits(a, bt)
    scale = torch.tensor([0.7], device=dev)
    _assert_bitwise(scaled_gemm(a, bt, scale), _twin(a, bt, scale), f"seed={seed} b as [K, N]")
    for s in SCALES:
        scale = torch.tensor([s], device=dev)
        _assert_bitwise(scaled_gemm(a, b, scale), _twin(a, b, scale), f"seed={seed} scale={s}")
    rows = torch.exp2(torch.randint(-140, 120, (70,), generator=g).float()).to(dev)  # one scale a row
    _assert_bitwise(scaled_gemm(a, b, rows), _twin(a, b, rows), f"seed={seed} row scales")
    # transposed views (how dgrad and wgrad operands arrive) and a padded product's crop
    at, bt = a.t().contiguous().t(), b.t().contiguous().t()
    scale = torch.tensor([0.3], device=dev)
    _assert_bitwise(scaled_gemm(at, bt, scale), _twin(a, b, scale), f"seed={seed} transposed")
    _assert_bitwise(
        scaled_gemm(a, b, scale, size=(33, 40)), _twin(a, b, scale, (33, 40)), f"seed={seed} crop"
    )


@kernel_test
def test_random_nvfp4_values_within_one_bf16_step(tma_fed):
    from inkling_fp4.numerics.kernels.scaled_gemm import scaled_gemm

    dev, seed = _device(), random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    qa = quantize_ref(torch.randn(64, 256, generator=g) * 3)
    qb = quantize_ref(torch.randn(48, 256, generator=g) * torch.exp2(torch.randn(48, 1, generator=g) * 4))
    a, b = qa.block_values().to(dev), qb.block_values().to(dev)
    scale = (qa.decode_scale * qb.decode_scale).reshape(1).to(dev)
    got, want = scaled_gemm(a, b, scale).float(), _twin(a, b, scale).float()
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)  # a BF16 ulp of want
    assert ((got - want).abs() <= step).all(), f"seed={seed}"
    assert (got == want).float().mean() > 0.98, f"seed={seed}: {(got != want).sum().item()} differ"


def test_scaled_gemm_refuses_what_it_cannot_take():
    from inkling_fp4.numerics.kernels.scaled_gemm import scaled_gemm

    a = torch.zeros(4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2-D BF16 operands"):
        scaled_gemm(a.float(), a, torch.ones(1))
    with pytest.raises(ValueError, match="differ in K"):
        scaled_gemm(a, a[:, :16], torch.ones(1))
    with pytest.raises(ValueError, match="one FP32 scale or one per row"):
        scaled_gemm(a, a, torch.ones(2))


test_kernels_under_triton_interpreter = interpreted_parent(__file__)
