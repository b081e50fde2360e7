"""Where the fused Triton quantize kernels run: CUDA, or the CPU under ``TRITON_INTERPRET=1``.

Every caller asks :func:`fused_for` through this module at call time, so a test that replaces it
switches every quantizer and GEMM to the torch reference at once.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.lru_cache(maxsize=1)
def _fused_nvfp4():
    """The fused 'quantize to BF16 block values' kernels, or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from inkling_fp4.numerics.kernels import triton_nvfp4  # needs triton

    return triton_nvfp4


def fused_for(t: torch.Tensor):
    """The Triton kernels for tensors on ``t``'s device: CUDA, or CPU under TRITON_INTERPRET=1
    (how the tests run them without a GPU); None where the torch reference runs."""
    if t.is_cuda or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        return _fused_nvfp4()
    return None


@functools.lru_cache(maxsize=16)
def signs_on(signs: tuple[float, ...] | None, device: torch.device) -> torch.Tensor | None:
    return None if signs is None else torch.tensor(signs, dtype=torch.float32, device=device)
