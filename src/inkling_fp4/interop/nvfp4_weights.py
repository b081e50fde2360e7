"""Each quantized linear layer's NVFP4 weight, exactly as the training forward quantizes it.

It calls the training fprop's quantizer (:func:`inkling_fp4.precision.gemm.quantize`, 2D: one E4M3
scale per 16×16 tile, one FP32 tensor scale) on the FP32 master weight W [N, K], so an export holds
the values the run trained with bit for bit:

    codes   uint8          [N, K/2]   even element in the low nibble, bit 3 the sign
    scales  float8_e4m3fn  [N, K/16]  a 16×16 tile's scale repeated for its 16 rows
    amax    float32        []         the tensor amax: S_enc = 6·448 / amax, S_dec = 1 / S_enc
    W ≈ code · scale · S_dec

Fused linears split by rows into transformers' modules (qkv_proj -> q, k, v) keep their one tensor
scale: serving engines fuse q, k and v again and need one global scale, as the training forward
used. A split must fall on a 16-row tile boundary. The layers are those the run's precision policy
quantizes, with the recipe as trained before any switch to BF16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from inkling_fp4.config import RunConfig
from inkling_fp4.errors import UserError
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.numerics import nvfp4
from inkling_fp4.precision import gemm
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import Recipe

E2M1_E4M3_MAX = 6.0 * 448.0


@dataclass
class NVFP4Weight:
    """One transformers module's weight in NVFP4 (see the module docstring for the shapes)."""

    codes: torch.Tensor
    scales: torch.Tensor
    amax: torch.Tensor

    @property
    def encode_scale(self) -> torch.Tensor:
        """S_enc = 6·448 / amax (compressed-tensors' ``weight_global_scale``), FP32 0-dim."""
        return nvfp4.tensor_scales(self.amax)[0]

    @property
    def decode_scale(self) -> torch.Tensor:
        """S_dec = 1 / S_enc (ModelOpt's ``weight_scale_2``), FP32 0-dim."""
        return nvfp4.tensor_scales(self.amax)[1]

    def dequantize(self) -> torch.Tensor:
        """code · scale · S_dec in FP32 [N, K]: the weight values the training forward multiplies."""
        N, K = self.codes.shape[0], self.codes.shape[1] * 2
        t = nvfp4.NVFP4Tensor(self.codes, self.scales, self.amax, torch.Size((N, K)), block_2d=True)
        return t.dequantize(torch.float32)


def nvfp4_recipe(cfg: RunConfig) -> tuple[PrecisionPolicy, Recipe]:
    """The run's policy and recipe; refused unless the recipe quantizes weights as 2D NVFP4."""
    policy = PrecisionPolicy(cfg.precision, cfg.model.n_layers)
    recipe = policy.recipe
    spec = None if recipe is None or recipe.fprop is None else recipe.fprop.b
    if spec is None or spec.format != "nvfp4" or spec.block != (16, 16) or spec.rht:
        raise UserError(
            f"precision.recipe={cfg.precision.recipe}: the NVFP4 exports need a run whose recipe quantizes "
            "weights as NVFP4 16x16 tiles (nvfp4); export it with --format hf"
        )
    if not any(policy.is_quantized_layer(i) for i in range(cfg.model.n_layers)):
        raise UserError(
            "every layer of the run is kept in BF16 (precision.bf16_*_layers); nothing to export as NVFP4"
        )
    return policy, recipe


def quantize_weight(linear: QuantLinear, recipe: Recipe) -> NVFP4Weight:
    """The layer's weight as the fprop quantizes it (same quantizer, FP32 master weight on the CPU)."""
    W = linear.weight.detach().float().cpu()  # W: [N, K]
    N, K = W.shape
    if K % nvfp4.BLOCK:
        raise UserError(
            f"{linear.full_name}: in_features={K} is not a multiple of 16; serving engines need whole "
            "NVFP4 blocks"
        )
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        op = gemm.quantize(W, recipe.fprop.b, codes=True, values=False, name=f"{linear.full_name} W")
    q = op.q
    return NVFP4Weight(q.codes[:N].contiguous(), q.scales[:N].contiguous(), q.amax.float())


