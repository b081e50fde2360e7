"""Backward step 1: the gradient dS_{c+1} of the state leaving every chunk, by a reverse loop over chunks.

The state entering chunk c feeds the chunk's outputs and, decayed, the state leaving it, so

    dS_c = carry_c exp(G_end) dS_{c+1} + sum_t m_in[t] exp(G_t) dy_t C_t^T
           [p, n]                        (dy_t exp(G_t))^T: [p, q] @ C: [q, n]

with dS_{c_last + 1} the gradient of the final state and dS_0 that of the initial state. The transpose
of :mod:`chunk_states`: same grid, same tiles, the chunks walked backwards; the program stores the
gradient of chunk c's leaving state before adding chunk c's outputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.model.ssd_kernels.chunking import (
    assert_buffers,
    chunk_masks,
    heads_from_groups,
    num_chunks,
    ref_dtype,
    to_chunks,
)
from inkling_fp4.model.ssd_kernels.tuning import autotune, cast_rne, configs, mma, operand_types

_CONFIGS = configs(
    [
        ({"BLOCK_P": 64, "BLOCK_N": 64}, 8),
        ({"BLOCK_P": 32, "BLOCK_N": 64}, 4),
        ({"BLOCK_P": 32, "BLOCK_N": 32}, 4),
    ],
    num_stages=3,
)


@autotune(_CONFIGS, key=["P", "N", "CHUNK", "HAS_SEG"])
@triton.jit
def _state_grads_kernel(
    dy_ptr, G_ptr, C_ptr, dfinal_ptr, seg_ptr, dstates_ptr, dinit_ptr,
    L, H, P, N, NC, R,
    s_dy_b, s_dy_l, s_dy_h,
    s_C_b, s_C_l, s_C_g,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DFINAL: tl.constexpr, HAS_SEG: tl.constexpr,
    IN_DTYPE: tl.constexpr, MM_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_bh = tl.program_id(2)
    bb = (pid_bh // H).to(tl.int64)
    hh = pid_bh % H
    bh = bb * H + hh
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_q = tl.arange(0, CHUNK)
    Lp = NC * CHUNK
    mask_pn = (offs_p[:, None] < P) & (offs_n[None, :] < N)
    tile = offs_p[:, None] * N + offs_n[None, :]
    dy_base = dy_ptr + bb * s_dy_b + hh * s_dy_h
    C_base = C_ptr + bb * s_C_b + (hh // R) * s_C_g
    G_base = G_ptr + bh * Lp
    dstates_base = dstates_ptr + bh * NC * P * N

    dS = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_DFINAL:
        dS = tl.load(dfinal_ptr + bh * P * N + tile, mask=mask_pn, other=0.0)
    for i in range(NC):
        c = NC - 1 - i
        tl.store(dstates_base + c * P * N + tile, cast_rne(dS, dstates_ptr.dtype.element_ty), mask=mask_pn)
        t = c * CHUNK + offs_q
        G = tl.load(G_base + t)
        G_end = tl.load(G_base + c * CHUNK + CHUNK - 1)
        scale = tl.exp(G)  # [q]
        carry = tl.exp(G_end)
        if HAS_SEG:
            seg = tl.load(seg_ptr + bb * Lp + t)
            seg_end = tl.load(seg_ptr + bb * Lp + c * CHUNK + CHUNK - 1)
            seg_start = tl.load(seg_ptr + bb * Lp + tl.maximum(c * CHUNK - 1, 0))
            scale = tl.where(seg == seg_start, scale, 0.0)
            carry = tl.where(seg_start == seg_end, carry, 0.0)
        in_l = t < L
        dyT = tl.load(
            dy_base + t[None, :] * s_dy_l + offs_p[:, None],
            mask=in_l[None, :] & (offs_p[:, None] < P),
            other=0.0,
        )  # [BLOCK_P, q]
        Cc = tl.load(
            C_base + t[:, None] * s_C_l + offs_n[None, :],
            mask=in_l[:, None] & (offs_n[None, :] < N),
            other=0.0,
        )  # [q, BLOCK_N]
        dyw = dyT.to(tl.float32) * scale[None, :]
        dS = mma(dyw, Cc, dS * carry, IN_DTYPE, MM_DTYPE, PRECISION)  # [BLOCK_P, q] @ [q, BLOCK_N]
    tl.store(dinit_ptr + bh * P * N + tile, dS, mask=mask_pn)


def state_grads(
    dy: torch.Tensor,
    G: torch.Tensor,
    C: torch.Tensor,
    dfinal: torch.Tensor | None,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dy: [b, l, h, p]; G: [b, h, L]; C: [b, l, g, n]; dfinal: [b, h, p, n] or None; seg: [b, L] or None
    -> (dstates [b, h, c, p, n]: gradient of the state leaving each chunk, in dy's dtype, like the
    snapshots of :mod:`chunk_states`; dinit [b, h, p, n] FP32)."""
    assert_buffers(G, dfinal, seg)
    b, l, h, p = dy.shape
    g, n = C.shape[-2:]
    nc = num_chunks(l, chunk_size)
    dstates = torch.empty(b, h, nc, p, n, device=dy.device, dtype=dy.dtype)
    dinit = torch.empty(b, h, p, n, device=dy.device, dtype=torch.float32)
    in_dtype, mm_dtype, precision = operand_types(dy.dtype)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(p, meta["BLOCK_P"]), b * h)

    _state_grads_kernel[grid](
        dy, G, C, dfinal, seg, dstates, dinit,
        l, h, p, n, nc, h // g,
        dy.stride(0), dy.stride(1), dy.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        CHUNK=chunk_size, HAS_DFINAL=dfinal is not None, HAS_SEG=seg is not None,
        IN_DTYPE=in_dtype, MM_DTYPE=mm_dtype, PRECISION=precision,
    )  # fmt: skip
    return dstates, dinit


def state_grads_ref(
    dy: torch.Tensor,
    G: torch.Tensor,
    C: torch.Tensor,
    dfinal: torch.Tensor | None,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`state_grads`."""
    b, l, h, p = dy.shape
    n = C.shape[-1]
    cdt = ref_dtype(dy, G, dfinal)
    nc = num_chunks(l, chunk_size)
    dyc = to_chunks(dy.to(cdt), chunk_size)  # [b, c, q, h, p]
    Cc = heads_from_groups(to_chunks(C.to(cdt), chunk_size), h)  # [b, c, q, h, n]
    G = G.to(cdt).view(b, h, nc, chunk_size)
    _, m_in, _, carry = chunk_masks(seg, b, nc, chunk_size, dy.device)
    scale = torch.exp(G) * m_in[:, None]  # [b, h, c, q]
    decay = torch.exp(G[..., -1]) * carry[:, None]  # [b, h, c]
    dS = torch.zeros(b, h, p, n, dtype=cdt, device=dy.device)
    if dfinal is not None:
        dS = dfinal.to(cdt)
    dstates = [None] * nc
    for c in reversed(range(nc)):
        dstates[c] = dS
        outputs = torch.einsum("bht,bthp,bthn->bhpn", scale[:, :, c], dyc[:, c], Cc[:, c])  # [b, h, p, n]
        dS = decay[:, :, c, None, None] * dS + outputs
    return torch.stack(dstates, 2), dS
