"""Precision recipes: for each of the three GEMMs of a linear layer, how each operand is quantized.

A linear layer ``y = x·Wᵀ`` (x: [M, K] tokens × in_features, W: [N, K]) runs three GEMMs per step:

    fprop   y  [M, N] = x  [M, K] · Wᵀ                contraction over K (in_features)
    dgrad   dx [M, K] = dy [M, N] · W                 contraction over N (out_features)
    wgrad   dW [N, K] = dyᵀ[N, M] · x [M, K]          contraction over M (tokens)

Hardware block scaling only works along the contraction dimension, so every operand is described
in its GEMM's "NT" layout (contraction last) and its scale block is ``(rows, cols)`` in that
layout: ``(1, 16)`` is one scale per 16 consecutive contraction elements, ``(16, 16)`` one per
16×16 tile, ``TENSORWISE`` one per tensor. The NVFP4 recipe of the paper (arXiv 2509.25149, §4):

    GEMM    operand      format   block     rounding     RHT
    fprop   x            NVFP4    1×16      nearest      -
    fprop   W            NVFP4    16×16     nearest      -
    dgrad   dy           NVFP4    1×16      stochastic   -
    dgrad   W (as Wᵀ)    NVFP4    16×16     nearest      -      (the same values as fprop's W)
    wgrad   dyᵀ          NVFP4    1×16      stochastic   16-pt  (blocks along tokens)
    wgrad   xᵀ           NVFP4    1×16      nearest      16-pt  (blocks along tokens)

The ablation switches ``rht``, ``stochastic_rounding`` and ``weight_2d`` each turn one piece off.
MXFP4 has 1×32 blocks with E8M0 scales and always 1-D weight blocks, so W and Wᵀ quantize differently
(one reason NVFP4 does better). The FP8 baseline (DeepSeek-V3, the paper's FP8 runs) is E4M3 in 1×128
blocks, 128×128 for weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from inkling_fp4.numerics import hadamard

TENSORWISE = (0, 0)
"""Block shape meaning one scale for the whole tensor."""

PAPER_DEPTH = 62
"""Layers of the paper's 12B Nemotron-H model, the depth the default BF16 counts are quoted for."""


@dataclass(frozen=True)
class OperandQuant:
    """How one operand of one GEMM is quantized (in the GEMM's layout, contraction dim last)."""

    format: str
    """nvfp4 | mxfp4 | e4m3 | e5m2."""
    block: tuple[int, int]
    """Scale block (rows, cols); cols run along the contraction dim. TENSORWISE = one scale."""
    stochastic: bool = False
    """Stochastic rounding of the elements (unbiased); otherwise round-to-nearest-even."""
    rht: bool = False
    """16-point random Hadamard transform along the contraction dim before quantizing (wgrad)."""
    delayed: bool = False
    """Tensorwise FP8 only: the scale from earlier steps' amaxes (``precision/amax_history.py``)."""
    row_scaled: bool = False
    """NVFP4 1×16 only: one FP32 scale per row, applied to the output's rows (``activation_scale=row``)."""

    def __post_init__(self):
        assert self.format in ("nvfp4", "mxfp4", "e4m3", "e5m2"), self.format
        assert not self.delayed or (self.block == TENSORWISE and self.format in ("e4m3", "e5m2")), self
        assert not self.row_scaled or (
            self.format == "nvfp4" and self.block == (1, 16) and not self.rht and not self.stochastic
        ), self

    @property
    def multiple(self) -> tuple[int, int]:
        """Rows and contraction are zero-padded to multiples of this: the block, and for FP8 at least
        16 both ways (``torch._scaled_mm`` needs it)."""
        r, c = self.block
        floor = 16 if self.format in ("e4m3", "e5m2") else 1
        return (max(r, floor), max(c, floor))

    def describe(self) -> str:
        blk = "tensor" if self.block == TENSORWISE else f"{self.block[0]}x{self.block[1]}"
        extra = (" SR" if self.stochastic else "") + (" RHT" if self.rht else "")
        extra += " delayed" if self.delayed else ""
        extra += " row-scaled" if self.row_scaled else ""
        return f"{self.format} {blk}{extra}"


