"""What every glue kernel shares: the numerics contract, interpreter-safe FP32 helpers, the tile
choice and the launch plumbing.

Numerics: FP32 math, each output rounded once. Forward kernels compile without FMA contraction
(``enable_fp_fusion=False``), so elementwise math matches the eager reference bit for bit (a norm's row
sum and transcendentals may differ in the last bit); gradients agree closely, not bitwise. Parameter
gradients are summed per program over fixed row chunks into an FP32 buffer: deterministic, no atomics.

A program covers [BLOCK_R, BLOCK_W] rows by the whole width (row-strided, last dim contiguous), so a
row's reduction never leaves it. Under ``TRITON_INTERPRET=1`` the helpers use numpy math and convert
BF16 through its bits (no libdevice there, and its BF16 casts truncate).

NOTE a kernel's FP8 variant (``fp8_epilogue_kwargs``) sums a row in its BF16 variant's order only where
Triton lays the two out alike: on an H200 (Triton 3.6) the norm's and gated norm's FP8 forwards at 4 and
8 warps put a few bytes one code off. The GPU tests compare every byte; run them after any tile change.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from inkling_fp4.model.grad_slab import AmaxGradBlock, FP8GradBlock, FP8Scaling
from inkling_fp4.model.ssd_kernels.tuning import INTERPRET
from inkling_fp4.numerics.kernels.fp8_quantize import conversion_instruction
from inkling_fp4.numerics.kernels.nvfp4_rht import native_bf16

CHUNK_ROWS = 64  # rows per backward program: one row of the parameter-gradient partial sums
TILE_FWD = 4096  # elements of a forward program's [BLOCK_R, BLOCK_W] tile (BLOCK_R = TILE // BLOCK_W)
TILE_BWD = 1024  # the backward's: it holds more tensors live per element
PER_THREAD = 4  # tile elements per thread (the gated backward sets its own: gated_norm_kernels.py)

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

if INTERPRET:
    # Plain functions, not @triton.jit: the interpreter re-patches triton.language per jit call.
    # BF16 goes through its bits: a BF16 number is the top half of the FP32 number of the same value.

    def to_f32(v):
        if v.dtype != tl.bfloat16:
            return v.to(tl.float32)
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)

    def load_f32(ptrs, mask):
        return to_f32(tl.load(ptrs, mask=mask, other=0.0))

    def round_to(v, DTYPE):
        """FP32 v rounded to DTYPE, to nearest even (BF16 through its bits; NaN stays NaN)."""
        if DTYPE != tl.bfloat16:
            return v.to(DTYPE)
        bits = v.to(tl.uint32, bitcast=True)
        top = tl.where(v != v, (bits >> 16) | 0x40, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
        return top.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    def rsqrt(v):
        return 1.0 / tl.sqrt(v)

    def exp(v):
        return tl.exp(v)

    def log1p(v):
        """log(1 + v) for FP32 v >= 0: Goldberg's log(w) v / (w - 1), w = 1 + v, in FP64."""
        v64 = v.to(tl.float64)
        w = 1.0 + v64
        ratio = v64 / tl.where(w == 1.0, 1.0, w - 1.0)
        return tl.where(w == 1.0, v64, tl.log(w) * ratio).to(tl.float32)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def to_f32(v):
        return v.to(tl.float32)

    @triton.jit
    def load_f32(ptrs, mask):
        return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def round_to(v, DTYPE: tl.constexpr):
        return v.to(DTYPE)  # round to nearest even

    @triton.jit
    def rsqrt(v):
        return libdevice.rsqrt(v)

    @triton.jit
    def exp(v):
        return libdevice.exp(v)

    @triton.jit
    def log1p(v):
        return libdevice.log1p(v)


def check_inputs(*tensors: torch.Tensor) -> None:
    """Refuse dtypes the kernels do not take, and non-CUDA tensors outside the interpreter."""
    for t in tensors:
        if t.dtype not in TL_DTYPES:
            raise ValueError(
                f"the Triton glue kernels take float32, bfloat16 or float16 tensors, not {t.dtype}"
            )
    if not (tensors[0].is_cuda or INTERPRET):
        raise ValueError(
            f"the Triton glue kernels need CUDA tensors (got {tensors[0].device}); on CPU use the references"
        )


