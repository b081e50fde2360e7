"""Triton kernels for the number formats: the fast CUDA path of ``numerics``.

Why a separate package: the torch code in ``numerics`` is the reference and runs everywhere; these
kernels reproduce it bit for bit (round to nearest) at memory bandwidth on CUDA, and nothing outside
``numerics`` imports them directly except for the fused ``fake_quantize*`` entry points. Files:

- ``common.py``: shared device functions (tensor scale, E4M3 rounding, E2M1 codes, packing, RNG);
- ``amax.py``: the global abs-max pass;
- ``nvfp4_quantize.py``: 1x16 / 16x16 quantization along rows;
- ``nvfp4_rht.py``: the fused RHT + transpose + quantize of the wgrad operands;
- ``nvfp4_block_values.py``: packed codes + scales -> BF16 block values;
- ``triton_nvfp4.py``: the public API (allocation, seeds, the NVFP4Tensor results);
- ``fp8_quantize.py``: FP8 quantization, tensorwise (current or delayed, optionally of the squared
  ReLU or its gradient) and blockwise, in the layouts the GEMMs read;
- ``fp8_epilogue.py``: FP8 bytes stored by the kernel that produces a tensor (the Mamba-2 backward
  kernels), and a byte transpose.

The kernels also run on CPU under ``TRITON_INTERPRET=1`` (slowly), which is how the tests check
them without a GPU.
"""

import importlib.util
import os

import torch


def available() -> bool:
    """True when Triton is importable and there is a device to run it: CUDA, or the interpreter."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
