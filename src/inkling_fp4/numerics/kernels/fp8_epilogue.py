"""Tensorwise FP8 written by the kernel that produces a tensor, and the transposed copy of those bytes.

Under delayed scaling a tensor's FP8 scale is known before the tensor exists, so its producer can store
FP8 bytes instead of BF16 and the quantizer pass goes away (the ``model/fused_fp8/`` paths). These pieces
make every producer round exactly as the quantizer does:

    v (FP32) -> BF16 value r (round half to even: the tensor the unfused path would have stored)
             -> byte = fp8(clamp(r · scale, ±fp8_max)),  scale = fp8_max / amax (the delayed amax)
             -> running max |r| (NaN kept), one atomic max per program into the amax record word

:func:`transpose_bytes` makes the wgrad layout. Bytes loaded from memory transpose as a plain layout
change, free of the issue in ``fp8_quantize._transposed_bytes``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels.common import bf16_round
from inkling_fp4.numerics.kernels.fp8_quantize import _fp8_bytes, _max_nan, _scales

# A program transposes a [64, 256] byte tile (64-byte rows written): faster than [64, 64] on an H200.
TRANSPOSE_TILE = (64, 256)
TRANSPOSE_WARPS = 8


@triton.jit
def fp8_scale(amax_ptr, E5M2: tl.constexpr):
    """The FP32 scale fp8_max / amax (1 for amax 0) from the delayed amax word, as the quantizer's."""
    if E5M2:
        scale, _ = _scales(tl.load(amax_ptr), 57344.0)
    else:
        scale, _ = _scales(tl.load(amax_ptr), 448.0)
    return scale


@triton.jit
def bf16_fp8_bytes(v, scale, E5M2: tl.constexpr, HW: tl.constexpr):
    """(FP8 bytes of v rounded to BF16 and scaled, that BF16 value in FP32) for FP32 v.
    ``HW``: the GPU's conversions (sm_89+); otherwise bit arithmetic (the interpreter truncates)."""
    r = bf16_round(v, HW)
    if E5M2:
        q = _fp8_bytes(r, scale, 2, 15, 57344.0, 65536.0, 0.00006103515625, HW)  # 2^16, 2^-14
    else:
        q = _fp8_bytes(r, scale, 3, 7, 448.0, 512.0, 0.015625, HW)  # 2^9, 2^-6
    return q, r


@triton.jit
def running_amax(seen, r, mask):
    """max(seen, |r|) over the stored elements (NaN kept, masked ones count 0)."""
    return _max_nan(seen, tl.where(mask, tl.abs(r), 0.0))


@triton.jit
def _transpose_bytes(
    src_ptr, dst_ptr, amax_ptr, scale_ptr, M, N, TILE_M: tl.constexpr, TILE_N: tl.constexpr,
    FP8_MAX: tl.constexpr,
):  # fmt: skip
    """dst [N, M] = src [M, N]ᵀ by tiles; with FP8_MAX > 0 program (0, 0) also stores scale_inv."""
    rows = tl.program_id(0) * TILE_M + tl.arange(0, TILE_M)
    cols = tl.program_id(1) * TILE_N + tl.arange(0, TILE_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tile = tl.load(src_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0)
    dst = dst_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :]
    tl.store(dst, tl.trans(tile), mask=tl.trans(mask))
    if FP8_MAX > 0:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _, scale_inv = _scales(tl.load(amax_ptr), FP8_MAX)
            tl.store(scale_ptr, scale_inv)


def transpose_bytes(
    data: torch.Tensor, amax: torch.Tensor | None = None, fp8_max: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(``data.t().contiguous()``, scale_inv or None) for a contiguous 2-D byte tensor, in one Triton pass.
    With ``amax`` and ``fp8_max`` the same launch returns the delayed amax's scale_inv, as the quantizer's."""
    if data.dim() != 2 or data.element_size() != 1 or not data.is_contiguous():
        raise ValueError(f"transpose_bytes takes a contiguous 2-D byte tensor, got {tuple(data.shape)}")
    m, n = data.shape
    out = torch.empty(n, m, dtype=data.dtype, device=data.device)
    scale_inv = None if amax is None else torch.empty((), dtype=torch.float32, device=data.device)
    grid = (max(1, triton.cdiv(m, TRANSPOSE_TILE[0])), max(1, triton.cdiv(n, TRANSPOSE_TILE[1])))
    src, dst = data.view(torch.uint8), out.view(torch.uint8)
    _transpose_bytes[grid](
        src, dst, dst if amax is None else amax, dst if amax is None else scale_inv, m, n,
        TILE_M=TRANSPOSE_TILE[0], TILE_N=TRANSPOSE_TILE[1], FP8_MAX=fp8_max if amax is not None else 0.0,
        num_warps=TRANSPOSE_WARPS,
    )  # fmt: skip
    return out, scale_inv
