"""The quantized GEMMs against independent FP64 computations from the reference quantizers."""

import dataclasses

import pytest
import torch

from inkling_fp4.numerics import fp8, mxfp4, nvfp4
from inkling_fp4.precision import gemm, native_fp8
from inkling_fp4.precision.recipes import TENSORWISE, OperandQuant

EPS32 = 2.0**-24


def _fp32_bound(a_abs: torch.Tensor, b_abs: torch.Tensor, k: int) -> torch.Tensor:
    """Error bound of an FP32-accumulated dot product: k·u·Σ|a_i b_i| (plus the output scale multiply)."""
    return (k + 2) * EPS32 * (a_abs @ b_abs.t()) + 1e-30


def _check_close_to_fp64(out: torch.Tensor, a64: torch.Tensor, b64: torch.Tensor) -> None:
    ref = a64 @ b64.t()
    bound = _fp32_bound(a64.abs(), b64.abs(), a64.shape[1])
    err = (out.double() - ref).abs()
    assert out.dtype == torch.float32
    assert bool((err <= bound).all()), f"max err {float(err.max())}, bound {float(bound.max())}"


def _randn(*shape, scale=1.0):
    return torch.randn(*shape) * scale


@pytest.mark.parametrize("shape", [(32, 64, 48), (7, 32, 16), (64, 128, 32)])
def test_nvfp4_emulated_gemm_equals_fp64_of_dequantized(shape):
    M, K, N = shape
    x = _randn(M, K, scale=3.0)
    w = _randn(N, K, scale=0.05)
    w[0, :16] *= 50.0  # a hot tile: different block scales across the tensor
    xq = gemm.quantize(x, OperandQuant("nvfp4", (1, 16)))
    wq = gemm.quantize(w, OperandQuant("nvfp4", (16, 16)))
    out = gemm.emulated_matmul(xq, wq)  # out: [M, N]
    # Independent: quantize with the reference quantizers, dequantize fully (code·scale·S_dec), FP64.
    a64 = nvfp4.quantize_ref(x).dequantize(torch.float32).double()
    b64 = nvfp4.quantize_ref(gemm.pad_to(w, 16, 16), block_2d=True).dequantize(torch.float32).double()[:N]
    _check_close_to_fp64(out[:M, :N], a64, b64)


def test_block_values_are_exact_in_bf16():
    x = _randn(16, 64) * torch.logspace(-6, 6, 64)
    q = nvfp4.quantize_ref(x)
    assert torch.equal(q.block_values(torch.bfloat16).float(), q.block_values(torch.float32))
    m = mxfp4.quantize(x)
    assert torch.equal(m.block_values(torch.bfloat16).float(), m.block_values(torch.float32))


def test_transposed_2d_weight_serves_dgrad():
    """dx = dy · W, W's 16×16 tiles reused transposed, equals the FP64 product of the dequantized tensors."""
    M, K, N = 24, 48, 32
    dy = _randn(M, N)
    w = _randn(N, K)
    wq = gemm.quantize(w, OperandQuant("nvfp4", (16, 16)))
    w_t = dataclasses.replace(wq, transposed=True)  # logical [K, N]
    dyq = gemm.quantize(dy, OperandQuant("nvfp4", (1, 16)))
    out = gemm.emulated_matmul(dyq, w_t)  # [M, K]
    a64 = nvfp4.quantize_ref(dy).dequantize().double()
    w64 = nvfp4.quantize_ref(w, block_2d=True).dequantize().double()
    _check_close_to_fp64(out, a64, w64.t())
    # 2D tiles: W and Wᵀ quantize to the same values.
    wt64 = nvfp4.quantize_ref(w.t().contiguous(), block_2d=True).dequantize().double()
    assert torch.equal(wt64, w64.t())


def test_mxfp4_emulated_gemm_equals_fp64():
    x, w = _randn(16, 96), _randn(40, 96, scale=1e-3)
    spec = OperandQuant("mxfp4", (1, 32))
    out = gemm.emulated_matmul(gemm.quantize(x, spec), gemm.quantize(w, spec))
    _check_close_to_fp64(
        out, mxfp4.quantize(x).dequantize().double(), mxfp4.quantize(w).dequantize().double()
    )


