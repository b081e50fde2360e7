"""The MLP's squared ReLU fused into the delayed-scaled FP8 quantizers (model/fused_fp8/mlp.py).

Three layers of evidence, each against an independent reference:

- ``fp8.squared_relu_ref`` is the model's squared ReLU, forward and autograd backward;
- the quantizer's prologue (``ACT_*`` in numerics/kernels/fp8_quantize.py) gives the bytes, scale and
  recorded amax of quantizing that reference tensor, under the interpreter on CPU and on the GPU at
  every (warps, CHUNK) candidate and conversion form, with random and adversarial inputs;
- a model whose MLPs take the fused path trains, loss, gradients and amax history, bit for bit as
  the same model with the MLP's linears run one by one.
"""

from __future__ import annotations

import random

import pytest
import torch

from bits import same_bits
from fused_fp8 import CPU_MODEL, fused_path_trains_bit_for_bit
from inkling_fp4.model.fused_fp8 import mlp as mlp_fp8
from inkling_fp4.model.mlp import squared_relu
from inkling_fp4.numerics import fp8
from interpreter import interpreted, run_interpreted

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bf16_inputs(m: int, n: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """h and dout [M, N] in BF16: mixed signs over 30 decades (squares stay finite), zero rows, -0,
    products that round to BF16 subnormals, and h exactly 0 next to dout of any size."""
    seed = random.randrange(2**31)
    print(f"input seed = {seed}")
    g = torch.Generator().manual_seed(seed)
    scale = torch.pow(10.0, torch.empty(m, 1).uniform_(-15, 15, generator=g))
    h = torch.randn(m, n, generator=g) * scale
    dout = torch.randn(m, n, generator=g) * torch.pow(10.0, torch.empty(m, 1).uniform_(-15, 15, generator=g))
    h[0] = 0.0
    h[1] = -0.0
    h[2] = torch.linspace(-1e-20, 1e-20, n)  # relu(h)² and dout·h below BF16's normal range
    dout[3] = 0.0
    h[4, : n // 2] = 0.0  # the gradient's h > 0 test at exactly 0, with dout not zero
    return h.bfloat16().to(device), dout.bfloat16().to(device)


def test_reference_is_the_models_squared_relu_forward_and_backward():
    h, dout = _bf16_inputs(64, 96)
    h = h.clamp(-1e15, 1e15)  # keep the autograd sum dout·r + dout·r away from BF16's subnormals
    h[2] = torch.linspace(-3, 3, 96).bfloat16()
    hr = h.clone().requires_grad_(True)
    out = squared_relu(hr)
    out.backward(dout)
    same_bits(fp8.squared_relu_ref(h), out.detach(), "forward")
    same_bits(fp8.squared_relu_ref(h, dout), hr.grad, "backward")


def check_prologue(h, dout, dtype, **launch) -> None:
    """The fused pair (forward if dout is None, else the gradient) against quantizing the reference
    tensor: bytes both ways, scale_inv, and the recorded amax, for a delayed amax below (saturating
    codes) and above the tensor's own."""
    from inkling_fp4.numerics.kernels import fp8_quantize as kern

    target = fp8.squared_relu_ref(h.cpu(), None if dout is None else dout.cpu())  # [M, N] BF16
    own = target.float().abs().amax()
    act = kern.ACT_SQUARED_RELU if dout is None else kern.ACT_SQUARED_RELU_GRAD
    for given in (own / 64, own * 3):
        amax = given.reshape(1).to(h.device)
        record = torch.full((1,), -1.0, device=h.device)
        out = kern.quantize_fp8(
            h, dtype, mode=kern.MODE_TENSOR, rows=True, cols=True, amax=amax, record=record, act=act,
            dout=dout, **launch,
        )  # fmt: skip
        ref = fp8.quantize_tensorwise_ref(target, dtype, amax=amax.cpu())
        what = f"{'gradient' if dout is not None else 'forward'} {dtype} amax {float(given):.3g} {launch}"
        same_bits(out["data"], ref.data, f"{what} data")
        same_bits(out["data_t"], ref.data.t(), f"{what} transposed data")
        same_bits(out["scale_inv"], ref.scale_inv, f"{what} scale_inv")
        assert record.item() == own.item(), (what, record.item(), own.item())


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interp_fused_squared_relu_pair_equals_reference(dtype):
    h, dout = _bf16_inputs(160, 200)  # rows past a block, a partial column block
    check_prologue(h, None, dtype)
    check_prologue(h, dout, dtype)


@interpreted
def test_interp_fused_squared_relu_records_non_finite():
    """NaN in h, or a square that overflows BF16, records Inf: the trainer then skips the step."""
    from inkling_fp4.numerics.kernels import fp8_quantize as kern

    for poison in (float("nan"), 1e20):
        h, dout = _bf16_inputs(32, 64)
        h[5, 7] = poison
        if poison == 1e20:
            dout[5, 7] = 1e20  # 2·dout·h overflows too
        for act, d in ((kern.ACT_SQUARED_RELU, None), (kern.ACT_SQUARED_RELU_GRAD, dout)):
            record = torch.full((1,), -1.0)
            kern.quantize_fp8(
                h, torch.float8_e4m3fn, mode=kern.MODE_TENSOR, rows=True, cols=True, amax=torch.ones(1),
                record=record, act=act, dout=d,
            )  # fmt: skip
            assert torch.isinf(record).all(), (poison, act)


@interpreted
def test_interp_public_pair_and_its_refusals():
    from inkling_fp4.errors import NumericsError
    from inkling_fp4.numerics.kernels import fp8_quantize as kern

    h, dout = _bf16_inputs(48, 80)
    amax = fp8.squared_relu_ref(h, dout).float().abs().amax().reshape(1) / 4
    rows, cols = fp8.quantize_squared_relu_pair(h, dout, torch.float8_e5m2, amax=amax, check=False)
    ref = fp8.quantize_tensorwise_ref(fp8.squared_relu_ref(h, dout), torch.float8_e5m2, amax=amax)
    same_bits(rows.data, ref.data, "rows")  # on CPU the public function runs the reference: same bits
    same_bits(cols.data, ref.data.t(), "cols")
    with pytest.raises(NumericsError, match="bfloat16"):
        fp8.quantize_squared_relu_pair(h.float(), amax=amax)
    kw = dict(mode=kern.MODE_TENSOR, amax=amax)
    with pytest.raises(ValueError, match="dout laid out as x"):
        kern.quantize_fp8(h, torch.float8_e4m3fn, act=kern.ACT_SQUARED_RELU_GRAD, **kw)
    with pytest.raises(ValueError, match="dout laid out as x"):
        kern.quantize_fp8(h, torch.float8_e4m3fn, act=kern.ACT_SQUARED_RELU, dout=dout, **kw)
    with pytest.raises(ValueError, match="bfloat16 x"):
        kern.quantize_fp8(h.float(), torch.float8_e4m3fn, act=kern.ACT_SQUARED_RELU, **kw)


def test_under_triton_interpreter():
    """Run every ``test_interp_*`` in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__, "-k", "interp")


# -- the model: fused against one linear at a time -------------------------------------------------


def _assert_fused_equals_unfused(device, cfg_kw, batch, monkeypatch):
    """Two steps: the first scales currently (no history yet, never fused), the second from the
    history, where each MLP of the recipe takes the fused path once."""
    n = fused_path_trains_bit_for_bit(
        monkeypatch, mlp_fp8, "squared_relu_mlp", device=device, model_kw=cfg_kw, batch=batch, steps=2,
        autocast=False,
    )  # fmt: skip
    assert 1 <= n <= cfg_kw["pattern"].count("-"), n  # on step 2 only


def test_fused_mlp_trains_bit_for_bit_as_the_unfused_one(monkeypatch):
    cfg = CPU_MODEL
    _assert_fused_equals_unfused("cpu", cfg, (2, 48), monkeypatch)


def test_fused_path_needs_delayed_pairs_and_a_history():
    from inkling_fp4.precision.amax_history import AmaxHistory
    from inkling_fp4.precision.quant_linear import QuantLinear
    from inkling_fp4.precision.recipes import fp8_tensorwise_recipe

    up, down = QuantLinear(8, 32, layer_idx=0), QuantLinear(32, 8, layer_idx=0)
    x = torch.randn(4, 8, requires_grad=True)
    assert not mlp_fp8.applies(up, down, x)  # BF16
    for m in (up, down):
        m.recipe = fp8_tensorwise_recipe()
    assert not mlp_fp8.applies(up, down, x)  # current scaling
    history = AmaxHistory(2, 2, torch.device("cpu"))
    for i, m in enumerate((up, down)):
        m.recipe, m.amax_history, m.amax_index = fp8_tensorwise_recipe(delayed=True), history, i
    assert not mlp_fp8.applies(up, down, x)  # no step in the history yet
    history.ready = True
    assert mlp_fp8.applies(up, down, x)
    with torch.no_grad():
        assert not mlp_fp8.applies(up, down, x)  # evaluation scales currently
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not mlp_fp8.applies(up, down, x)  # torch.compile traces the linears one by one


# -- on the GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@on_gpu
def test_gpu_fused_squared_relu_pair_every_config_and_conversion():
    from inkling_fp4.numerics.kernels import fp8_quantize as kern

    h, dout = _bf16_inputs(512, 1536, device="cuda")
    forms = [dict(hardware_cast=False), dict(hardware_cast=True, transposed_cast=False)]
    forms.append(dict(hardware_cast=True, transposed_cast=True))
    for config in kern.CANDIDATES:
        for form in forms:
            check_prologue(h, None, torch.float8_e4m3fn, config=config, **form)
            check_prologue(h, dout, torch.float8_e5m2, config=config, **form)
    check_prologue(h, dout, torch.float8_e5m2)  # the autotuned pick and default conversion


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_fused_gradient_hits_every_code_and_tie(dtype):
    """dh = 2·dout·0.5 = dout: every code of the format and the BF16 values around each tie, through
    the gradient prologue, both layouts, at every candidate and conversion form."""
    from inkling_fp4.numerics.kernels import fp8_quantize as kern
    from test_kernels_fp8 import _every_code_and_tie

    dout = _every_code_and_tie(dtype).bfloat16().cuda()
    h = torch.full_like(dout, 0.5)
    for config in kern.CANDIDATES:
        for transposed_cast in (False, True):
            check_prologue(h, dout, dtype, config=config, hardware_cast=True, transposed_cast=transposed_cast)


@pytest.mark.gpu
@on_gpu
def test_gpu_fused_mlp_trains_bit_for_bit_as_the_unfused_one(monkeypatch):
    cfg = dict(pattern="M-*-M-", vocab_size=1024, d_model=256, ffn_dim=1024, n_heads=4, n_kv_heads=2)
    _assert_fused_equals_unfused("cuda", cfg, (4, 256), monkeypatch)
