"""Global abs-max of a 2-D tensor in one read: the first of NVFP4's two passes.

Why a kernel of our own: the tensor scale ``S_enc`` needs ``amax(|x|)`` before any block can be
encoded, so quantization is two passes over x. ``x.abs().amax()`` would write and re-read an |x|
temporary; this kernel reads x once, reduces ``STEPS`` tiles per program (a loop) in registers and
folds the result into one FP32 word with an atomic max (exact: the max of non-negative floats does
not depend on the order). Several tiles per program keep the number of atomics on that one word
small.

NaN would vanish in a hardware max (``max(NaN, y) = y``), so NaN is mapped to +Inf before the
reduction: the result is non-finite whenever x is, which is what the finiteness check looks at.

The atomic max needs a word that starts at zero. A ``torch.zeros(1)`` per tensor would be one more
(fill) kernel launch per quantized operand, and an emulated NVFP4 step is bound by launches, so
:func:`zeroed_words` hands out never-used words of a larger buffer zeroed once: one fill per
``POOL_WORDS`` words. A word is handed out once and never recycled, so a CUDA graph that replays an
amax pass must zero its words on every replay: a capture calls :func:`start_new_pool` first, so its
first word comes from a buffer allocated, and zero-filled, inside the capture (the fill is replayed
too), and again at its end, so that eager code never gets a word that replays rewrite.
"""

import threading

import torch
import triton
import triton.language as tl

POOL_WORDS = 8192
"""FP32 words per zero-filled buffer of :func:`zeroed_words` (32 KiB: one fill per ~2700 layers)."""

_pools: dict[torch.device, tuple[torch.Tensor, int]] = {}  # device -> (buffer, first unused word)
_pool_lock = threading.Lock()


def zeroed_words(n: int, device: torch.device) -> torch.Tensor:
    """``n`` FP32 zeros on ``device`` that nothing else has used or will use (a view of a shared buffer;
    the caller may write them). Equal to ``torch.zeros(n)`` without a fill launch per call."""
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
    """``max(|x|)`` of a 2-D tensor with unit last-dim stride, as an FP32 tensor of shape [1]
    (+Inf when x holds NaN or Inf). Default tile: the fastest of an H200 sweep (16384x4096 BF16)."""
    m, n = x.shape
    amax = zeroed_words(1, x.device)
    grid = (triton.cdiv(m, block_m * steps), triton.cdiv(n, block_n))
    _abs_max_kernel[grid](
        x, amax, m, n, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, STEPS=steps, num_warps=num_warps
    )
    return amax
