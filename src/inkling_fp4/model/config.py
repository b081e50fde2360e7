"""Model configuration: the hybrid layout and the sizes of its three block types.

Defaults are the ``tiny`` model. Precedence is defaults < preset < explicit fields, which is why the
constructor is written out: only it can tell a field that was passed from one left at its default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from inkling_fp4.model.presets import PRESETS


@dataclass(init=False)
class ModelConfig:
    preset: str | None = None
    """Named size (tiny, hybrid-125m, hybrid-350m, nemotron-h-12b); explicit fields override it."""
    pattern: str = "M-*-M-"
    """One character per layer: 'M' Mamba-2, '*' attention, '-' MLP (Nemotron-H notation)."""
    vocab_size: int = 4096
    """Vocabulary size; must be >= the tokenizer's."""
    d_model: int = 64
    """Residual stream width."""
    n_heads: int = 4
    """Attention query heads."""
    n_kv_heads: int = 2
    """Attention key/value heads (grouped-query attention); divides n_heads."""
    head_dim: int | None = None
    """Attention head width; None means d_model // n_heads."""
    ffn_dim: int = 256
    """MLP hidden width (squared-ReLU MLP)."""
    mamba_heads: int = 16
    """Mamba-2 heads H; d_inner = mamba_heads * mamba_head_dim (expand * d_model in the papers)."""
    mamba_head_dim: int = 8
    """Mamba-2 head width P."""
    d_state: int = 12
    """SSM state size N."""
    n_groups: int = 2
    """Groups G of B/C, each shared by mamba_heads / n_groups heads."""
    conv_kernel: int = 4
    """Depthwise causal conv width over x, B, C."""
    chunk_size: int = 64
    """SSD chunk length (a speed knob; results are the same for any value)."""
    dt_min: float = 1e-3
    """dt_bias is initialised so that softplus(dt_bias) is log-uniform in [dt_min, dt_max]."""
    dt_max: float = 0.1
    """Upper end of the dt initialisation range (see dt_min)."""
    dt_init_floor: float = 1e-4
    """Smallest dt the initialisation may produce (as in Mamba-2)."""
    dt_min_clamp: float = 0.0
    """Lower clamp of dt = softplus(dt_raw + dt_bias) in every forward, as transformers' Nemotron-H applies
    at ``time_step_limit[0]`` (at ``time_step_min`` before 5.25); 0 means no clamp."""
    a_init_range: tuple[float, float] = (1.0, 16.0)
    """A = -exp(A_log) is initialised with -A uniform in this range (Mamba-2)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal init of linear layers and embeddings (output projections scaled by depth)."""
    ssd_impl: str = "auto"
    """SSD scan implementation: auto (Triton on CUDA when available), triton, or reference."""
    conv_impl: str = "auto"
    """Mamba-2 conv: auto (the Triton kernel on CUDA, eager on CPU), triton, compiled (torch.compile of
    the reference), or reference (eager)."""

    def __init__(self, **values):
        names = [f.name for f in dataclasses.fields(ModelConfig)]
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise TypeError(f"ModelConfig got unknown fields {unknown}; valid: {', '.join(names)}")
        preset = values.get("preset")
        if preset is not None and preset not in PRESETS:
            raise ValueError(f"model.preset '{preset}' is not one of {', '.join(PRESETS)}")
        merged = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
        merged.update(PRESETS.get(preset, {}))
        merged.update(values)
        for name in names:
            setattr(self, name, merged[name])
        self.__post_init__()

    def __post_init__(self):
        for key in (
            "vocab_size",
            "d_model",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "mamba_heads",
            "mamba_head_dim",
            "d_state",
            "n_groups",
            "conv_kernel",
            "chunk_size",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} must be a positive integer, got {getattr(self, key)}")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"model.head_dim must be a positive integer or null, got {self.head_dim}")
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(f"model.dt_min={self.dt_min} and dt_max={self.dt_max} need 0 < dt_min <= dt_max")
        if not self.dt_min_clamp >= 0:
            raise ValueError(f"model.dt_min_clamp must be >= 0 (0: no clamp), got {self.dt_min_clamp}")
        if not 0 < self.a_init_range[0] <= self.a_init_range[1]:
            raise ValueError(f"model.a_init_range={list(self.a_init_range)} needs 0 < low <= high")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("model.norm_eps and model.init_std must be positive")
        bad = set(self.pattern) - set("M*-")
        if not self.pattern or bad:
            raise ValueError(
                f"model.pattern '{self.pattern}' may only contain 'M' (Mamba-2), '*' (attention) "
                "and '-' (MLP), at least one layer"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.mamba_heads % self.n_groups:
            raise ValueError(f"model.n_groups={self.n_groups} must divide mamba_heads={self.mamba_heads}")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim"
            )
        if self.ssd_impl not in ("auto", "triton", "reference"):
            raise ValueError(f"model.ssd_impl must be auto, triton or reference, not '{self.ssd_impl}'")
        if self.conv_impl not in ("auto", "triton", "compiled", "reference"):
            raise ValueError(
                f"model.conv_impl must be auto, triton, compiled or reference, not '{self.conv_impl}'"
            )

    @property
    def n_layers(self) -> int:
        return len(self.pattern)

    @property
    def d_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads
