"""The NVFP4 decode fprop (precision/decode_fprop.py, numerics/kernels/nvfp4_decode_gemm.py) against the
unfused emulated fprop, with either GEMM after the quantize pass (the Triton one, cuBLAS + scale kernel).

The unfused path (quantize x to its block values, FP32 GEMM, output scale, BF16) is the reference. The
kernels quantize x with the same device functions, so with a weight that makes every output element a
single product (a signed permutation) its output must equal the reference bit for bit: that pins the
activation codes, block scales and tensor or row scales, and the epilogue's two roundings. With random
weights only the order of the FP32 sums differs: outputs agree to within one BF16 rounding.

On CPU the kernels run in a TRITON_INTERPRET=1 child process; on a GPU directly (shapes of a decode
step of the 158M peer config too).
"""

from __future__ import annotations

import random

import pytest
import torch

from interpreter import interpreted_parent, kernel_test

pytest.importorskip("triton")

from inkling_fp4.errors import NumericsError  # noqa: E402
from inkling_fp4.precision import decode_fprop as decode_module  # noqa: E402
from inkling_fp4.precision import finite_guard, gemm  # noqa: E402
from inkling_fp4.precision.decode_fprop import decode_fprop  # noqa: E402
from inkling_fp4.precision.linear_gemms import _fprop  # noqa: E402
from inkling_fp4.precision.recipes import nvfp4_recipe  # noqa: E402

test_kernels_under_triton_interpreter = interpreted_parent(__file__)


@pytest.fixture(params=["triton", "cublas"])
def gemm_backend(request, monkeypatch):
    monkeypatch.setattr(decode_module, "GEMM", request.param)
    return request.param


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _held(w: torch.Tensor, recipe) -> gemm.Operand:
    """W's fprop operand as QuantLinear.freeze_weights holds it: BF16 block values + decode scale."""
    wq = gemm.quantize(w, recipe.fprop.b, codes=False, values=True)
    assert wq.values is not None and wq.values.dtype == torch.bfloat16
    return wq


def _reference(x, w, recipe, wq):
    """The unfused emulated fprop (the path decode_fprop replaces)."""
    y, _, _ = _fprop(x, w, recipe, "ref", torch.bfloat16, wq=wq)
    return y


