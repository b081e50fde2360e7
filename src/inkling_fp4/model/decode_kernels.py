"""Triton kernels of the decoding step: the fused Mamba-2 step and GQA decode attention.

The math and torch twins are in ``model/mamba2_decode.py`` and ``model/attention_decode.py``. Both
kernels read every length from the device, so the step can be captured as a CUDA graph.

Shape letters: B batch, E d_inner, C conv channels, H heads, P head dim, G groups, N state, k conv
width; attention: H query heads, K kv heads, R = H / K, Dh head dim, T cache length.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.model.glue_kernels.common import (
    TL_DTYPES,
    exp,
    load_f32,
    log1p,
    on_device,
    round_to,
    rsqrt,
    to_f32,
)
from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import (
    load_row_halves,
    quantize_rows_in_registers,
    quantize_whole_rows,
    row_blocks,
    row_operand,
    rows_fit_in_registers,
)

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus's default: above it softplus(v) = v
KP = tl.constexpr(4)  # conv taps held per channel (the kernel takes conv widths k <= 4)
MAMBA_WARPS = 4  # a [64, 128] FP32 state tile is 64 registers a thread at 4 warps
NV_BLOCK_K = tl.constexpr(256)  # columns per pass of the output row's NVFP4 quantization
ATTN_BLOCK_T = 64  # cached positions per iteration of the attention loop
ATTN_WARPS = 4


@triton.jit
def _conv_silu(row_ptr, conv_ptr, w_ptr, b_ptr, ch, cmask, E: tl.constexpr, K: tl.constexpr,
               SHIFT: tl.constexpr):  # fmt: skip
    """Channels ``ch`` [c] of one sequence: the conv + SiLU of (window, this input) in FP32, rounded to
    the input's dtype; with SHIFT the shifted window is stored back. conv_ptr: the sequence's [C, K-1]."""
    j = tl.arange(0, KP)
    old = load_f32(conv_ptr + ch[:, None] * (K - 1) + j[None, :], cmask[:, None] & (j[None, :] < K - 1))
    new = to_f32(round_to(load_f32(row_ptr + E + ch, cmask), conv_ptr.dtype.element_ty))  # as the window
    w = load_f32(w_ptr + ch[:, None] * K + j[None, :], cmask[:, None] & (j[None, :] < K))
    win = tl.where(j[None, :] == K - 1, new[:, None], old)  # [c, KP]: oldest first, this input at K-1
    acc = tl.sum(win * w, axis=1) + load_f32(b_ptr + ch, cmask)
    if SHIFT:
        _shift_window(row_ptr, conv_ptr, ch, cmask, E, K)
    s = acc / (1.0 + exp(-acc))
    return to_f32(round_to(s, row_ptr.dtype.element_ty))


@triton.jit
def _shift_window(row_ptr, conv_ptr, ch, cmask, E: tl.constexpr, K: tl.constexpr):
    """conv window of channels ``ch`` <- (window[1:], this input)."""
    j = tl.arange(0, KP)
    new = load_f32(row_ptr + E + ch, cmask)
    nxt = load_f32(
        conv_ptr + ch[:, None] * (K - 1) + j[None, :] + 1, cmask[:, None] & (j[None, :] + 1 < K - 1)
    )
    nxt = tl.where(j[None, :] == K - 2, new[:, None], nxt)
    # NOTE every thread must have read the window before any thread shifts it: a channel's taps may
    # sit in different threads (and a small tile is replicated across threads)
    tl.debug_barrier()
    mask = cmask[:, None] & (j[None, :] < K - 1)
    tl.store(
        conv_ptr + ch[:, None] * (K - 1) + j[None, :], round_to(nxt, conv_ptr.dtype.element_ty), mask=mask
    )


@triton.jit
def _mamba_decode(row0_ptr, s_row, conv0_ptr, w_ptr, b_ptr, ssm0_ptr, dtb_ptr, alog_ptr, d_ptr, nw_ptr,
                  gated0_ptr, sumsq0_ptr, count0_ptr, out0_ptr, s_out, eps, dt_min,
                  w_decode_ptr, values_ptr, out_scale_ptr, max_ptr,
                  E: tl.constexpr, C: tl.constexpr, H: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                  G: tl.constexpr, K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_GW: tl.constexpr, BLOCK_HG: tl.constexpr, NVFP4_ROWS: tl.constexpr,
                  NV_IN_REGISTERS: tl.constexpr, NV_G: tl.constexpr):  # fmt: skip
    """Program (b, h): the conv of head h's x and of its group's B and C, dt, the state update and y with
    the D skip and gate, into an FP32 scratch row with its sum of squares. The group's last program (an
    atomic count per (b, g), modulo H/G) applies the RMS norm and shifts the group's B and C windows.
    ``NVFP4_ROWS``: the row's last group (a count per b in column G, modulo G) also writes the NVFP4
    block values and scale of the whole output row: with ``NV_IN_REGISTERS`` read once as the halves of
    its NV_G 16-value blocks (``nvfp4_decode_gemm.quantize_rows_in_registers``), else in two loops
    (``quantize_whole_rows``); the same bits."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HG: tl.constexpr = H // G
    g = h // HG
    row_ptr = row0_ptr + b * s_row
    conv_ptr = conv0_ptr + b * (C * (K - 1))
    n = tl.arange(0, BLOCK_N)
    nmask = n < N
    Bv = _conv_silu(row_ptr, conv_ptr, w_ptr, b_ptr, E + g * N + n, nmask, E, K, False)  # [N]
    Cv = _conv_silu(row_ptr, conv_ptr, w_ptr, b_ptr, E + G * N + g * N + n, nmask, E, K, False)
    p = tl.arange(0, BLOCK_P)
    pmask = p < P
    x = _conv_silu(row_ptr, conv_ptr, w_ptr, b_ptr, h * P + p, pmask, E, K, True)  # [P]: this head's
    v = to_f32(tl.load(row_ptr + E + C + h)) + tl.load(dtb_ptr + h).to(tl.float32)
    dt = tl.where(v > SOFTPLUS_THRESHOLD, v, log1p(exp(v)))
    dt = tl.where(dt < dt_min, dt_min, dt)  # the model's lower clamp (0: none); a NaN stays NaN
    decay = exp(dt * -exp(tl.load(alog_ptr + h).to(tl.float32)))
    smask = pmask[:, None] & nmask[None, :]
    s_ptrs = ssm0_ptr + ((b * H + h) * P + p[:, None]) * N + n[None, :]
    S = tl.load(s_ptrs, mask=smask, other=0.0)  # [P, N] FP32
    S = decay * S + (dt * x)[:, None] * Bv[None, :]
    tl.store(s_ptrs, S, mask=smask)
    y = tl.sum(S * Cv[None, :], axis=1) + x * tl.load(d_ptr + h).to(tl.float32)  # [P]
    z = load_f32(row_ptr + h * P + p, pmask)
    gated = tl.where(pmask, y * (z / (1.0 + exp(-z))), 0.0)
    tl.store(gated0_ptr + b * E + h * P + p, gated, mask=pmask)
    tl.store(sumsq0_ptr + b * H + h, tl.sum(gated * gated, axis=0))
    # NOTE the barrier orders every thread's stores (and reads of the B, C windows) before the count's
    # release; the last program's acquire then sees them all
    tl.debug_barrier()
    done = tl.atomic_add(count0_ptr + b * (G + 1) + g, 1, sem="acq_rel")  # never reset: modulo HG
    if done % HG == HG - 1:
        hs = tl.arange(0, BLOCK_HG)
        sumsq = tl.sum(
            tl.load(sumsq0_ptr + b * H + g * HG + hs, mask=hs < HG, other=0.0, cache_modifier=".cg"), axis=0
        )
        GW: tl.constexpr = HG * P
        c = tl.arange(0, BLOCK_GW)
        cmask = c < GW
        row = tl.load(gated0_ptr + b * E + g * GW + c, mask=cmask, other=0.0, cache_modifier=".cg")
        out = row * rsqrt(sumsq / GW + eps) * load_f32(nw_ptr + g * GW + c, cmask)
        tl.store(out0_ptr + b * s_out + g * GW + c, round_to(out, out0_ptr.dtype.element_ty), mask=cmask)
        _shift_window(row_ptr, conv_ptr, E + g * N + n, nmask, E, K)
        _shift_window(row_ptr, conv_ptr, E + G * N + g * N + n, nmask, E, K)
        if NVFP4_ROWS:
            # NOTE as above: the group's output stores before the row count's release
            tl.debug_barrier()
            groups = tl.atomic_add(count0_ptr + b * (G + 1) + G, 1, sem="acq_rel")
            if groups % G == G - 1:
                rows = b + tl.arange(0, 1)  # [1]: this row, whole
                if NV_IN_REGISTERS:  # the other groups' parts are in memory: one load of the row
                    lo, hi = load_row_halves(out0_ptr, s_out, rows, b + 1, E, 1, NV_G)  # [1, NV_G, 8] each
                    quantize_rows_in_registers(lo, hi, rows, b + 1, E, w_decode_ptr, values_ptr,
                                               out_scale_ptr, max_ptr, 1, NV_G)  # fmt: skip
                else:
                    quantize_whole_rows(out0_ptr, s_out, rows, b + 1, E, w_decode_ptr, values_ptr,
                                        out_scale_ptr, max_ptr, 1, NV_BLOCK_K)  # fmt: skip


