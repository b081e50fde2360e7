"""The checks of a Nemotron-H directory, before fp4train builds a model from it or writes anything.

    config.json     the keys the model is built from: present where required, of their JSON type,
                    in range, and a layer pattern that matches num_hidden_layers
    *.safetensors   a header that parses and a file of the size it declares; every tensor the config
                    predicts present once, floating-point, of the predicted shape, and no other
    the values      finite (a NaN would otherwise surface as a loss spike blamed on the LR)

The header checks read no tensor data, so ``info`` stays cheap; the values are checked as the
importer reads them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from inkling_fp4.errors import UserError
from inkling_fp4.interop.nemotron_h import layer_pattern, to_hf_tensors
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.runs.checkpoint import model_tensors

CONFIG_FILE = "config.json"

_POSITIVE = "a positive integer"
REQUIRED_INTS = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "mamba_num_heads",
                 "mamba_head_dim", "ssm_state_size")  # fmt: skip
OPTIONAL_INTS = (
    "n_groups",
    "mamba_n_groups",
    "conv_kernel",
    "mamba_d_conv",
    "chunk_size",
    "mamba_chunk_size",
)
"""Integers that may be absent (fp4train's default applies)."""
NULLABLE_INTS = ("num_key_value_heads", "head_dim", "num_hidden_layers", "max_position_embeddings")
"""Integers that may be absent or null (derived from the others, or fp4train's default)."""
OPTIONAL_NUMBERS = {"time_step_min": 0.0, "time_step_max": None, "time_step_floor": 0.0,
                    "layer_norm_epsilon": None, "initializer_range": None}  # fmt: skip
"""Numbers that may be absent: key -> the least value allowed (None: above 0)."""

FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")
ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}  # fmt: skip
_MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header


def check_config(hf: dict) -> None:
    """Refuse a config.json whose model keys are missing, mistyped, out of range or inconsistent."""
    for key in REQUIRED_INTS:
        if key not in hf:
            raise UserError(f"{CONFIG_FILE}: {key} is missing; expected {_POSITIVE}")
        _check_int(key, hf[key])
    for key in OPTIONAL_INTS:
        if key in hf:
            _check_int(key, hf[key])
    for key in NULLABLE_INTS:
        if hf.get(key) is not None:
            _check_int(key, hf[key])
    for key, least in OPTIONAL_NUMBERS.items():
        if key in hf:
            _check_number(key, hf[key], least)
    pattern = layer_pattern(hf)
    layers = hf.get("num_hidden_layers")
    source = "layers_block_type" if hf.get("layers_block_type") is not None else "hybrid_override_pattern"
    if layers is not None and layers != len(pattern):
        raise UserError(
            f"{CONFIG_FILE}: num_hidden_layers is {layers} but {source} has {len(pattern)} layers "
            f"({pattern}); expected {len(pattern)}, one layer per pattern entry"
        )
    text = hf.get("hybrid_override_pattern")
    if source == "layers_block_type" and isinstance(text, str) and text != pattern:
        raise UserError(
            f"{CONFIG_FILE}: hybrid_override_pattern is {text!r} but layers_block_type says {pattern!r}; "
            "expected the two to agree"
        )


def _found(value) -> str:
    return f"{value!r} (a {type(value).__name__})" if not isinstance(value, (int, float)) else repr(value)


def _check_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{CONFIG_FILE}: {key} is {_found(value)}; expected {_POSITIVE}")


def _check_number(key: str, value, least: float | None) -> None:
    expected = "a number > 0" if least is None else f"a number >= {least:g}"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if least is None else value < least):
        raise UserError(f"{CONFIG_FILE}: {key} is {_found(value)}; expected {expected}")


# ----------------------------------------------------------------------------------------------
# safetensors files


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """transformers' tensor names -> the shape a model of ``cfg`` gives each (no memory: meta tensors)."""
    with torch.device("meta"):
        model = HybridLM(cfg)
    return {k: tuple(v.shape) for k, v in to_hf_tensors(cfg, dict(model_tensors(model))).items()}


