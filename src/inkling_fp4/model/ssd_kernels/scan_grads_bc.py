"""Backward step 3: dB and dC, one program per (n block, chunk, batch x group), looping over its heads.

B and C are shared by the r = h/g heads of a group, so their gradients are sums over those heads. The
program keeps the [q, BLOCK_N] accumulators of dB and dC in registers and adds each head in turn: no
per-head gradient buffer, no atomics, no reduction pass. Per head, with M[t, s] = D[t, s] dt_s (dy_t . x_s)
(D the masked decay exp(G_t - G_s)):

    dC = M @ B            + (m_in exp(G) o dy) @ S_c        [q, q] @ [q, n]  +  [q, p] @ [p, n]
    dB = M^T @ C          + (w dt o x) @ dS_{c+1}           [q, q] @ [q, n]  +  [q, p] @ [p, n]

the first terms from the intra-chunk form, the second from the entering state (read out by C) and the
leaving state (fed through B, w_s = m_out[s] exp(G_end - G_s)).
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

_CONFIGS = configs([({"BLOCK_N": 64}, 8), ({"BLOCK_N": 32}, 8), ({"BLOCK_N": 32}, 4)])


@autotune(_CONFIGS, key=["P", "N", "R", "CHUNK", "HAS_SEG"])
@triton.jit
def _scan_grads_bc_kernel(
    x_ptr, dt_ptr, G_ptr, B_ptr, C_ptr, dy_ptr, states_ptr, dstates_ptr, seg_ptr, dB_ptr, dC_ptr,
    L, H, GROUPS, P, N, NC, R,
    s_x_b, s_x_l, s_x_h,
    s_B_b, s_B_l, s_B_g,
    s_C_b, s_C_l, s_C_g,
    s_dy_b, s_dy_l, s_dy_h,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEG: tl.constexpr,
    IN_DTYPE: tl.constexpr, MM_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    pid_bg = tl.program_id(2)
    bb = (pid_bg // GROUPS).to(tl.int64)
    gg = pid_bg % GROUPS
    Lp = NC * CHUNK
    offs_q = tl.arange(0, CHUNK)
    offs_p = tl.arange(0, BLOCK_P)
    t = c * CHUNK + offs_q
    in_l = t < L
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask_qn = in_l[:, None] & mask_n[None, :]
    mask_qp = in_l[:, None] & mask_p[None, :]
    mask_pn = mask_p[:, None] & mask_n[None, :]
    Bc = tl.load(
        B_ptr + bb * s_B_b + gg * s_B_g + t[:, None] * s_B_l + offs_n[None, :], mask=mask_qn, other=0.0
    )
    Cc = tl.load(
        C_ptr + bb * s_C_b + gg * s_C_g + t[:, None] * s_C_l + offs_n[None, :], mask=mask_qn, other=0.0
    )
    same = offs_q[:, None] >= offs_q[None, :]
    if HAS_SEG:
        seg = tl.load(seg_ptr + bb * Lp + t)
        seg_start = tl.load(seg_ptr + bb * Lp + tl.maximum(c * CHUNK - 1, 0))
        seg_end = tl.load(seg_ptr + bb * Lp + c * CHUNK + CHUNK - 1)
        same = same & (seg[:, None] == seg[None, :])

    dB = tl.zeros([CHUNK, BLOCK_N], dtype=tl.float32)
    dC = tl.zeros([CHUNK, BLOCK_N], dtype=tl.float32)
    for i in range(R):
        hh = gg * R + i
        bh = bb * H + hh
        dt = tl.load(dt_ptr + bh * Lp + t)
        G = tl.load(G_ptr + bh * Lp + t)
        G_end = tl.load(G_ptr + bh * Lp + c * CHUNK + CHUNK - 1)
        scale = tl.exp(G)
        w = tl.exp(G_end - G)
        if HAS_SEG:
            scale = tl.where(seg == seg_start, scale, 0.0)
            w = tl.where(seg == seg_end, w, 0.0)
        x = tl.load(
            x_ptr + bb * s_x_b + hh * s_x_h + t[:, None] * s_x_l + offs_p[None, :], mask=mask_qp, other=0.0
        )
        dy = tl.load(
            dy_ptr + bb * s_dy_b + hh * s_dy_h + t[:, None] * s_dy_l + offs_p[None, :],
            mask=mask_qp,
            other=0.0,
        )
        state_tile = (bh * NC + c) * P * N + offs_p[:, None] * N + offs_n[None, :]  # [p, BLOCK_N]
        S = tl.load(states_ptr + state_tile, mask=mask_pn, other=0.0)
        dS = tl.load(dstates_ptr + state_tile, mask=mask_pn, other=0.0)
        dyx = mma(dy, tl.trans(x), tl.zeros([CHUNK, CHUNK], dtype=tl.float32), IN_DTYPE, MM_DTYPE, PRECISION)
        M = dyx * tl.exp(tl.where(same, G[:, None] - G[None, :], float("-inf"))) * dt[None, :]  # [t, s]
        dC = mma(M, Bc, dC, IN_DTYPE, MM_DTYPE, PRECISION)  # [q, q] @ [q, BLOCK_N]
        dB = mma(tl.trans(M), Cc, dB, IN_DTYPE, MM_DTYPE, PRECISION)  # [q, q] @ [q, BLOCK_N]
        dC = mma(
            dy.to(tl.float32) * scale[:, None], S, dC, IN_DTYPE, MM_DTYPE, PRECISION
        )  # [q, p] @ [p, BLOCK_N]
        dB = mma(x.to(tl.float32) * (w * dt)[:, None], dS, dB, IN_DTYPE, MM_DTYPE, PRECISION)

    out = (
        bb * L * GROUPS * N + t[:, None] * (GROUPS * N) + gg * N + offs_n[None, :]
    )  # contiguous [b, l, g, n]
    tl.store(dB_ptr + out, cast_rne(dB, dB_ptr.dtype.element_ty), mask=mask_qn)
    tl.store(dC_ptr + out, cast_rne(dC, dC_ptr.dtype.element_ty), mask=mask_qn)


def scan_grads_bc(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dy: torch.Tensor,
    states: torch.Tensor,
    dstates: torch.Tensor,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes as :func:`scan_grads_x` -> (dB, dC), [b, l, g, n] in B's and C's dtypes."""
    assert_buffers(dt_t, G, states, dstates, seg)
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    nc = num_chunks(l, chunk_size)
    dB = torch.empty(b, l, g, n, device=B.device, dtype=B.dtype)
    dC = torch.empty(b, l, g, n, device=C.device, dtype=C.dtype)
    in_dtype, mm_dtype, precision = operand_types(x.dtype)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), nc, b * g)

    _scan_grads_bc_kernel[grid](
        x, dt_t, G, B, C, dy, states, dstates, seg, dB, dC,
        l, h, g, p, n, nc, h // g,
        x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        dy.stride(0), dy.stride(1), dy.stride(2),
        CHUNK=chunk_size, BLOCK_P=block_size(p), HAS_SEG=seg is not None,
        IN_DTYPE=in_dtype, MM_DTYPE=mm_dtype, PRECISION=precision,
    )  # fmt: skip
    return dB, dC


