"""The model's fast paths against their references: the Triton conv, the fast glue, the chunked loss.

- Triton causal conv + SiLU (``test_interp_*``): values and gradients (x, weight, bias) against
  ``conv_silu`` in FP32, on a strided view of a wider tensor, with and without document resets. Run
  in a child process under TRITON_INTERPRET=1 (``test_under_triton_interpreter``).
- Chunked LM head + cross-entropy: value and gradients against ``F.cross_entropy`` of full logits, with a
  loss mask, chunk sizes that do not divide the token count, and through ``HybridLM.loss``.
- Glue functions: on CPU they are their plain references (no compilation) and equal the formulas; on
  the GPU (``@pytest.mark.gpu``) the fast forms (Triton kernels for five of them, ``torch.compile`` for
  gated_rms_norm) equal the references, values and gradients. The kernels' own tests, with tight
  tolerances, are in test_glue_kernels.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from inkling_fp4.model.compiled import reference_glue
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.conv import conv_silu
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.model.loss import chunked_cross_entropy
from inkling_fp4.model.mamba2 import dt_softplus
from inkling_fp4.model.mlp import squared_relu
from inkling_fp4.model.norm import add_rms_norm, gated_rms_norm, rms_norm, skip_gated_rms_norm
from inkling_fp4.model.packing import segment_ids
from interpreter import interpreted, run_interpreted

on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _seed() -> int:
    seed = random.randrange(2**31)
    print(f"input seed = {seed}")
    torch.manual_seed(seed)
    return seed


def _random_segments(b: int, l: int) -> torch.Tensor:
    doc = torch.zeros(b, l, dtype=torch.long)
    for row in range(b):
        for cut in torch.randint(1, l, (3,)).tolist():
            doc[row, cut:] += 1
    doc[0, 1:] += 1  # a one-token document at the start of row 0
    return segment_ids(doc)


def _conv_grads(fn, base, lo, C, w, bias, seg, dy):
    base = base.clone().requires_grad_()
    w = w.clone().requires_grad_()
    bias = bias.clone().requires_grad_()
    y = fn(base[..., lo : lo + C], w, bias, seg)
    y.backward(dy)
    return y.detach(), base.grad, w.grad, bias.grad


def _close(got, ref, rtol, what):
    err = ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
    assert err < rtol, f"{what}: relative error {err:.2e}"


@interpreted
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("k", [4, 2])
@pytest.mark.parametrize("shape", [(2, 45, 150), (1, 300, 24)])  # tiles cut L and C; two backward chunks
def test_interp_conv_silu_triton_matches_reference(packed, k, shape):
    from inkling_fp4.model.conv_triton import conv_silu_triton

    _seed()
    B, L, C = shape
    base = torch.randn(B, L, C + 20) * 2
    w, bias = torch.randn(C, k), torch.randn(C)
    seg = _random_segments(B, L) if packed else None
    dy = torch.randn(B, L, C)
    fast = _conv_grads(conv_silu_triton, base, 7, C, w, bias, seg, dy)
    ref = _conv_grads(conv_silu, base, 7, C, w, bias, seg, dy)
    for name, got, want in zip(("out", "dx", "dweight", "dbias"), fast, ref, strict=True):
        _close(got, want, 1e-5, name)


@interpreted
@pytest.mark.parametrize("packed", [False, True])
def test_interp_conv_blocks_give_the_whole_outputs_gradients_bit_for_bit(packed):
    """With ``blocks`` the output comes as column blocks (the mixer's x, B, C) whose gradients the
    backward reads where they are: values and all gradients equal the whole output's, bit for bit, for
    block edges inside a channel tile."""
    from inkling_fp4.model.conv_triton import conv_silu_triton

    _seed()
    B, L, C, k = 2, 70, 150, 4
    blocks = [70, 41, 39]
    base = torch.randn(B, L, C + 9) * 2
    w, bias = torch.randn(C, k), torch.randn(C)
    seg = _random_segments(B, L) if packed else None
    dys = [torch.randn(B, L, n) for n in blocks]

    def run(split):
        x = base.clone().requires_grad_()
        wv, bv = w.clone().requires_grad_(), bias.clone().requires_grad_()
        if split:
            outs = conv_silu_triton(x[..., 4 : 4 + C], wv, bv, seg, blocks)
            assert [o.shape[-1] for o in outs] == blocks
            torch.autograd.backward(outs, dys)
            out = torch.cat([o.detach() for o in outs], -1)
        else:
            out = conv_silu_triton(x[..., 4 : 4 + C], wv, bv, seg)
            out.backward(torch.cat(dys, -1))
        return out.detach(), x.grad, wv.grad, bv.grad

    for name, got, want in zip(("out", "dx", "dweight", "dbias"), run(True), run(False), strict=True):
        assert torch.equal(got, want), name
    with pytest.raises(ValueError, match="blocks must be 1 or 3 widths summing to 150"):
        conv_silu_triton(base[..., :C], w, bias, None, [100, 40])
    with pytest.raises(ValueError, match="widths up to 4, got 5; use model.conv_impl=compiled"):
        conv_silu_triton(base[..., :C], torch.randn(C, 5), bias)


class _NoSlab:
    def into(self, i):
        return None  # each consumer allocates its own gradient; autograd concatenates them


@interpreted
@pytest.mark.parametrize("packed", [False, True])
def test_interp_mixer_writes_in_projs_gradient_in_place(monkeypatch, packed):
    """The Mamba-2 mixer on its fast path (the Triton conv and glue, forced on CPU tensors): the gated
    norm, the conv and dt's softplus write their input gradients into one buffer (model/grad_slab.py)
    and in_proj's backward gets it without a concatenation (the fallback fails the test). Every
    gradient is bit for bit the one of the same kernels with autograd's split and concatenation."""
    from inkling_fp4.model import compiled, grad_slab, mamba2
    from inkling_fp4.model.packing import Packing

    seed = _seed()
    cfg = ModelConfig(
        vocab_size=64, d_model=32, pattern="M", mamba_heads=4, mamba_head_dim=8, n_groups=2, d_state=8,
        chunk_size=16, ssd_impl="reference", conv_impl="triton",
    )  # fmt: skip
    B, L = 2, 40
    packing = Packing(seg=_random_segments(B, L), attn_mask=None) if packed else None
    monkeypatch.setattr(compiled, "fast_forms_on", lambda first: True)
    monkeypatch.setattr(mamba2, "fast_forms_on", lambda first: True)

    def run(slab: bool):
        torch.manual_seed(seed)
        mixer = mamba2.Mamba2Mixer(cfg, 0)
        u = torch.randn(B, L, cfg.d_model, requires_grad=True)
        with monkeypatch.context() as m:
            if slab:
                m.setattr(grad_slab, "concatenate", lambda *a: pytest.fail("fell back to the concatenation"))
            else:
                m.setattr(mamba2, "split_with_grad_slab", lambda t, widths: (t.split(widths, -1), _NoSlab()))
            out = mixer(u, packing)
            out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
        return [out.detach(), u.grad] + [p.grad for p in mixer.parameters()]

    for i, (got, want) in enumerate(zip(run(True), run(False), strict=True)):
        assert torch.equal(got, want), f"output/gradient {i}"


@interpreted
def test_interp_conv_zero_input_and_doc_per_token():
    """All-zero input gives silu(bias) everywhere; one document per token leaves only the current tap."""
    from inkling_fp4.model.conv_triton import conv_silu_triton

    B, L, C, k = 1, 9, 5, 4
    w, bias = torch.randn(C, k), torch.randn(C)
    out = conv_silu_triton(torch.zeros(B, L, C), w, bias)
    torch.testing.assert_close(out, F.silu(bias).expand(B, L, C))
    x = torch.randn(B, L, C)
    seg = torch.arange(L)[None]
    torch.testing.assert_close(conv_silu_triton(x, w, bias, seg), F.silu(x * w[:, -1] + bias))


def test_under_triton_interpreter():
    """Run every ``test_interp_*`` in a child process with TRITON_INTERPRET=1."""
    run_interpreted(__file__, "-k", "interp")


def _reference_ce(hidden, weight, targets, mask):
    logits = hidden @ weight.t()
    ce = F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none")
    return (ce * mask.flatten()).sum()


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_cross_entropy_matches_full_logits(chunk):
    _seed()
    B, L, D, V = 2, 19, 16, 50
    hidden = (torch.randn(B, L, D, dtype=torch.float64) * 3).requires_grad_()
    weight = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, L))
    mask = torch.rand(B, L) > 0.3
    mask[0, 0] = False
    targets[0, 0] = -100  # a masked-out position may hold any target
    loss = chunked_cross_entropy(hidden, weight, targets, mask, chunk_tokens=chunk)
    dh, dw = torch.autograd.grad(2.5 * loss, (hidden, weight))
    ref = _reference_ce(hidden, weight, torch.where(mask, targets, 0), mask)
    rdh, rdw = torch.autograd.grad(2.5 * ref, (hidden, weight))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)  # both FP32 cross-entropies
    # FP32 softmax inside both: elementwise, an entry of dW near 0 that sums terms of size ~10 keeps
    # their absolute FP32 error, so the bound is on the whole tensor (over 300 seeds: <= 7.3e-7)
    _close(dh, rdh, 1e-5, "dhidden")
    _close(dw, rdw, 1e-5, "dweight")


