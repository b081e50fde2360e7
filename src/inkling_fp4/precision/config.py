"""Precision configuration: which recipe, which backend, which pieces of the recipe are on."""

from __future__ import annotations

from dataclasses import dataclass

RECIPES = ("bf16", "fp8", "fp8-tensorwise", "nvfp4", "mxfp4")
BACKENDS = ("auto", "emulated", "native-fp8", "te")


@dataclass
class PrecisionConfig:
    recipe: str = "nvfp4"
    """GEMM precision: bf16 | fp8 (paper baseline, blockwise E4M3) | fp8-tensorwise | nvfp4 | mxfp4."""
    backend: str = "auto"
    """auto (fastest faithful for the device) | emulated | native-fp8 (Hopper+) | te (Blackwell)."""
    rht: bool = True
    """Random Hadamard transform on the wgrad operands (nvfp4, mxfp4)."""
    stochastic_rounding: bool = True
    """Stochastic rounding of gradients (dy) in dgrad and wgrad."""
    weight_2d: bool = True
    """16x16 2D block scales for weights, so W and its transpose quantize identically."""
    bf16_first_layers: int | None = None
    """First N layers kept in BF16; None = the recipe's default for this depth."""
    bf16_last_layers: int | None = None
    """Last N layers kept in BF16; None = the recipe's default for this depth."""
    rht_signs: str = "fixed"
    """RHT sign vector: 'fixed' (Transformer Engine's) or 'random' (seeded by rht_seed)."""
    rht_seed: int = 0
    """Seed of the random RHT sign vector."""
    switch_to_bf16: str | int | float | None = "decay"
    """When to leave the recipe for BF16: a step (int), a fraction of the run (float < 1),
    'decay' (the first decay step), or null / 'never'."""
    switch_scope: str = "all"
    """What the switch moves to BF16: 'all' GEMMs, or 'forward' passes only (paper appendix D)."""
    fp8_scaling: str = "current"
    """fp8-tensorwise: 'current' (each tensor's own amax) or 'delayed' (x, dy and W scaled from the
    largest amax of the last ``amax_history`` steps: one read of each, not two)."""
    amax_history: int = 16
    """Steps of amax history behind delayed scaling."""
    activation_scale: str = "tensor"
    """nvfp4: the FP32 second-level scale of fprop's x. 'tensor' (the paper's): one scale for the whole
    [tokens, K] tensor, so a token's codes depend on the rest of its batch (in sampling, a source of
    sampler/trainer mismatch). 'row': one scale per token row, applied to the GEMM output's rows, so
    a token's forward is the same in any batch, at one FP32 scale and multiply per row. Only fprop's
    x: W does not depend on the batch, and the wgrad operands are blocked along the tokens."""

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"precision.recipe '{self.recipe}' is not one of {', '.join(RECIPES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"precision.backend '{self.backend}' is not one of {', '.join(BACKENDS)}")
        if self.rht_signs not in ("fixed", "random"):
            raise ValueError("precision.rht_signs must be 'fixed' or 'random'")
        if self.switch_scope not in ("all", "forward"):
            raise ValueError("precision.switch_scope must be 'all' or 'forward'")
        if isinstance(self.switch_to_bf16, str) and self.switch_to_bf16 not in ("decay", "never"):
            raise ValueError(
                "precision.switch_to_bf16 must be a step, a fraction in (0, 1), 'decay' or 'never'"
            )
        if self.fp8_scaling not in ("current", "delayed"):
            raise ValueError("precision.fp8_scaling must be 'current' or 'delayed'")
        if self.fp8_scaling == "delayed" and self.recipe != "fp8-tensorwise":
            raise ValueError(
                f"precision.fp8_scaling=delayed needs precision.recipe=fp8-tensorwise (one scale per "
                f"tensor); {self.recipe} scales per block from each block's own amax"
            )
        if self.activation_scale not in ("tensor", "row"):
            raise ValueError("precision.activation_scale must be 'tensor' or 'row'")
        if self.activation_scale == "row" and self.recipe != "nvfp4":
            raise ValueError(
                f"precision.activation_scale=row is for precision.recipe=nvfp4 (whose FP32 activation "
                f"scale it makes per row), not {self.recipe}; use activation_scale=tensor"
            )
        if self.amax_history < 1:
            raise ValueError("precision.amax_history must be >= 1")
        for name in ("bf16_first_layers", "bf16_last_layers"):
            v = getattr(self, name)
            if v is not None and v < 0:
                raise ValueError(f"precision.{name} must be >= 0")
