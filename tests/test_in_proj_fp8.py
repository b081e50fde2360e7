"""Mamba-2's in_proj gradient written as FP8 by its consumers (model/fused_fp8/in_proj.py, model/grad_slab.py,
numerics/kernels/fp8_epilogue.py), each piece against an independent reference:

- the byte transpose against ``t().contiguous()``;
- each consumer kernel (gated norm, conv, dt softplus backwards) writing FP8 bytes against the same
  kernel writing BF16 values, then quantized by the torch reference with the same delayed scale:
  bytes, the recorded amax, and the consumer's other gradients unchanged; random inputs, a delayed
  amax that saturates some values and zero-gradient rows;
- in_proj + split as one function against QuantLinear and a plain split: the same gradients and
  recorded amax, with blocks whose consumer returns BF16 values and a block without a gradient;
- on the GPU, a model trained with the fused path against the same model without it, bit for bit.

Kernel tests (marked ``gpu``) run on a CUDA device, or on CPU in a child pytest under
TRITON_INTERPRET=1 (``test_kernels_under_triton_interpreter``).
"""

from __future__ import annotations

import pytest
import torch

from bits import same_bits
from fresh_seed import fresh_generator
from fused_fp8 import (
    GPU_MODEL,
    check_applies,
    check_fp8_epilogue,
    count_fp8_slab_takes,
    delayed_linear,
    fused_path_trains_bit_for_bit,
)
from inkling_fp4.model.fused_fp8 import in_proj as in_proj_fp8
from inkling_fp4.model.grad_slab import GradSlab
from inkling_fp4.numerics import fp8
from interpreter import INTERPRET, interpreted_parent, kernel_test

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
BF = torch.bfloat16


def check_consumer(run, shape, widths, block: int, e5m2: bool) -> None:
    """``run(into) -> (the block's gradient, the other gradients)``, one backward of a consumer of block
    ``block`` writing into ``into``: the FP8 bytes equal the reference quantization of its BF16 gradient,
    the record its amax, and the other gradients do not change."""
    like = torch.empty((), dtype=BF, device=DEVICE).expand(*shape)
    plain = GradSlab(like, widths)
    grad, others = run(plain.into(block))
    assert plain.holds(grad, block)  # the consumer wrote into the BF16 slab, as before

    def produce(scaling):
        slab = GradSlab(like, widths, scaling)
        placeholder, others_fp8 = run(slab.into(block))
        assert slab.holds(placeholder, block), "the consumer returned its block's placeholder"
        for a, b in zip(others_fp8, others, strict=True):
            same_bits(a, b, "another gradient of the consumer")
        return slab.block(block).data

    check_fp8_epilogue(produce, grad.clone(), e5m2, DEVICE)


@kernel_test
@pytest.mark.parametrize("e5m2", [True, False])
def test_gated_norm_backward_writes_fp8_dz(e5m2):
    from inkling_fp4.model.glue_kernels.gated_norm_kernels import skip_gated_rms_norm

    fresh_generator()
    B, L, H, P, G = 2, 80, 4, 32, 2
    E = H * P
    widths = [E, 96, 8]
    zx = torch.randn(B, L, sum(widths), device=DEVICE).to(BF)  # in_proj's output; z its first block
    y = torch.randn(B, L, H, P, device=DEVICE).to(BF)
    x = torch.randn(B, L, H, P, device=DEVICE).to(BF)
    D, w = torch.randn(H, device=DEVICE), torch.randn(E, device=DEVICE)
    dout = torch.randn(B, L, E, device=DEVICE).to(BF)
    dout[0, :5] = 0.0  # rows whose dz is zero

    def run(into):
        leaves = [t.detach().clone().requires_grad_(True) for t in (y, x, D, zx, w)]
        z = leaves[3][..., :E]
        skip_gated_rms_norm(
            leaves[0], leaves[1], leaves[2], z, leaves[4], G, 1e-5, BF, dz_into=into
        ).backward(dout)
        dz = _captured_grad()
        return dz, [leaves[i].grad for i in (0, 1, 2, 4)]

    check_consumer(run, (B, L, sum(widths)), widths, 0, e5m2)


