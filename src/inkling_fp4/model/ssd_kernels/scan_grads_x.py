"""Backward step 2: dx, ddt and dA, in one pass over each (head, chunk), parallel like the forward scan.

With v_s = dt_s x_s, the forward output of a chunk is y = attn v + ys, attn[t, s] = D[t, s] (C_t . B_s)
(D the masked decay exp(G_t - G_s)), ys_t = m_in[t] exp(G_t) C_t S_c, and the leaving state gets
w_s v_s B_s^T (w_s = m_out[s] exp(G_end - G_s)). Given dy and dS_{c+1} (from :mod:`state_grads`):

    dv = (D o C B^T)^T dy + w o (B dS_{c+1}^T)      [q, q]^T @ [q, p]  +  [q, n] @ [n, p]
    dx = dv dt ;   ddt (through v) = sum_p dv x

The decay enters through G; its gradient needs no extra matmul. G_t multiplies everything that reaches
output t and divides everything that leaves input s, so

    dG_t = dy_t . y_t  -  v_t . dv_t  +  [t = end] <dS_{c+1}, S_{c+1}>

(y_t and v_t . dv_t are formed from the FP32 matrix M[t, s] = D (C_t . B_s) dt_s (dy_t . x_s), as its row
and column sums, rather than from BF16 outputs; S_{c+1} is expanded as carry exp(G_end) S_c plus the
chunk's inputs). G is a within-chunk cumsum of a = dt A, so da_s = sum_{t >= s} dG_t, which adds
A da to ddt and sum dt da to dA (per chunk here; summed over chunks and batch by the caller).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.model.ssd_kernels.chunking import (
    assert_buffers,
    chunk_masks,
    from_chunks,
    heads_from_groups,
    num_chunks,
    ref_dtype,
    to_chunks,
)
from inkling_fp4.model.ssd_kernels.tuning import autotune, block_size, cast_rne, configs, mma, operand_types

_CONFIGS = configs([({"BLOCK_K": 64}, 8), ({"BLOCK_K": 32}, 8), ({"BLOCK_K": 32}, 4)])


@autotune(_CONFIGS, key=["P", "N", "CHUNK", "HAS_SEG"])
@triton.jit
def _scan_grads_x_kernel(
    x_ptr, dt_ptr, G_ptr, A_ptr, B_ptr, C_ptr, dy_ptr, states_ptr, dstates_ptr, seg_ptr,
    dx_ptr, ddt_ptr, dA_ptr,
    L, H, P, N, NC, R,
    s_x_b, s_x_l, s_x_h,
    s_B_b, s_B_l, s_B_g,
    s_C_b, s_C_l, s_C_g,
    s_dy_b, s_dy_l, s_dy_h,
    s_dx_b, s_dx_l, s_dx_h,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SEG: tl.constexpr,
    IN_DTYPE: tl.constexpr, MM_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    hh = tl.program_id(0)
    c = tl.program_id(1)
    bb = tl.program_id(2).to(tl.int64)
    bh = bb * H + hh
    Lp = NC * CHUNK
    offs_q = tl.arange(0, CHUNK)
    offs_p = tl.arange(0, BLOCK_P)
    t = c * CHUNK + offs_q
    in_l = t < L
    mask_p = offs_p < P
    mask_qp = in_l[:, None] & mask_p[None, :]
    dt = tl.load(dt_ptr + bh * Lp + t)
    G = tl.load(G_ptr + bh * Lp + t)
    G_end = tl.load(G_ptr + bh * Lp + c * CHUNK + CHUNK - 1)
    B_base = B_ptr + bb * s_B_b + (hh // R) * s_B_g
    C_base = C_ptr + bb * s_C_b + (hh // R) * s_C_g
    S_off = (bh * NC + c) * P * N

    cb = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    ys = tl.zeros([CHUNK, BLOCK_P], dtype=tl.float32)  # C S_c^T, before its decay
    dvs = tl.zeros([CHUNK, BLOCK_P], dtype=tl.float32)  # B dS_{c+1}^T, before its decay
    sds = tl.zeros([BLOCK_P], dtype=tl.float32)  # <S_c, dS_{c+1}>, partial sums over n
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < N
        mask_qk = in_l[:, None] & mask_k[None, :]
        mask_kp = mask_k[:, None] & mask_p[None, :]
        Ck = tl.load(C_base + t[:, None] * s_C_l + offs_k[None, :], mask=mask_qk, other=0.0)  # [q, K]
        Bk = tl.load(B_base + t[:, None] * s_B_l + offs_k[None, :], mask=mask_qk, other=0.0)  # [q, K]
        state_tile = offs_p[None, :] * N + offs_k[:, None]  # [K, p] offsets of a transposed state tile
        SkT = tl.load(states_ptr + S_off + state_tile, mask=mask_kp, other=0.0)
        dSkT = tl.load(dstates_ptr + S_off + state_tile, mask=mask_kp, other=0.0)
        cb = mma(Ck, tl.trans(Bk), cb, IN_DTYPE, MM_DTYPE, PRECISION)  # [q, K] @ [K, q]
        ys = mma(Ck, SkT, ys, IN_DTYPE, MM_DTYPE, PRECISION)  # [q, K] @ [K, p]
        dvs = mma(Bk, dSkT, dvs, IN_DTYPE, MM_DTYPE, PRECISION)  # [q, K] @ [K, p]
        sds += tl.sum(SkT.to(tl.float32) * dSkT.to(tl.float32), axis=0)

    scale = tl.exp(G)
    w = tl.exp(G_end - G)
    carry = tl.exp(G_end)
    same = offs_q[:, None] >= offs_q[None, :]
    if HAS_SEG:
        seg = tl.load(seg_ptr + bb * Lp + t)
        seg_start = tl.load(seg_ptr + bb * Lp + tl.maximum(c * CHUNK - 1, 0))
        seg_end = tl.load(seg_ptr + bb * Lp + c * CHUNK + CHUNK - 1)
        scale = tl.where(seg == seg_start, scale, 0.0)
        w = tl.where(seg == seg_end, w, 0.0)
        carry = tl.where(seg_start == seg_end, carry, 0.0)
        same = same & (seg[:, None] == seg[None, :])
    ys = ys * scale[:, None]
    dvs = dvs * w[:, None]
    cbd = cb * tl.exp(tl.where(same, G[:, None] - G[None, :], float("-inf")))  # [t, s] = D o C B^T

    x = tl.load(
        x_ptr + bb * s_x_b + hh * s_x_h + t[:, None] * s_x_l + offs_p[None, :], mask=mask_qp, other=0.0
    )
    dy = tl.load(
        dy_ptr + bb * s_dy_b + hh * s_dy_h + t[:, None] * s_dy_l + offs_p[None, :], mask=mask_qp, other=0.0
    )
    dyx = mma(dy, tl.trans(x), tl.zeros([CHUNK, CHUNK], dtype=tl.float32), IN_DTYPE, MM_DTYPE, PRECISION)
    dv = mma(tl.trans(cbd), dy, dvs, IN_DTYPE, MM_DTYPE, PRECISION)  # [s, t] @ [t, p]
    xf = x.to(tl.float32)
    ddt_v = tl.sum(dv * xf, axis=1)  # [q]
    tl.store(
        dx_ptr + bb * s_dx_b + hh * s_dx_h + t[:, None] * s_dx_l + offs_p[None, :],
        cast_rne(dv * dt[:, None], dx_ptr.dtype.element_ty),
        mask=mask_qp,
    )

    # dG from FP32 terms only (not from dv, whose matmul took BF16 operands): the pairs that cancel in
    # dG_t = dy_t . y_t - v_t . dv_t then cancel exactly. M[t, s] = D (C_t . B_s) dt_s (dy_t . x_s).
    M = cbd * dyx * dt[None, :]
    vdvs = dt * tl.sum(xf * dvs, axis=1)  # v_s . (the leaving state's part of dv_s)
    dG = tl.sum(dy.to(tl.float32) * ys, axis=1) + tl.sum(M, axis=1) - tl.sum(M, axis=0) - vdvs
    leaving = tl.sum(vdvs, axis=0) + carry * tl.sum(sds, axis=0)
    dG += tl.where(offs_q == CHUNK - 1, leaving, 0.0)
    da = tl.sum(dG, axis=0) - tl.cumsum(dG, axis=0) + dG  # reverse cumsum: sum_{t >= s} dG_t
    A = tl.load(A_ptr + hh).to(tl.float32)
    tl.store(ddt_ptr + bh * Lp + t, ddt_v + A * da)
    tl.store(dA_ptr + bh * NC + c, tl.sum(da * dt, axis=0))


def scan_grads_x(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dy: torch.Tensor,
    states: torch.Tensor,
    dstates: torch.Tensor,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shapes as :func:`chunk_scan`, plus A: [h], dy: [b, l, h, p], dstates: [b, h, c, p, n] ->
    (dx [b, l, h, p] in x's dtype, ddt_t [b, h, L] FP32, dA per chunk [b, h, c] FP32)."""
    assert_buffers(dt_t, G, states, dstates, seg)
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    nc = num_chunks(l, chunk_size)
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    ddt_t = torch.empty_like(dt_t)
    dA = torch.empty(b, h, nc, device=x.device, dtype=torch.float32)
    in_dtype, mm_dtype, precision = operand_types(x.dtype)
    _scan_grads_x_kernel[(h, nc, b)](
        x, dt_t, G, A, B, C, dy, states, dstates, seg,
        dx, ddt_t, dA,
        l, h, p, n, nc, h // g,
        x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        dy.stride(0), dy.stride(1), dy.stride(2),
        dx.stride(0), dx.stride(1), dx.stride(2),
        CHUNK=chunk_size, BLOCK_P=block_size(p), HAS_SEG=seg is not None,
        IN_DTYPE=in_dtype, MM_DTYPE=mm_dtype, PRECISION=precision,
    )  # fmt: skip
    return dx, ddt_t, dA


