"""The Mamba-2 mixer against an independent implementation, and its pieces (conv, gated norm, init)."""

import math

import pytest
import torch
import torch.nn.functional as F

from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.conv import causal_conv, conv_silu, fused_conv_silu
from inkling_fp4.model.mamba2 import Mamba2Mixer
from inkling_fp4.model.norm import GatedRMSNorm, RMSNorm
from inkling_fp4.model.packing import Packing
from inkling_fp4.model.ssd import ssd_recurrent
from model_helpers import exact_model, random_doc_ids

TOL = dict(atol=1e-10, rtol=1e-10)


def conv1d_reference(xBC, weight, bias):
    """PyTorch's depthwise Conv1d, causal by left padding. xBC: [B, L, C]; weight: [C, k]."""
    k = weight.shape[1]
    out = F.conv1d(F.pad(xBC.transpose(1, 2), (k - 1, 0)), weight[:, None, :], bias, groups=xBC.shape[-1])
    return out.transpose(1, 2)


def test_conv_equals_conv1d_and_resets_at_boundaries():
    x = torch.randn(2, 23, 6, dtype=torch.float64)
    w, b = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(causal_conv(x, w, b), conv1d_reference(x, w, b), **TOL)
    docs = random_doc_ids(2, 23, 4)
    seg = Packing.from_doc_ids(docs).seg
    out = causal_conv(x, w, b, seg=seg)
    for row in range(2):
        for s in seg[row].unique().tolist():
            idx = (seg[row] == s).nonzero()[:, 0]
            sep = conv1d_reference(x[row : row + 1, idx], w, b)
            torch.testing.assert_close(out[row : row + 1, idx], sep, **TOL)
    # A carried-in window equals running the conv over the concatenation.
    prev = torch.randn(2, 6, 3, dtype=torch.float64)
    whole = conv1d_reference(torch.cat([prev.transpose(1, 2), x], 1), w, b)[:, 3:]
    torch.testing.assert_close(causal_conv(x, w, b, prev=prev), whole, **TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.compile with Triton)")
def test_fused_conv_equals_the_reference_on_gpu():
    """The fused conv is conv_silu through torch.compile: same values and gradients in BF16."""
    seg = Packing.from_doc_ids(random_doc_ids(2, 300, 5)).seg.cuda()
    x = torch.randn(2, 300, 96, dtype=torch.bfloat16, device="cuda")
    w, b = torch.randn(96, 4, device="cuda"), torch.randn(96, device="cuda")
    results = []
    for fn in (conv_silu, fused_conv_silu()):
        args = [t.clone().requires_grad_() for t in (x, w, b)]
        out = fn(*args, seg)
        out.float().square().sum().backward()
        results.append([out.float()] + [a.grad.float() for a in args])
    for eager, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, eager, atol=2e-2, rtol=2e-2)


def test_conv_for_each_impl_kernel_width_and_device(monkeypatch):
    """model.conv_impl=auto: the Triton conv on CUDA up to kernel width 4, the compiled one past it,
    the reference on CPU; every choice returns the output's column blocks."""
    from types import SimpleNamespace

    from inkling_fp4.model import mamba2

    compiled_calls = []

    def compiled(xBC, weight, bias, seg):
        compiled_calls.append(weight.shape[1])
        return conv_silu(xBC, weight, bias, seg)

    monkeypatch.setattr(mamba2, "fused_conv_silu", lambda: compiled)
    cuda = SimpleNamespace(is_cuda=True)  # only the device is looked at
    x, w, b = torch.randn(2, 9, 10), torch.randn(10, 5), torch.randn(10)
    cases = [("auto", cuda, 5, True), ("compiled", x, 4, True), ("auto", x, 4, False)]
    cases.append(("reference", cuda, 4, False))
    for impl, like, k, is_compiled in cases:
        compiled_calls.clear()
        conv = mamba2.conv_silu_for(impl, like, k)
        blocks = conv(x, w[:, :k], b, None, [4, 3, 3], None)
        want = conv_silu(x, w[:, :k], b)
        assert torch.equal(torch.cat(blocks, -1), want) and [t.shape[-1] for t in blocks] == [4, 3, 3]
        assert compiled_calls == ([k] if is_compiled else []), (impl, k)
    pytest.importorskip("triton")
    from inkling_fp4.model.conv_triton import conv_silu_triton

    assert mamba2.conv_silu_for("auto", cuda, 4) is conv_silu_triton
    assert mamba2.conv_silu_for("triton", x, 4) is conv_silu_triton


