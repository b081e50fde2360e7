"""A quantized GEMM operand, and the zero padding that makes an operand a whole number of blocks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from inkling_fp4.precision.recipes import OperandQuant


@dataclass
class Operand:
    """A quantized GEMM operand, logically [rows, contraction] (stored transposed if ``transposed``)."""

    q: Any
    """An NVFP4Tensor, MXFP4Tensor, FP8Tensor or FP8BlockTensor (inkling_fp4.numerics); None when
    only ``values`` were produced (an operand used at once and never saved)."""
    spec: OperandQuant
    transposed: bool = False
    values: torch.Tensor | None = None
    """BF16 block values written by the quantizer, or None: computed from ``q`` on use."""
    decode_scale: torch.Tensor | None = None
    """The NVFP4 tensor decode scale 1/S_enc as the fused quantizer wrote it (bit for bit
    ``q.decode_scale``); None: computed from ``q.amax`` on use."""
    output_scale: tuple[torch.Tensor, torch.Tensor] | None = None
    """(the other operand's decode scale s, ``decode_scale · s``): the output scale of the GEMM with
    that operand, multiplied by the fused quantizer (:func:`quantize`'s ``scale_with``)."""

    def packed(self) -> Operand:
        """This operand without its BF16 values: what is kept for the backward pass."""
        assert self.q is not None, "an operand quantized without codes cannot be saved"
        return dataclasses.replace(self, values=None, output_scale=None)


def pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Zero-pad a 2-D tensor so its dims are multiples of ``rows`` / ``cols`` (no copy if they are).

    Zeros are exact no-ops everywhere they are used: they do not change a block's amax (nor the
    tensor's), they quantize to 0, and they add nothing to a dot product.
    """
    pr = (-t.shape[0]) % rows
    pc = (-t.shape[1]) % cols
    if pr == 0 and pc == 0:
        return t
    return F.pad(t, (0, pc, 0, pr))
