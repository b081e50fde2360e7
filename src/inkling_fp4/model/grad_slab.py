"""One gradient buffer for a tensor split into column blocks, written in place by the blocks' consumers.

The Mamba-2 mixer splits in_proj's output [B, L, E + C + H] into z, xBC and dt, each read by one
kernel: the gated norm, the conv, dt's softplus. Autograd's backward of a split concatenates the
blocks' gradients into a new [B, L, W] tensor: a full read and write of it, per layer. Here the
consumers' backward kernels write their input gradients straight into column blocks of one buffer
(each consumer takes a ``*_into`` argument, :meth:`GradSlab.into`), and the split's backward hands
that buffer on to in_proj's backward: no copy.

Under delayed-scaled FP8 (``model/in_proj_fp8.py``) the buffer holds FP8 bytes instead: in_proj's
backward needs its output gradient only as FP8 operands, and their scale is known in advance, so each
consumer's kernel writes its block as bytes (an :class:`FP8GradBlock`) and records its amax, and
returns :attr:`FP8GradBlock.placeholder` (zeros, no memory) as the block's gradient.

The buffer is allocated by the first consumer backward that asks for its block, not in the forward,
where it would live through everything in between. The split's backward checks that each gradient it
receives is exactly its block of the buffer. Anything else (a consumer that allocated its own, a
block without a gradient) falls back to the concatenation, so the result is right whatever the
consumers did; a gradient summed in place into its block by autograd (a block read twice) is right
too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inkling_fp4.numerics import fp8
from inkling_fp4.precision.gemm import Operand
from inkling_fp4.precision.recipes import OperandQuant

_ZEROS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def zeros_placeholder(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros of ``shape`` that take no memory and, after the first call per device and dtype, launch
    nothing: one cached zero scalar, expanded (a CUDA-graphed step would otherwise replay a fill kernel
    for each of the model's ~80 placeholders). Inside a CUDA graph capture an uncached scalar is made:
    the capture records its fill, which eager code never sees run."""
    key = (torch.device(device), dtype)
    zero = _ZEROS.get(key)
    if zero is None:
        zero = torch.zeros((), dtype=dtype, device=device)
        if not (zero.is_cuda and torch.cuda.is_current_stream_capturing()):
            _ZEROS[key] = zero
    return zero.expand(shape)


@dataclass
class FP8Scaling:
    """How an FP8 slab's consumers quantize."""

    amax: torch.Tensor
    """FP32 [1]: the delayed scale's amax."""
    record: torch.Tensor
    """FP32 [1]: this step's amax record word."""
    e5m2: bool
    """The format: E5M2, else E4M3."""


@dataclass
class FP8GradBlock:
    """A block of the gradient to be written as tensorwise FP8 bytes under a delayed scale.

    The consumer's kernel rounds each gradient value to BF16 (the value a BF16 buffer would hold),
    stores ``fp8(value · fp8_max / amax)`` in ``data`` and folds max |value| into the record word
    (``numerics/kernels/fp8_epilogue.py``)."""

    data: torch.Tensor
    """uint8 [..., width], a column block of the byte buffer (rows of one stride)."""
    scaling: FP8Scaling
    placeholder: torch.Tensor
    """What the consumer's backward returns as the block's gradient: zeros of its shape and dtype
    (an expanded scalar), which tell the split's backward the bytes were written."""


