"""The loss and the validation pass, shared by the training loop and the benchmarks.

The loss is a sum over the ``loss_mask`` positions; the loop divides by the global batch's
trained-token count, so the gradient does not depend on how the batch is split over micro batches
and ranks. :func:`all_gemms_in_bf16` gives the BF16 view the paper evaluates in, leaving the policy's
state untouched.

Legend: B sequences, L sequence length, V vocabulary.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from inkling_fp4 import distributed as D
from inkling_fp4.precision.quant_linear import QuantLinear


def masked_cross_entropy(
    logits_BLV: torch.Tensor, targets_BL: torch.Tensor, mask_BL: torch.Tensor
) -> torch.Tensor:
    """Sum (not mean) of the FP32 cross-entropy over the positions where ``mask_BL`` is True."""
    V = logits_BLV.shape[-1]
    ce = F.cross_entropy(logits_BLV.float().reshape(-1, V), targets_BL.reshape(-1), reduction="none")
    return (ce * mask_BL.reshape(-1)).sum()


@torch.no_grad()
def evaluate(model: nn.Module, batches: list, autocast, dist: D.DistInfo) -> float:
    """Mean validation cross-entropy per trained target token."""
    was_training = model.training
    model.eval()
    device = dist.device
    total = torch.zeros((), device=device, dtype=torch.float64)
    count = torch.zeros((), device=device, dtype=torch.float64)
    for b in batches:
        b = b.to(device)
        with autocast:
            logits_BLV = model(b.input_ids, doc_ids=b.doc_ids)
        total += masked_cross_entropy(logits_BLV, b.targets, b.loss_mask).double()
        count += b.num_tokens
    model.train(was_training)
    return (D.all_reduce_sum(total, dist) / D.all_reduce_sum(count, dist)).item()


@contextlib.contextmanager
def all_gemms_in_bf16(model: nn.Module):
    """Every QuantLinear in BF16 for the block, then each back to the recipe it had."""
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    saved = [m.recipe for m in layers]
    for m in layers:
        m.recipe = None
    try:
        yield
    finally:
        for m, r in zip(layers, saved, strict=True):
            m.recipe = r
