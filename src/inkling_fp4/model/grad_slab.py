"""One gradient buffer for a tensor split into column blocks, written in place by the blocks' consumers.

Autograd's backward of a split concatenates the blocks' gradients into a new tensor, a full read and
write per layer (in_proj's output split into z, xBC and dt). Here the consumers' backward kernels write
straight into column blocks of one buffer (their ``*_into`` argument), which the split's backward hands
on. Under delayed-scaled FP8 the buffer holds FP8 bytes and each consumer returns its block's
placeholder. Under NVFP4 (``SlabAmaxes``) each consumer also reduces the buffer's two tensor amaxes over
its block, and the split hands them to the linear whose gradient the buffer is, once every block's
writer has.

The buffer is allocated by the first consumer backward that asks for it, not in the forward, where it
would live through everything in between. A gradient that is not exactly its block (a consumer that
allocated its own, a block without a gradient) falls back to the concatenation, so the result is
right whatever the consumers did.
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
    """Zeros of ``shape`` without memory or, after the first call, a launch (a CUDA graph would replay a
    fill per placeholder): one cached zero scalar, expanded; uncached inside a graph capture."""
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
    """A gradient block written as tensorwise FP8 bytes under a delayed scale (``fp8_epilogue.py``)."""

    data: torch.Tensor
    """uint8 [..., width], a column block of the byte buffer (rows of one stride)."""
    scaling: FP8Scaling
    placeholder: torch.Tensor
    """Returned by the consumer's backward as the block's gradient: zeros of its shape (an expanded
    scalar), telling the split's backward the bytes were written."""


@dataclass
class SlabAmaxes:
    """A BF16 slab's two NVFP4 tensor amaxes, reduced by the kernels that write its blocks
    (``nvfp4_rht.store_amax_pair``), for the linear whose output gradient the slab is."""

    sign_bits: int
    """The wgrad RHT's sign mask."""
    words: torch.Tensor
    """FP32 [2], zero until the consumers' backward: ``[max |rht(slabᵀ)|, max |slab|]``."""
    box: list
    """The linear's ``dy_amaxes``: it gets ``words`` once every block's writer has reduced them."""


@dataclass
class AmaxGradBlock:
    """A BF16 gradient block whose writer also reduces the slab's amaxes over it; the writer's launch
    says so (:meth:`reduced`) when it passes the words to its kernel."""

    data: torch.Tensor
    amaxes: SlabAmaxes
    slab: GradSlab
    index: int

    def reduced(self) -> None:
        self.slab.reduced.add(self.index)


class GradSlab:
    """The gradient buffer of one split ``t [..., sum(widths)]``; block i holds block i's gradient,
    as values of t's dtype, or with ``fp8`` as FP8 bytes (:class:`FP8GradBlock`); with ``amaxes`` its
    writers also reduce its NVFP4 tensor amaxes (:class:`AmaxGradBlock`)."""

    def __init__(self, like: torch.Tensor, widths: list[int], fp8: FP8Scaling | None = None, amaxes=None):
        self._shape, self._dtype, self._device = like.shape, like.dtype, like.device
        self._bounds = [0]
        for w in widths:
            self._bounds.append(self._bounds[-1] + w)
        self.fp8 = fp8
        self.amaxes: SlabAmaxes | None = amaxes
        self.reduced: set[int] = set()
        """The blocks whose writer reduced the amaxes over them."""
        self._zero = zeros_placeholder((), like.dtype, like.device) if fp8 is not None else None
        self.buffer: torch.Tensor | None = None

    def _view(self, i: int) -> torch.Tensor:
        if self.buffer is None:
            dtype = torch.uint8 if self.fp8 is not None else self._dtype
            self.buffer = torch.empty(self._shape, dtype=dtype, device=self._device)
        return self.buffer[..., self._bounds[i] : self._bounds[i + 1]]

    def block(self, i: int) -> torch.Tensor | FP8GradBlock | AmaxGradBlock:
        """Block i of the buffer [..., widths[i]] (allocated on first use), or its FP8 bytes."""
        view = self._view(i)
        if self.fp8 is not None:
            return FP8GradBlock(view, self.fp8, self._zero.expand(view.shape))
        if self.amaxes is not None:
            return AmaxGradBlock(view, self.amaxes, self, i)
        return view

    def into(self, i: int) -> Callable[[], torch.Tensor | FP8GradBlock | AmaxGradBlock]:
        """A consumer's ``*_into`` for block i: called in its backward, returns where to write."""
        return functools.partial(self.block, i)

    def holds(self, grad: torch.Tensor | None, i: int) -> bool:
        """Whether ``grad`` is exactly block i of the buffer (or, in an FP8 slab, block i's placeholder)."""
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
        """An FP8 slab's gradient as dgrad and wgrad operands (dy [M, W], dyᵀ [W, M]); a block whose consumer
        returned values is quantized into the buffer (the same bytes), one without a gradient is zero."""
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
            if slab.amaxes is not None and slab.reduced == set(range(len(grads))):
                slab.amaxes.box.append(slab.amaxes.words)  # every block's writer reduced its part
        else:  # a consumer did not write into its block
            grad = concatenate(grads, ctx.widths)
        slab.buffer = None
        slab.reduced = set()
        return grad, None, None


def concatenate(grads: tuple, widths: list[int]) -> torch.Tensor:
    """The blocks' gradients as one tensor (zeros for a block without one), as autograd's split backward."""
    like = next(g for g in grads if g is not None)
    parts = [
        g if g is not None else like.new_zeros(*like.shape[:-1], w)
        for g, w in zip(grads, widths, strict=True)
    ]
    return torch.cat(parts, -1)


def split_with_grad_slab(
    t: torch.Tensor, widths: list[int], amaxes: SlabAmaxes | None = None
) -> tuple[tuple[torch.Tensor, ...], GradSlab]:
    """``t.split(widths, -1)`` and the :class:`GradSlab` its consumers may write their gradients into
    (reducing ``amaxes`` over them where given)."""
    slab = GradSlab(t, list(widths), amaxes=amaxes)
    return _SplitColumns.apply(t, list(widths), slab), slab