@pytest.mark.parametrize("blocks", [((1, 128), (128, 128)), ((1, 128), (1, 128)), (TENSORWISE, TENSORWISE)])
def test_fp8_emulated_gemm_equals_fp64(blocks):
    x, w = _randn(32, 256, scale=10.0), _randn(128, 256, scale=0.1)
    a = gemm.quantize(x, OperandQuant("e4m3", blocks[0]))
    b = gemm.quantize(w, OperandQuant("e5m2" if blocks[1] == TENSORWISE else "e4m3", blocks[1]))
    out = gemm.emulated_matmul(a, b)
    if blocks[0] == TENSORWISE:
        a64 = fp8.quantize_tensorwise(x).dequantize().double()
        b64 = fp8.quantize_tensorwise(w, dtype=torch.float8_e5m2).dequantize().double()
    else:
        a64 = fp8.quantize_blockwise(x, block=blocks[0]).dequantize().double()
        b64 = fp8.quantize_blockwise(w, block=blocks[1]).dequantize().double()
    _check_close_to_fp64(out, a64, b64)


def test_native_fp8_tensorwise_layouts_match_emulation():
    """torch._scaled_mm runs per-tensor FP8 on CPU too: check every operand layout the layer uses."""
    x, w, dy = _randn(48, 64), _randn(32, 64), _randn(48, 32)
    e4, e5 = OperandQuant("e4m3", TENSORWISE), OperandQuant("e5m2", TENSORWISE)
    xq, wq, dyq = gemm.quantize(x, e4), gemm.quantize(w, e4), gemm.quantize(dy, e5)
    pairs = [
        (xq, wq),  # fprop: y = x · Wᵀ
        (dyq, dataclasses.replace(wq, transposed=True)),  # dgrad: dx = dy · W
        (dataclasses.replace(dyq, transposed=True), dataclasses.replace(xq, transposed=True)),  # wgrad
    ]
    for a, b in pairs:
        native = native_fp8.native_fp8_matmul(a, b, torch.float32)
        emulated = gemm.emulated_matmul(a, b)
        torch.testing.assert_close(native, emulated, rtol=1e-5, atol=1e-5 * float(emulated.abs().max()))


def test_padding_is_exact():
    """Zero padding leaves block scales, codes and products of the real elements unchanged."""
    x = _randn(5, 40)
    padded = gemm.pad_to(x, 16, 16)
    assert padded.shape == (16, 48) and torch.equal(padded[:5, :40], x) and not padded[5:].any()
    assert gemm.pad_to(x, 1, 8) is x
    q = gemm.quantize(x, OperandQuant("nvfp4", (1, 16)))
    assert q.q.shape == (5, 48)
    # The last block holds 8 real values and 8 zeros: its scale comes from the real values only.
    ref = nvfp4.quantize_ref(torch.cat([x, torch.zeros(5, 8)], 1))
    assert torch.equal(q.q.codes, ref.codes) and torch.equal(
        q.q.scales.view(torch.uint8), ref.scales.view(torch.uint8)
    )


def test_bf16_matmul_is_fp32_accumulated():
    a, b = _randn(8, 512), _randn(4, 512)
    out = gemm.bf16_matmul(a, b)
    _check_close_to_fp64(out, a.bfloat16().double(), b.bfloat16().double())


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
def test_cuda_emulated_gemm_matches_fp64():
    x, w = _randn(256, 512).cuda(), _randn(384, 512).cuda()
    xq = gemm.quantize(x, OperandQuant("nvfp4", (1, 16)))
    wq = gemm.quantize(w, OperandQuant("nvfp4", (16, 16)))
    out = gemm.emulated_matmul(xq, wq).cpu()
    a64 = nvfp4.quantize_ref(x.cpu()).dequantize().double()
    b64 = nvfp4.quantize_ref(w.cpu(), block_2d=True).dequantize().double()
    _check_close_to_fp64(out, a64, b64)