def on_device(t: torch.Tensor):
    """The context that launches on t's GPU (nothing under the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """t [..., width] as [R, width] with unit column stride: a view when the leading dims collapse."""
    t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


def grad_buffer(into, like: torch.Tensor) -> torch.Tensor | FP8GradBlock | AmaxGradBlock:
    """The tensor a backward writes like's gradient into: ``into()`` (a column block of a shared buffer,
    ``model/grad_slab.py``, or an :class:`FP8GradBlock` / :class:`AmaxGradBlock`) or a new one."""
    if into is None:
        return torch.empty(like.shape, device=like.device, dtype=like.dtype)
    target = into()
    out = target.data if isinstance(target, FP8GradBlock | AmaxGradBlock) else target
    dtype = torch.uint8 if isinstance(target, FP8GradBlock) else like.dtype
    ok = out.shape == like.shape and out.dtype == dtype and out.device == like.device
    if not ok or out.stride(-1) != 1 or not _rows_of_one_stride(out):
        raise ValueError(
            f"a gradient buffer must be {tuple(like.shape)} {dtype} on {like.device} with unit column "
            f"stride and rows of one stride; got {tuple(out.shape)} {out.dtype} strides {out.stride()}"
        )
    return target


def epilogue_args(
    target: torch.Tensor | FP8GradBlock | AmaxGradBlock,
) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """(tensor the kernel stores into, FP8 epilogue launch arguments, gradient the backward returns)."""
    if isinstance(target, FP8GradBlock):
        return target.data, fp8_epilogue_kwargs(target.scaling, target.data), target.placeholder
    if isinstance(target, AmaxGradBlock):
        return target.data, fp8_epilogue_kwargs(None, target.data), target.data
    return target, fp8_epilogue_kwargs(None, target), target


def amax_epilogue_kwargs(
    amax_pair: tuple[int, torch.Tensor] | None, placeholder: torch.Tensor, block_n: int | None = None
) -> dict:
    """The launch arguments of a kernel's NVFP4 amax epilogue (``nvfp4_rht.store_amax_pair``): on with
    ``amax_pair`` (RHT sign bits, FP32 words [2] at zero), off without (``placeholder`` for the words).
    ``block_n``: the features read back at a time (PAIR_BLOCK_N), where the kernel takes it."""
    sign_bits, words = amax_pair or (0, placeholder)
    kwargs = dict(
        pair_ptr=words, AMAX_PAIR=amax_pair is not None, SIGN_BITS=sign_bits, NATIVE_BF16=native_bf16()
    )
    return kwargs if block_n is None else dict(kwargs, PAIR_BLOCK_N=block_n)


def amax_pair_kwargs(target, rows_each: int, placeholder: torch.Tensor, block_n: int | None = None) -> dict:
    """:func:`amax_epilogue_kwargs` for a gradient kernel writing ``target``: on for an
    :class:`AmaxGradBlock` where each program stores whole 16-token groups (``rows_each`` rows from a
    multiple of them), which it then marks as reduced; else off."""
    on = isinstance(target, AmaxGradBlock) and rows_each % 16 == 0
    if on:
        target.reduced()
    amax_pair = (target.amaxes.sign_bits, target.amaxes.words) if on else None
    return amax_epilogue_kwargs(amax_pair, placeholder, block_n)


def fp8_epilogue_kwargs(scaling: FP8Scaling | None, out: torch.Tensor) -> dict:
    """The FP8 epilogue's launch arguments (``numerics/kernels/fp8_epilogue.py``); FP8=False without
    ``scaling``."""
    if scaling is None:
        return dict(amax_ptr=out, record_ptr=out, FP8=False, E5M2=False, HW=False)
    hw = conversion_instruction(out.device)
    return dict(amax_ptr=scaling.amax, record_ptr=scaling.record, FP8=True, E5M2=scaling.e5m2, HW=hw)


def _rows_of_one_stride(t: torch.Tensor) -> bool:
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _tile(width: int, elems: int, per_thread: int) -> tuple[int, int, int]:
    """(BLOCK_W, BLOCK_R, num_warps) of a tile of about ``elems`` elements, ``per_thread`` per thread.

    NOTE plain Python, cached: ``triton.next_power_of_2`` and ``triton.cdiv`` are jit functions in triton
    3.9, microseconds of host time per call."""
    block_w = 1 << (width - 1).bit_length()
    block_r = max(1, elems // block_w)
    return block_w, block_r, max(4, min(16, block_r * block_w // (32 * per_thread)))


def forward_tile(width: int) -> tuple[int, int, int]:
    return _tile(width, TILE_FWD, PER_THREAD)


def backward_tile(width: int, per_thread: int | None = None, chunk_rows: int | None = None):
    """(BLOCK_W, BLOCK_R, num_warps, CHUNK) of a backward program walking CHUNK rows tile by tile."""
    block_w, block_r, warps = _tile(width, TILE_BWD, per_thread or PER_THREAD)
    return block_w, block_r, warps, max(chunk_rows or CHUNK_ROWS, block_r)
