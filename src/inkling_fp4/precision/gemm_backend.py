"""One GEMM of a quantized linear layer on its backend (:mod:`.gemm` emulated, :mod:`.native_fp8`)."""

from __future__ import annotations

import torch

from inkling_fp4.precision import native_fp8
from inkling_fp4.precision.backends import native_fp8_blockwise_out_dtypes
from inkling_fp4.precision.gemm import Operand, emulated_matmul
from inkling_fp4.precision.recipes import TENSORWISE


def matmul(
    a: Operand, b: Operand, *, backend: str, out_dtype: torch.dtype, size: tuple[int, int]
) -> torch.Tensor:
    """out [size] = a · bᵀ on ``backend``: native FP8 where it runs, exact emulation otherwise."""
    if backend == "native-fp8" and a.spec.format in ("e4m3", "e5m2"):
        if a.spec.block == TENSORWISE:
            return native_fp8.native_fp8_matmul(a, b, out_dtype)[: size[0], : size[1]]
        dtypes = native_fp8_blockwise_out_dtypes(a.q.data.device)
        if out_dtype in dtypes:
            return native_fp8.native_fp8_matmul(a, b, out_dtype)[: size[0], : size[1]]
        if torch.bfloat16 in dtypes:  # e.g. no FP32 output for blockwise scaling in this cuBLAS
            return native_fp8.native_fp8_matmul(a, b, torch.bfloat16)[: size[0], : size[1]].to(out_dtype)
    return emulated_matmul(a, b, out_dtype, size)