def _adversarial_x(m: int, k: int, seed: int, device: str) -> torch.Tensor:
    """Random rows plus a zero row, a row with one huge outlier, a row of tiny values (subnormal E4M3
    block scales), a constant row and ±0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    rows = [
        torch.zeros(k),
        torch.randn(k, generator=g).index_put_((torch.tensor([k // 2]),), torch.tensor(3e4)),
        torch.randn(k, generator=g) * 1e-6,
        torch.full((k,), -2.5),
        torch.zeros(k).index_fill_(0, torch.arange(0, k, 2), -0.0),
    ]
    for i, r in enumerate(rows[: max(0, m - 1)]):
        x[i + 1] = r
    return x.to(torch.bfloat16).to(device)


@kernel_test
@pytest.mark.parametrize("scale", ["tensor", "row"])
@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 48, 40), (17, 160, 72), (64, 256, 96)])
def test_signed_permutation_weight_is_bit_exact(scale, m, k, n, gemm_backend):
    seed = random.randrange(2**31)
    device = _device()
    recipe = nvfp4_recipe(activation_scale=scale)
    x = _adversarial_x(m, k, seed, device)
    g = torch.Generator().manual_seed(seed)
    w = torch.zeros(n, k)
    w[torch.arange(n), torch.randint(k, (n,), generator=g)] = torch.randint(0, 2, (n,), generator=g) * 2.0 - 1
    w = w.to(device)
    wq = _held(w, recipe)
    y = decode_fprop(x, wq, recipe.fprop.a, n, "t")
    assert y is not None and y.dtype == torch.bfloat16 and y.shape == (m, n)
    ref = _reference(x, w, recipe, wq)
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), f"seed {seed}"


@kernel_test
@pytest.mark.parametrize("scale", ["tensor", "row"])
# (m, k, n): one row tile of 16, one of 64 with ragged K (two quantizer blocks of 256, the last of 16)
# and N, and past 64 rows: the [64, 64, 128] tiles, two of each with a ragged last, two K steps
@pytest.mark.parametrize("m,k,n", [(3, 128, 64), (33, 272, 80), (72, 256, 96)])
# on CPU (interpreted, slow) the Triton GEMM alone: the cuBLAS path's GEMM is the reference's FP32 one,
# its quantize pass and epilogue are pinned bit for bit by the signed-permutation test above
@pytest.mark.parametrize("gemm_backend", ["triton", "cublas"] if torch.cuda.is_available() else ["triton"],
                         indirect=True)  # fmt: skip
def test_random_weight_within_one_rounding(scale, m, k, n, gemm_backend):
    seed = random.randrange(2**31)
    device = _device()
    recipe = nvfp4_recipe(activation_scale=scale)
    x = _adversarial_x(m, k, seed, device)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    wq = _held(w, recipe)
    y = decode_fprop(x, wq, recipe.fprop.a, n, "t").float()
    ref = _reference(x, w, recipe, wq).float()
    # only the FP32 summation order differs: at most one BF16 rounding step apart (2^-8 relative),
    # plus FP32 cancellation where the sum is near zero (relative to the row's largest output)
    tol = ref.abs() * 2**-7 + ref.abs().amax(1, keepdim=True) * 1e-5
    assert ((y - ref).abs() <= tol).all(), f"seed {seed}: max |d| {(y - ref).abs().max()}"


@kernel_test
def test_not_used_where_it_does_not_apply():
    device = _device()
    recipe = nvfp4_recipe()
    w = torch.randn(32, 64, device=device)
    wq = _held(w, recipe)
    assert decode_fprop(torch.randn(257, 64, device=device), wq, recipe.fprop.a, 32, "t") is None  # prefill
    assert decode_fprop(torch.randn(4, 64, device=device), None, recipe.fprop.a, 32, "t") is None  # no held W
    dy = recipe.dgrad.a  # stochastic rounding: not an fprop activation
    assert decode_fprop(torch.randn(4, 64, device=device), wq, dy, 32, "t") is None


@kernel_test
@pytest.mark.parametrize("scale", ["tensor", "row"])
def test_non_finite_activation_is_reported(scale):
    device = _device()
    recipe = nvfp4_recipe(activation_scale=scale)
    w = torch.randn(32, 64, device=device)
    x = torch.randn(4, 64, device=device)
    x[2, 5] = float("nan")
    finite_guard.discard()
    decode_fprop(x, _held(w, recipe), recipe.fprop.a, 32, "layers.3.in_proj")
    with pytest.raises(NumericsError, match="layers.3.in_proj x"):
        finite_guard.raise_if_non_finite()


@kernel_test
def test_quant_linear_decode_routes_through_the_kernel(monkeypatch):
    """A no-grad forward of a layer with held weights takes the fused kernel at decode sizes, and gives
    what the unfused path gives; a prefill-sized forward does not take it."""
    from inkling_fp4.precision import linear_gemms
    from inkling_fp4.precision.quant_linear import QuantLinear

    device = _device()
    layer = QuantLinear(64, 48, layer_idx=1, name="in_proj").to(device)
    layer.recipe = nvfp4_recipe(activation_scale="row")
    calls = []
    real = linear_gemms.decode_fprop
    monkeypatch.setattr(linear_gemms, "decode_fprop", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    x = torch.randn(2, 3, 64, device=device)
    with torch.no_grad():
        unheld = layer(x)
        layer.freeze_weights(version=1)
        held = layer(x)
        layer(torch.randn(300, 64, device=device))
    assert [c for c in calls] == [6, 6, 300]  # asked each time; applies only with the held weight
    ref = _reference(x.reshape(6, 64), layer.weight, layer.recipe, layer.frozen_weight())
    assert torch.equal(held.reshape(6, 48), ref)
    assert torch.allclose(held.float(), unheld.float(), rtol=2**-7, atol=1e-4)


def test_without_triton_the_cpu_forward_takes_the_reference(monkeypatch):
    """An install without Triton (``pip install -e .``) samples on CPU through the unfused reference:
    the kernels module (which imports triton) is not imported."""
    import sys

    from inkling_fp4.precision.quant_linear import QuantLinear

    if torch.cuda.is_available():
        pytest.skip("the CPU path")
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    monkeypatch.delitem(sys.modules, "inkling_fp4.numerics.kernels.nvfp4_decode_gemm", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    layer = QuantLinear(64, 32, layer_idx=1, name="in_proj")
    layer.recipe = nvfp4_recipe()
    x = torch.randn(4, 64)
    with torch.no_grad():
        unheld = layer(x)
        layer.freeze_weights(version=1)  # the sampler's held weight: BF16 block values
        assert layer.frozen_weight().values is not None
        assert torch.equal(layer(x), unheld)
