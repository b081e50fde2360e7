"""Mamba-2's gated norm writing out_proj's x as FP8 (model/fused_fp8/out_proj.py), each piece against an
independent reference:

- the norm's forward kernel storing FP8 bytes against the same kernel storing BF16 values, then
  quantized by the torch reference with the same delayed scale: bytes, recorded amax and rstd, with a
  delayed amax that saturates some values and one that does not, and zero rows;
- the norm and out_proj as one function against the norm and QuantLinear run one after the other: the
  same output, every gradient and the same amax history, bit for bit (CPU, the reference norm);
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
    delayed_linear,
    fused_path_trains_bit_for_bit,
)
from inkling_fp4.model.fused_fp8 import out_proj as out_proj_fp8
from inkling_fp4.model.norm import skip_gated_rms_norm
from interpreter import INTERPRET, interpreted_parent, kernel_test

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
BF = torch.bfloat16


def _norm_inputs(B, L, H, P, device, g):
    """y, x [B, L, H, P] BF16 (x a strided view, as the conv's output is), D [H], z [B, L, H P],
    the norm's weight [H P]; the first rows of y, x and z zero."""
    E = H * P
    y = torch.randn(B, L, H, P, generator=g).to(BF)
    xz = torch.randn(B, L, E + 24, generator=g).to(BF)
    z = torch.randn(B, L, E, generator=g).to(BF)
    y[0, :3], xz[0, :3], z[0, :3] = 0.0, 0.0, 0.0
    D, w = torch.randn(H, generator=g), torch.randn(E, generator=g)
    x = xz.to(device)[..., :E].unflatten(-1, (H, P))
    return y.to(device), x, D.to(device), z.to(device), w.to(device)


@kernel_test
@pytest.mark.parametrize("e5m2", [False, True])
def test_gated_norm_forward_writes_fp8_bytes(e5m2):
    from inkling_fp4.model.glue_kernels.gated_norm_kernels import gated_forward

    g = fresh_generator()
    H, P, G = 4, 32, 2
    y, x, D, z, w = _norm_inputs(2, 72, H, P, DEVICE, g)
    values, rstd = gated_forward(y, x, D, z, w, G, 1e-5, BF)  # the BF16 store, as before

    def produce(scaling):
        q, rstd_fp8 = gated_forward(y, x, D, z, w, G, 1e-5, BF, fp8_out=scaling)
        same_bits(rstd_fp8, rstd, "rstd")
        return q

    check_fp8_epilogue(produce, values, e5m2, DEVICE)


test_kernels_under_triton_interpreter = interpreted_parent(__file__)


def test_norm_and_out_proj_equal_the_norm_then_the_linear():
    """On CPU the function runs the reference norm and quantizes its BF16 output: its output, every
    gradient and the amax history equal the unfused path's bit for bit, with the delayed scales in use
    (some of h saturates at the x amax chosen)."""
    g = fresh_generator()
    H, P, G = 4, 16, 2
    inputs = _norm_inputs(2, 24, H, P, "cpu", g)
    dout = torch.randn(2, 24, 48, generator=g).to(BF)
    results = []
    for fused in (True, False):
        lin, history = delayed_linear(H * P, 48, "mixer.out_proj", (0.5, 0.02, 0.1))
        leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
        y, x, D, z, w = leaves
        if fused:
            out = out_proj_fp8.skip_gated_norm_out_proj(y, x, D, z, w, G, 1e-5, lin)
        else:
            out = lin(skip_gated_rms_norm(y, x, D, z, w, G, 1e-5, BF))
        out.backward(dout)
        results.append([out, *(t.grad for t in leaves), lin.weight.grad, history.state.clone()])
    names = ["output", "dy", "dx", "dD", "dz", "d norm weight", "d out_proj weight", "amax history"]
    for a, b, what in zip(*results, names, strict=True):
        same_bits(a, b, what)
    assert results[0][-1][0, 0, 1] > 0.5  # x's own amax recorded, above the delayed one: saturated


def test_out_proj_fp8_applies_only_to_delayed_pairs_on_the_kernels():
    lin, history = delayed_linear(64, 32, "mixer.out_proj", (0.5, 0.02, 0.1))
    z = torch.randn(2, 16, 64, requires_grad=True)
    check_applies(out_proj_fp8, lambda t: out_proj_fp8.applies(lin, t, BF), z, history)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(out_proj_fp8, "fast_forms_on", lambda t: True)
        assert not out_proj_fp8.applies(lin, z, torch.float32)  # no autocast: the norm writes FP32


# -- the model on the GPU --------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_model_with_fp8_norm_output_trains_bit_for_bit(monkeypatch):
    cfg = GPU_MODEL
    n = fused_path_trains_bit_for_bit(
        monkeypatch, out_proj_fp8, "skip_gated_norm_out_proj", device="cuda", model_kw=cfg, batch=(4, 256),
        steps=3, autocast=True,
    )  # fmt: skip
    assert n == 4, n  # steps 2 and 3, the 2 quantized Mamba-2 mixers
