"""QuantLinear's three GEMMs against independent FP64 computations from the reference quantizers.

The reference path for each GEMM: quantize with ``numerics`` (torch reference quantizers), fully
dequantize (code · block scale · S_dec), multiply in FP64. The layer must agree to FP32-accumulation
tolerance. Stochastic rounding is checked statistically (its mean), the RHT in exact arithmetic.
"""

import pytest
import torch

from inkling_fp4.errors import NumericsError
from inkling_fp4.numerics import hadamard, nvfp4
from inkling_fp4.precision import finite_guard, gemm, gemm_backend
from inkling_fp4.precision.linear_gemms import quantized_forward
from inkling_fp4.precision.policy import RoundingRNG
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import (
    fp8_recipe,
    fp8_tensorwise_recipe,
    mxfp4_recipe,
    nvfp4_recipe,
    rht_sign_vector,
)

EPS32 = 2.0**-24


def _layer(k, n, recipe, seed=0):
    m = QuantLinear(k, n, layer_idx=0, name="probe")
    m.recipe = recipe
    m.rng = RoundingRNG(seed)
    return m


def _pad(t, rows, cols):
    return torch.nn.functional.pad(t, (0, -t.shape[1] % cols, 0, -t.shape[0] % rows))


def _assert_fp32_close(got, a64, b64):
    """got ≈ a64 · b64ᵀ within the FP32 accumulation bound k·u·(|a|·|b|ᵀ)."""
    ref = a64 @ b64.t()
    bound = (a64.shape[1] + 4) * EPS32 * (a64.abs() @ b64.abs().t()) + 1e-30
    err = (got.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err {float(err.max()):.3g} vs bound {float(bound.max()):.3g}"


def _run(m, x, g):
    """Forward and backward with upstream gradient g; returns (y, dx, dW)."""
    x = x.clone().requires_grad_(True)
    m.weight.grad = None
    y = m(x)
    y.backward(g)
    return y, x.grad, m.weight.grad


def _deq(t, **kw):
    return nvfp4.quantize_ref(t, **kw).dequantize(torch.float32).double()


def _wgrad_operand(t, signs, m_pad=16):
    """Q(RHT(tᵀ)) fully dequantized: tᵀ blocked along tokens, FP64. t: [M, C] -> [C, M_pad]."""
    t = _pad(t, m_pad, 1)
    return nvfp4.quantize_rht_t_ref(t, torch.tensor(signs)).dequantize().double()


@pytest.mark.parametrize("M,K,N", [(32, 64, 48), (26, 40, 24)])
def test_nvfp4_three_gemms_equal_fp64_reference_without_sr(M, K, N):
    recipe = nvfp4_recipe(stochastic_rounding=False)
    m = _layer(K, N, recipe)
    x = torch.randn(2, M // 2, K) * 2.0
    g = (torch.randn(2, M // 2, N) * 1e-3).bfloat16()
    y, dx, dw = _run(m, x, g)
    x2, g2 = x.reshape(M, K), g.reshape(M, N).float()
    w16 = _pad(m.weight.detach(), 16, 16)
    wq = _deq(w16, block_2d=True)  # [N16, K16]
    # fprop: y = Q(x) · Q2D(W)ᵀ, exact up to FP32 accumulation before the BF16 output rounding
    y32 = quantized_forward(x2, m.weight.detach(), recipe)
    _assert_fp32_close(y32, _deq(_pad(x2, 1, 16))[:, :], wq[:N])
    assert torch.equal(y.reshape(M, N), y32.bfloat16())
    # dgrad: dx = Q(dy) · Q2D(W), contraction over N
    _assert_fp32_close(dx.reshape(M, K), _deq(_pad(g2, 1, 16)), wq.t()[:K])
    # wgrad: dW = Q(RHT(dyᵀ)) · Q(RHT(xᵀ))ᵀ, both blocked along the tokens
    signs = recipe.rht_signs
    _assert_fp32_close(dw, _wgrad_operand(g2, signs), _wgrad_operand(x2, signs))
    assert dw.dtype == torch.float32 and dx.dtype == x.dtype and y.dtype == torch.bfloat16


@pytest.mark.slow
def test_stochastic_rounding_mean_converges_to_bf16_gradient():
    """E[Q_sr(dy)] = dy, so the mean dgrad/wgrad over many draws tends to the GEMM with dy left in BF16."""
    M, K, N, draws = 32, 32, 32, 64
    recipe = nvfp4_recipe()
    m = _layer(K, N, recipe, seed=int(torch.randint(0, 2**31, ())))
    x = torch.randn(M, K)
    g = torch.randn(M, N).bfloat16()
    dx_sum = torch.zeros(M, K, dtype=torch.float64)
    dw_sum = torch.zeros(N, K, dtype=torch.float64)
    first = None
    for _ in range(draws):
        _, dx, dw = _run(m, x, g)
        dx_sum += dx.double()
        dw_sum += dw.double()
        first = (dx.double(), dw.double()) if first is None else first
    g64 = g.double()
    dx_expected = g64 @ _deq(m.weight.detach(), block_2d=True)  # dy in BF16, W as quantized
    signs = torch.tensor(recipe.rht_signs)
    rht_dy = nvfp4.rht(g.t().contiguous(), signs).double()  # RHT(dyᵀ) in BF16, unquantized
    dw_expected = rht_dy @ _wgrad_operand(x, recipe.rht_signs).t()
    for total, expected, one in ((dx_sum, dx_expected, first[0]), (dw_sum, dw_expected, first[1])):
        single = float((one - expected).norm() / expected.norm())
        mean = float((total / draws - expected).norm() / expected.norm())
        # Independent draws: the error of the mean shrinks like 1/sqrt(draws) (8-bit SR randomness
        # adds a bias below step/256, far under this).
        assert mean < 3.0 * single / draws**0.5, (mean, single)
        assert single > 0.01  # a single draw really is noisy


def test_rht_cancels_in_exact_arithmetic():
    """(dyᵀ R)(xᵀ R)ᵀ = dyᵀ x in FP64 for the block-diagonal 16-point RHT R along the tokens."""
    M, K, N = 64, 24, 40
    x, dy = torch.randn(M, K, dtype=torch.float64), torch.randn(M, N, dtype=torch.float64)
    for kind in ("fixed", "random"):
        r16 = hadamard.rht_matrix(hadamard.rht_signs(kind, seed=3)).double()
        r = torch.block_diag(*[r16] * (M // 16))  # [M, M], orthogonal
        torch.testing.assert_close(r @ r.t(), torch.eye(M, dtype=torch.float64))
        torch.testing.assert_close((dy.t() @ r) @ (x.t() @ r).t(), dy.t() @ x, rtol=1e-12, atol=1e-12)


def test_rht_changes_the_quantized_wgrad_error():
    """The RHT changes which values the wgrad operands quantize to, hence the wgrad error; the product
    stays a faithful estimate either way. (Its benefit in the paper is a training effect at scale:
    on i.i.d. heavy-tailed synthetic data it can even raise the Frobenius error of one GEMM, since
    a block's outlier is exact at the block maximum but not after being spread by the transform.)"""
    M, K, N = 256, 64, 64
    x = torch.randn(M, K)
    dy = torch.randn(M, N)
    hot = torch.randperm(M)[: M // 16]
    x[hot] *= 40.0  # outlier tokens
    exact = dy.double().t() @ x.double()
    errors, grads = {}, {}
    for rht in (True, False):
        m = _layer(K, N, nvfp4_recipe(rht=rht, stochastic_rounding=False))
        _, _, grads[rht] = _run(m, x, dy.bfloat16())
        errors[rht] = float((grads[rht].double() - exact).norm() / exact.norm())
    assert not torch.equal(grads[True], grads[False])
    assert errors[True] != errors[False]
    assert max(errors.values()) < 0.25 and min(errors.values()) > 0.0, errors


def _three_outputs(recipe, x, g, seed=7):
    """(y, dx, dW) of a layer whose weights depend only on the shapes (same for every recipe)."""
    torch.manual_seed(0)
    m = _layer(x.shape[-1], g.shape[-1], recipe, seed=seed)
    return _run(m, x, g)


@pytest.mark.parametrize(
    "switch,changes",
    [
        (dict(stochastic_rounding=False), {"dx", "dw"}),
        (dict(rht=False), {"dw"}),
        (dict(weight_2d=False), {"y", "dx"}),
        (dict(rht_signs=rht_sign_vector("random", 5)), {"dw"}),
    ],
)
def test_each_ablation_switch_changes_only_its_gemms(switch, changes):
    x = torch.randn(48, 64)
    g = torch.randn(48, 32).bfloat16()
    base = dict(zip(("y", "dx", "dw"), _three_outputs(nvfp4_recipe(), x, g), strict=True))
    ablated = dict(zip(("y", "dx", "dw"), _three_outputs(nvfp4_recipe(**switch), x, g), strict=True))
    for key in ("y", "dx", "dw"):
        same = torch.equal(base[key], ablated[key])
        assert same == (key not in changes), f"{switch}: {key} {'unchanged' if same else 'changed'}"


def test_stochastic_rounding_is_seeded_and_switchable():
    x, g = torch.randn(32, 32), torch.randn(32, 16).bfloat16()
    a = _three_outputs(nvfp4_recipe(), x, g, seed=1)
    b = _three_outputs(nvfp4_recipe(), x, g, seed=1)
    c = _three_outputs(nvfp4_recipe(), x, g, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not torch.equal(a[1], c[1]) and not torch.equal(a[2], c[2])
    d = _three_outputs(nvfp4_recipe(stochastic_rounding=False), x, g, seed=1)
    e = _three_outputs(nvfp4_recipe(stochastic_rounding=False), x, g, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(d, e, strict=True))


def _saved_bytes(m, x):
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(x)
    y.float().sum().backward()
    return total


@pytest.mark.parametrize("recipe", [nvfp4_recipe(), mxfp4_recipe()], ids=["nvfp4", "mxfp4"])
def test_saved_for_backward_is_quantized(recipe):
    K, N, M = 128, 96, 256
    x = torch.randn(M, K, requires_grad=True)
    bf16 = _layer(K, N, None)
    quant = _layer(K, N, recipe)
    quant.weight.data.copy_(bf16.weight.data)
    ratio = _saved_bytes(quant, x) / _saved_bytes(bf16, x)
    assert ratio <= 0.3, ratio


def test_forward_only_switch_keeps_backward_quantized():
    recipe = nvfp4_recipe()
    x, g = torch.randn(32, 48), torch.randn(32, 32).bfloat16()
    y_full, dx_full, dw_full = _three_outputs(recipe, x, g)
    y_fwd, dx_fwd, dw_fwd = _three_outputs(recipe.bf16_forward(), x, g)
    assert torch.equal(dx_fwd, dx_full) and torch.equal(dw_fwd, dw_full)
    assert not torch.equal(y_fwd, y_full)
    torch.manual_seed(0)
    w = QuantLinear(48, 32, layer_idx=0).weight.detach()  # the weights _three_outputs used
    y32 = quantized_forward(x, w, recipe.bf16_forward())  # BF16 operands, FP32 accumulation
    _assert_fp32_close(y32, x.bfloat16().double(), w.bfloat16().double())
    assert torch.equal(y_fwd, y32.bfloat16())


@pytest.mark.parametrize(
    "recipe",
    [fp8_recipe(), fp8_tensorwise_recipe(), mxfp4_recipe(stochastic_rounding=False)],
    ids=["fp8", "fp8-tensorwise", "mxfp4"],
)
def test_other_recipes_fprop_dgrad_match_reference(recipe):
    from inkling_fp4.numerics import fp8, mxfp4

    M, K, N = 40, 256, 128
    m = _layer(K, N, recipe)
    x, g = torch.randn(M, K), (torch.randn(M, N) * 1e-2).bfloat16()
    _, dx, _ = _run(m, x, g)
    w = m.weight.detach()
    y32 = quantized_forward(x, w, recipe)
    if recipe.name == "fp8":
        xq = fp8.quantize_blockwise(x).dequantize().double()
        wq = fp8.quantize_blockwise(w, block=(128, 128)).dequantize().double()
        gq = fp8.quantize_blockwise(g.float()).dequantize().double()
        wtq = wq.t()
    elif recipe.name == "fp8-tensorwise":
        xq = fp8.quantize_tensorwise(x).dequantize().double()
        wq = fp8.quantize_tensorwise(w).dequantize().double()
        gq = fp8.quantize_tensorwise(g.float(), dtype=torch.float8_e5m2).dequantize().double()
        wtq = wq.t()
    else:
        xq, wq = mxfp4.quantize(x).dequantize().double(), mxfp4.quantize(w).dequantize().double()
        gq = mxfp4.quantize(g.float()).dequantize().double()
        wtq = mxfp4.quantize(w.t().contiguous()).dequantize().double()  # 1×32 along N: not Wᵀ's values
    _assert_fp32_close(y32, xq, wq)
    _assert_fp32_close(dx, gq, wtq)


@pytest.mark.parametrize("tensorwise", [False, True], ids=["fp8", "fp8-tensorwise"])
def test_fp8_paired_quantization_gives_the_unpaired_results(monkeypatch, tensorwise):
    """The fp8 layers quantize x / xᵀ and dy / dyᵀ in pairs (one read each on CUDA): with 128·k tokens
    in 1×128 blocks, with any token count tensorwise; tensorwise W / Wᵀ too (128×128 tiles need no
    pair). y, dx and dW are bitwise those of quantizing every operand on its own, dW matches the FP64
    product of the dequantized wgrad operands, and the wgrad GEMM gets both operands as stored (no
    transposed copy of FP8 bytes on the GPU)."""
    from inkling_fp4.numerics import fp8

    M, K, N = (200, 96, 48) if tensorwise else (256, 256, 128)
    x, g = torch.randn(M, K) * 2.0, (torch.randn(M, N) * 1e-2).bfloat16()
    calls, wgrad_transposed = [], []
    pair, matmul = gemm.fp8_operand_pair, gemm_backend.matmul
    monkeypatch.setattr(
        gemm,
        "fp8_operand_pair",
        lambda *a, **k: calls.append((a[3].split()[-1], pair(*a, **k))) or calls[-1][1],
    )

    def recording_matmul(a, b, **kw):
        if kw["size"] == (N, K):  # the wgrad GEMM: dW [N, K] = dyᵀ · x
            wgrad_transposed.append((a.transposed, b.transposed))
        return matmul(a, b, **kw)

    monkeypatch.setattr(gemm_backend, "matmul", recording_matmul)
    m = _layer(K, N, fp8_tensorwise_recipe() if tensorwise else fp8_recipe())
    paired = _run(m, x, g)
    paired_operands = {name: bool(result) for name, result in calls}  # x, W in forward, dy in backward
    assert len(calls) == 3 and paired_operands == {"x": True, "W": tensorwise, "dy": True}, calls
    assert wgrad_transposed == [(False, False)]
    monkeypatch.setattr(gemm, "fp8_operand_pair", lambda *a, **k: None)
    single = _run(m, x, g)
    for label, a, b in zip(("y", "dx", "dW"), paired, single, strict=True):
        assert torch.equal(a, b), label
    if tensorwise:
        gt = fp8.quantize_tensorwise_ref(g.float(), torch.float8_e5m2).dequantize().double().t()
        xt = fp8.quantize_tensorwise_ref(x).dequantize().double().t()
    else:
        gt = fp8.quantize_blockwise_t_ref(g.float()).dequantize().double()  # dyᵀ: [N, M]
        xt = fp8.quantize_blockwise_t_ref(x).dequantize().double()  # xᵀ: [K, M]
    _assert_fp32_close(paired[2], gt, xt)


def test_no_grad_and_autocast_give_the_same_output():
    m = _layer(64, 32, nvfp4_recipe())
    x = torch.randn(3, 5, 64)
    y = m(x)
    with torch.no_grad():
        y_ng = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_ac = m(x)
    assert y.shape == (3, 5, 32) and torch.equal(y, y_ng) and torch.equal(y, y_ac)


def test_adversarial_inputs():
    m = _layer(32, 16, nvfp4_recipe())
    zeros = torch.zeros(16, 32, requires_grad=True)
    y = m(zeros)
    y.float().sum().backward()
    assert not y.any() and torch.isfinite(m.weight.grad).all()
    bad = torch.randn(16, 32)
    bad[3, 7] = float("nan")
    with pytest.raises(NumericsError, match="probe"):
        m(bad)
    bad[3, 7] = float("inf")
    with pytest.raises(NumericsError, match="non-finite"):
        m(bad)
    huge = torch.randn(16, 32) * torch.logspace(-30, 30, 32)
    y = m(huge)
    assert torch.isfinite(y).all()


def test_deferred_finite_check_names_the_first_bad_operand(monkeypatch):
    finite_guard.discard()
    finite_guard.record(torch.tensor(3.0), "operand 'a'")
    finite_guard.record(torch.tensor(float("inf")), "operand 'b'")
    finite_guard.record(torch.tensor(float("nan")), "operand 'c'")
    with pytest.raises(NumericsError, match="operand 'b'.*2 quantized operand"):
        finite_guard.raise_if_non_finite()
    finite_guard.raise_if_non_finite()  # cleared
    monkeypatch.setattr(finite_guard, "MAX_PENDING", 2)
    finite_guard.record(torch.tensor(1.0), "operand 'd'")
    with pytest.raises(NumericsError, match="operand 'e'"):  # checks by itself when the record is full
        finite_guard.record(torch.tensor(float("nan")), "operand 'e'")
    finite_guard.eager_checks(True)
    try:
        assert finite_guard.eager()
    finally:
        finite_guard.eager_checks(False)
    monkeypatch.setattr(finite_guard, "MAX_PENDING", 512)
    finite_guard.record(torch.tensor([1.0, 2.0, float("inf"), 4.0]), ["w", "x", "y", "z"])  # several at once
    with pytest.raises(NumericsError, match="y contains.*1 quantized operand"):
        finite_guard.raise_if_non_finite()
    with finite_guard.capturing() as records:
        finite_guard.record(torch.tensor([1.0, 2.0]), ["p", "q"])
    assert [label for _, label in records] == ["p", "q"] and all(a.shape == (1,) for a, _ in records)


def test_captured_records_are_checked_after_each_replay():
    """Inside a graph capture records are kept apart (no check: it would read the device); after each
    replay their amaxes, as the replay left them, join the record, labels in order."""
    finite_guard.discard()
    amax_a, amax_b = torch.tensor([1.0]), torch.tensor([2.0])  # the graph's buffers
    with finite_guard.capturing() as records:
        finite_guard.record(amax_a, "operand 'a'")
        finite_guard.record(amax_b, "operand 'b'")
    assert [label for _, label in records] == ["operand 'a'", "operand 'b'"]
    finite_guard.raise_if_non_finite()  # nothing pending: the capture's records are not eager ones
    finite_guard.record_replay(records)  # replay 1: finite
    amax_b.fill_(float("nan"))  # replay 2 writes a NaN into the same buffer ...
    finite_guard.record_replay(records)
    amax_b.fill_(5.0)  # ... which replay 3 overwrites: the copy taken after replay 2 must still tell
    finite_guard.record_replay(records)
    with pytest.raises(NumericsError, match="operand 'b'.*1 quantized operand"):
        finite_guard.raise_if_non_finite()
    finite_guard.record_replay([])
    finite_guard.raise_if_non_finite()


_FUSED_CHECK = """
import torch
from inkling_fp4.errors import NumericsError
from inkling_fp4.precision import finite_guard, fused_kernels, gemm, linear_gemms
from inkling_fp4.precision.policy import RoundingRNG
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import nvfp4_recipe

def run(dtype):  # BF16 x: BF16 y and dx through the GEMM epilogue kernel (scale and round in one pass)
    torch.manual_seed(0)
    m = QuantLinear(64, 48, layer_idx=0)
    m.recipe, m.rng = nvfp4_recipe(stochastic_rounding=False), RoundingRNG(0)
    x = torch.randn(32, 64).to(dtype).requires_grad_()
    y = m(x)
    y.backward(torch.randn(32, 48).bfloat16())
    return y, x.grad, m.weight.grad

assert fused_kernels.fused_for(torch.zeros(1)) is not None
gemm.SAVED_WGRAD_VALUES = False  # x's wgrad operand as codes, until the values check below
pairs = []  # x's and dy's two operands from one pass each (gemm.nvfp4_operand_pair)
one_pass = gemm.nvfp4_operand_pair
gemm.nvfp4_operand_pair = lambda *a, **k: pairs.append(one_pass(*a, **k)) or pairs[-1]
gemm.FUSED_NVFP4_PAIR = True
fused = run(torch.float32) + run(torch.bfloat16)
assert len(pairs) == 4 and all(p is not None for p in pairs), pairs
gemm.FUSED_NVFP4_PAIR = False  # each operand in its own pass
two_passes = run(torch.float32) + run(torch.bfloat16)
assert len(pairs) == 8 and all(p is None for p in pairs[4:]), pairs
for a, b in zip(fused, two_passes, strict=True):
    assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
kinds = []  # x's wgrad operand kept as BF16 values instead of codes (gemm.SAVED_WGRAD_VALUES)
save = linear_gemms.save_operands
linear_gemms.save_operands = lambda ctx, saved: save(ctx, saved) or kinds.extend(
    entry[0] for entry in ctx.layout.values()
)
gemm.SAVED_WGRAD_VALUES = True
values_saved = run(torch.float32) + run(torch.bfloat16)
gemm.SAVED_WGRAD_VALUES = False
linear_gemms.save_operands = save
assert kinds.count("values") == 2 and kinds.count("operand") == 2, kinds  # x as values, W packed
for a, b in zip(values_saved, two_passes, strict=True):
    assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
finite_guard.raise_if_non_finite()
# NaN on the fused path: no error (and no sync) while quantizing, a named one at the check.
m = QuantLinear(64, 48, layer_idx=3, name="probe")
m.recipe = nvfp4_recipe()
bad = torch.randn(32, 64)
bad[1, 2] = float("nan")
m(bad)
try:
    finite_guard.raise_if_non_finite()
    raise SystemExit("NaN was not reported")
except NumericsError as e:
    assert "layers.3.probe x" in str(e), str(e)
finite_guard.raise_if_non_finite()  # the record is cleared
fused_kernels.fused_for = lambda t: None
reference = run(torch.float32) + run(torch.bfloat16)
for a, b in zip(fused, reference, strict=True):
    assert torch.equal(a, b), float((a.float() - b.float()).abs().max())
print("ok")
"""


@pytest.mark.slow
def test_fused_triton_path_equals_reference_path():
    """The CUDA path (fused quantize-to-BF16-values kernels) gives the reference path's results bit
    for bit with round-to-nearest; run on CPU through the Triton interpreter."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", _FUSED_CHECK], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]


_SCALES_CHECK = """
import sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from inkling_fp4.numerics import nvfp4
from inkling_fp4.numerics.kernels import triton_nvfp4
from inkling_fp4.numerics.kernels.amax import zeroed_words
from inkling_fp4.precision import finite_guard, fused_kernels, gemm
from inkling_fp4.precision.policy import RoundingRNG
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import nvfp4_recipe

assert fused_kernels.fused_for(torch.zeros(1)) is not None
seed = int(sys.argv[1])
g = torch.Generator().manual_seed(seed)
r = torch.randn(16, 32, generator=g)
inputs = [  # (x, dy, steps): a second step draws new stochastic-rounding seeds
    (r * 3, torch.randn(16, 32, generator=g), 2),
    (torch.zeros(16, 32), torch.randn(16, 32, generator=g) * 1e-40, 1),  # dy: FP32 subnormals
    (r * torch.logspace(-30, 30, 32), torch.randn(16, 32, generator=g) * torch.logspace(-20, 20, 32), 1),
    (r[:14, :24] * 1e-39, torch.full((14, 40), -1.3), 1),  # padded inside the GEMMs
]

def run(recipe, inputs=inputs):
    out = []
    for x0, dy, steps in inputs:
        torch.manual_seed(0)
        m = QuantLinear(x0.shape[1], dy.shape[1], layer_idx=0)
        m.recipe, m.rng = recipe, RoundingRNG(seed)
        for _ in range(steps):
            x = x0.bfloat16().requires_grad_(True)
            m.weight.grad = None
            y = m(x)
            y.backward(dy.bfloat16())
            out += [y, x.grad, m.weight.grad]
    finite_guard.raise_if_non_finite()
    return out

class Census(TorchDispatchMode):
    ops = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

recipes = [nvfp4_recipe(), nvfp4_recipe(weight_2d=False, rht=False)]
zeroed_words(1, torch.device("cpu"))  # the pool's one fill, before counting
with Census():  # (the interpreter's own ops while it runs a kernel included)
    fused = [run(recipes[0])]
fused.append(run(recipes[1], inputs[:1]))
scalar_math = {"div", "reciprocal", "where", "clamp", "full_like", "zeros", "fill_", "scalar_tensor"}
assert not scalar_math & set(Census.ops), sorted(scalar_math & set(Census.ops))
# The previous computation: 1/S_enc from the amax by the torch reference, sa * sb by one multiply.
def eager_scales(decode, partner, launched, amax):
    s_dec = nvfp4.tensor_scales(amax.reshape(()))[1]
    if decode is None:
        return None, None
    return s_dec.clone(), None if partner is None else s_dec * partner.reshape(())
triton_nvfp4._decode_scales = eager_scales
gemm._output_scale = lambda a, sa, b, sb: sa * sb
eager = [run(recipes[0]), run(recipes[1], inputs[:1])]
bits = {2: torch.int16, 4: torch.int32}
for got, want in zip(fused, eager, strict=True):
    for a, b in zip(got, want, strict=True):  # bit patterns: NaN from an overflowing product included
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        same = torch.equal(a.view(bits[a.element_size()]), b.view(bits[b.element_size()]))
        assert same, (a - b).abs().max()
print("ok")
"""


@pytest.mark.slow
def test_kernel_written_scales_give_the_eager_results():
    """The fused path takes 1/S_enc and the GEMM output scales from the quantize kernels instead of
    eager torch ops; with stochastic rounding on (the same seeds drawn), y, dx and dW equal bit for
    bit those of the eager scale computation, on random and adversarial inputs. Also: no eager
    scalar math (tensor scales, amax zero fills) is left in a layer's forward + backward."""
    import os
    import random
    import subprocess
    import sys

    pytest.importorskip("triton")
    seed = random.randrange(2**31)
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-c", _SCALES_CHECK, str(seed)], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "ok" in result.stdout, f"seed={seed}: " + result.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_layer_matches_cpu_reference_path():
    """The CUDA path (Triton quantizers, fused block values, tensor-core GEMMs) against the CPU path."""
    recipe = nvfp4_recipe(stochastic_rounding=False)
    x, g = torch.randn(256, 512) * 3.0, torch.randn(256, 384).bfloat16()
    results = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        m = _layer(512, 384, recipe).to(device)
        results.append([t.float().cpu() for t in _run(m, x.to(device), g.to(device))])
    for label, a, b in zip(("y", "dx", "dW"), *results, strict=True):
        rtol = 1e-4 if label == "dW" else 2.0**-7  # one BF16 ulp for BF16 outputs
        err = ((a - b).abs() / (a.abs() + 1e-3 * a.abs().max())).max().item()
        assert err <= rtol, (label, err)


def test_bf16_linear_fn_keeps_the_weight_gradient_in_fp32():
    """The BF16 layer's autograd function (the CUDA path, run here on CPU): y and dx are F.linear's
    on the BF16-rounded operands; dW is the FP32 accumulation of BF16 products, not rounded to BF16
    (checked against an FP64 GEMM of the same BF16 values)."""
    from inkling_fp4.precision.quant_linear import _BF16LinearFn

    x = (torch.randn(3, 40, 64) * torch.logspace(-2, 2, 64)).requires_grad_(True)
    w = torch.randn(48, 64, requires_grad=True)
    dy = torch.randn(3, 40, 48)
    y = _BF16LinearFn.apply(x, w)
    y.backward(dy)
    x16, w16, dy16 = x.detach().to(torch.bfloat16), w.detach().to(torch.bfloat16), dy.to(torch.bfloat16)
    y_ref = (x16.double() @ w16.double().t()).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), y_ref.float(), rtol=8e-3, atol=1e-6)
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    dx_ref = (dy16.double() @ w16.double()).to(torch.bfloat16)
    torch.testing.assert_close(x.grad, dx_ref.float(), rtol=8e-3, atol=1e-6)
    dw64 = dy16.double().reshape(-1, 48).t() @ x16.double().reshape(-1, 64)
    rel = (w.grad.double() - dw64).norm() / dw64.norm()
    assert rel < 1e-6, rel  # FP32 accumulation; a BF16-rounded dW would be ~1e-3 off
    rounded = (dw64.to(torch.bfloat16).double() - dw64).norm() / dw64.norm()
    assert rounded > 1e2 * rel
