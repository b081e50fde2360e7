"""precision.activation_scale=row: a token's NVFP4 activation codes, scales and outputs do not
depend on its batch; the numerics against a reference made row by row; and with ``tensor`` they do."""

import pytest
import torch

from fresh_seed import fresh_generator
from inkling_fp4.errors import ConfigError
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.numerics import nvfp4
from inkling_fp4.numerics.formats import e4m3_bytes
from inkling_fp4.precision import gemm, gemm_backend
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import build_recipe
from interpreter import interpreted_parent, kernel_test

ROW = PrecisionConfig(recipe="nvfp4", activation_scale="row", bf16_first_layers=0, bf16_last_layers=0)
TENSOR = PrecisionConfig(recipe="nvfp4", bf16_first_layers=0, bf16_last_layers=0)


def spec(cfg):
    return build_recipe(cfg).fprop.a


def random_rows(g, m, k):
    """Rows of very different magnitudes, so a tensor amax differs from most rows' amax."""
    return torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[torch.randperm(m, generator=g)][:, None]


def test_row_quantizer_is_the_tensor_quantizer_of_each_row_alone():
    g = fresh_generator()
    x = random_rows(g, 24, 96)
    q = nvfp4.quantize_rows(x)
    assert q.amax.shape == (24, 1) and q.decode_scale.shape == (24, 1)
    for r in range(24):
        alone = nvfp4.quantize_ref(x[r : r + 1])
        assert torch.equal(q.codes[r], alone.codes[0])
        assert torch.equal(e4m3_bytes(q.scales[r]), e4m3_bytes(alone.scales[0]))
        assert torch.equal(q.amax[r, 0], alone.amax)
        assert torch.equal(q.dequantize()[r], alone.dequantize()[0])


def test_row_scaled_gemm_against_a_hand_made_reference():
    g = fresh_generator()
    """y[r] = (Σ_k code·s_b of x's row r · code·s_b of W) · S_dec(row r) · S_dec(W), scales on the output."""
    x = random_rows(g, 20, 64)
    w = torch.randn(48, 64, generator=g)
    recipe = build_recipe(ROW)
    xq = gemm.quantize(x, recipe.fprop.a, values=True)
    wq = gemm.quantize(w, recipe.fprop.b, values=True)
    y = gemm_backend.matmul(xq, wq, backend="emulated", out_dtype=torch.float32, size=(20, 48))
    wt = nvfp4.quantize_ref(w, block_2d=True)
    ref = torch.empty(20, 48, dtype=torch.float64)
    for r in range(20):  # every row quantized alone, dequantized by hand
        xr = nvfp4.quantize_ref(x[r : r + 1])
        block_x = xr.block_values(torch.float64)  # code · block scale, exact
        ref[r] = (
            (block_x @ wt.block_values(torch.float64).T)[0]
            * xr.decode_scale.double()
            * wt.decode_scale.double()
        )
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


def test_a_rows_codes_do_not_depend_on_its_batch():
    g = fresh_generator()
    row, tensor = spec(ROW), spec(TENSOR)
    seq = random_rows(g, 3, 128)
    alone_r = gemm.quantize(seq, row).q
    differs = 0
    for _ in range(4):  # fresh random batches, the sequence at a random place
        others = random_rows(g, 13, 128) * 10
        at = int(torch.randint(0, 14, (), generator=g))
        batch = torch.cat([others[:at], seq, others[at:]])
        in_r = gemm.quantize(batch, row).q
        assert torch.equal(in_r.codes[at : at + 3], alone_r.codes)
        assert torch.equal(e4m3_bytes(in_r.scales[at : at + 3]), e4m3_bytes(alone_r.scales))
        assert torch.equal(in_r.amax[at : at + 3], alone_r.amax)
        alone_t, in_t = nvfp4.quantize_ref(seq), gemm.quantize(batch, tensor).q
        differs += not torch.equal(in_t.codes[at : at + 3], alone_t.codes)
    assert differs == 4  # with one scale per tensor the batch's amax changes the sequence's codes


def tiny_model(policy_cfg, seed=0):
    cfg = ModelConfig(pattern="M*-M*-", vocab_size=512, d_model=64, n_heads=2, n_kv_heads=1, ffn_dim=128,
                      mamba_heads=4, mamba_head_dim=16, n_groups=1, d_state=8, chunk_size=16)  # fmt: skip
    torch.manual_seed(seed)
    model = HybridLM(cfg)
    PrecisionPolicy(policy_cfg, cfg.n_layers).apply(model)
    return model