def split_rows(w: NVFP4Weight, widths: list[int], name: str) -> list[NVFP4Weight]:
    """Row blocks of one quantized weight, sharing its tensor scale; blocks start on tile boundaries."""
    starts = torch.tensor([0, *widths]).cumsum(0)[:-1].tolist()
    if any(s % nvfp4.BLOCK for s in starts):
        raise UserError(
            f"{name}: the row split {widths} does not fall on 16-row NVFP4 tiles; serving engines cannot "
            "keep the training forward's scales for it"
        )
    codes, scales = w.codes.split(widths, 0), w.scales.split(widths, 0)
    return [NVFP4Weight(c.contiguous(), s.contiguous(), w.amax) for c, s in zip(codes, scales, strict=True)]


def quantized_modules(
    model: HybridLM, cfg: RunConfig
) -> tuple[dict[str, tuple[NVFP4Weight, str]], list[str]]:
    """({transformers module: (its NVFP4 weight, the fp4train layer)}, the linear modules kept in BF16)."""
    policy, recipe = nvfp4_recipe(cfg)
    mcfg = model.cfg
    quantized: dict[str, tuple[NVFP4Weight, str]] = {}
    kept: list[str] = []
    for i, block in enumerate(model.layers):
        prefix = f"backbone.layers.{i}.mixer."
        if block.kind == "M":
            pairs = [(block.mixer.in_proj, ["in_proj"], None), (block.mixer.out_proj, ["out_proj"], None)]
        elif block.kind == "*":
            E = mcfg.attn_head_dim
            widths = [mcfg.n_heads * E, mcfg.n_kv_heads * E, mcfg.n_kv_heads * E]
            pairs = [
                (block.mixer.qkv_proj, ["q_proj", "k_proj", "v_proj"], widths),
                (block.mixer.o_proj, ["o_proj"], None),
            ]
        else:
            pairs = [(block.mixer.up_proj, ["up_proj"], None), (block.mixer.down_proj, ["down_proj"], None)]
        for linear, names, widths in pairs:
            if not policy.is_quantized_layer(i):
                kept += [prefix + n for n in names]
                continue
            w = quantize_weight(linear, recipe)
            parts = [w] if widths is None else split_rows(w, widths, linear.full_name)
            for n, part in zip(names, parts, strict=True):
                quantized[prefix + n] = (part, linear.full_name)
    return quantized, kept


def keep_dtype(name: str, t: torch.Tensor) -> torch.Tensor:
    """BF16 for what serving keeps in high precision, FP32 for the SSM parameters."""
    return t.float() if name.rpartition(".")[2] in ("A_log", "D", "dt_bias") else t.to(torch.bfloat16)


@dataclass(frozen=True)
class NVFP4Layout:
    """The tensor names of an NVFP4 export format (one per writer module), and the shape of its global
    scales; ``decode``: they are decode scales amax / (6·448), else encode scales 6·448 / amax."""

    codes: str
    scales: str
    weight_global: str
    input_global: str
    decode: bool
    scale_shape: tuple[int, ...]
    metadata: Callable[[list[str], str], tuple[dict, dict[str, str]]]
    """(excluded modules, fp4train's version) -> (config.json's quantization_config, {file: text})."""

    def tensors(
        self,
        base: dict[str, torch.Tensor],
        quantized: dict[str, NVFP4Weight],
        input_amax: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """The export's tensors: ``base`` (transformers' names, FP32) with each quantized module's
        weight replaced by its NVFP4 tensors, the rest in :func:`keep_dtype`."""
        out = {}
        for name, t in base.items():
            module = name.rpartition(".")[0]
            if module in quantized and name.endswith(".weight"):
                out.update(self._module_tensors(module, quantized[module], input_amax[module].float()))
            else:
                out[name] = keep_dtype(name, t)
        return out

    def _module_tensors(self, m: str, w: NVFP4Weight, amax: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.decode:
            w_global, in_global = w.decode_scale, amax / E2M1_E4M3_MAX
        else:
            w_global, in_global = w.encode_scale, torch.full_like(amax, E2M1_E4M3_MAX) / amax
        return {
            f"{m}.{self.codes}": w.codes,
            f"{m}.{self.scales}": w.scales,
            f"{m}.{self.weight_global}": w_global.reshape(self.scale_shape),
            f"{m}.{self.input_global}": in_global.reshape(self.scale_shape),
        }
