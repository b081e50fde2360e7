"""Global abs-max of a 2-D tensor in one read: the first of NVFP4's two passes.

Each program reduces ``STEPS`` tiles in registers and folds the result into one FP32 word with an
atomic max (exact in any order). NaN would vanish in a hardware max, so it is mapped to +Inf: the
result is non-finite whenever x is, which the finiteness check reads.

The word must start at zero, and an emulated step is bound by launches, so :func:`zeroed_words` hands
out never-used words of a buffer zeroed once. NOTE words are never recycled, so a CUDA graph capture
calls :func:`start_new_pool` at its start (its words are zero-filled inside the capture, so replays
re-zero them) and at its end (so eager code never gets a word that replays rewrite).
"""

import threading

import torch
import triton
import triton.language as tl

POOL_WORDS = 8192
"""FP32 words per zero-filled buffer of :func:`zeroed_words`."""

_pools: dict[torch.device, tuple[torch.Tensor, int]] = {}  # device -> (buffer, first unused word)
_pool_lock = threading.Lock()


def zeroed_words(n: int, device: torch.device) -> torch.Tensor:
    """``n`` FP32 zeros on ``device`` that nothing else uses (a view of a shared buffer), without a fill
    launch per call."""
    device = torch.device(device)
    with _pool_lock:
        buffer, used = _pools.get(device, (None, POOL_WORDS))
        if used + n > POOL_WORDS:
            buffer, used = torch.zeros(max(POOL_WORDS, n), dtype=torch.float32, device=device), 0
        _pools[device] = (buffer, used + n)
    return buffer[used : used + n]


def start_new_pool(device: torch.device) -> None:
    """Take the next words of ``device`` from a new buffer, zero-filled when the next word is asked for."""
    with _pool_lock:
        _pools.pop(torch.device(device), None)


@triton.jit
def _abs_max_kernel(
    x_ptr, amax_ptr, M, N, stride_xm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr
):
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    running = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(STEPS):
        rows = (tl.program_id(0) * STEPS + step) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        # x: [BLOCK_M, BLOCK_N]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        magnitude = tl.abs(x.to(tl.float32))
        running = tl.maximum(running, tl.where(magnitude == magnitude, magnitude, float("inf")))
    tl.atomic_max(amax_ptr, tl.max(tl.max(running, axis=1), axis=0))


def abs_max(
    x: torch.Tensor, *, block_m: int = 64, block_n: int = 256, steps: int = 8, num_warps: int = 8
) -> torch.Tensor:
    """``max(|x|)`` of a 2-D tensor with unit last-dim stride as FP32 [1] (+Inf for NaN or Inf)."""
    m, n = x.shape
    amax = zeroed_words(1, x.device)
    grid = (triton.cdiv(m, block_m * steps), triton.cdiv(n, block_n))
    _abs_max_kernel[grid](
        x, amax, m, n, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, STEPS=steps, num_warps=num_warps
    )
    return amax