@dataclass(frozen=True)
class GemmQuant:
    """The two operands of one GEMM ``out = a · bᵀ`` (a: [rows_a, contraction], b: [rows_b, contraction])."""

    a: OperandQuant
    b: OperandQuant


@dataclass(frozen=True)
class Recipe:
    """Per GEMM of the module's table, its operands' quantization (None = BF16)."""

    name: str
    """bf16 | fp8 | fp8-tensorwise | nvfp4 | mxfp4 (for logs and checkpoints)."""
    fprop: GemmQuant | None
    dgrad: GemmQuant | None
    wgrad: GemmQuant | None
    rht_signs: tuple[float, ...] | None = None
    """The 16 ±1 signs of the RHT (D in H·D); None when no operand uses the RHT."""
    backend: str = "emulated"
    """emulated | native-fp8 | te: which kernels compute the GEMMs (resolved by the policy)."""

    def __hash__(self) -> int:
        """The fields' hash, computed once: every linear's GEMMs look up their operand plan by recipe
        on each call, and hashing the nested specs anew costs about a microsecond."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            self.__dict__["_hash"] = cached
        return cached

    def __getstate__(self) -> dict:
        """Without the cached hash: a string's hash differs from process to process."""
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    def bf16_forward(self) -> Recipe:
        """This recipe with fprop in BF16 and the backward GEMMs unchanged (paper appendix D)."""
        return dataclasses.replace(self, fprop=None)

    @property
    def quantizes_anything(self) -> bool:
        return any(g is not None for g in (self.fprop, self.dgrad, self.wgrad))

    def describe(self) -> str:
        parts = []
        for gemm in ("fprop", "dgrad", "wgrad"):
            g = getattr(self, gemm)
            parts.append(f"{gemm} " + ("bf16" if g is None else f"[{g.a.describe()} | {g.b.describe()}]"))
        return f"{self.name} ({self.backend}): " + "; ".join(parts)


def _linear_recipe(name, *, x, w, dy, x_t, dy_t, rht_signs=None) -> Recipe:
    """The GEMM table: fprop = (x, W), dgrad = (dy, Wᵀ) with W's quantization, wgrad = (dyᵀ, xᵀ)."""
    return Recipe(
        name=name,
        fprop=GemmQuant(x, w),
        dgrad=GemmQuant(dy, w),
        wgrad=GemmQuant(dy_t, x_t),
        rht_signs=rht_signs,
    )


def nvfp4_recipe(
    *, rht: bool = True, stochastic_rounding: bool = True, weight_2d: bool = True, rht_signs=None,
    activation_scale: str = "tensor",
) -> Recipe:  # fmt: skip
    """The paper's NVFP4 recipe, with its three techniques switchable for ablations; with
    ``activation_scale="row"`` fprop's x has one FP32 scale per token row (``PrecisionConfig``)."""
    return _linear_recipe(
        "nvfp4",
        x=OperandQuant("nvfp4", (1, 16), row_scaled=activation_scale == "row"),
        w=OperandQuant("nvfp4", (16, 16) if weight_2d else (1, 16)),
        dy=OperandQuant("nvfp4", (1, 16), stochastic=stochastic_rounding),
        x_t=OperandQuant("nvfp4", (1, 16), rht=rht),
        dy_t=OperandQuant("nvfp4", (1, 16), stochastic=stochastic_rounding, rht=rht),
        rht_signs=_signs(rht_signs) if rht else None,
    )


def mxfp4_recipe(*, rht: bool = True, stochastic_rounding: bool = True, rht_signs=None) -> Recipe:
    """MXFP4 (OCP MX: E2M1 elements, one E8M0 scale per 1×32 block) with the NVFP4 recipe's RHT/SR."""
    return _linear_recipe(
        "mxfp4",
        x=OperandQuant("mxfp4", (1, 32)),
        w=OperandQuant("mxfp4", (1, 32)),
        dy=OperandQuant("mxfp4", (1, 32), stochastic=stochastic_rounding),
        x_t=OperandQuant("mxfp4", (1, 32), rht=rht),
        dy_t=OperandQuant("mxfp4", (1, 32), stochastic=stochastic_rounding, rht=rht),
        rht_signs=_signs(rht_signs) if rht else None,
    )


