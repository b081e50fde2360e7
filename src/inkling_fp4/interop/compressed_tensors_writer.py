"""The ``nvfp4-compressed-tensors`` export: the ``nvfp4-pack-quantized`` layout of compressed-tensors
(vLLM's ``compressed-tensors`` quantization, llm-compressor's output).

Per quantized linear module ``<m>`` (transformers' names):

    <m>.weight_packed        uint8          [out, in/2]   two E2M1 codes a byte, even element low
    <m>.weight_scale         float8_e4m3fn  [out, in/16]  block scales (16×16 tiles, per row)
    <m>.weight_global_scale  float32        [1]           6·448 / amax = S_enc (the inverse of
                                                          ModelOpt's weight_scale_2)
    <m>.input_global_scale   float32        [1]           6·448 / calibrated input amax

so W = code · weight_scale / weight_global_scale. config.json's ``quantization_config`` has one
``tensor_group`` scheme (group size 16, E4M3 scales) for weights and input activations; ``ignore``
lists the modules kept in BF16 (:data:`~.export.ALWAYS_EXCLUDED` among them).
"""

from __future__ import annotations

from inkling_fp4.interop.nvfp4_weights import NVFP4Layout

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


def compressed_tensors_metadata(ignored: list[str], version: str) -> tuple[dict, dict[str, str]]:
    """(config.json's ``quantization_config``, no extra files); ``version`` is not recorded."""
    scheme = {
        "targets": ["Linear"],
        "weights": _fp4_args(False),
        "input_activations": {**_fp4_args("local"), "observer": "static_minmax"},
        "output_activations": None,
        "format": FORMAT,
    }
    config = {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme},
        "ignore": sorted(ignored),
        "kv_cache_scheme": None,
    }
    return config, {}


LAYOUT = NVFP4Layout(
    codes="weight_packed",
    scales="weight_scale",
    weight_global="weight_global_scale",
    input_global="input_global_scale",
    decode=False,
    scale_shape=(1,),
    metadata=compressed_tensors_metadata,
)
compressed_tensors = LAYOUT.tensors  # the export's tensors in this layout
