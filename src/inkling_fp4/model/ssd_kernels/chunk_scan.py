"""Step 3 of the scan: the outputs of every chunk, in parallel over (head, chunk, batch).

    y_t = m_in[t] exp(G_t) C_t S_c  +  sum_{s <= t, same[t, s]} exp(G_t - G_s) (C_t . B_s) dt_s x_s
          ys = C: [q, n] @ S_c^T: [n, p]            P = (C: [q, n] @ B^T: [n, q]) o decay o dt: [q, q]
                                                     P @ x: [q, q] @ [q, p]

One program computes one head's [q, p] output block of one chunk; C B^T is recomputed per head rather
than stored per group (it is cheap, and a stored [b, c, g, q, q] would cost more in memory traffic).
The heads of a group are neighbours in the grid, so their shared B and C loads hit in L2.
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
def _chunk_scan_kernel(
    x_ptr, dt_ptr, G_ptr, B_ptr, C_ptr, states_ptr, seg_ptr, y_ptr,
    L, H, P, N, NC, R,
    s_x_b, s_x_l, s_x_h,
    s_B_b, s_B_l, s_B_g,
    s_C_b, s_C_l, s_C_g,
    s_y_b, s_y_l, s_y_h,
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
    dt = tl.load(dt_ptr + bh * Lp + t)
    G = tl.load(G_ptr + bh * Lp + t)
    B_base = B_ptr + bb * s_B_b + (hh // R) * s_B_g
    C_base = C_ptr + bb * s_C_b + (hh // R) * s_C_g
    S_base = states_ptr + (bh * NC + c) * P * N

    cb = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
    ys = tl.zeros([CHUNK, BLOCK_P], dtype=tl.float32)
    for k0 in range(0, N, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < N
        Ck = tl.load(
            C_base + t[:, None] * s_C_l + offs_k[None, :], mask=in_l[:, None] & mask_k[None, :], other=0.0
        )
        BkT = tl.load(
            B_base + t[None, :] * s_B_l + offs_k[:, None], mask=in_l[None, :] & mask_k[:, None], other=0.0
        )
        SkT = tl.load(
            S_base + offs_p[None, :] * N + offs_k[:, None], mask=mask_p[None, :] & mask_k[:, None], other=0.0
        )
        cb = mma(Ck, BkT, cb, IN_DTYPE, MM_DTYPE, PRECISION)  # [q, BLOCK_K] @ [BLOCK_K, q]
        ys = mma(Ck, SkT, ys, IN_DTYPE, MM_DTYPE, PRECISION)  # [q, BLOCK_K] @ [BLOCK_K, p]

    scale = tl.exp(G)  # [q] decay of the entering state to position t
    same = offs_q[:, None] >= offs_q[None, :]
    if HAS_SEG:
        seg = tl.load(seg_ptr + bb * Lp + t)
        seg_start = tl.load(seg_ptr + bb * Lp + tl.maximum(c * CHUNK - 1, 0))
        scale = tl.where(seg == seg_start, scale, 0.0)
        same = same & (seg[:, None] == seg[None, :])
    decay = tl.exp(tl.where(same, G[:, None] - G[None, :], float("-inf")))  # [q, q], 0 off the mask
    attn = cb * decay * dt[None, :]  # [t, s]
    x = tl.load(
        x_ptr + bb * s_x_b + hh * s_x_h + t[:, None] * s_x_l + offs_p[None, :],
        mask=in_l[:, None] & mask_p[None, :],
        other=0.0,
    )  # [q, p]
    y = mma(attn, x, ys * scale[:, None], IN_DTYPE, MM_DTYPE, PRECISION)  # [q, q] @ [q, p]
    tl.store(
        y_ptr + bb * s_y_b + hh * s_y_h + t[:, None] * s_y_l + offs_p[None, :],
        cast_rne(y, y_ptr.dtype.element_ty),
        mask=in_l[:, None] & mask_p[None, :],
    )


def chunk_scan(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    states: torch.Tensor,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> torch.Tensor:
    """x: [b, l, h, p]; dt_t, G: [b, h, L]; B, C: [b, l, g, n]; states: [b, h, c, p, n] (entering each
    chunk); seg: [b, L] int32 or None -> y: [b, l, h, p] in x's dtype."""
    assert_buffers(dt_t, G, states, seg)
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    nc = num_chunks(l, chunk_size)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    in_dtype, mm_dtype, precision = operand_types(x.dtype)
    _chunk_scan_kernel[(h, nc, b)](
        x, dt_t, G, B, C, states, seg, y,
        l, h, p, n, nc, h // g,
        x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        y.stride(0), y.stride(1), y.stride(2),
        CHUNK=chunk_size, BLOCK_P=block_size(p), HAS_SEG=seg is not None,
        IN_DTYPE=in_dtype, MM_DTYPE=mm_dtype, PRECISION=precision,
    )  # fmt: skip
    return y


def chunk_scan_ref(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    states: torch.Tensor,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> torch.Tensor:
    """Torch twin of :func:`chunk_scan` (returns the compute dtype, not x's)."""
    b, l, h, p = x.shape
    cdt = ref_dtype(x, dt_t, states)
    nc = num_chunks(l, chunk_size)
    xc = to_chunks(x.to(cdt), chunk_size)  # [b, c, q, h, p]
    Bc = heads_from_groups(to_chunks(B.to(cdt), chunk_size), h)  # [b, c, q, h, n]
    Cc = heads_from_groups(to_chunks(C.to(cdt), chunk_size), h)
    dt = dt_t.to(cdt).view(b, h, nc, chunk_size)
    G = G.to(cdt).view(b, h, nc, chunk_size)
    same, m_in, _, _ = chunk_masks(seg, b, nc, chunk_size, x.device)
    decay = torch.exp(torch.where(same[:, None], G[..., :, None] - G[..., None, :], float("-inf")))
    cb = torch.einsum("bcthn,bcshn->bhcts", Cc, Bc)  # [b, h, c, t, s]
    attn = cb * decay * dt[..., None, :]
    y = torch.einsum("bhcts,bcshp->bcthp", attn, xc)
    scale = torch.exp(G) * m_in[:, None]  # [b, h, c, t]
    y = y + torch.einsum("bcthn,bhcpn,bhct->bcthp", Cc, states.to(cdt), scale)
    return from_chunks(y, l)