def test_chunked_cross_entropy_rejects_bad_arguments():
    h, w = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(h, w, torch.zeros(4, dtype=torch.long), chunk_tokens=0)
    with pytest.raises(ValueError, match="targets"):
        chunked_cross_entropy(h, w, torch.zeros(5, dtype=torch.long))


def test_hybrid_loss_equals_cross_entropy_of_forward():
    _seed()
    model = HybridLM(ModelConfig())
    ids = torch.randint(0, model.cfg.vocab_size, (2, 40))
    targets = torch.randint(0, model.cfg.vocab_size, (2, 40))
    docs = torch.zeros(2, 40, dtype=torch.long)
    docs[:, 25:] = 1
    mask = torch.rand(2, 40) > 0.2
    loss = model.loss(ids, targets, docs, mask, chunk_tokens=33)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = _reference_ce(model(ids, docs), torch.eye(model.cfg.vocab_size), targets, mask)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    # the blocks' GEMMs round their operands to BF16 (QuantLinear), which turns FP32-ulp differences of
    # the loss gradient into an occasional BF16 ulp (2^-8 to 2^-7 of a value): compare gradients by
    # relative norm within one BF16 ulp on every element, 2^-7 (over 500 seeds: at most 2.6e-3)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads, strict=True):
        _close(g, r, 2**-7, name)
    with torch.no_grad():
        torch.testing.assert_close(model.loss(ids, targets, docs, mask), ref, rtol=1e-5, atol=1e-5)


