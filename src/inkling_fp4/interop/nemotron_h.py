"""The mapping between fp4train's hybrid and transformers' ``NemotronHForCausalLM`` (``nemotron_h``).

The architectures are the same (pre-norm blocks; Mamba-2 with in_proj order [z, x, B, C, dt], a
depthwise conv with bias, a grouped gated RMSNorm; GQA attention without positions; squared-ReLU
MLP; untied head); only names and shapes differ: transformers puts the body under ``backbone.``
(the embedding as ``embeddings``), holds the conv weight as [C, 1, k] where fp4train has [C, k], and
splits the fused ``qkv_proj`` [(H+2K)E, D] into ``q_proj``, ``k_proj`` and ``v_proj``.

NOTE: transformers clamps Mamba's dt from below, at ``time_step_min`` up to 5.24 and at
``time_step_limit[0]`` from 5.25 on; fp4train at ``model.dt_min_clamp`` (0: no clamp). An export
writes the clamp into both, so every version computes what fp4train does. An import takes the
clamp from ``time_step_limit[0]`` (0 without one), as transformers from 5.25 and mamba_ssm's
``dt_limit`` do; ``time_step_min`` is then only the dt init range. An upper limit is refused.
Init-only fields (``a_init_range``, ``init_std``, ...) do not change a model's function: an import
keeps fp4train's defaults for those transformers lacks. A config fp4train cannot express (MoE, biases,
tied embeddings, ...) is refused with one line naming the fields.

Shape letters: D d_model, H attention heads, K kv heads, E head dim, C conv channels, k conv width.
"""

from __future__ import annotations

import math

import torch

from inkling_fp4.errors import UserError
from inkling_fp4.model.config import ModelConfig

MODEL_TYPE = "nemotron_h"
ARCHITECTURE = "NemotronHForCausalLM"
BLOCK_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}
"""Pattern characters and the ``layers_block_type`` names transformers gives them (Mamba-2 layers are
its "linear_attention")."""
BLOCK_TYPE_ALIASES = {
    "mamba": "M",
    "linear_attention": "M",
    "attention": "*",
    "full_attention": "*",
    "mlp": "-",
}
"""``layers_block_type`` names (the checkpoints' and transformers' own) -> pattern characters."""

# transformers fields whose value fp4train's model has fixed: (field, value fp4train needs).
_FIXED = {
    "tie_word_embeddings": False,
    "mlp_hidden_act": "relu2",
    "mamba_hidden_act": "silu",
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "use_bias": False,
    "mlp_bias": False,
    "attention_bias": False,
    "sliding_window": None,
    "num_nextn_predict_layers": 0,
}


def layer_types(pattern: str) -> list[str]:
    return [BLOCK_TYPES[c] for c in pattern]


def hf_config(cfg: ModelConfig, bos: int | None, eos: int | None, pad: int | None, max_len: int) -> dict:
    """transformers' ``config.json`` (as a dict) for a model of ``cfg``; token ids from the tokenizer."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "dtype": "float32",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "hybrid_override_pattern": cfg.pattern,
        "layers_block_type": layer_types(cfg.pattern),
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.attn_head_dim,
        "intermediate_size": cfg.ffn_dim,
        "mamba_num_heads": cfg.mamba_heads,
        "mamba_head_dim": cfg.mamba_head_dim,
        "ssm_state_size": cfg.d_state,
        "n_groups": cfg.n_groups,
        "conv_kernel": cfg.conv_kernel,
        # NOTE: transformers sizes the mixer from mamba_num_heads * mamba_head_dim; expand is unread
        "expand": max(1, cfg.d_inner // cfg.d_model),
        "chunk_size": cfg.chunk_size,
        "time_step_min": cfg.dt_min_clamp,
        "time_step_limit": [cfg.dt_min_clamp, math.inf],
        "time_step_max": cfg.dt_max,
        "time_step_floor": cfg.dt_init_floor,
        "layer_norm_epsilon": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "residual_in_fp32": True,
        "max_position_embeddings": max_len,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        **_FIXED,
    }


def layer_pattern(hf: dict) -> str:
    """The pattern of a config.json's layers_block_type (or layer_types), else its hybrid_override_pattern."""
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None:
        pattern = hf.get("hybrid_override_pattern")
        if not isinstance(pattern, str):
            found = "missing" if pattern is None else f"{pattern!r}"
            raise UserError(
                f"config.json: hybrid_override_pattern is {found} and there is no layers_block_type; "
                "expected a string of M (Mamba-2), * (attention) and - (MLP), one per layer"
            )
        kinds = list(pattern)
    out = []
    for kind in kinds:
        if kind in BLOCK_TYPES:
            out.append(kind)
        elif kind in BLOCK_TYPE_ALIASES:
            out.append(BLOCK_TYPE_ALIASES[kind])
        else:
            label = "E (MoE)" if kind in ("E", "moe") else repr(kind)
            raise UserError(
                f"config.json: layer type {label} has no fp4train equivalent (only Mamba-2, attention "
                "and MLP layers)"
            )
    return "".join(out)


