"""Named model sizes: each a dict of ModelConfig fields (``model.preset`` in a recipe; explicit fields win).

| preset         | layers M/*/-  | d_model | FFN   | attn q/kv x hd | Mamba H x P, G, N | vocab  | params |
|----------------|---------------|---------|-------|----------------|-------------------|--------|--------|
| tiny           | 6: 2/1/3      | 64      | 256   | 4/2 x 16       | 16 x 8, 2, 12     | 4096   | 0.69M  |
| peer158m       | 26: 12/2/12   | 768     | 3072  | 12/4 x 64      | 24 x 64, 2, 128   | 32768  | 158M   |
| hybrid-125m    | 24: 11/2/11   | 768     | 2048  | 12/4 x 64      | 24 x 64, 4, 128   | 32768  | 136M   |
| hybrid-350m    | 35: 16/3/16   | 1024    | 4096  | 16/4 x 64      | 32 x 64, 8, 128   | 32768  | 344M   |
| nemotron-h-12b | 62: 28/6/28   | 5120    | 20480 | 40/8 x 128     | 160 x 64, 8, 128  | 131072 | 12.31B |

The small presets keep Nemotron-H's layout (Mamba-2 and MLP alternating, about one layer in ten
attention); nemotron-h-12b is the model the NVFP4 paper trains (arXiv 2509.25149, Table 3). GEMM widths
are multiples of 32 where the architecture allows, so NVFP4 and MXFP4 blocks tile them unpadded; the
Mamba in_proj width 2 E + 2 G N + H is one only when H is, and the precision layer pads the rest.
"""

from __future__ import annotations

NEMOTRON_H_12B_PATTERN = "M-M-M-M*-" * 6 + "M-M-M-M-"
"""The 12B's 62 layers (paper: 'M-M-M-M*-M-M-M-M*-...-M-M-M-M-')."""

PRESETS: dict[str, dict] = {
    "tiny": dict(
        pattern="M-*-M-",
        vocab_size=4096,
        d_model=64,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=256,
        mamba_heads=16,
        mamba_head_dim=8,
        n_groups=2,
        d_state=12,
        chunk_size=64,
    ),
    # the size of the transformers NemotronH configuration that the throughput benchmarks compare
    # against (scripts/bench_pretrain.py, scripts/bench_model.py); chunk 64 as everywhere here
    "peer158m": dict(
        pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-",
        vocab_size=32768,
        d_model=768,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=3072,
        mamba_heads=24,
        mamba_head_dim=64,
        n_groups=2,
        d_state=128,
        chunk_size=64,
    ),
    "hybrid-125m": dict(
        pattern="M-M-M-M*-" * 2 + "M-M-M-",
        vocab_size=32768,
        d_model=768,
        n_heads=12,
        n_kv_heads=4,
        ffn_dim=2048,
        mamba_heads=24,
        mamba_head_dim=64,
        n_groups=4,
        d_state=128,
        chunk_size=64,
    ),
    "hybrid-350m": dict(
        pattern="M-M-M-M*-" * 3 + "M-M-M-M-",
        vocab_size=32768,
        d_model=1024,
        n_heads=16,
        n_kv_heads=4,
        ffn_dim=4096,
        mamba_heads=32,
        mamba_head_dim=64,
        n_groups=8,
        d_state=128,
        chunk_size=64,
    ),
    "nemotron-h-12b": dict(
        pattern=NEMOTRON_H_12B_PATTERN,
        vocab_size=131072,
        d_model=5120,
        n_heads=40,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=20480,
        mamba_heads=160,
        mamba_head_dim=64,
        n_groups=8,
        d_state=128,
        conv_kernel=4,
        chunk_size=128,
    ),
}


def model_preset(name: str) -> dict:
    """The ModelConfig fields of preset ``name`` (a copy)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset '{name}'; known: {', '.join(PRESETS)}")
    return dict(PRESETS[name])