def test_glue_on_cpu_is_the_plain_formula():
    _seed()
    h = torch.randn(3, 5, 8, 4)  # [..., H, P]
    x = torch.randn(3, 5, 8, 4)
    z = torch.randn(3, 5, 32)
    D, w = torch.randn(8), torch.randn(32)
    gated = skip_gated_rms_norm(h, x, D, z, w, 2, 1e-5)
    s = ((h + x * D[:, None]).flatten(-2) * F.silu(z)).unflatten(-1, (2, 16))
    want = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)).flatten(-2) * w
    torch.testing.assert_close(gated, want)
    torch.testing.assert_close(squared_relu(z), F.relu(z) ** 2)
    torch.testing.assert_close(dt_softplus(z[..., :8], D), F.softplus(z[..., :8] + D))
    torch.testing.assert_close(
        rms_norm(z, w, 1e-5), z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    )
    y16 = torch.randn(3, 5, 32).to(torch.bfloat16)
    h, normed = add_rms_norm(z, y16, w, 1e-5, torch.bfloat16)
    assert h.dtype == torch.float32 and normed.dtype == torch.bfloat16
    assert torch.equal(h, z + y16.float())
    assert torch.equal(normed, rms_norm(z + y16.float(), w, 1e-5).to(torch.bfloat16))


# --- GPU: the compiled and Triton forms against the references, BF16 as in training ------------------


def _grads_of(fn, args, dy):
    args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*args)
    out.backward(dy)
    return [out.detach()] + [a.grad for a in args if a.requires_grad]