def scan_grads_bc_ref(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    dy: torch.Tensor,
    states: torch.Tensor,
    dstates: torch.Tensor,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`scan_grads_bc` (results in the compute dtype)."""
    b, l, h, p = x.shape
    g = B.shape[-2]
    cdt = ref_dtype(x, dt_t, states)
    nc = num_chunks(l, chunk_size)
    q = chunk_size
    xc = to_chunks(x.to(cdt), q)  # [b, c, q, h, p]
    dyc = to_chunks(dy.to(cdt), q)
    Bc = heads_from_groups(to_chunks(B.to(cdt), q), h)  # [b, c, q, h, n]
    Cc = heads_from_groups(to_chunks(C.to(cdt), q), h)
    dt = dt_t.to(cdt).view(b, h, nc, q)
    G = G.to(cdt).view(b, h, nc, q)
    same, m_in, m_out, _ = chunk_masks(seg, b, nc, q, x.device)
    scale = (torch.exp(G) * m_in[:, None]).permute(0, 2, 3, 1)[..., None]  # [b, c, q, h, 1]
    w = (torch.exp(G[..., -1:] - G) * m_out[:, None] * dt).permute(0, 2, 3, 1)[..., None]
    decay = torch.exp(torch.where(same[:, None], G[..., :, None] - G[..., None, :], float("-inf")))
    M = torch.einsum("bcthp,bcshp->bhcts", dyc, xc) * decay * dt[..., None, :]  # [b, h, c, t, s]
    dC = torch.einsum("bhcts,bcshn->bcthn", M, Bc) + torch.einsum(
        "bcthp,bhcpn->bcthn", dyc * scale, states.to(cdt)
    )
    dB = torch.einsum("bhcts,bcthn->bcshn", M, Cc) + torch.einsum(
        "bcshp,bhcpn->bcshn", xc * w, dstates.to(cdt)
    )
    r = h // g
    dB = dB.view(*dB.shape[:3], g, r, -1).sum(4)  # heads of a group summed: [b, c, q, g, n]
    dC = dC.view(*dC.shape[:3], g, r, -1).sum(4)
    return from_chunks(dB, l), from_chunks(dC, l)
