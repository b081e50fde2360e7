"""The Transformer Engine backend: the recipe's GEMMs on Blackwell tensor cores through TE.

Imported only for ``backend=te``; no test needs TE. TE's NVFP4 uses the emulation's fixed RHT signs
(``hadamard.FIXED_SIGNS``), so random signs are rejected. Each :class:`QuantLinear` lazily gets a
``te.Linear`` whose weight *is* the layer's FP32 master parameter, so the optimizer, checkpoints and
the precision switch see one weight. A BF16-forward recipe has no TE equivalent and runs emulated.
"""

from __future__ import annotations

import torch

from inkling_fp4.errors import UserError
from inkling_fp4.precision.recipes import Recipe, rht_sign_vector


def te_recipe(recipe: Recipe):
    """The Transformer Engine recipe object equivalent to ``recipe`` (UserError if there is none)."""
    from transformer_engine.common import recipe as te_recipes

    if recipe.name == "nvfp4":
        if recipe.fprop is not None and recipe.fprop.a.row_scaled:
            raise UserError(
                "precision.activation_scale=row runs on the emulated backend; use precision.backend=emulated"
            )
        if recipe.rht_signs is not None and recipe.rht_signs != rht_sign_vector("fixed", 0):
            raise UserError(
                "precision.rht_signs=random cannot run on backend te (Transformer Engine uses the fixed "
                "sign vector); use rht_signs=fixed or precision.backend=emulated"
            )
        return te_recipes.NVFP4BlockScaling(
            disable_rht=not recipe.wgrad.a.rht,
            disable_stochastic_rounding=not recipe.dgrad.a.stochastic,
            disable_2d_quantization=recipe.fprop.b.block != (16, 16),
        )
    if recipe.name == "fp8":
        return te_recipes.Float8BlockScaling(fp8_format=te_recipes.Format.E4M3)
    if recipe.name == "fp8-tensorwise":
        return te_recipes.Float8CurrentScaling(fp8_format=te_recipes.Format.HYBRID)
    raise UserError(f"precision.backend=te has no '{recipe.name}' recipe; use precision.backend=emulated")


def _autocast(te, te_rec):
    """TE's quantization context across versions (``autocast`` in newer TE, ``fp8_autocast`` before)."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=te_rec)
    return te.fp8_autocast(enabled=True, fp8_recipe=te_rec)


def te_linear(module, x: torch.Tensor) -> torch.Tensor:
    """``module``'s forward through a ``te.Linear`` that shares its weight; returns BF16."""
    import transformer_engine.pytorch as te

    cache = module.__dict__.get("_te_state")
    if cache is None or cache[0] is not module.recipe:
        lin = module.__dict__.get("_te_module")
        if lin is None:
            lin = te.Linear(
                module.in_features, module.out_features, bias=False,
                params_dtype=torch.float32, device=module.weight.device,
            )  # fmt: skip
            del lin.weight
            lin.weight = module.weight  # the same Parameter: one master weight, one gradient
            module.__dict__["_te_module"] = lin  # not a submodule: no duplicate state_dict entry
        cache = (module.recipe, te_recipe(module.recipe))
        module.__dict__["_te_state"] = cache
    lin = module.__dict__["_te_module"]
    with _autocast(te, cache[1]):
        y = lin(x.to(torch.bfloat16))
    return y.to(torch.bfloat16)