def test_a_sequences_forward_pass_is_the_same_alone_and_in_any_batch(monkeypatch):
    g = fresh_generator()
    """row: the codes of every quantized activation and the logits agree (here bit for bit on CPU;
    the bound allows another accumulation order). tensor: logits 0.19 apart (measured, seed 0)."""
    captured = []
    real = nvfp4.quantize_rows
    monkeypatch.setattr(
        nvfp4,
        "quantize_rows",
        lambda x, name=None, check=True: captured.append(real(x, name, check)) or captured[-1],
    )
    model = tiny_model(ROW)
    tensor_model = tiny_model(TENSOR)
    worst_tensor = 0.0
    for _ in range(3):
        x = torch.randint(0, 512, (6, 24), generator=g)
        at = int(torch.randint(0, 6, (), generator=g))
        with torch.no_grad():
            captured.clear()
            alone = model(x[at : at + 1])[0]
            codes_alone = [q.codes for q in captured]
            captured.clear()
            batch = model(x)[at]
            codes_batch = [q.codes.view(6, 24, -1)[at].reshape(24, -1) for q in captured]
            worst_tensor = max(
                worst_tensor, (tensor_model(x[at : at + 1])[0] - tensor_model(x)[at]).abs().max().item()
            )
        assert len(codes_alone) == 12  # every QuantLinear of the 6 layers quantized its x per row
        for a, b in zip(codes_alone, codes_batch, strict=True):
            assert torch.equal(a, b)
        assert torch.allclose(alone, batch, rtol=0, atol=1e-4)
    assert worst_tensor > 1e-2  # the tensor scale's batch dependence, far above accumulation order


def test_training_with_row_scales_matches_its_no_grad_forward_and_learns():
    g = fresh_generator()
    layer = QuantLinear(64, 32, layer_idx=1, name="t")
    PrecisionPolicy(ROW, 3).apply(torch.nn.Sequential(layer))
    x = random_rows(g, 32, 64).requires_grad_()
    y = layer(x)
    with torch.no_grad():
        assert torch.equal(layer(x), y)
    y.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    assert layer.weight.grad.abs().sum() > 0


def test_row_needs_the_nvfp4_recipe():
    with pytest.raises(ValueError, match="activation_scale=row"):
        PrecisionConfig(recipe="fp8", activation_scale="row")
    from inkling_fp4.config import RunConfig, apply_overrides, from_dict

    with pytest.raises(ConfigError, match="activation_scale"):
        from_dict(RunConfig, apply_overrides({}, ["precision.activation_scale=column"]))
    assert "row-scaled" in build_recipe(ROW).describe()


@kernel_test
def test_fused_row_scaled_quantizer_equals_the_reference():
    """The Triton path (CUDA, or the interpreter on CPU): codes, scale bytes, values and row scales
    of ``nvfp4.quantize_rows``, bit for bit, and the same GEMM output through ``gemm.quantize``."""
    from inkling_fp4.numerics.kernels import triton_nvfp4

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = fresh_generator()
    x = random_rows(g, 40, 96).to(device)
    x[3] = 0.0  # a zero row: scale 1, codes 0
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        ref = nvfp4.quantize_rows(xd.cpu())
        bv = triton_nvfp4.fake_quantize_row_scaled(xd, keep_codes=True)
        assert torch.equal(bv.quantized.codes.cpu(), ref.codes)
        assert torch.equal(e4m3_bytes(bv.quantized.scales).cpu(), e4m3_bytes(ref.scales))
        assert torch.equal(bv.amax.cpu(), ref.amax) and torch.equal(bv.decode_scale.cpu(), ref.decode_scale)
        assert torch.equal(bv.values.cpu(), ref.block_values(torch.bfloat16))
    recipe = build_recipe(ROW)
    w = torch.randn(48, 96, generator=g).to(device)
    xq = gemm.quantize(x, recipe.fprop.a, codes=False, values=True)
    wq = gemm.quantize(w, recipe.fprop.b, codes=False, values=True, scale_with=xq.decode_scale)
    y = gemm_backend.matmul(xq, wq, backend="emulated", out_dtype=torch.float32, size=(40, 48))
    xr = gemm.Operand(nvfp4.quantize_rows(x.cpu()), recipe.fprop.a)
    wr = gemm.Operand(nvfp4.quantize_ref(w.cpu(), block_2d=True), recipe.fprop.b)
    want = gemm_backend.matmul(xr, wr, backend="emulated", out_dtype=torch.float32, size=(40, 48))
    assert torch.allclose(y.cpu(), want, rtol=1e-6, atol=1e-6 * want.abs().max().item())


test_kernels_under_triton_interpreter = interpreted_parent(__file__)
