"""The output projections' gradient written as FP8 by the next norm's backward (delayed scaling).

Why: a block's mixer ends in one linear (Mamba-2's out_proj, the MLP's down_proj, attention's o_proj)
whose output is added to the residual stream inside the next block's norm kernel (``FusedFP8Block.forward``).
That output's gradient is the residual stream's gradient there, which the norm's backward kernel
computes anyway and stores twice: in FP32 for the residual stream, and in BF16 for the linear, whose
backward then reads the BF16 copy and quantizes it into its dgrad and wgrad operands. With the
linear's delayed dy scale the norm's kernel stores FP8 bytes instead of the BF16 copy, each value
rounded to BF16 first as that copy would hold it, and records the amax
(``numerics/kernels/fp8_epilogue.py``); the wgrad layout is then a transpose of 1-byte elements. Per
block and step: 1 byte per element fewer written by the norm, and a read of 1 and a write of 1 instead
of the quantizer's read of 2 and write of 2 (hybrid-350m: 33 linears, 32768 x 1024 each).

The handoff is a one-block FP8 :class:`~inkling_fp4.model.grad_slab.GradSlab`: the block makes it for
its output linear (:func:`output_grad`), hands it to the mixer (``dy_fp8``, down to the linear's
autograd function) and returns it beside the output; the next norm's backward writes the bytes into it
and returns its placeholder as the output's gradient, and the linear's backward takes the bytes
(:meth:`GradSlab.fp8_operands`). A consumer that returns values instead (the norm's torch reference,
or any other use of the output) has them quantized into the slab by the linear: the same bytes. The
bits are those of the unfused path (``tests/test_residual_fp8.py``).
"""

from __future__ import annotations

import torch

from inkling_fp4.model.compiled import fast_forms_on
from inkling_fp4.model.grad_slab import FP8Scaling, GradSlab
from inkling_fp4.precision.quant_linear import QuantLinear


def applies(linear: QuantLinear, x: torch.Tensor) -> bool:
    """Whether :func:`output_grad` makes a slab for ``linear`` writing a block's output, x [..., D] the
    block's input: a training forward on the GPU kernels, the linear's x and dy delayed FP8 pairs, and
    sizes the FP8 GEMMs take without padding (16 | tokens, 16 | D)."""
    tokens = x.numel() // x.shape[-1]
    sizes = tokens % 16 == 0 and linear.out_features % 16 == 0
    return torch.is_grad_enabled() and sizes and fast_forms_on(x) and linear.delayed_fp8_pairs()


def output_grad(linear: QuantLinear, x: torch.Tensor) -> GradSlab:
    """The FP8 slab for the gradient of ``linear``'s output ([..., D] BF16, x's leading dims) under its
    delayed dy scale, where :func:`applies`."""
    words = linear.delayed_words()
    scaling = FP8Scaling(
        words.dy_used.reshape(1), words.dy_record.reshape(1), linear.recipe.dgrad.a.format == "e5m2"
    )
    like = torch.empty((), device=x.device, dtype=torch.bfloat16).expand(*x.shape[:-1], linear.out_features)
    return GradSlab(like, [linear.out_features], scaling)
