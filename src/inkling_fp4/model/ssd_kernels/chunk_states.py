"""Step 2 of the scan: the state S_c entering every chunk, by one sequential loop over chunks.

Per head, the recurrence over whole chunks (the chunk state and the state passing of Mamba-2, fused):

    S_{c+1} = carry_c exp(G_end) S_c + sum_s m_out[s] exp(G_end - G_s) dt_s x_s B_s^T
              [p, n]                     (x_s dt_s w_s)^T: [p, q] @ B: [q, n]

Each program owns one [BLOCK_P, BLOCK_N] tile of one head's state (the tiles are independent) and walks
the c chunks in order, storing S_c before adding chunk c: the states are written once and never
re-read to be passed on.

The recurrence and the final state are FP32. The snapshots S_c are read only as matmul operands,
rounded to the input dtype anyway, so they are stored in it (BF16 in training): the same numbers, half
the scan's largest memory traffic.
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
def _chunk_states_kernel(
    x_ptr, dt_ptr, G_ptr, B_ptr, init_ptr, seg_ptr, states_ptr, final_ptr,
    L, H, P, N, NC, R,
    s_x_b, s_x_l, s_x_h,
    s_B_b, s_B_l, s_B_g,
    CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_SEG: tl.constexpr,
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
    tile = offs_p[:, None] * N + offs_n[None, :]  # [BLOCK_P, BLOCK_N] offsets in one [p, n] state
    x_base = x_ptr + bb * s_x_b + hh * s_x_h
    B_base = B_ptr + bb * s_B_b + (hh // R) * s_B_g
    dt_base = dt_ptr + bh * Lp
    G_base = G_ptr + bh * Lp
    states_base = states_ptr + bh * NC * P * N

    S = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    if HAS_INIT:
        S = tl.load(init_ptr + bh * P * N + tile, mask=mask_pn, other=0.0)
    for c in range(NC):
        tl.store(states_base + c * P * N + tile, cast_rne(S, states_ptr.dtype.element_ty), mask=mask_pn)
        t = c * CHUNK + offs_q
        dt = tl.load(dt_base + t)
        G = tl.load(G_base + t)
        G_end = tl.load(G_base + c * CHUNK + CHUNK - 1)
        w = tl.exp(G_end - G) * dt  # [q] weight of input s in the leaving state
        carry = tl.exp(G_end)
        if HAS_SEG:
            seg = tl.load(seg_ptr + bb * Lp + t)
            seg_end = tl.load(seg_ptr + bb * Lp + c * CHUNK + CHUNK - 1)
            seg_start = tl.load(seg_ptr + bb * Lp + tl.maximum(c * CHUNK - 1, 0))
            w = tl.where(seg == seg_end, w, 0.0)
            carry = tl.where(seg_start == seg_end, carry, 0.0)
        in_l = t < L
        xT = tl.load(
            x_base + t[None, :] * s_x_l + offs_p[:, None],
            mask=in_l[None, :] & (offs_p[:, None] < P),
            other=0.0,
        )  # [BLOCK_P, q]
        Bc = tl.load(
            B_base + t[:, None] * s_B_l + offs_n[None, :],
            mask=in_l[:, None] & (offs_n[None, :] < N),
            other=0.0,
        )  # [q, BLOCK_N]
        xw = xT.to(tl.float32) * w[None, :]
        S = mma(xw, Bc, S * carry, IN_DTYPE, MM_DTYPE, PRECISION)  # [BLOCK_P, q] @ [q, BLOCK_N]
    tl.store(final_ptr + bh * P * N + tile, S, mask=mask_pn)


def chunk_states(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    B: torch.Tensor,
    initial_state: torch.Tensor | None,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [b, l, h, p]; dt_t, G: [b, h, L]; B: [b, l, g, n]; initial_state: [b, h, p, n] FP32 or None;
    seg: [b, L] int32 or None -> (states [b, h, c, p, n] in x's dtype, final [b, h, p, n] FP32)."""
    assert_buffers(dt_t, G, initial_state, seg)
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    nc = num_chunks(l, chunk_size)
    states = torch.empty(b, h, nc, p, n, device=x.device, dtype=x.dtype)
    final = torch.empty(b, h, p, n, device=x.device, dtype=torch.float32)
    in_dtype, mm_dtype, precision = operand_types(x.dtype)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(p, meta["BLOCK_P"]), b * h)

    _chunk_states_kernel[grid](
        x, dt_t, G, B, initial_state, seg, states, final,
        l, h, p, n, nc, h // g,
        x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        CHUNK=chunk_size, HAS_INIT=initial_state is not None, HAS_SEG=seg is not None,
        IN_DTYPE=in_dtype, MM_DTYPE=mm_dtype, PRECISION=precision,
    )  # fmt: skip
    return states, final


def chunk_states_ref(
    x: torch.Tensor,
    dt_t: torch.Tensor,
    G: torch.Tensor,
    B: torch.Tensor,
    initial_state: torch.Tensor | None,
    seg: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`chunk_states`."""
    b, l, h, p = x.shape
    n = B.shape[-1]
    cdt = ref_dtype(x, dt_t, initial_state)
    nc = num_chunks(l, chunk_size)
    xc = to_chunks(x.to(cdt), chunk_size)  # [b, c, q, h, p]
    Bc = heads_from_groups(to_chunks(B.to(cdt), chunk_size), h)  # [b, c, q, h, n]
    dt = dt_t.to(cdt).view(b, h, nc, chunk_size)
    G = G.to(cdt).view(b, h, nc, chunk_size)
    _, _, m_out, carry = chunk_masks(seg, b, nc, chunk_size, x.device)
    G_end = G[..., -1:]
    w = torch.exp(G_end - G) * dt * m_out[:, None]  # [b, h, c, q]
    decay = torch.exp(G_end[..., 0]) * carry[:, None]  # [b, h, c]
    S = torch.zeros(b, h, p, n, dtype=cdt, device=x.device)
    if initial_state is not None:
        S = initial_state.to(cdt)
    states = []
    for c in range(nc):
        states.append(S)
        inputs = torch.einsum("bhs,bshp,bshn->bhpn", w[:, :, c], xc[:, c], Bc[:, c])  # [b, h, p, n]
        S = decay[:, :, c, None, None] * S + inputs
    return torch.stack(states, 2), S