# Hopper FP8 tensor cores accumulate with fewer than FP32's 24 bits (DeepSeek-V3 report, 3.3.2: about
# 14 bits between promotions), so native and emulated FP8 GEMMs differ by ~2^-13 of Σ|a_i·b_i| per
# addition, and the errors of a 128-long block can add up: 1.17 x 2^-10 was seen once on an H200
# (blockwise dgrad, FP32 out). A wrong scale layout scales whole blocks by the wrong factor: errors of
# the order of Σ|a_i·b_i|, 256 times this bound.
FP8_ACCUM_TOL = 2.0**-8
FP8_CASES = [
    (scaling, gemm_name, out_dtype)
    for scaling in ("tensorwise", "blockwise")
    for gemm_name in ("fprop", "dgrad", "wgrad")
    for out_dtype in (torch.float32, torch.bfloat16)
]


def fp8_gemm_operands(scaling: str, gemm_name: str, x, w, dy):
    """(a, b) of one GEMM of a linear layer under ``scaling``, as the layer builds them."""
    if scaling == "tensorwise":
        e4, e5 = OperandQuant("e4m3", TENSORWISE), OperandQuant("e5m2", TENSORWISE)
        xq, wq, dyq = gemm.quantize(x, e4), gemm.quantize(w, e4), gemm.quantize(dy, e5)
        return {
            "fprop": (xq, wq),  # y [M, N] = x · Wᵀ
            "dgrad": (dyq, dataclasses.replace(wq, transposed=True)),  # dx [M, K] = dy · W
            "wgrad": (dataclasses.replace(dyq, transposed=True), dataclasses.replace(xq, transposed=True)),
        }[gemm_name]
    act, tile = OperandQuant("e4m3", (1, 128)), OperandQuant("e4m3", (128, 128))
    if gemm_name == "fprop":
        return gemm.quantize(x, act), gemm.quantize(w, tile)
    if gemm_name == "dgrad":
        return gemm.quantize(dy, act), dataclasses.replace(gemm.quantize(w, tile), transposed=True)
    return gemm.quantize(dy, act, transpose=True), gemm.quantize(x, act, transpose=True)  # dW [N, K]


def fp8_layout_error(native: torch.Tensor, a: gemm.Operand, b: gemm.Operand) -> float:
    """max |native - emulated| / (Σ|a_i·b_i| + bf16 rounding of the output), per element."""
    emulated = gemm.emulated_matmul(a, b)
    av, _ = gemm._values(a)
    bv, _ = gemm._values(b)
    magnitude = gemm.mm_fp32_out(av.abs().float(), bv.abs().float().t())
    bound = FP8_ACCUM_TOL * magnitude + 2.0**-8 * emulated.abs() * (native.dtype != torch.float32) + 1e-30
    return float(((native.float() - emulated).abs() / bound).max())


def block_varied(*shape, device="cuda"):
    """randn times 2^(row factor + column factor): every blocking has blocks of very different scale."""
    r = torch.randint(-6, 7, (shape[0], 1), device=device).float()
    c = torch.randint(-6, 7, (1, shape[1]), device=device).float()
    return torch.randn(*shape, device=device) * torch.exp2(r + c)