def read_header(file: Path) -> dict[str, dict]:
    """The tensor entries of a safetensors file's header, after checking that the header parses and
    that the file has the size it declares (a truncated download or copy fails here)."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or n > min(size - 8, _MAX_HEADER):
            raise UserError(
                f"{file.name}: not a readable safetensors file ({size} bytes, header length "
                f"{n if n >= 0 else 'missing'}); expected an 8-byte header length and a JSON header within "
                "the file: is the file complete?"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        header = None
    if not isinstance(header, dict):
        raise UserError(f"{file.name}: the safetensors header is not a JSON object; is the file complete?")
    header.pop("__metadata__", None)
    end = 0
    for name, entry in header.items():
        span = _span(file, name, entry)
        end = max(end, span[1])
    declared = 8 + n + end
    if size != declared:
        raise UserError(
            f"{file.name}: {size} bytes, but its header declares {declared} bytes of tensors; "
            f"{'the file is truncated' if size < declared else 'the file has trailing bytes'}: copy or "
            "export it again"
        )
    return header


def _span(file: Path, name: str, entry) -> tuple[int, int]:
    ok = isinstance(entry, dict) and entry.get("dtype") in ITEM_BYTES
    shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
    if not (ok and _naturals(shape) and _naturals(offsets, 2) and offsets[0] <= offsets[1]):
        raise UserError(f"{file.name}: the header entry of tensor {name} is malformed ({str(entry)[:80]})")
    need = math.prod(shape) * ITEM_BYTES[entry["dtype"]]
    if offsets[1] - offsets[0] != need:
        raise UserError(
            f"{file.name}: tensor {name} spans {offsets[1] - offsets[0]} bytes; its dtype {entry['dtype']} "
            f"and shape {shape} need {need}"
        )
    return offsets[0], offsets[1]


def _naturals(xs, n: int | None = None) -> bool:
    """A JSON list of ``n`` (any number of) integers >= 0."""
    return (
        isinstance(xs, list)
        and (n is None or len(xs) == n)
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in xs)
    )


def check_weights(path: Path, cfg: ModelConfig) -> list[Path]:
    """Check every ``*.safetensors`` header of ``path`` against ``cfg``; returns the files."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"no *.safetensors weights beside {CONFIG_FILE}; expected the model's weights there")
    found: dict[str, tuple[Path, dict]] = {}
    for file in files:
        for name, entry in read_header(file).items():
            if name in found:
                raise UserError(
                    f"tensor {name} is in both {found[name][0].name} and {file.name}; expected once"
                )
            found[name] = (file, entry)
    expected = expected_shapes(cfg)
    missing = [k for k in expected if k not in found]
    if missing:
        shape = list(expected[missing[0]])
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(
            f"no tensor {missing[0]}{more} in {', '.join(f.name for f in files)}; {CONFIG_FILE} predicts it "
            f"with shape {shape}: is it a complete Nemotron-H checkpoint?"
        )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise UserError(
            f"{len(extra)} tensors fp4train's model has no place for ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}); expected only those {CONFIG_FILE} predicts"
        )
    for name, shape in expected.items():
        file, entry = found[name]
        if entry["dtype"] not in FLOAT_DTYPES:
            raise UserError(
                f"{file.name}: tensor {name} is {entry['dtype']}; expected a floating-point dtype "
                f"({', '.join(FLOAT_DTYPES)})"
            )
        if tuple(entry["shape"]) != shape:
            raise UserError(
                f"{file.name}: tensor {name} has shape {entry['shape']}; {CONFIG_FILE} predicts {list(shape)}"
            )
    return files


def check_finite(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            kind = "NaN" if bool(torch.isnan(t).any()) else "Inf"
            raise UserError(
                f"{file.name}: tensor {name} holds {kind} ({bad} of its {t.numel()} values are not finite); "
                "expected finite weights: the checkpoint is corrupt"
            )