class GradSlab:
    """The gradient buffer of one split ``t [..., sum(widths)]``; block i holds block i's gradient,
    as values of t's dtype, or with ``fp8`` as FP8 bytes (:class:`FP8GradBlock`)."""

    def __init__(self, like: torch.Tensor, widths: list[int], fp8: FP8Scaling | None = None):
        self._shape, self._dtype, self._device = like.shape, like.dtype, like.device
        self._bounds = [0]
        for w in widths:
            self._bounds.append(self._bounds[-1] + w)
        self.fp8 = fp8
        self._zero = zeros_placeholder((), like.dtype, like.device) if fp8 is not None else None
        self.buffer: torch.Tensor | None = None

    def _view(self, i: int) -> torch.Tensor:
        if self.buffer is None:
            dtype = torch.uint8 if self.fp8 is not None else self._dtype
            self.buffer = torch.empty(self._shape, dtype=dtype, device=self._device)
        return self.buffer[..., self._bounds[i] : self._bounds[i + 1]]

    def block(self, i: int) -> torch.Tensor | FP8GradBlock:
        """Block i of the buffer, a strided view [..., widths[i]] (the buffer is allocated on first
        use); in an FP8 slab, that view of the bytes with its scaling."""
        view = self._view(i)
        if self.fp8 is None:
            return view
        return FP8GradBlock(view, self.fp8, self._zero.expand(view.shape))

    def into(self, i: int) -> Callable[[], torch.Tensor | FP8GradBlock]:
        """What a consumer of block i takes as its ``*_into`` argument: called in its backward, it
        returns the tensor (or FP8 block) to write the block's gradient into."""
        return functools.partial(self.block, i)

    def holds(self, grad: torch.Tensor | None, i: int) -> bool:
        """Whether ``grad`` is exactly block i of the buffer (same memory, shape, strides, dtype); in an
        FP8 slab, whether it is block i's placeholder (the consumer wrote the bytes)."""
        if grad is None or self.buffer is None:
            return False
        b = self._view(i)
        if self.fp8 is not None:  # leading dims may come flattened (a linear's [M, W] view of them)
            zeros = grad.data_ptr() == self._zero.data_ptr() and not any(grad.stride())
            return zeros and grad.shape[-1] == b.shape[-1] and grad.numel() == b.numel()
        return (
            grad.data_ptr() == b.data_ptr()
            and grad.shape == b.shape
            and grad.stride() == b.stride()
            and grad.dtype == b.dtype
        )

    def fp8_operands(self, grads: tuple, dgrad: OperandQuant, wgrad: OperandQuant) -> tuple[Operand, Operand]:
        """An FP8 slab's tensor gradient as its dgrad and wgrad operands (dy [M, W] and dyᵀ [W, M],
        ``gemm.fp8_operand_pair``'s form) from the bytes the consumers wrote, ``grads`` holding each
        block's gradient as received. A block whose consumer returned values instead of its
        placeholder is quantized into the buffer (the bytes its kernel would have written); a block
        without a gradient is zero. The buffer is handed over (the slab lets go of it)."""
        dtype = torch.float8_e5m2 if self.fp8.e5m2 else torch.float8_e4m3fn
        for i, g in enumerate(grads):
            block = self.block(i)
            if g is None:  # zero bytes (FP8 zero), nothing to record
                block.data.zero_()
            elif not self.holds(g, i):
                w = block.data.shape[-1]
                q = fp8.quantize_tensorwise(
                    g.reshape(-1, w), dtype, check=False, amax=self.fp8.amax, record=self.fp8.record
                )
                block.data.view(-1, w).copy_(q.data.view(torch.uint8))
        rows = self.buffer.view(-1, self._bounds[-1]).view(dtype)  # [M, W]
        self.buffer = None
        rows, cols = fp8.tensorwise_pair_from_rows(rows, self.fp8.amax)  # cols: [W, M]
        return Operand(rows, dgrad), Operand(cols, wgrad)


class _SplitColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, widths, slab):
        ctx.slab, ctx.widths = slab, widths
        ctx.set_materialize_grads(False)
        return tuple(t.split(widths, -1))

    @staticmethod
    def backward(ctx, *grads):
        slab = ctx.slab
        if all(g is None for g in grads):
            slab.buffer = None
            return None, None, None
        if all(slab.holds(g, i) for i, g in enumerate(grads)):
            grad = slab.buffer
        else:  # a consumer did not write into its block
            grad = concatenate(grads, ctx.widths)
        slab.buffer = None
        return grad, None, None


def concatenate(grads: tuple, widths: list[int]) -> torch.Tensor:
    """The blocks' gradients as one tensor (zeros for a block without one): autograd's backward of a
    split, the fallback when a consumer did not write into its block."""
    like = next(g for g in grads if g is not None)
    parts = [
        g if g is not None else like.new_zeros(*like.shape[:-1], w)
        for g, w in zip(grads, widths, strict=True)
    ]
    return torch.cat(parts, -1)


def split_with_grad_slab(t: torch.Tensor, widths: list[int]) -> tuple[tuple[torch.Tensor, ...], GradSlab]:
    """``t.split(widths, -1)`` (views, differentiable) and the :class:`GradSlab` whose blocks their
    consumers may write their gradients into."""
    slab = GradSlab(t, list(widths))
    return _SplitColumns.apply(t, list(widths), slab), slab