def test_gated_norm_normalises_each_group():
    norm = GatedRMSNorm(12, n_groups=3, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(12))
    y, z = torch.randn(2, 5, 12, dtype=torch.float64), torch.randn(2, 5, 12, dtype=torch.float64)
    out = norm(y, z)
    h = y * z * torch.sigmoid(z)
    for grp in range(3):
        sl = slice(4 * grp, 4 * grp + 4)
        ref = h[..., sl] / torch.sqrt(h[..., sl].pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight[sl]
        torch.testing.assert_close(out[..., sl], ref, **TOL)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert RMSNorm(8, 1e-5)(x).dtype == torch.bfloat16


def test_norms_write_the_autocast_dtype_from_the_fp32_residual():
    """Under autocast the block norm (FP32 residual in) and the mixer's output norm (FP32 skip sum)
    write BF16: the normalised FP32 result rounded once; without autocast, FP32 as before."""
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16) + 0.5)
    x = torch.randn(4, 16) * torch.logspace(-3, 3, 16)
    plain = norm(x)
    assert plain.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        narrowed = norm(x)
    assert narrowed.dtype == torch.bfloat16
    assert torch.equal(narrowed, plain.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a BF16 input is not widened
        assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16
    cfg = ModelConfig()
    mixer = Mamba2Mixer(cfg, 0)
    u = torch.randn(2, 8, cfg.d_model)
    seen = []
    mixer.out_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].dtype))
    mixer(u)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixer(u)
    assert seen == [torch.float32, torch.bfloat16]


def mixer_reference(m: Mamba2Mixer, u: torch.Tensor) -> torch.Tensor:
    """The mixer written out from the Mamba-2 equations, with F.conv1d and the token recurrence."""
    E, G, N, H, P = m.d_inner, m.G, m.N, m.H, m.P
    zxbcdt = u @ m.in_proj.weight.T
    z = zxbcdt[..., :E]
    xBC = zxbcdt[..., E : 2 * E + 2 * G * N]
    dt_raw = zxbcdt[..., 2 * E + 2 * G * N :]
    xBC = F.silu(conv1d_reference(xBC, m.conv_weight, m.conv_bias))
    x, B, C = xBC[..., :E], xBC[..., E : E + G * N], xBC[..., E + G * N :]
    dt = F.softplus(dt_raw + m.dt_bias)
    Bsz, L = u.shape[:2]
    x = x.reshape(Bsz, L, H, P)
    y, _ = ssd_recurrent(x, dt, -torch.exp(m.A_log), B.reshape(Bsz, L, G, N), C.reshape(Bsz, L, G, N))
    y = (y + m.D[:, None] * x).reshape(Bsz, L, E)
    h = (y * F.silu(z)).reshape(Bsz, L, G, E // G)
    h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + m.norm.eps)
    return (h.reshape(Bsz, L, E) * m.norm.weight) @ m.out_proj.weight.T


@pytest.mark.parametrize("n_groups", [1, 2, 4])
def test_mixer_equals_the_equations(n_groups):
    cfg = ModelConfig(pattern="M", n_groups=n_groups, chunk_size=8)
    m = exact_model(cfg).layers[0].mixer
    u = torch.randn(2, 21, cfg.d_model, dtype=torch.float64)
    torch.testing.assert_close(m(u), mixer_reference(m, u), **TOL)


def test_packed_mixer_equals_separate_documents():
    cfg = ModelConfig(pattern="M", chunk_size=8)
    m = exact_model(cfg).layers[0].mixer
    u = torch.randn(1, 30, cfg.d_model, dtype=torch.float64)
    docs = torch.zeros(1, 30, dtype=torch.int32)
    docs[:, 9:] = 1
    docs[:, 11:] = 2
    out = m(u, Packing.from_doc_ids(docs))
    for s, e in ((0, 9), (9, 11), (11, 30)):
        torch.testing.assert_close(out[:, s:e], m(u[:, s:e]), **TOL)


def test_ssm_parameter_init_and_flags():
    cfg = ModelConfig(pattern="M", mamba_heads=64, mamba_head_dim=2)
    m = Mamba2Mixer(cfg, layer_idx=0)
    for p in (m.A_log, m.dt_bias, m.D):
        assert p.dtype == torch.float32 and p._no_weight_decay is True
    A = -torch.exp(m.A_log)
    assert (A <= -cfg.a_init_range[0]).all() and (A >= -cfg.a_init_range[1]).all()
    dt = F.softplus(m.dt_bias)
    assert (dt >= cfg.dt_min * (1 - 1e-5)).all() and (dt <= cfg.dt_max * (1 + 1e-5)).all()
    # log-uniform: the mean of log dt sits mid-way between the log bounds (64 draws, generous band)
    mid = (math.log(cfg.dt_min) + math.log(cfg.dt_max)) / 2
    assert abs(dt.log().mean().item() - mid) < 0.6
    assert torch.equal(m.D, torch.ones_like(m.D))
    bound = 1 / math.sqrt(cfg.conv_kernel)
    assert m.conv_weight.abs().max() <= bound and m.conv_bias.abs().max() <= bound
    assert m.in_proj.weight.shape == (
        2 * cfg.d_inner + 2 * cfg.n_groups * cfg.d_state + cfg.mamba_heads,
        cfg.d_model,
    )
