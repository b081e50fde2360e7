"""The 16-point RHT: Sylvester H16, sign vectors, the transform's rounding and orthogonality."""

import pytest
import torch

from inkling_fp4.errors import NumericsError
from inkling_fp4.numerics import hadamard, nvfp4

TE_SIGNS = [1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of BF16 values at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.exp2(exponent - 7)


def _accumulation_slack(x: torch.Tensor) -> torch.Tensor:
    """A bound on FP32 summation error in a 16-term block sum: a few 2^-24 of the block's L1 norm."""
    l1 = x.double().abs().reshape(-1, 16).sum(-1, keepdim=True) / 4
    return (l1 * 2.0**-20).expand(-1, 16).reshape(x.shape)


def _rht_float64(x: torch.Tensor, signs: list[float]) -> torch.Tensor:
    """x_blocks · diag(s) · H16 / 4 in float64, with H16[i, j] = (-1)^popcount(i & j)."""
    idx = torch.arange(16)
    parity = torch.tensor([[bin(i & j).count("1") % 2 for j in range(16)] for i in idx.tolist()])
    h = (1 - 2 * parity).double()
    s = torch.tensor(signs, dtype=torch.float64)
    return ((x.double().reshape(-1, 16) * s) @ h / 4).reshape(x.shape)


def test_sylvester_hadamard():
    for n in (1, 2, 4, 16, 32):
        h = hadamard.hadamard_matrix(n)
        assert set(h.unique().tolist()) <= {-1.0, 1.0}
        assert torch.equal(h @ h.t(), n * torch.eye(n))
    h16 = hadamard.hadamard_matrix(16)
    for i in range(16):
        for j in range(16):
            assert h16[i, j] == (-1) ** bin(i & j).count("1")
    with pytest.raises(ValueError, match="power of two"):
        hadamard.hadamard_matrix(12)


def test_sign_vectors():
    assert hadamard.rht_signs("fixed").tolist() == TE_SIGNS
    a, b = hadamard.rht_signs("random", seed=7), hadamard.rht_signs("random", seed=7)
    assert torch.equal(a, b) and a.dtype == torch.float32 and a.shape == (16,)
    assert set(a.tolist()) <= {-1.0, 1.0}
    others = [hadamard.rht_signs("random", seed=s) for s in range(8, 12)]
    assert any(not torch.equal(a, o) for o in others)
    with pytest.raises(ValueError, match="fixed"):
        hadamard.rht_signs("hadamard")


def test_rht_matrix_is_orthogonal_with_signs_on_the_input_side():
    r = hadamard.rht_matrix()
    assert torch.equal(r @ r.t(), torch.eye(16))
    s = torch.tensor(TE_SIGNS, dtype=torch.float32)
    assert torch.equal(r, torch.diag(s) @ hadamard.hadamard_matrix(16) / 4)
    with pytest.raises(ValueError, match="16 values"):
        hadamard.rht_matrix(torch.ones(8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rht_is_fp32_math_rounded_once_to_bf16(dtype):
    x = (torch.randn(64, 128) * torch.exp2(torch.randint(-4, 5, (64, 1)).float())).to(dtype)
    y = nvfp4.rht(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    exact = _rht_float64(x, TE_SIGNS)
    err = (y.double() - exact).abs()
    # One rounding: within half a BF16 ulp, plus the FP32 accumulation's own few ulps of 2^-24.
    assert torch.all(err <= _bf16_ulp(exact) / 2 + _accumulation_slack(x))
    assert (y.double() == exact.to(torch.bfloat16).double()).float().mean() > 0.99


def test_rht_of_fp32_is_not_pre_rounded_to_bf16():
    x = torch.randn(32, 64)
    exact = _rht_float64(x, TE_SIGNS).to(torch.bfloat16)
    assert (nvfp4.rht(x) == exact).float().mean() > (nvfp4.rht(x.bfloat16()) == exact).float().mean()


def test_rht_preserves_inner_products():
    x, y = torch.randn(8, 256), torch.randn(12, 256)
    rx, ry = nvfp4.rht(x).double(), nvfp4.rht(y).double()
    exact = x.double() @ y.double().t()
    bound = 2.0**-7 * x.double().norm(dim=1)[:, None] * y.double().norm(dim=1)[None, :]
    assert torch.all((rx @ ry.t() - exact).abs() <= bound)
    # Transposed use (the wgrad contraction over tokens): dYᵀ X is preserved too.
    dy, a = torch.randn(64, 16), torch.randn(64, 24)
    product = nvfp4.rht(dy.t().contiguous()).double() @ nvfp4.rht(a.t().contiguous()).double().t()
    bound = 2.0**-7 * dy.double().norm(dim=0)[:, None] * a.double().norm(dim=0)[None, :]
    assert torch.all((product - dy.t().double() @ a.double()).abs() <= bound)


def test_rht_with_custom_signs_and_leading_dims():
    signs = hadamard.rht_signs("random", seed=3)
    x = torch.randn(2, 3, 32)
    y = nvfp4.rht(x, signs)
    assert y.shape == (2, 3, 32)
    exact = _rht_float64(x, signs.tolist())
    assert torch.all((y.double() - exact).abs() <= _bf16_ulp(exact) / 2 + _accumulation_slack(x))


def test_rht_rejects_bad_shapes():
    with pytest.raises(NumericsError, match="block size 16"):
        nvfp4.rht(torch.randn(4, 24))


def test_rht_of_fp32_ignores_a_reduced_matmul_precision():
    x = torch.randn(16, 64)
    expected = nvfp4.rht(x)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        assert torch.equal(nvfp4.rht(x), expected)
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(previous)
