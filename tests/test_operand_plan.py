"""operand_plan against a table written from the recipes' definitions: which operand each GEMM of a
linear layer reuses and which it quantizes anew, for every recipe and every (dx, dW) need."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from inkling_fp4.precision.operand_plan import operand_plan
from inkling_fp4.precision.recipes import (
    fp8_recipe,
    fp8_tensorwise_recipe,
    mxfp4_recipe,
    nvfp4_recipe,
)

# recipe -> (saved_w, saved_x, reuse_dy) with both gradients needed. Why each cell:
# nvfp4: W in 16x16 tiles is Wᵀ's operand; xᵀ goes through the RHT; dyᵀ too (so not dy's).
# nvfp4 without 2D weights: 1x16 blocks of W are not blocks of Wᵀ.
# nvfp4 without RHT: xᵀ and dyᵀ have x's and dy's spec, but 1x16 blocks run along the other axis.
# mxfp4: 1x32 weights; fp8: 128x128 weights (square), 1x128 activations; tensorwise: one scale each.
TABLE = {
    "nvfp4": (nvfp4_recipe(), "reuse", "own", False),
    "nvfp4-row": (nvfp4_recipe(activation_scale="row"), "reuse", "own", False),
    "nvfp4-1d-weights": (nvfp4_recipe(weight_2d=False), "own", "own", False),
    "nvfp4-no-rht": (nvfp4_recipe(rht=False), "reuse", "own", False),
    "mxfp4": (mxfp4_recipe(), "own", "own", False),
    "fp8": (fp8_recipe(), "reuse", "own", False),
    "fp8-tensorwise": (fp8_tensorwise_recipe(), "reuse", "reuse", True),
    "fp8-delayed": (fp8_tensorwise_recipe(delayed=True), "reuse", "reuse", True),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_both_gradients(name):
    recipe, saved_w, saved_x, reuse_dy = TABLE[name]
    plan = operand_plan(recipe, True, True)
    assert (plan.saved_w, plan.saved_x, plan.reuse_dy) == (saved_w, saved_x, reuse_dy)
    assert plan.fprop_x == recipe.fprop.a
    assert plan.wgrad_x == recipe.wgrad.b
    assert plan.dgrad_dy == recipe.dgrad.a and plan.wgrad_dy == recipe.wgrad.a


@pytest.mark.parametrize("name", list(TABLE))
def test_a_gradient_not_needed_takes_nothing(name):
    recipe = TABLE[name][0]
    only_dx = operand_plan(recipe, True, False)  # a frozen weight: no wgrad
    assert only_dx.saved_x == "" and only_dx.wgrad_x is None and only_dx.wgrad_dy is None
    assert not only_dx.reuse_dy
    assert only_dx.saved_w == TABLE[name][1]
    only_dw = operand_plan(recipe, False, True)  # the first layer: no dx
    assert only_dw.saved_w == "" and only_dw.dgrad_dy is None and not only_dw.reuse_dy
    assert only_dw.saved_x == TABLE[name][2]
    neither = operand_plan(recipe, False, False)
    assert (neither.saved_w, neither.saved_x, neither.dgrad_dy, neither.wgrad_dy) == ("", "", None, None)


@pytest.mark.parametrize("name", list(TABLE))
def test_a_bf16_forward_reuses_nothing(name):
    """Paper appendix D: fprop in BF16, the backward GEMMs quantized; with no quantized fprop there is
    nothing to reuse, so the dgrad and wgrad quantize their own operands."""
    recipe = TABLE[name][0].bf16_forward()
    plan = operand_plan(recipe, True, True)
    assert plan.fprop_x is None
    assert (plan.saved_w, plan.saved_x) == ("own", "own")
    assert plan.reuse_dy == TABLE[name][3]  # dy's reuse does not depend on the forward


def test_a_bf16_backward_gemm_reads_bf16():
    recipe = dataclasses.replace(nvfp4_recipe(), dgrad=None, wgrad=None)
    plan = operand_plan(recipe, True, True)
    assert (plan.saved_w, plan.saved_x, plan.dgrad_dy, plan.wgrad_dy) == ("bf16", "bf16", None, None)


def test_a_recipes_hash_is_its_fields_and_does_not_travel():
    """The hash is cached (the plan is looked up by recipe on every GEMM call); equal recipes hash
    equal, a changed field changes it, and a pickle carries no hash from another process."""
    a, b = nvfp4_recipe(), nvfp4_recipe()
    assert a == b and hash(a) == hash(b)
    assert hash(a) == hash(tuple(getattr(a, f.name) for f in dataclasses.fields(a)))
    other = dataclasses.replace(a, backend="te")
    assert other != a and hash(other) != hash(a)
    copied = pickle.loads(pickle.dumps(a))
    assert "_hash" not in copied.__dict__ and copied == a and hash(copied) == hash(a)