def fp8_recipe() -> Recipe:
    """The paper's FP8 baseline: E4M3 everywhere, 1×128 activations/gradients, 128×128 weights."""
    act = OperandQuant("e4m3", (1, 128))
    return _linear_recipe("fp8", x=act, w=OperandQuant("e4m3", (128, 128)), dy=act, x_t=act, dy_t=act)


def fp8_tensorwise_recipe(*, delayed: bool = False) -> Recipe:
    """Per-tensor scaling: E4M3 for x and W, E5M2 for the gradient dy (wider range). Current scaling,
    or with ``delayed`` x, dy and W scaled from an amax history (``precision/amax_history.py``)."""
    x = OperandQuant("e4m3", TENSORWISE, delayed=delayed)
    grad = OperandQuant("e5m2", TENSORWISE, delayed=delayed)
    w = OperandQuant("e4m3", TENSORWISE, delayed=delayed)
    return _linear_recipe("fp8-tensorwise", x=x, w=w, dy=grad, x_t=x, dy_t=grad)


def build_recipe(cfg) -> Recipe | None:
    """The recipe a :class:`~inkling_fp4.precision.config.PrecisionConfig` asks for; None for bf16."""
    if cfg.recipe == "bf16":
        return None
    if cfg.recipe == "nvfp4":
        return nvfp4_recipe(
            rht=cfg.rht,
            stochastic_rounding=cfg.stochastic_rounding,
            weight_2d=cfg.weight_2d,
            rht_signs=rht_sign_vector(cfg.rht_signs, cfg.rht_seed),
            activation_scale=cfg.activation_scale,
        )
    if cfg.recipe == "mxfp4":
        return mxfp4_recipe(
            rht=cfg.rht,
            stochastic_rounding=cfg.stochastic_rounding,
            rht_signs=rht_sign_vector(cfg.rht_signs, cfg.rht_seed),
        )
    if cfg.recipe == "fp8":
        return fp8_recipe()
    if cfg.recipe == "fp8-tensorwise":
        return fp8_tensorwise_recipe(delayed=cfg.fp8_scaling == "delayed")
    raise AssertionError(f"recipe {cfg.recipe} passed config validation but has no definition")


def rht_sign_vector(kind: str, seed: int) -> tuple[float, ...]:
    """The RHT's 16 signs: 'fixed' (the numerics default) or 'random' (seeded)."""
    return tuple(float(s) for s in hadamard.rht_signs(kind, seed=seed).tolist())


def _signs(signs) -> tuple[float, ...]:
    if signs is None:
        return rht_sign_vector("fixed", 0)
    out = tuple(float(s) for s in signs)
    assert len(out) == 16 and all(s in (1.0, -1.0) for s in out), out
    return out


def default_bf16_layers(recipe_name: str, n_layers: int) -> tuple[int, int]:
    """How many first and last layers a recipe keeps in BF16 by default, for a model of this depth.

    The paper keeps the first 2 and last 8 of 62 layers for NVFP4 (and MXFP4), the first 1 and last 2
    for FP8. Depth L scales them (round(L·2/62), round(L·8/62)), at least 1 each so the layers next to
    the embedding and head, the most sensitive, never quantize; if no layer would stay quantized, the
    last count gives way first. E.g. 6 layers: 1 + 1, 24: 1 + 3. Explicit config values override this.
    """
    if recipe_name == "bf16" or n_layers <= 0:
        return (0, 0)
    first_frac, last_frac = (1, 2) if recipe_name in ("fp8", "fp8-tensorwise") else (2, 8)
    first = max(1, round(n_layers * first_frac / PAPER_DEPTH))
    last = max(1, round(n_layers * last_frac / PAPER_DEPTH))
    while first + last > n_layers - 1 and (first or last):
        if last >= first and last > 0:
            last -= 1
        else:
            first -= 1
    return (first, last)
