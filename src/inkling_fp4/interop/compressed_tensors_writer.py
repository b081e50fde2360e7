"""The ``nvfp4-compressed-tensors`` export: the ``nvfp4-pack-quantized`` layout of compressed-tensors
(vLLM's ``compressed-tensors`` quantization, llm-compressor's output).

Per quantized linear module ``<m>`` (transformers' names):

    <m>.weight_packed        uint8          [out, in/2]   two E2M1 codes a byte, even element low
    <m>.weight_scale         float8_e4m3fn  [out, in/16]  block scales (16×16 tiles, per row)
    <m>.weight_global_scale  float32        [1]           6·448 / amax = S_enc (the inverse of
                                                          ModelOpt's weight_scale_2)
    <m>.input_global_scale   float32        [1]           6·448 / calibrated input amax

so W = code · weight_scale / weight_global_scale. config.json's ``quantization_config`` has one
``tensor_group`` scheme (group size 16, E4M3 scales) for weights and dynamic-local input
activations, targets ``Linear``, and ``ignore`` lists every linear module the recipe keeps in BF16,
the embeddings and the LM head. Unquantized tensors are BF16 (A_log, D, dt_bias FP32).
"""

from __future__ import annotations

import torch

from inkling_fp4.interop.nvfp4_weights import E2M1_E4M3_MAX, NVFP4Weight, replace_quantized

FORMAT = "nvfp4-pack-quantized"


def _fp4_args(dynamic) -> dict:
    return {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "group_size": 16,
        "strategy": "tensor_group",
        "dynamic": dynamic,
        "scale_dtype": "torch.float8_e4m3fn",
    }


def compressed_tensors(
    base: dict[str, torch.Tensor], quantized: dict[str, NVFP4Weight], input_amax: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The export's tensors: ``base`` (transformers' names, FP32) with the quantized modules replaced."""

    def tensors_of(module: str, w: NVFP4Weight, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            f"{module}.weight_packed": w.codes,
            f"{module}.weight_scale": w.scales,
            f"{module}.weight_global_scale": w.encode_scale.reshape(1),
            f"{module}.input_global_scale": (torch.full_like(amax, E2M1_E4M3_MAX) / amax).reshape(1),
        }

    return replace_quantized(base, quantized, input_amax, tensors_of)


def compressed_tensors_config(ignored: list[str]) -> dict:
    """config.json's ``quantization_config``."""
    scheme = {
        "targets": ["Linear"],
        "weights": _fp4_args(False),
        "input_activations": {**_fp4_args("local"), "observer": "static_minmax"},
        "output_activations": None,
        "format": FORMAT,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": sorted(ignored),
        "kv_cache_scheme": None,
    }
