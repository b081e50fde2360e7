"""The block norms writing their output as FP8 (the next mixer's x under delayed scaling): the forward
kernel storing FP8 bytes against the same kernel storing BF16 values, then quantized by the torch
reference with the same delayed scale: bytes, recorded amax, rstd and h, with a saturating and a
non-saturating amax and zero rows.

Kernel tests (marked ``gpu``) run on a CUDA device, or on CPU in a child pytest under
TRITON_INTERPRET=1 (``test_kernels_under_triton_interpreter``).
"""

from __future__ import annotations

import pytest
import torch

from bits import same_bits
from fresh_seed import fresh_generator
from fused_fp8 import (
    CPU_MODEL,
    GPU_MODEL,
    check_applies,
    check_fp8_epilogue,
    delayed_linear,
    fused_path_trains_bit_for_bit,
    residual_rows,
)
from interpreter import INTERPRET, interpreted_parent, kernel_test

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@kernel_test
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("e5m2", [False, True])
def test_norm_forward_writes_fp8_bytes(add, e5m2):
    from inkling_fp4.model.glue_kernels.norm_kernels import norm_forward

    g = fresh_generator()
    R, D = 40, 160  # tiles of 16 rows of 256: two whole, a ragged third; each program records its amax
    x, y = residual_rows(g, R, D)
    x[:4] = 0.0
    if add:
        y[:4] = 0.0
    x, y, w = x.to(DEVICE), y.to(DEVICE), torch.randn(D, generator=g).to(DEVICE)
    h_plain = torch.empty(R, D, device=DEVICE) if add else None
    values, rstd = norm_forward(x, y if add else None, w, 1e-5, torch.bfloat16, h_plain)

    def produce(scaling):
        h = torch.empty(R, D, device=DEVICE) if add else None
        q, rstd_fp8 = norm_forward(x, y if add else None, w, 1e-5, torch.bfloat16, h, fp8_out=scaling)
        same_bits(rstd_fp8, rstd, "rstd")
        if add:
            same_bits(h, h_plain, "h")
        return q

    check_fp8_epilogue(produce, values, e5m2, DEVICE)


test_kernels_under_triton_interpreter = interpreted_parent(__file__)


# -- the norm and the mixer's first linear ---------------------------------------------------------


@pytest.mark.parametrize("add", [False, True])
def test_norm_fp8_equals_the_norm_then_the_linear(add):
    """On CPU the function runs the reference norm and quantizes its BF16 output: h, the linear's
    output, every gradient and the amax history equal the unfused path's bit for bit, with the delayed
    scales in use (some of the norm's output saturates at the x amax chosen)."""
    from inkling_fp4.model.fused_fp8 import norm as norm_fp8
    from inkling_fp4.model.norm import RMSNorm, add_rms_norm, rms_norm

    g = fresh_generator()
    D, N = 64, 48
    x = torch.randn(2, 24, D, generator=g) * 3
    y = torch.randn(2, 24, D, generator=g).to(torch.bfloat16)
    dout = torch.randn(2, 24, N, generator=g).to(torch.bfloat16)
    dh = torch.randn(2, 24, D, generator=g)  # the residual stream's own gradient
    norm = RMSNorm(D, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(D, generator=g) + 0.5)
    results = []
    for fused in (True, False):
        lin, history = delayed_linear(D, N, "mixer.in_proj", (1.5, 0.02, 0.1))
        xx, yy = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        norm.weight.grad = None
        if fused:
            h, placeholder, pair = norm_fp8.norm(norm, xx, yy if add else None, lin)
            out = lin(placeholder, pair)
        else:
            if add:  # the norm's BF16 output, as under autocast
                h, normed = add_rms_norm(xx, yy, norm.weight, norm.eps, torch.bfloat16)
            else:
                h, normed = xx, rms_norm(xx, norm.weight, norm.eps, torch.bfloat16)
            out = lin(normed)
        torch.autograd.backward([out, h] if add else [out], [dout, dh] if add else [dout])
        grads = [xx.grad, yy.grad if add else torch.zeros(()), norm.weight.grad, lin.weight.grad]
        results.append([h, out, *grads, history.state.clone()])
    names = ["h", "output", "dx", "dy", "d norm weight", "d linear weight", "amax history"]
    for a, b, what in zip(*results, names, strict=True):
        same_bits(a, b, what)
    assert results[0][-1][0, 0, 1] > 1.5  # x's own amax recorded, above the delayed one: saturated


def test_norm_fp8_applies_only_to_delayed_pairs_on_the_kernels():
    from inkling_fp4.model.fused_fp8 import norm as norm_fp8

    lin, history = delayed_linear(64, 32, "mixer.in_proj", (1.0, 0.02, 0.1))
    x = torch.randn(2, 16, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the norm's output in BF16
        check_applies(norm_fp8, lambda t: norm_fp8.applies(lin, t, torch.float32), x, history)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norm_fp8, "fast_forms_on", lambda t: True)
        assert not norm_fp8.applies(lin, x, torch.float32)  # no autocast: the norm writes FP32, not BF16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not norm_fp8.applies(None, x, torch.float32)  # a mixer without one first linear
    with pytest.raises(ValueError, match="pair_x"):
        with torch.no_grad():
            lin(x, ("not", "used"))


def test_model_with_fp8_norm_output_trains_bit_for_bit(monkeypatch):
    """A model under CPU autocast with the norms' FP8 path (their reference form) against the same model
    without it: Mamba-2, attention and MLP blocks, the first block's plain norm and the fused adds."""
    from inkling_fp4.model.fused_fp8 import norm as norm_fp8

    monkeypatch.setattr(
        norm_fp8, "fast_forms_on", lambda t: True
    )  # applies() on CPU; the norm's reference runs
    cfg = CPU_MODEL
    n = fused_path_trains_bit_for_bit(
        monkeypatch, norm_fp8, "norm", device="cpu", model_kw=cfg, batch=(2, 48), steps=2, autocast=True
    )
    assert n == 4, n  # step 2, every block but the first and last (BF16 in the recipe)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_model_with_fp8_norm_output_trains_bit_for_bit(monkeypatch):
    from inkling_fp4.model.fused_fp8 import norm as norm_fp8

    cfg = GPU_MODEL
    n = fused_path_trains_bit_for_bit(
        monkeypatch, norm_fp8, "norm", device="cuda", model_kw=cfg, batch=(4, 256), steps=3, autocast=True
    )
    assert n == 10, n  # steps 2 and 3, the 5 quantized blocks