@pytest.mark.parametrize("transposed", [False, True], ids=["fprop-W", "dgrad-W"])
def test_rows_1x128_scale_b_reproduces_tile_scales(transposed, monkeypatch):
    """ROWS_1X128 hands a 128x128-tiled weight to the 1x128 kernel: its [C/128, Rb] scales, applied
    per 128-block of the [C, Rb] mat2, must give exactly the tile-dequantized weight (ragged rows)."""
    w = block_varied(200, 384, device="cpu")  # 200 rows: the last tile row is partial
    wq = dataclasses.replace(gemm.quantize(w, OperandQuant("e4m3", (128, 128))), transposed=transposed)
    monkeypatch.setitem(native_fp8._tile_layout, torch.device("cpu"), native_fp8.ROWS_1X128)
    mat2 = native_fp8._col_major_t(wq).float()  # [C, Rb]
    scale_b = native_fp8._scale_b(wq, mat2.shape[1])  # [C/128, Rb]
    assert scale_b.shape == (-(-mat2.shape[0] // 128), mat2.shape[1]) and scale_b.is_contiguous()
    got = mat2 * scale_b.repeat_interleave(128, dim=0)[: mat2.shape[0]]  # [C, Rb]
    logical, _ = gemm._values(wq)  # [Rb, C]
    assert torch.equal(got.t(), logical)


def test_probe_falls_back_to_rows_1x128(monkeypatch):
    """A torch whose explicit-recipe op rejects our scales and whose 128x128 kernel reads them wrong
    (what torch 2.11 + cuBLAS did on an H200): the probe must end on _scaled_mm with ROWS_1X128, for
    both output dtypes, and forget nothing it found on the way."""
    cpu = torch.device("cpu")

    def fake_native(a, b, out_dtype=torch.float32):
        if native_fp8._blockwise_api.get(cpu) != "_scaled_mm":
            raise ValueError("scale_b must have shape 4 x 2 Float elements")
        wrong = b.spec.block == (128, 128) and native_fp8._tile_layout.get(cpu) != native_fp8.ROWS_1X128
        return (gemm.emulated_matmul(a, b) * (3.0 if wrong else 1.0)).to(out_dtype)

    monkeypatch.setattr(native_fp8, "native_fp8_matmul", fake_native)
    monkeypatch.setattr(native_fp8, "_blockwise_apis", lambda: ("scaled_mm", "_scaled_mm"))
    monkeypatch.setattr(native_fp8, "_tile_layout", {})
    monkeypatch.setattr(native_fp8, "_blockwise_api", {})
    assert native_fp8.probe_native_fp8_blockwise(cpu) == {torch.bfloat16, torch.float32}
    assert (
        native_fp8._blockwise_api[cpu] == "_scaled_mm"
        and native_fp8._tile_layout[cpu] == native_fp8.ROWS_1X128
    )

    monkeypatch.setattr(
        native_fp8, "native_fp8_matmul", lambda a, b, out_dtype=None: gemm.emulated_matmul(a, b) * 3
    )
    assert native_fp8.probe_native_fp8_blockwise(cpu) == frozenset()  # nothing agrees: emulation is used
    assert cpu not in native_fp8._blockwise_api and cpu not in native_fp8._tile_layout


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    ("scaling", "gemm_name", "out_dtype"), FP8_CASES, ids=lambda v: str(v).split(".")[-1]
)
def test_cuda_native_fp8_matches_emulation(scaling, gemm_name, out_dtype):
    from inkling_fp4.precision.backends import native_fp8_blockwise_out_dtypes

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    if scaling == "blockwise" and out_dtype not in native_fp8_blockwise_out_dtypes(torch.device("cuda")):
        pytest.skip(f"no native blockwise FP8 GEMM with {out_dtype} output here")
    x, w, dy = block_varied(256, 384), block_varied(256, 384), block_varied(256, 256)  # K/128 = 3
    a, b = fp8_gemm_operands(scaling, gemm_name, x, w, dy)
    err = fp8_layout_error(native_fp8.native_fp8_matmul(a, b, out_dtype), a, b)
    assert err <= 1.0, f"{scaling} {gemm_name} {out_dtype}: error {err:.3g}x the FP8 accumulation bound"


def test_fp8_operand_pair_equals_separate_quantization():
    """x along rows and xᵀ along the tokens from one call: the same bytes and scales as two calls."""
    act = OperandQuant("e4m3", (1, 128))
    x = _randn(256, 384, scale=3.0)
    x[0, :128] = 0.0  # a zero block
    x[1, :] = torch.linspace(-1e-40, 1e-40, 384)  # FP32 subnormals
    x[:, 5] *= 1e30  # a huge column: every token block of xᵀ's row 5
    rows, cols = gemm.fp8_operand_pair(x, act, act, "x")
    for got, ref in ((rows, gemm.quantize(x, act)), (cols, gemm.quantize(x, act, transpose=True))):
        assert got.spec == ref.spec and got.transposed == ref.transposed
        assert torch.equal(got.q.data.view(torch.uint8), ref.q.data.view(torch.uint8))
        assert torch.equal(got.q.scale_inv, ref.q.scale_inv)
    assert cols.q.data.shape == (384, 256)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_operand_pair_tensorwise_is_t_and_its_transpose(fmt):
    """Tensorwise: t's and tᵀ's operands from one pass (any M, any width) carry the bits of quantizing
    each on its own (one scale, so tᵀ's codes are t's transposed), as stored operands the GEMM reads
    without a transposed copy."""
    spec = OperandQuant(fmt, TENSORWISE)
    x = _randn(200, 96) * torch.pow(10.0, torch.empty(200, 1).uniform_(-12, 12))
    x[0] = 0.0  # a zero row
    x[1] = torch.linspace(-1e-40, 1e-40, 96)  # FP32 subnormals
    rows, cols = gemm.fp8_operand_pair(x, spec, spec, "x")
    for got, ref in ((rows, gemm.quantize(x, spec)), (cols, gemm.quantize(x, spec, transpose=True))):
        assert got.spec == ref.spec and not got.transposed
        assert torch.equal(got.q.data.view(torch.uint8), ref.q.data.view(torch.uint8))
        assert torch.equal(got.q.scale_inv, ref.q.scale_inv)
    assert cols.q.data.shape == (96, 208) and cols.q.data.is_contiguous()  # M padded to 16, as quantize does


@pytest.mark.parametrize(
    "case",
    ["rows not 128k", "tensorwise and blocks", "nvfp4", "formats differ", "one operand"],
)
def test_fp8_operand_pair_declines_what_it_cannot_fuse(case):
    act = OperandQuant("e4m3", (1, 128))
    shape, row_spec, token_spec = (256, 256), act, act
    if case == "rows not 128k":
        shape = (200, 256)
    elif case == "tensorwise and blocks":
        row_spec = OperandQuant("e4m3", TENSORWISE)
    elif case == "nvfp4":
        row_spec = token_spec = OperandQuant("nvfp4", (1, 16))
    elif case == "formats differ":
        token_spec = OperandQuant("e5m2", (1, 128))
    else:
        token_spec = None
    assert gemm.fp8_operand_pair(_randn(*shape), row_spec, token_spec) is None


def _narrow(m: int, c: int) -> torch.Tensor:
    """t [M, C], C % 128 != 0, with a zero row, ties (k/64 beside 448), subnormals and a huge range."""
    t = _randn(m, c) * torch.pow(10.0, torch.empty(m, 1).uniform_(-15, 15))
    t[0] = 0.0
    t[1] = torch.arange(c) / 64.0
    t[1, -1] = 448.0  # in the partial last block
    t[2] = torch.linspace(-1e-40, 1e-40, c)
    t[3, -1] = 1e30
    return t


def _same_operand(got: gemm.Operand, ref: gemm.Operand, rows: int | None = None) -> None:
    """Bitwise the same codes and scales (the first ``rows`` rows of got when given)."""
    data, scale = got.q.data, got.q.scale_inv
    if rows is not None:
        data, scale = data[:rows], scale[:rows]
    assert got.spec == ref.spec and got.transposed == ref.transposed
    assert torch.equal(data.view(torch.uint8).cpu(), ref.q.data.view(torch.uint8).cpu())
    assert torch.equal(scale.cpu(), ref.q.scale_inv.cpu())


@pytest.mark.parametrize("shape", [(128, 160), (256, 200), (128, 288)], ids=str)
def test_fp8_operand_pair_pads_a_narrow_width(shape):
    """C % 128 != 0: rows operand [M, Cp] as quantize() pads it; tokens operand [Cp, M] whose first
    rows are quantize(transpose=True)'s and the rest zero codes with scale_inv 1: both the reference
    on the zero-padded t."""
    act = OperandQuant("e4m3", (1, 128))
    m, c = shape
    cp, c16 = -(-c // 128) * 128, -(-c // 16) * 16
    t = _narrow(m, c)
    rows, cols = gemm.fp8_operand_pair(t, act, act, "dy")
    assert rows.q.data.shape == (m, cp) and cols.q.data.shape == (cp, m)
    _same_operand(rows, gemm.quantize(t, act))
    _same_operand(cols, gemm.quantize(t, act, transpose=True), rows=c16)
    assert not cols.q.data[c16:].view(torch.uint8).any() and bool((cols.q.scale_inv[c16:] == 1.0).all())
    padded = torch.nn.functional.pad(t, (0, cp - c))
    ref_t = fp8.quantize_blockwise_t_ref(padded)
    assert torch.equal(cols.q.data.view(torch.uint8), ref_t.data.view(torch.uint8))
    assert torch.equal(cols.q.scale_inv, ref_t.scale_inv)


@pytest.mark.parametrize("k, n", [(256, 200), (160, 288)], ids=str)
def test_fp8_layer_with_narrow_widths_gives_the_unpaired_results(monkeypatch, k, n):
    """An fp8 QuantLinear whose in/out features are not multiples of 128 quantizes x and dy in pairs
    (padded by the quantizer); y, dx and dW are bitwise those of the unpaired path (padding copies)."""
    from inkling_fp4.precision.policy import RoundingRNG
    from inkling_fp4.precision.quant_linear import QuantLinear
    from inkling_fp4.precision.recipes import fp8_recipe

    layer = QuantLinear(k, n, layer_idx=0, name="narrow")
    layer.recipe, layer.rng = fp8_recipe(), RoundingRNG(0)
    x, g = _randn(256, k, scale=2.0), (_randn(256, n) * 1e-2).bfloat16()
    g[:, -1] = 0.0  # a zero column beside the padding

    def run():
        xr = x.clone().requires_grad_(True)
        layer.weight.grad = None
        y = layer(xr)
        y.backward(g)
        return y, xr.grad, layer.weight.grad

    calls = []
    pair = gemm.fp8_operand_pair
    monkeypatch.setattr(gemm, "fp8_operand_pair", lambda *a, **kw: calls.append(pair(*a, **kw)) or calls[-1])
    paired = run()
    assert len(calls) == 2 and all(calls)
    monkeypatch.setattr(gemm, "fp8_operand_pair", lambda *a, **kw: None)
    single = run()
    for label, a, b in zip(("y", "dx", "dW"), paired, single, strict=True):
        assert a.shape == b.shape and torch.equal(a, b), label


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_fp8_narrow_operands_equal_reference():
    """On CUDA the padded pair and the narrow transposed operand come from the kernel (no copies)."""
    act = OperandQuant("e4m3", (1, 128))
    t = _narrow(512, 6176 // 8).bfloat16()  # 772 % 128 == 4
    rows, cols = gemm.fp8_operand_pair(t.cuda(), act, act, "dy")
    ref_rows, ref_cols = gemm.fp8_operand_pair(t, act, act, "dy")
    _same_operand(rows, ref_rows)
    _same_operand(cols, ref_cols)
    _same_operand(gemm.quantize(t.cuda(), act, transpose=True), gemm.quantize(t, act, transpose=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.gpu
def test_cuda_fp8_pair_equals_reference():
    x = _randn(512, 768, scale=2.0).bfloat16()
    rows, cols = fp8.quantize_blockwise_pair(x.cuda())
    ref_rows, ref_cols = fp8.quantize_blockwise_ref(x), fp8.quantize_blockwise_t_ref(x)
    for got, ref in ((rows, ref_rows), (cols, ref_cols)):
        assert torch.equal(got.data.cpu().view(torch.uint8), ref.data.view(torch.uint8))
        assert torch.equal(got.scale_inv.cpu(), ref.scale_inv)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("k", [1024, 2048])
def test_cuda_bf16_output_fuses_its_epilogue_up_to_max_k(k, monkeypatch):
    """A BF16-output NVFP4 GEMM on CUDA runs scaled_gemm where K <= FUSED_MAX_K (set to 1024 here) and
    the two passes beyond it; either way it is the two-pass product to within one BF16 step (the order
    of the sums)."""
    from inkling_fp4.numerics.kernels import scaled_gemm

    calls = []
    fused = scaled_gemm.scaled_gemm
    monkeypatch.setattr(scaled_gemm, "scaled_gemm", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    monkeypatch.setattr(gemm, "FUSED_MAX_K", 1024)
    x, w = _randn(300, k, scale=3.0).cuda(), _randn(200, k, scale=0.05).cuda()
    xq = gemm.quantize(x, OperandQuant("nvfp4", (1, 16)))
    wq = gemm.quantize(w, OperandQuant("nvfp4", (16, 16)))
    got = gemm.emulated_matmul(xq, wq, torch.bfloat16, size=(300, 200)).float()
    assert len(calls) == (1 if k <= gemm.FUSED_MAX_K else 0)
    monkeypatch.setattr(gemm, "FUSED_EPILOGUE", False)
    want = gemm.emulated_matmul(xq, wq, torch.bfloat16, size=(300, 200)).float()
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert ((got - want).abs() <= step).all() and (got == want).float().mean() > 0.98