def mamba_decode_triton(
    zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, n_groups, eps,
    out_dtype, dt_min_clamp=0.0, done=None, w_decode=None,
):  # fmt: skip
    """See :func:`inkling_fp4.model.mamba2_decode.mamba_decode`: ``out``, or with ``w_decode`` (BF16
    output) (out, its NVFP4 row operand: values, out_scale, largest row amax)."""
    Bsz, H, P, N = ssm_state.shape
    C, K = conv_state.shape[1], conv_state.shape[2] + 1
    E = H * P
    if K > 4 or K < 2:
        raise ValueError(f"the fused Mamba-2 decode step takes conv widths 2..4, not {K}")
    if ssm_state.dtype != torch.float32 or not (ssm_state.is_contiguous() and conv_state.is_contiguous()):
        raise ValueError("the fused Mamba-2 decode step needs contiguous states and an FP32 SSM state")
    for t in (zxbcdt, conv_state):
        if t.dtype not in TL_DTYPES:
            raise ValueError(
                f"the fused Mamba-2 decode step takes float32, bfloat16 or float16, not {t.dtype}"
            )
    if zxbcdt.stride(-1) != 1:
        zxbcdt = zxbcdt.contiguous()
    dev = zxbcdt.device
    out = torch.empty(Bsz, E, device=dev, dtype=out_dtype)
    gated = torch.empty(Bsz, E, device=dev, dtype=torch.float32)  # y * silu(z), before the norm
    sumsq = torch.empty(Bsz, H, device=dev, dtype=torch.float32)
    if done is None:
        done = torch.zeros(Bsz, n_groups + 1, device=dev, dtype=torch.int32)  # heads of (b, g), groups of b
    elif done.shape != (Bsz, n_groups + 1) or done.dtype != torch.int32 or not done.is_contiguous():
        raise ValueError(f"mamba_decode: done must be a contiguous [{Bsz}, {n_groups + 1}] int32 tensor")
    nvfp4_rows = w_decode is not None
    if nvfp4_rows and (out_dtype != torch.bfloat16 or E % 16):
        raise ValueError(f"mamba_decode: NVFP4 rows need a BF16 output of a width divisible by 16, not {E}")
    values, out_scale, largest = row_operand(Bsz, E, dev) if nvfp4_rows else (out, out, out)
    in_registers = nvfp4_rows and rows_fit_in_registers(E)
    hg = H // n_groups
    with on_device(zxbcdt):
        _mamba_decode[(Bsz, H)](
            zxbcdt, zxbcdt.stride(0), conv_state, conv_weight, conv_bias, ssm_state, dt_bias, A_log, D,
            norm_weight, gated, sumsq, done, out, out.stride(0), eps, float(dt_min_clamp),
            w_decode if nvfp4_rows else out, values, out_scale, largest,
            E=E, C=C, H=H, P=P, N=N, G=n_groups, K=K, BLOCK_P=triton.next_power_of_2(P),
            BLOCK_N=triton.next_power_of_2(N), BLOCK_GW=triton.next_power_of_2(hg * P),
            BLOCK_HG=triton.next_power_of_2(hg), NVFP4_ROWS=nvfp4_rows, NV_IN_REGISTERS=in_registers,
            NV_G=row_blocks(E) if in_registers else 1, num_warps=MAMBA_WARPS,
        )  # fmt: skip
    return (out, values, out_scale, largest) if nvfp4_rows else out