@kernel_test
@pytest.mark.parametrize("e5m2", [True, False])
def test_conv_backward_writes_fp8_dx(e5m2):
    from inkling_fp4.model.conv_triton import conv_silu_triton

    fresh_generator()
    B, L, C, K = 2, 72, 96, 4
    widths = [16, C, 8]
    xz = torch.randn(B, L, sum(widths), device=DEVICE).to(BF)  # xBC: the middle block
    weight, bias = torch.randn(C, K, device=DEVICE) * 0.5, torch.randn(C, device=DEVICE)
    douts = [torch.randn(B, L, c, device=DEVICE).to(BF) for c in (64, 16, 16)]

    def run(into):
        leaves = [t.detach().clone().requires_grad_(True) for t in (xz, weight, bias)]
        xBC = leaves[0][..., 16 : 16 + C]
        outs = conv_silu_triton(xBC, leaves[1].to(BF), leaves[2].to(BF), None, [64, 16, 16], into)
        torch.autograd.backward(outs, douts)
        return _captured_grad(), [leaves[1].grad, leaves[2].grad]

    check_consumer(run, (B, L, sum(widths)), widths, 1, e5m2)


@kernel_test
@pytest.mark.parametrize("e5m2", [True, False])
def test_dt_softplus_backward_writes_fp8_ddt(e5m2):
    from inkling_fp4.model.glue_kernels.pointwise_kernels import dt_softplus

    fresh_generator()
    B, L, H = 2, 100, 8
    widths = [32, 16, H]
    zd = (torch.randn(B, L, sum(widths), device=DEVICE) * 4).to(BF)  # dt_raw: the last block
    bias = torch.randn(H, device=DEVICE)
    dout = torch.randn(B, L, H, device=DEVICE)

    def run(into):
        leaves = [t.detach().clone().requires_grad_(True) for t in (zd, bias)]
        dt_softplus(leaves[0][..., 48:], leaves[1], ddt_into=into).backward(dout)
        return _captured_grad(), [leaves[1].grad]

    check_consumer(run, (B, L, sum(widths)), widths, 2, e5m2)


_GRADS: dict = {}


def _captured_grad():
    """The gradient the consumer returned for its block: the BF16 slab's block or the FP8 slab's
    placeholder (captured by the hook that :func:`_capture` installs)."""
    return _GRADS.pop("grad")


@pytest.fixture(autouse=True)
def _capture(monkeypatch):
    """Record what each consumer's backward returns for its slab block (what the split would receive)."""
    from inkling_fp4.model.glue_kernels import common

    real = common.epilogue_args

    def recording(target):
        out, kw, grad = real(target)
        _GRADS["grad"] = grad
        return out, kw, grad

    for module in ("gated_norm_kernels", "pointwise_kernels"):
        monkeypatch.setattr(f"inkling_fp4.model.glue_kernels.{module}.epilogue_args", recording)
    monkeypatch.setattr("inkling_fp4.model.conv_triton.epilogue_args", recording)


