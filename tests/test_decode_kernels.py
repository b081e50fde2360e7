"""The decode kernels against their torch twins, and the twins against the training math.

- CPU, plain torch: the Mamba-2 twin (mamba_decode_ref) equals one step of the training path's pieces
  (conv + SiLU, ssd_step, skip_gated_rms_norm) in FP64, and the GQA twin (gqa_decode_ref) equals the
  training attention's repeated-heads SDPA.
- Triton (CUDA, or the interpreter on CPU through the parent test): each kernel against its twin in
  FP32 and BF16, on fresh random inputs (odd widths, every conv width the kernel takes, one and several
  heads per group / kv head, ragged lengths), the state updates included.
- GPU: the model's decode with the kernels against the twins (reference_glue).

The seed of each input set is in every failure message.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.nn.functional as F

from inkling_fp4.model.attention_decode import gqa_decode_ref
from inkling_fp4.model.mamba2_decode import mamba_decode_ref
from inkling_fp4.model.norm import skip_gated_rms_norm
from inkling_fp4.model.ssd import ssd_step
from interpreter import interpreted_parent, kernel_test


def _msg(context: str):
    """assert_close's message with ``context`` (the seed) appended."""
    return lambda m: f"{m}\n{context}"


def fresh_seed() -> int:
    seed = random.randrange(2**31)
    print(f"seed = {seed}")
    return seed