def _json_float(value) -> float:
    """A float from config.json; transformers writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _refusals(hf: dict) -> list[str]:
    bad = [f"{k}={hf[k]!r}" for k, need in _FIXED.items() if k in hf and hf[k] != need]
    if hf.get("n_routed_experts") and any(k in ("E", "moe") for k in (hf.get("layers_block_type") or [])):
        bad.append("n_routed_experts (MoE)")
    limit = _dt_limit(hf)
    if limit is None or limit[1] != math.inf or not limit[0] >= 0.0:
        bad.append(f"time_step_limit={hf['time_step_limit']!r}")
    return bad


def _dt_limit(hf: dict) -> tuple[float, float] | None:
    """transformers' (lower, upper) clamp of Mamba's dt: ``time_step_limit``, (0, inf) without one;
    None when it is not a pair of numbers."""
    limit = hf.get("time_step_limit")
    if limit is None:
        return 0.0, math.inf
    try:
        lo, hi = (_json_float(v) for v in limit)
    except (TypeError, ValueError):
        return None
    return lo, hi


def model_config(hf: dict) -> ModelConfig:
    """fp4train's ModelConfig for a transformers ``nemotron_h`` config.json (refusing what it lacks)."""
    if hf.get("model_type") != MODEL_TYPE:
        raise UserError(f"config.json has model_type {hf.get('model_type')!r}, not {MODEL_TYPE!r}")
    pattern = layer_pattern(hf)
    bad = _refusals(hf)
    if bad:
        raise UserError(f"config.json: fp4train's model has no equivalent of {', '.join(bad)}")
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim")
    head_dim = (
        None if head_dim is None or (d_model % n_heads == 0 and head_dim == d_model // n_heads) else head_dim
    )
    clamp = _dt_limit(hf)[0]  # a pair: refused above otherwise
    dt_init_min = float(hf.get("time_step_min", 0.0))
    dt_max = float(hf.get("time_step_max", 0.1))
    values = dict(
        pattern=pattern,
        vocab_size=int(hf["vocab_size"]),
        d_model=d_model,
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(hf["intermediate_size"]),
        mamba_heads=int(hf["mamba_num_heads"]),
        mamba_head_dim=int(hf["mamba_head_dim"]),
        d_state=int(hf["ssm_state_size"]),
        n_groups=int(hf.get("n_groups", hf.get("mamba_n_groups", 1))),
        conv_kernel=int(hf.get("conv_kernel", hf.get("mamba_d_conv", 4))),
        chunk_size=int(hf.get("chunk_size", hf.get("mamba_chunk_size", 64))),
        dt_min_clamp=clamp,
        dt_max=dt_max,
        dt_init_floor=float(hf.get("time_step_floor", 1e-4)),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        init_std=float(hf.get("initializer_range", 0.02)),
    )
    if 0 < dt_init_min <= dt_max:
        values["dt_min"] = dt_init_min  # transformers' dt init range [time_step_min, time_step_max]
    elif dt_max < ModelConfig().dt_min:
        values["dt_min"] = dt_max
    try:
        return ModelConfig(**values)
    except ValueError as e:
        raise UserError(f"config.json: {e}") from None


def _qkv_widths(cfg: ModelConfig) -> list[int]:
    E = cfg.attn_head_dim
    return [cfg.n_heads * E, cfg.n_kv_heads * E, cfg.n_kv_heads * E]


def to_hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp4train tensor names -> transformers' (contiguous tensors, in the model's order)."""
    out: dict[str, torch.Tensor] = {"backbone.embeddings.weight": tensors["embed.weight"]}
    for i, kind in enumerate(cfg.pattern):
        src, dst = f"layers.{i}.", f"backbone.layers.{i}."
        out[dst + "norm.weight"] = tensors[src + "norm.weight"]
        m, hm = src + "mixer.", dst + "mixer."
        if kind == "M":
            out[hm + "in_proj.weight"] = tensors[m + "in_proj.weight"]
            out[hm + "conv1d.weight"] = tensors[m + "conv_weight"].unsqueeze(1)  # [C, k] -> [C, 1, k]
            out[hm + "conv1d.bias"] = tensors[m + "conv_bias"]
            for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
                out[hm + name] = tensors[m + name]
        elif kind == "*":
            q, k, v = tensors[m + "qkv_proj.weight"].split(_qkv_widths(cfg), 0)  # Order: [q, k, v]
            out[hm + "q_proj.weight"], out[hm + "k_proj.weight"], out[hm + "v_proj.weight"] = q, k, v
            out[hm + "o_proj.weight"] = tensors[m + "o_proj.weight"]
        else:
            for name in ("up_proj.weight", "down_proj.weight"):
                out[hm + name] = tensors[m + name]
    out["backbone.norm_f.weight"] = tensors["norm_f.weight"]
    out["lm_head.weight"] = tensors["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`to_hf_tensors`; every name must be there (``check_weights`` names a gap)."""
    take = tensors.__getitem__
    out = {"embed.weight": take("backbone.embeddings.weight")}
    for i, kind in enumerate(cfg.pattern):
        src, dst = f"backbone.layers.{i}.", f"layers.{i}."
        out[dst + "norm.weight"] = take(src + "norm.weight")
        hm, m = src + "mixer.", dst + "mixer."
        if kind == "M":
            out[m + "in_proj.weight"] = take(hm + "in_proj.weight")
            out[m + "conv_weight"] = take(hm + "conv1d.weight").squeeze(1)  # [C, 1, k] -> [C, k]
            out[m + "conv_bias"] = take(hm + "conv1d.bias")
            for name in ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight"):
                out[m + name] = take(hm + name)
        elif kind == "*":
            parts = [take(hm + f"{p}_proj.weight") for p in "qkv"]
            out[m + "qkv_proj.weight"] = torch.cat(parts, 0)
            out[m + "o_proj.weight"] = take(hm + "o_proj.weight")
        else:
            for name in ("up_proj.weight", "down_proj.weight"):
                out[m + name] = take(hm + name)
    out["norm_f.weight"] = take("backbone.norm_f.weight")
    out["lm_head.weight"] = take("lm_head.weight")
    return out
