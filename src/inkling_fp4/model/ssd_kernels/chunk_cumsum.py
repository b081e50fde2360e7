"""Step 1 of the scan: the cumulative log decay G inside each chunk, and dt in the kernels' layout.

    G[t] = sum_{s <= t, s in the chunk of t} dt_s A        (<= 0, FP32)

Later kernels read decays as exp(G_t - G_s) or exp(G_end - G_s) from this [b, h, c*q] FP32 buffer. dt
is copied beside it in the same layout (zero past l), so later kernels load q contiguous values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.model.ssd_kernels.chunking import num_chunks, ref_dtype, to_chunks
from inkling_fp4.model.ssd_kernels.tuning import INTERPRET


@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr, A_ptr, dt_out_ptr, G_ptr,
    L, H, NC,
    s_dt_b, s_dt_l, s_dt_h,
    CHUNK: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    c = tl.program_id(0)
    bb = tl.program_id(1).to(tl.int64)
    offs_h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = c * CHUNK + tl.arange(0, CHUNK)
    mask_h = offs_h < H
    dt = tl.load(
        dt_ptr + bb * s_dt_b + t[:, None] * s_dt_l + offs_h[None, :] * s_dt_h,
        mask=(t[:, None] < L) & mask_h[None, :],
        other=0.0,
    ).to(tl.float32)  # [q, BLOCK_H]
    A = tl.load(A_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    G = tl.cumsum(dt * A[None, :], axis=0)  # [q, BLOCK_H]
    out = (bb * H + offs_h[None, :]) * (NC * CHUNK) + t[:, None]
    tl.store(dt_out_ptr + out, dt, mask=mask_h[None, :])
    tl.store(G_ptr + out, G, mask=mask_h[None, :])


def chunk_cumsum(dt: torch.Tensor, A: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dt: [b, l, h], A: [h] -> (dt_t, G), both FP32 [b, h, c*q]."""
    b, l, h = dt.shape
    nc = num_chunks(l, chunk_size)
    dt_t = torch.empty(b, h, nc * chunk_size, device=dt.device, dtype=torch.float32)
    G = torch.empty_like(dt_t)
    block_h = min(16, triton.next_power_of_2(h))
    grid = (nc, b, triton.cdiv(h, block_h))
    _chunk_cumsum_kernel[grid](
        dt, A, dt_t, G, l, h, nc, *dt.stride(),
        CHUNK=chunk_size, BLOCK_H=block_h, num_warps=1 if INTERPRET else 4,
    )  # fmt: skip
    return dt_t, G


def chunk_cumsum_ref(dt: torch.Tensor, A: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin of :func:`chunk_cumsum`."""
    cdt = ref_dtype(dt, A)
    dt_c = to_chunks(dt.to(cdt), chunk_size)  # [b, c, q, h]
    G = (dt_c * A.to(cdt)).cumsum(2)  # [b, c, q, h]
    b, nc, q, h = dt_c.shape
    return tuple(t.permute(0, 3, 1, 2).reshape(b, h, nc * q).contiguous() for t in (dt_c, G))