@kernel_test
def test_byte_transpose_and_scale_equal_torch():
    """The byte transpose against ``t().contiguous()``, and the scale_inv it writes against the
    reference's for delayed amaxes (zero: scale 1; tiny: the scale clamps at FLT_MAX)."""
    from inkling_fp4.numerics.kernels.fp8_epilogue import transpose_bytes

    g = fresh_generator()
    for m, n in ((1, 1), (67, 130), (128, 64), (200, 48), (130, 600)):  # partial tiles both ways
        data = torch.randint(0, 256, (m, n), generator=g, dtype=torch.uint8).to(DEVICE)
        got, scale_inv = transpose_bytes(data.view(torch.float8_e5m2))
        assert scale_inv is None
        same_bits(got.view(torch.uint8), data.t().contiguous(), f"{m}x{n}")
    rows = torch.randint(0, 256, (48, 80), generator=g, dtype=torch.uint8).to(DEVICE)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        for amax in (0.0, 1e-40, 3.7, 6.5e4, 3e38):
            word = torch.full((1,), amax, device=DEVICE)
            _, ref = fp8.current_scale(torch.tensor(amax), fp8.FP8_MAX[dtype])
            got, scale_inv = transpose_bytes(rows.view(dtype), word, fp8.FP8_MAX[dtype])  # the kernel
            same_bits(scale_inv, ref, f"kernel scale_inv, amax {amax}")
            x, xt = fp8.tensorwise_pair_from_rows(rows.view(dtype), word)  # the dispatch (CPU: torch)
            same_bits(x.scale_inv, ref, f"scale_inv, amax {amax}")
            same_bits(xt.scale_inv, ref, f"scale_inv, amax {amax}")
            same_bits(xt.data, rows.view(dtype).t().contiguous(), "transposed bytes")
    with pytest.raises(ValueError, match="contiguous 2-D byte tensor"):
        transpose_bytes(torch.zeros(4, 4, device=DEVICE))
    # the dispatch the native FP8 GEMMs use for a weight's dgrad operand (a strided input is copied first)
    wide = torch.randint(0, 256, (96, 160), generator=g, dtype=torch.uint8).to(DEVICE)
    wide = wide.view(torch.float8_e4m3fn)
    for data in (wide, wide[:, 16:144]):
        same_bits(fp8.transpose_fp8(data), data.t().contiguous(), f"transpose_fp8 {tuple(data.stride())}")
    from inkling_fp4.errors import NumericsError

    with pytest.raises(NumericsError, match="2-D"):
        fp8.transpose_fp8(wide.reshape(2, 48, 160))


test_kernels_under_triton_interpreter = interpreted_parent(__file__)


# -- in_proj + split -------------------------------------------------------------------------------


def test_in_proj_split_equals_linear_then_split_when_consumers_return_values():
    """On CPU the consumers are torch ops that return BF16 values (no FP8 epilogue): those are quantized
    into the slab, an unused block is zeroed; in_proj's gradients and recorded amax equal the unfused
    path's bit for bit."""
    g = fresh_generator()
    widths = [32, 48, 16]
    u = torch.randn(2, 24, 64, generator=g)
    weights = [torch.randn(2, 24, w, generator=g) for w in widths[:2]]
    results = []
    for fused in (True, False):
        lin, history = delayed_linear(64, sum(widths), "mixer.in_proj", (3.0, 0.05, 0.4))
        uu = u.clone().requires_grad_(True)
        if fused:
            blocks, slab = in_proj_fp8.in_proj_split(lin, uu, widths)
            assert slab.fp8 is not None
        else:
            blocks = lin(uu).split(widths, -1)
        loss = sum((b.float() * wt).sum() for b, wt in zip(blocks, weights, strict=False))  # block 2 unused
        loss.backward()
        results.append((uu.grad, lin.weight.grad, history.state.clone()))
    for a, b, what in zip(*results, ("u's gradient", "W's gradient", "amax history"), strict=True):
        same_bits(a, b, what)
    assert results[0][2][0, 1, 1] > 0  # dy's amax was recorded


def test_in_proj_fp8_applies_only_to_delayed_pairs_on_the_kernels():
    lin, history = delayed_linear(64, 96, "mixer.in_proj", (3.0, 0.05, 0.4))
    u = torch.randn(2, 16, 64, requires_grad=True)
    check_applies(in_proj_fp8, lambda t: in_proj_fp8.applies(lin, t), u, history)


# -- the model on the GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_model_with_fp8_in_proj_gradient_trains_bit_for_bit(monkeypatch):
    cfg = GPU_MODEL
    taken = count_fp8_slab_takes(monkeypatch, blocks=3)  # z, xBC, dt
    n = fused_path_trains_bit_for_bit(
        monkeypatch, in_proj_fp8, "in_proj_split", device="cuda", model_kw=cfg, batch=(4, 256), steps=3,
        autocast=True,
    )  # fmt: skip
    assert n == 4, n  # steps 2 and 3, the 2 quantized Mamba-2 mixers
    assert taken == {"bytes": n, "values": 0}, taken  # the three consumers' kernels wrote every block