# (H, P, G, N, k): tiny's odd state (12) with three heads a group (the norm's masked head and channel
# tiles), P below a warp, one group, every conv width the kernel takes, a full [64, 128] state tile
MAMBA_SHAPES = [(6, 8, 2, 12, 4), (4, 16, 1, 16, 3), (6, 8, 3, 8, 2), (4, 64, 2, 128, 4)]
# (H, K, Dh): R = 2, 3 (not a power of two), 1
ATTN_SHAPES = [(4, 2, 16), (12, 4, 64), (2, 2, 8)]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def mamba_inputs(seed, Bsz, H, P, G, N, k, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    E, C = H * P, H * P + 2 * G * N

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    wide = torch.float64 if dtype == torch.float64 else torch.float32  # states and parameters
    return dict(
        zxbcdt=randn(Bsz, 2 * E + 2 * G * N + H).to(device, dtype),
        conv_state=randn(Bsz, C, k - 1).to(device, dtype),
        ssm_state=randn(Bsz, H, P, N, scale=0.5).to(device, wide),
        conv_weight=randn(C, k, scale=0.5).to(device, wide),
        conv_bias=randn(C, scale=0.5).to(device, wide),
        dt_bias=(torch.rand(H, generator=gen) * 6 - 5).to(device),  # softplus over (-5, 1) and past 20 below
        A_log=(torch.rand(H, generator=gen) * 2.7).to(device),
        D=randn(H).to(device),
        norm_weight=(1 + randn(E, scale=0.1)).to(device),
    )


def run_mamba(fn, inp, G, out_dtype, eps=1e-5, dt_min_clamp=0.0):
    state = {k: v.clone() for k, v in inp.items()}
    h = fn(*state.values(), G, eps, out_dtype, dt_min_clamp=dt_min_clamp)
    return h, state["conv_state"], state["ssm_state"]


def test_mamba_twin_is_one_step_of_the_training_math():
    seed = fresh_seed()
    H, P, G, N, k = 16, 8, 2, 12, 4
    inp = mamba_inputs(seed, 3, H, P, G, N, k, torch.float64)
    inp = {n: t.double() for n, t in inp.items()}
    inp["zxbcdt"][0, 2 * H * P + 2 * G * N] = 30.0  # a dt above softplus's threshold
    h, conv, ssm = run_mamba(mamba_decode_ref, inp, G, torch.float64)
    E, C = H * P, H * P + 2 * G * N
    z, xBC_in, dt_raw = inp["zxbcdt"].split([E, C, H], -1)
    window = torch.cat([inp["conv_state"], xBC_in[..., None]], -1)  # [B, C, k]
    xBC = F.silu(F.conv1d(window, inp["conv_weight"][:, None], inp["conv_bias"], groups=C))[..., 0]
    x, Bm, Cm = xBC.split([E, G * N, G * N], -1)
    dt = F.softplus(dt_raw + inp["dt_bias"])
    y, new = ssd_step(inp["ssm_state"], x.unflatten(-1, (H, P)), dt, -torch.exp(inp["A_log"]),
                      Bm.unflatten(-1, (G, N)), Cm.unflatten(-1, (G, N)))  # fmt: skip
    ref = skip_gated_rms_norm(y, x.unflatten(-1, (H, P)), inp["D"], z, inp["norm_weight"], G, 1e-5)
    msg = f"seed {seed}"
    torch.testing.assert_close(h, ref, atol=1e-12, rtol=1e-12, msg=msg)
    torch.testing.assert_close(ssm, new, atol=1e-12, rtol=1e-12, msg=msg)
    torch.testing.assert_close(conv, window[..., 1:], atol=0, rtol=0, msg=msg)


def attn_inputs(seed, Bsz, H, K, Dh, T, dtype, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T, (Bsz,), generator=gen)
    lengths[0] = 0  # a first token: it attends to itself alone
    lengths[-1] = T - 1  # a full cache
    cache = [torch.randn(Bsz, T, K, Dh, generator=gen) for _ in range(2)]
    return dict(
        q=torch.randn(Bsz, H, Dh, generator=gen).to(device, dtype),
        k_new=torch.randn(Bsz, K, Dh, generator=gen).to(device, dtype),
        v_new=torch.randn(Bsz, K, Dh, generator=gen).to(device, dtype),
        k_cache=cache[0].to(device, dtype),
        v_cache=cache[1].to(device, dtype),
        lengths=lengths.to(device),
    )


def run_attn(fn, inp, **kw):
    state = {k: v.clone() for k, v in inp.items()}
    y = fn(*state.values(), **kw)
    return y, state["k_cache"], state["v_cache"]


@pytest.mark.parametrize("H,K,Dh", ATTN_SHAPES)
def test_gqa_twin_equals_repeated_heads_sdpa(H, K, Dh):
    seed = fresh_seed()
    Bsz, T = 5, 19
    inp = attn_inputs(seed, Bsz, H, K, Dh, T, torch.float64)
    y, kc, vc = run_attn(gqa_decode_ref, inp)
    rows = torch.arange(Bsz)
    k_full, v_full = inp["k_cache"].clone(), inp["v_cache"].clone()
    k_full[rows, inp["lengths"]], v_full[rows, inp["lengths"]] = inp["k_new"], inp["v_new"]
    torch.testing.assert_close(kc, k_full, atol=0, rtol=0)
    torch.testing.assert_close(vc, v_full, atol=0, rtol=0)
    keys = k_full.transpose(1, 2).repeat_interleave(H // K, dim=1)  # [B, H, T, Dh]: the training path
    values = v_full.transpose(1, 2).repeat_interleave(H // K, dim=1)
    visible = torch.arange(T)[None, :] <= inp["lengths"][:, None]
    ref = F.scaled_dot_product_attention(inp["q"][:, :, None], keys, values, attn_mask=visible[:, None, None])
    torch.testing.assert_close(y, ref[:, :, 0], atol=1e-12, rtol=1e-12, msg=_msg(f"seed {seed}"))
    span = int(inp["lengths"].max()) + 1
    y_span, _, _ = run_attn(gqa_decode_ref, inp, span=span)
    torch.testing.assert_close(y_span, y, atol=1e-12, rtol=1e-12)


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,P,G,N,k", MAMBA_SHAPES)
def test_mamba_kernel_matches_twin(H, P, G, N, k, dtype):
    from inkling_fp4.model.mamba2_decode import mamba_decode

    seed = fresh_seed()
    Bsz = 2  # (each program is one (sequence, head): a second sequence covers the batch strides)
    inp = mamba_inputs(seed, Bsz, H, P, G, N, k, dtype, _device())
    inp["zxbcdt"][1, 2 * H * P + 2 * G * N] = 25.0  # softplus's linear branch
    # NOTE with BF16 inputs the conv's x, B, C are rounded to BF16 in both: where the two FP32 SiLUs
    # differ in the last bit at a rounding midpoint, one BF16 ulp apart, so BF16 tolerances throughout
    tol = TOL[dtype]
    for out_dtype in dict.fromkeys((dtype, torch.float32)):  # FP32 inputs: FP32 out once
        h_ref, conv_ref, ssm_ref = run_mamba(mamba_decode_ref, inp, G, out_dtype)
        h, conv, ssm = run_mamba(mamba_decode, inp, G, out_dtype)
        msg = _msg(f"seed {seed}, {dtype}, out {out_dtype}")
        torch.testing.assert_close(h, h_ref, **tol, msg=msg)
        torch.testing.assert_close(conv, conv_ref, atol=0, rtol=0, msg=msg)  # a shift: exact
        torch.testing.assert_close(ssm, ssm_ref, **tol, msg=msg)
    # a lower clamp of dt (transformers' time_step_min) that binds for some heads
    h_ref, _, ssm_ref = run_mamba(mamba_decode_ref, inp, G, torch.float32, dt_min_clamp=0.05)
    h, _, ssm = run_mamba(mamba_decode, inp, G, torch.float32, dt_min_clamp=0.05)
    torch.testing.assert_close(h, h_ref, **tol, msg=_msg(f"seed {seed}, dt clamp"))
    torch.testing.assert_close(ssm, ssm_ref, **tol, msg=_msg(f"seed {seed}, dt clamp"))
    # several steps in a row: the shifted window and the state feed the next step, and the kernel's
    # count of finished heads carries over (it is never cleared)
    state = {n: t.clone() for n, t in inp.items()}
    twin = {n: t.clone() for n, t in inp.items()}
    done = torch.zeros(Bsz, G + 1, dtype=torch.int32, device=_device())
    gen = torch.Generator().manual_seed(seed + 1)
    for _ in range(3):
        row = torch.randn(state["zxbcdt"].shape, generator=gen).to(state["zxbcdt"])
        state["zxbcdt"], twin["zxbcdt"] = row, row.clone()
        h = mamba_decode(*state.values(), G, 1e-5, torch.float32, done=done)
        h_ref = mamba_decode_ref(*twin.values(), G, 1e-5, torch.float32)
    torch.testing.assert_close(h, h_ref, **tol, msg=_msg(f"seed {seed}, three steps"))
    torch.testing.assert_close(state["ssm_state"], twin["ssm_state"], **tol, msg=_msg(f"seed {seed}"))
    torch.testing.assert_close(state["conv_state"], twin["conv_state"], atol=0, rtol=0)
    assert (done[:, :G] == 3 * (H // G)).all() and (done[:, G] == 0).all()  # no NVFP4 rows: no row count


@kernel_test
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,K,Dh", ATTN_SHAPES)
def test_gqa_kernel_matches_twin(H, K, Dh, dtype):
    from inkling_fp4.model.decode_kernels import gqa_decode_triton

    seed = fresh_seed()
    Bsz, T = 4, 150  # more than two blocks of positions
    inp = attn_inputs(seed, Bsz, H, K, Dh, T, dtype, _device())
    y_ref, kc_ref, vc_ref = run_attn(gqa_decode_ref, inp)
    y, kc, vc = run_attn(gqa_decode_triton, inp)
    msg = _msg(f"seed {seed}, {dtype}")
    torch.testing.assert_close(kc, kc_ref, atol=0, rtol=0, msg=msg)
    torch.testing.assert_close(vc, vc_ref, atol=0, rtol=0, msg=msg)
    tol = TOL[dtype] if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y, y_ref, **tol, msg=msg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_decode_with_kernels_matches_twins():
    from inkling_fp4.model.compiled import reference_glue
    from inkling_fp4.model.config import ModelConfig
    from inkling_fp4.model.hybrid import HybridLM

    torch.manual_seed(fresh_seed())
    cfg = ModelConfig(preset="tiny")
    model = HybridLM(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (4, 24), device="cuda")
    lengths = torch.tensor([16, 5, 1, 9], device="cuda")
    runs = []
    for ref in (False, True):
        cache = model.allocate_cache(4, 40)
        ctx = reference_glue() if ref else contextlib.nullcontext()
        with torch.autocast("cuda", dtype=torch.bfloat16), ctx:
            out = [model.prefill(ids[:, :16], lengths, cache).float()]
            for s in range(8):
                out.append(model.decode_step(ids[:, 16 + s], cache).float())
        runs.append(torch.stack(out))
    torch.testing.assert_close(runs[0], runs[1], atol=3e-2, rtol=3e-2)


test_kernels_under_triton_interpreter = interpreted_parent(__file__)
