"""The ``nvfp4-modelopt`` export: NVIDIA ModelOpt's NVFP4 layout (TensorRT-LLM, vLLM's ``modelopt``).

Per quantized linear module ``<m>`` (transformers' names):

    <m>.weight          uint8          [out, in/2]   two E2M1 codes a byte, even element low
    <m>.weight_scale    float8_e4m3fn  [out, in/16]  block decode scales (16×16 tiles, per row)
    <m>.weight_scale_2  float32        []            amax / (6·448) = S_dec, the global decode scale
    <m>.input_scale     float32        []            calibrated input amax / (6·448)

so W = code · weight_scale · weight_scale_2. ``hf_quant_config.json`` and config.json's
``quantization_config`` say ``quant_algo: NVFP4``, ``group_size: 16``, and list in ``exclude_modules``
the modules kept in BF16. Unquantized tensors are as :func:`~.nvfp4_weights.keep_dtype` says.
"""

from __future__ import annotations

import json

from inkling_fp4.interop.nvfp4_weights import NVFP4Layout

QUANT_ALGO = "NVFP4"
GROUP_SIZE = 16


def modelopt_metadata(excluded: list[str], version: str) -> tuple[dict, dict[str, str]]:
    """(config.json's quantization_config, {hf_quant_config.json: its text})."""
    quant = {
        "quant_algo": QUANT_ALGO,
        "group_size": GROUP_SIZE,
        "kv_cache_quant_algo": None,
        "exclude_modules": sorted(excluded),
    }
    hf_quant = {"producer": {"name": "fp4train", "version": version}, "quantization": quant}
    text = json.dumps(hf_quant, indent=2, sort_keys=True) + "\n"
    return {"quant_method": "modelopt", **quant}, {"hf_quant_config.json": text}


LAYOUT = NVFP4Layout(
    codes="weight",
    scales="weight_scale",
    weight_global="weight_scale_2",
    input_global="input_scale",
    decode=True,
    scale_shape=(),
    metadata=modelopt_metadata,
)
modelopt_tensors = LAYOUT.tensors  # the export's tensors in this layout
