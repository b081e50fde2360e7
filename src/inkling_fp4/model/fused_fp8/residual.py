"""The output projections' gradient written as FP8 by the next norm's backward (delayed scaling).

A block's output linear is added to the residual stream inside the next block's norm kernel, whose
backward computes that gradient anyway; it stores it as FP8 bytes (``numerics/kernels/fp8_epilogue.py``)
into a one-block ``GradSlab`` that the block makes (:func:`output_grad`) and passes down to the linear
(``dy_fp8``). A consumer returning values instead has them quantized into the slab: the same bytes
(``tests/test_residual_fp8.py``).
"""

from __future__ import annotations

import torch

from inkling_fp4.model.compiled import fast_forms_on
from inkling_fp4.model.grad_slab import FP8Scaling, GradSlab
from inkling_fp4.precision.quant_linear import QuantLinear


def applies(linear: QuantLinear, x: torch.Tensor) -> bool:
    """Whether :func:`output_grad` applies: a training forward on the GPU kernels, delayed FP8 pairs, and
    16 | tokens, 16 | D."""
    tokens = x.numel() // x.shape[-1]
    sizes = tokens % 16 == 0 and linear.out_features % 16 == 0
    return torch.is_grad_enabled() and sizes and fast_forms_on(x) and linear.delayed_fp8_pairs()


def output_grad(linear: QuantLinear, x: torch.Tensor) -> GradSlab:
    """The FP8 slab for the gradient of ``linear``'s output ([..., D] BF16) under its delayed dy scale."""
    words = linear.delayed_words()
    scaling = FP8Scaling(
        words.dy_used.reshape(1), words.dy_record.reshape(1), linear.recipe.dgrad.a.format == "e5m2"
    )
    like = torch.empty((), device=x.device, dtype=torch.bfloat16).expand(*x.shape[:-1], linear.out_features)
    return GradSlab(like, [linear.out_features], scaling)
