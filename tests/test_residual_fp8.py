"""The output projections' gradient written as FP8 by the next norm's backward
(``model/fused_fp8/residual.py``):
the backward kernel storing dy's FP8 bytes against the same kernel storing BF16 dy, then quantized by
the torch reference with the same delayed scale (bytes, recorded amax, dx and the norm weight's
gradient, with a saturating and a non-saturating amax and zero rows); a linear taking its dy from the
slab against the linear alone; a model trained with and without the slabs, bit for bit.

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
    count_fp8_slab_takes,
    delayed_linear,
    fused_path_trains_bit_for_bit,
    residual_rows,
)
from inkling_fp4.model.grad_slab import GradSlab
from inkling_fp4.numerics import fp8
from interpreter import INTERPRET, interpreted_parent, kernel_test

DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"


@kernel_test
@pytest.mark.parametrize("with_dh", [False, True])
@pytest.mark.parametrize("e5m2", [False, True])
def test_norm_backward_writes_dy_as_fp8_bytes(with_dh, e5m2):
    from inkling_fp4.model.glue_kernels.norm_kernels import norm_backward, norm_forward

    g = fresh_generator()
    R, D = 96, 160
    x, y = residual_rows(g, R, D)
    dout = torch.randn(R, D, generator=g).to(torch.bfloat16)
    dh = torch.randn(R, D, generator=g) * 2
    dout[:4], dh[:4] = 0.0, 0.0  # rows whose gradient is zero
    x, y, dout, dh = (t.to(DEVICE) for t in (x, y, dout, dh))
    w = torch.randn(D, generator=g).to(DEVICE)
    h = torch.empty(R, D, device=DEVICE)
    _, rstd = norm_forward(x, y, w, 1e-5, torch.bfloat16, h)
    dh_in = dh if with_dh else None
    dx_plain, dy_plain, dw_plain = norm_backward(h, w, rstd, dout, dh_in, torch.float32, torch.bfloat16)
    assert dy_plain.dtype == torch.bfloat16

    def produce(scaling):
        like = torch.empty((), dtype=torch.bfloat16, device=DEVICE).expand(R, D)
        slab = GradSlab(like, [D], scaling)
        dx, dy, dw = norm_backward(h, w, rstd, dout, dh_in, torch.float32, torch.bfloat16, slab.into(0))
        assert slab.holds(dy, 0), "dy is the slab's placeholder"
        same_bits(dx, dx_plain, "dx")
        same_bits(dw, dw_plain, "d weight")
        return slab.buffer

    check_fp8_epilogue(produce, dy_plain, e5m2, DEVICE)


test_kernels_under_triton_interpreter = interpreted_parent(__file__)


# -- the linear taking its output's gradient from the slab ---------------------------------------


def test_linear_takes_its_output_gradient_from_the_slab():
    """A delayed linear handed a slab: where dy comes as its placeholder with the bytes written (as the
    norm's kernel does), and where it comes as values (a consumer without the epilogue), dx, dW and
    the amax history equal the linear's own quantization of dy, bit for bit."""
    from inkling_fp4.model.fused_fp8.residual import output_grad

    g = fresh_generator()
    K, N = 48, 64
    x = torch.randn(2, 24, K, generator=g)
    dy = torch.randn(2, 24, N, generator=g).to(torch.bfloat16) * 3
    results = []
    for mode in ("plain", "bytes", "values"):
        lin, history = delayed_linear(K, N, "mixer.out_proj", (1.5, 0.5, 0.1))  # some of dy saturates
        xx = x.clone().requires_grad_(True)
        if mode == "plain":
            out = lin(xx)
            out.backward(dy)
        else:
            slab = output_grad(lin, xx)
            out = lin(xx, dy_fp8=slab)
            if mode == "bytes":  # what the norm's kernel writes: dy's bytes and its amax, the placeholder
                block = slab.block(0)
                dtype = torch.float8_e5m2 if block.scaling.e5m2 else torch.float8_e4m3fn
                q = fp8.quantize_tensorwise_ref(dy.reshape(-1, N), dtype, amax=block.scaling.amax)
                block.data.view(-1, N).copy_(q.data.view(torch.uint8))
                block.scaling.record.copy_(torch.maximum(block.scaling.record, dy.float().abs().amax()))
                out.backward(block.placeholder)
            else:
                out.backward(dy)
            assert slab.buffer is None, "the linear's backward took the buffer"
        results.append([out, xx.grad, lin.weight.grad, history.state.clone()])
    for other, mode in zip(results[1:], ("bytes", "values"), strict=True):
        for a, b, what in zip(results[0], other, ["output", "dx", "dW", "amax history"], strict=True):
            same_bits(b, a, f"{mode}: {what}")
    assert results[0][-1][0, 1, 1] > 0.5  # dy's own amax recorded, above the delayed one: saturated


def test_slab_only_for_delayed_pairs_on_the_kernels():
    from inkling_fp4.model.fused_fp8 import residual as residual_fp8

    lin, history = delayed_linear(64, 32, "mixer.out_proj", (1.0, 0.02, 0.1))
    x = torch.randn(2, 16, 32, requires_grad=True)
    check_applies(residual_fp8, lambda t: residual_fp8.applies(lin, t), x, history)
    slab = residual_fp8.output_grad(lin, x)
    with torch.no_grad(), pytest.raises(ValueError, match="dy_fp8"):  # a slab outside training
        lin(torch.randn(2, 16, 64), dy_fp8=slab)


def test_model_with_fp8_residual_gradient_trains_bit_for_bit(monkeypatch):
    """A model under CPU autocast with the slabs (the norms' reference forms return values, which the
    linears quantize into the slabs) against the same model without them, with the norms' FP8 outputs
    on in both: Mamba-2, attention and MLP blocks."""
    from inkling_fp4.model.fused_fp8 import norm as norm_fp8
    from inkling_fp4.model.fused_fp8 import residual as residual_fp8

    monkeypatch.setattr(norm_fp8, "fast_forms_on", lambda t: True)
    monkeypatch.setattr(residual_fp8, "fast_forms_on", lambda t: True)
    taken = count_fp8_slab_takes(monkeypatch, blocks=1)  # the output linears' slabs
    n = fused_path_trains_bit_for_bit(
        monkeypatch, residual_fp8, "output_grad", device="cpu", model_kw=CPU_MODEL, batch=(2, 48), steps=2,
        autocast=True,
    )  # fmt: skip
    assert n == 4, n  # step 2, every block but the first and last (BF16 in the recipe)
    assert taken == {"bytes": 0, "values": 4}, taken  # each slab reached its linear; no kernel on CPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_model_with_fp8_residual_gradient_trains_bit_for_bit(monkeypatch):
    from inkling_fp4.model.fused_fp8 import residual as residual_fp8

    taken = count_fp8_slab_takes(monkeypatch, blocks=1)  # the output linears' slabs
    n = fused_path_trains_bit_for_bit(
        monkeypatch, residual_fp8, "output_grad", device="cuda", model_kw=GPU_MODEL, batch=(4, 256), steps=3,
        autocast=True,
    )  # fmt: skip
    assert n == 10, n  # steps 2 and 3, the 5 quantized blocks
    assert taken == {"bytes": 10, "values": 0}, taken  # every norm's backward kernel wrote the bytes