@triton.jit
def _gqa_decode(q0_ptr, s_qb, kn0_ptr, vn0_ptr, s_nb, kc0_ptr, vc0_ptr, s_cb, s_ct, len_ptr, out0_ptr, s_ob,
                scale, R: tl.constexpr, DH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_T: tl.constexpr):  # fmt: skip
    """Program (b, kv head kh): write this token's k, v at len[b], then attend the R query heads sharing kh
    over positions 0 .. len[b] with an online softmax. FP32 dots: the step is bound by reading the cache."""
    b = tl.program_id(0).to(tl.int64)
    kh = tl.program_id(1)
    L = tl.load(len_ptr + b)  # the new token's position
    d = tl.arange(0, BLOCK_D)
    dmask = d < DH
    kc_ptr = kc0_ptr + b * s_cb + kh * DH
    vc_ptr = vc0_ptr + b * s_cb + kh * DH
    kn = tl.load(kn0_ptr + b * s_nb + kh * DH + d, mask=dmask)
    vn = tl.load(vn0_ptr + b * s_nb + kh * DH + d, mask=dmask)
    tl.store(kc_ptr + L * s_ct + d, round_to(to_f32(kn), kc0_ptr.dtype.element_ty), mask=dmask)
    tl.store(vc_ptr + L * s_ct + d, round_to(to_f32(vn), vc0_ptr.dtype.element_ty), mask=dmask)
    tl.debug_barrier()  # NOTE the loop below reads position L back, in other threads
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    q_ptrs = q0_ptr + b * s_qb + (kh * R + r[:, None]) * DH + d[None, :]
    q = load_f32(q_ptrs, rmask[:, None] & dmask[None, :])  # [R, Dh], rows padded to a dot's 16
    m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    t0 = tl.arange(0, BLOCK_T)
    for start in range(0, L + 1, BLOCK_T):
        t = start + t0
        tmask = t <= L
        kv_mask = tmask[:, None] & dmask[None, :]
        k = load_f32(kc_ptr + t[:, None] * s_ct + d[None, :], kv_mask)  # [T, Dh]
        v = load_f32(vc_ptr + t[:, None] * s_ct + d[None, :], kv_mask)
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [R, T]
        scores = tl.where(tmask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = exp(m - m_new)
        pr = exp(scores - m_new[:, None])  # [R, T]
        s = s * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr, v, input_precision="ieee")
        m = m_new
    y = acc / s[:, None]
    o_ptrs = out0_ptr + b * s_ob + (kh * R + r[:, None]) * DH + d[None, :]
    tl.store(o_ptrs, round_to(y, out0_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def gqa_decode_triton(q, k_new, v_new, k_cache, v_cache, lengths) -> torch.Tensor:
    """See :func:`inkling_fp4.model.attention_decode.gqa_decode`."""
    Bsz, H, DH = q.shape
    K = k_new.shape[1]
    for t in (q, k_new, v_new):
        if t.stride(-1) != 1 or t.stride(-2) != DH:
            raise ValueError("gqa_decode: q, k, v need contiguous heads ([B, heads, Dh], row stride free)")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_new.stride(0) != v_new.stride(0):
        raise ValueError("gqa_decode: the KV cache must be contiguous [B, T, K, Dh]")
    out = torch.empty(Bsz, H, DH, device=q.device, dtype=q.dtype)
    R = H // K
    if k_cache.dtype not in TL_DTYPES:
        raise ValueError(f"gqa_decode takes a float32, bfloat16 or float16 cache, not {k_cache.dtype}")
    with on_device(q):
        _gqa_decode[(Bsz, K)](
            q, q.stride(0), k_new, v_new, k_new.stride(0), k_cache, v_cache, k_cache.stride(0),
            k_cache.stride(1), lengths, out, out.stride(0), DH**-0.5,
            R=R, DH=DH, BLOCK_R=max(16, triton.next_power_of_2(R)),
            BLOCK_D=max(16, triton.next_power_of_2(DH)), BLOCK_T=ATTN_BLOCK_T, num_warps=ATTN_WARPS,
        )  # fmt: skip
    return out