def scan_grads_x_ref(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dy: torch.Tensor,
    states: torch.Tensor,
    dstates: torch.Tensor,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`scan_grads_x` (dx in the compute dtype)."""
    b, l, h, p = x.shape
    cdt = ref_dtype(x, dt_t, states)
    nc = num_chunks(l, chunk_size)
    q = chunk_size
    xc = to_chunks(x.to(cdt), q)  # [b, c, q, h, p]
    dyc = to_chunks(dy.to(cdt), q)
    Bc = heads_from_groups(to_chunks(B.to(cdt), q), h)  # [b, c, q, h, n]
    Cc = heads_from_groups(to_chunks(C.to(cdt), q), h)
    dt = dt_t.to(cdt).view(b, h, nc, q)
    G = G.to(cdt).view(b, h, nc, q)
    S, dS = states.to(cdt), dstates.to(cdt)  # [b, h, c, p, n]
    same, m_in, m_out, carry = chunk_masks(seg, b, nc, q, x.device)
    G_end = G[..., -1:]
    scale = torch.exp(G) * m_in[:, None]  # [b, h, c, q]
    w = torch.exp(G_end - G) * m_out[:, None]
    carry = torch.exp(G_end[..., 0]) * carry[:, None]  # [b, h, c]
    cbd = torch.einsum("bcthn,bcshn->bhcts", Cc, Bc) * torch.exp(
        torch.where(same[:, None], G[..., :, None] - G[..., None, :], float("-inf"))
    )  # [b, h, c, t, s]
    v = xc * dt.permute(0, 2, 3, 1)[..., None]  # [b, c, q, h, p]
    ys = torch.einsum("bcthn,bhcpn->bcthp", Cc, S) * scale.permute(0, 2, 3, 1)[..., None]
    y = torch.einsum("bhcts,bcshp->bcthp", cbd, v) + ys
    dvs = torch.einsum("bcshn,bhcpn->bcshp", Bc, dS) * w.permute(0, 2, 3, 1)[..., None]
    dv = torch.einsum("bhcts,bcthp->bcshp", cbd, dyc) + dvs
    ddt_v = (dv * xc).sum(-1)  # [b, c, q, h]
    S_next = carry[..., None, None] * S + torch.einsum(
        "bcshp,bcshn->bhcpn", v * w.permute(0, 2, 3, 1)[..., None], Bc
    )
    dG = ((dyc * y).sum(-1) - (v * dv).sum(-1)).permute(0, 3, 1, 2)  # [b, h, c, q]
    dG[..., -1] += (dS * S_next).sum((-2, -1))
    da = dG.flip(-1).cumsum(-1).flip(-1)
    ddt = ddt_v.permute(0, 3, 1, 2) + A.to(cdt)[:, None, None] * da  # [b, h, c, q]
    dx = from_chunks(dv * dt.permute(0, 2, 3, 1)[..., None], l)
    return dx, ddt.reshape(b, h, nc * q), (da * dt).sum(-1)
