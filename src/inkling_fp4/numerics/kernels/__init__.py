"""Triton kernels for the number formats: the fast CUDA path of ``numerics``, bit for bit the torch
reference (round to nearest) at memory bandwidth. common.py holds the shared device functions;
amax.py, nvfp4_quantize.py, nvfp4_rht.py (the wgrad operands), nvfp4_block_values.py and
triton_nvfp4.py (the API) are NVFP4; mxfp4_quantize.py is MXFP4; fp8_quantize.py and
fp8_epilogue.py are FP8. The tests run them on CPU under ``TRITON_INTERPRET=1``.
"""

import importlib.util
import os

import torch


def available() -> bool:
    """True when Triton is importable and there is a device to run it: CUDA, or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