def _add_rms_norm_stacked(x, y, w, eps):
    """add_rms_norm's two outputs as one tensor, for the gradient check."""
    h, normed = add_rms_norm(x, y, w, eps, torch.bfloat16)
    return torch.stack((h, normed.float()))


@pytest.mark.gpu
@on_gpu
def test_gpu_fast_glue_matches_reference():
    _seed()
    dev, bf = "cuda", torch.bfloat16
    y = torch.randn(4, 256, 8, 64, device=dev, dtype=bf)
    x = torch.randn(4, 256, 8, 64, device=dev, dtype=bf)
    z = torch.randn(4, 256, 512, device=dev, dtype=bf)
    D, w = torch.randn(8, device=dev), torch.randn(512, device=dev)
    r = torch.randn(4, 256, 512, device=dev)
    cases = [
        (skip_gated_rms_norm, (y, x, D, z, w), (2, 1e-5)),
        (gated_rms_norm, (z, z * 0.5, w), (4, 1e-5)),
        (rms_norm, (r, w), (1e-5,)),
        (_add_rms_norm_stacked, (r, z, w), (1e-5,)),
        (squared_relu, (z,), ()),
        (dt_softplus, (z[..., :8], D), ()),
    ]
    for fn, tensors, consts in cases:

        def call(*t, fn=fn, consts=consts):
            return fn(*t, *consts)

        dy = torch.randn_like(call(*tensors))
        fast = _grads_of(call, tensors, dy)
        with reference_glue():
            ref = _grads_of(call, tensors, dy)
        for got, want in zip(fast, ref, strict=True):
            _close(got, want, 1e-2, fn.__name__)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_conv_triton_matches_reference(packed):
    from inkling_fp4.model.conv_triton import conv_silu_triton

    _seed()
    B, L, C = 2, 1000, 640
    base = torch.randn(B, L, C + 64, device="cuda", dtype=torch.bfloat16)
    w, bias = torch.randn(C, 4, device="cuda") * 0.5, torch.randn(C, device="cuda")
    seg = _random_segments(B, L).cuda() if packed else None
    dy = torch.randn(B, L, C, device="cuda", dtype=torch.bfloat16)
    fast = _conv_grads(conv_silu_triton, base, 32, C, w, bias, seg, dy)
    ref = _conv_grads(conv_silu, base, 32, C, w, bias, seg, dy)
    for name, got, want in zip(("out", "dx", "dweight", "dbias"), fast, ref, strict=True):
        _close(got, want, 1e-2, name)


@pytest.mark.gpu
@on_gpu
def test_gpu_chunked_cross_entropy_under_autocast():
    _seed()
    hidden = torch.randn(3000, 256, device="cuda", requires_grad=True)
    weight = (torch.randn(4096, 256, device="cuda") * 0.05).requires_grad_()
    targets = torch.randint(0, 4096, (3000,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=1024)
        ref = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    got = [loss.detach()] + list(torch.autograd.grad(loss, (hidden, weight)))
    want = [ref.detach()] + list(torch.autograd.grad(ref, (hidden, weight)))
    for name, g, r in zip(("loss", "dhidden", "dweight"), got, want, strict=True):
        _close(g, r, 1e-2, name)


@pytest.mark.gpu
@on_gpu
def test_gpu_autocast_feeds_every_gemm_bf16():
    """Under CUDA autocast every QuantLinear gets a BF16 input: the norms write BF16 from the FP32
    residual, and the squared ReLU stays BF16 (autocast would run a ``pow`` in FP32). An FP32 input
    means an extra cast pass forward and backward, and twice the bytes for the quantizers."""
    from inkling_fp4.precision.quant_linear import QuantLinear

    _seed()
    model = HybridLM(ModelConfig(pattern="M-*-", d_model=128, ffn_dim=256)).cuda()
    seen = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            module.register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].dtype))
    ids = torch.randint(0, model.cfg.vocab_size, (2, 128), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(ids, targets=ids).backward()
    assert len(seen) == sum(isinstance(m, QuantLinear) for m in model.modules())
    assert {n: d for n, d in seen.items() if d != torch.bfloat16} == {}
