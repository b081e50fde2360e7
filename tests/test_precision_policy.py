"""The precision policy: per-layer recipes, the mid-run switch, checkpoints, backend selection."""

import json
import sys

import pytest
import torch
from torch import nn

from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.precision import backends
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import build_recipe, default_bf16_layers, nvfp4_recipe


class ToyBlock(nn.Module):
    def __init__(self, idx: int, d: int):
        super().__init__()
        self.layer_idx = idx
        self.norm = nn.LayerNorm(d)
        self.up = QuantLinear(d, 2 * d, layer_idx=idx, name=f"layers.{idx}.up")
        self.down = QuantLinear(2 * d, d, layer_idx=idx, name=f"layers.{idx}.down")

    def forward(self, h):
        return h + self.down(torch.relu(self.up(self.norm(h)))).float()


class ToyLM(nn.Module):
    """Embedding, n blocks of two QuantLinears each, an unquantized head."""

    def __init__(self, n_layers=4, d=16, vocab=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(ToyBlock(i, d) for i in range(n_layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)


def _loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 9), generator=g)
        opt.zero_grad()
        _loss(model, ids).backward()
        opt.step()


@pytest.mark.parametrize(
    "recipe,depth,expected",
    [
        ("nvfp4", 62, (2, 8)),
        ("fp8", 62, (1, 2)),
        ("nvfp4", 6, (1, 1)),
        ("nvfp4", 24, (1, 3)),
        ("mxfp4", 32, (1, 4)),
        ("fp8", 6, (1, 1)),
        ("nvfp4", 2, (1, 0)),
        ("nvfp4", 1, (0, 0)),
        ("bf16", 8, (0, 0)),
    ],
)
def test_default_bf16_layers_scale_with_depth(recipe, depth, expected):
    assert default_bf16_layers(recipe, depth) == expected


def test_apply_sets_recipes_by_layer_index():
    model = ToyLM(n_layers=6)
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), 6)
    policy.apply(model)
    for block in model.layers:
        quantized = 1 <= block.layer_idx <= 4
        for lin in (block.up, block.down):
            assert (lin.recipe is not None) == quantized
            assert lin.recipe is None or lin.recipe.name == "nvfp4" and lin.recipe.backend == "emulated"
    assert policy.describe(model) == (
        "nvfp4: 8/12 linear layers, backend emulated (first 1, last 1 of 6 layers in BF16)"
    )
    explicit = PrecisionPolicy(PrecisionConfig(recipe="nvfp4", bf16_first_layers=0, bf16_last_layers=3), 6)
    explicit.apply(model)
    assert [b.up.recipe is not None for b in model.layers] == [True, True, True, False, False, False]
    off = PrecisionPolicy(PrecisionConfig(recipe="nvfp4", rht=False, stochastic_rounding=False), 6)
    off.apply(model)
    assert "nvfp4 (no RHT, no SR)" in off.describe(model)
    bf16 = PrecisionPolicy(PrecisionConfig(recipe="bf16"), 6)
    bf16.apply(model)
    assert all(b.up.recipe is None for b in model.layers)
    assert bf16.describe(model) == "bf16: all 12 linear layers in BF16"


def test_config_switches_reach_the_recipe():
    base = build_recipe(PrecisionConfig(recipe="nvfp4"))
    assert base == nvfp4_recipe()
    no_2d = build_recipe(PrecisionConfig(recipe="nvfp4", weight_2d=False))
    assert no_2d.fprop.b.block == (1, 16) and no_2d.wgrad == base.wgrad and no_2d.fprop.a == base.fprop.a
    no_rht = build_recipe(PrecisionConfig(recipe="nvfp4", rht=False))
    assert no_rht.fprop == base.fprop and no_rht.dgrad == base.dgrad and not no_rht.wgrad.a.rht
    random_signs = build_recipe(PrecisionConfig(recipe="nvfp4", rht_signs="random", rht_seed=4))
    assert random_signs.rht_signs != base.rht_signs and random_signs.wgrad == base.wgrad
    assert build_recipe(PrecisionConfig(recipe="bf16")) is None
    with pytest.raises(ValueError, match="precision.switch_scope"):
        PrecisionConfig(switch_scope="backward")


def test_switch_to_bf16_keeps_parameters_and_optimizer_state():
    torch.manual_seed(0)
    model = ToyLM()
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), len(model.layers))
    policy.apply(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)  # has per-parameter state
    _train(model, opt, steps=2)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(opt.state.values())}
    ids = torch.randint(0, 64, (2, 9))

    policy.switch_to_bf16(model, scope="all")
    assert all(m.recipe is None for m in model.modules() if isinstance(m, QuantLinear))
    assert model.state_dict().keys() == params.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in params.items())
    assert all(
        torch.equal(opt_state[i][k], v) for i, s in enumerate(opt.state.values()) for k, v in s.items()
    )
    assert "switched to BF16 (all GEMMs)" in policy.describe(model)
    # The switched model computes what an all-BF16 model with the same weights computes...
    twin = ToyLM()
    twin.load_state_dict(model.state_dict())
    PrecisionPolicy(PrecisionConfig(recipe="bf16"), len(twin.layers)).apply(twin)
    assert torch.equal(model(ids), twin(ids))
    # ...and keeps training with the same optimizer.
    _train(model, opt, steps=1, seed=1)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_switch_forward_only():
    model = ToyLM()
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), len(model.layers))
    policy.apply(model)
    policy.switch_to_bf16(model, scope="forward")
    quantized = [b.up.recipe for b in model.layers if b.up.recipe is not None]
    assert len(quantized) == 2
    assert all(r.fprop is None and r.dgrad is not None and r.wgrad is not None for r in quantized)
    assert "forward" in policy.describe(model)
    policy.switch_to_bf16(model, scope="all")
    assert all(b.up.recipe is None for b in model.layers)
    with pytest.raises(ValueError, match="scope"):
        policy.switch_to_bf16(model, scope="half")


def _grads(model, ids):
    model.zero_grad()
    _loss(model, ids).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_state_dict_round_trip_restores_switch_and_rounding_stream():
    torch.manual_seed(0)
    model = ToyLM()
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), len(model.layers), seed=11)
    policy.apply(model)
    ids = torch.randint(0, 64, (2, 9))
    _grads(model, ids)  # advance the stochastic-rounding stream
    state = json.loads(json.dumps(policy.state_dict()))  # checkpoints store it as JSON
    expected = _grads(model, ids)
    policy.switch_to_bf16(model, scope="forward")

    resumed = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), len(model.layers))
    resumed.apply(model)
    resumed.load_state_dict(state)
    assert not resumed.switched
    got = _grads(model, ids)  # the same random draws as before the checkpoint was taken
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))

    resumed.switch_to_bf16(model, scope="forward")
    again = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), len(model.layers))
    again.apply(model)
    again.load_state_dict(resumed.state_dict())
    assert again.switched_scope == "forward" and model.layers[1].up.recipe.fprop is None
    with pytest.raises(ConfigError, match="recipe"):
        PrecisionPolicy(PrecisionConfig(recipe="fp8"), 6).load_state_dict(state)


def test_generator_seed_reproduces_and_separates():
    torch.manual_seed(0)
    model = ToyLM()
    policy = PrecisionPolicy(PrecisionConfig(recipe="nvfp4"), len(model.layers))
    policy.apply(model)
    ids = torch.randint(0, 64, (2, 9))
    policy.set_generator_seed(5)
    a = _grads(model, ids)
    policy.set_generator_seed(5)
    b = _grads(model, ids)
    policy.set_generator_seed(6)
    c = _grads(model, ids)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_backend_selection_names_the_hardware():
    cpu = torch.device("cpu")
    assert backends.resolve_backend("auto", "nvfp4", cpu) == "emulated"
    assert backends.resolve_backend("auto", "fp8", cpu) == "emulated"
    assert backends.resolve_backend("emulated", "fp8-tensorwise", cpu) == "emulated"
    with pytest.raises(UserError, match="CPU only|CPU tensors") as e:
        backends.resolve_backend("native-fp8", "fp8", cpu)
    assert "sm_89" in str(e.value)
    with pytest.raises(UserError, match="only the fp8 recipes"):
        backends.resolve_backend("native-fp8", "nvfp4", cpu)
    with pytest.raises(UserError, match="no 'mxfp4' recipe"):
        backends.resolve_backend("te", "mxfp4", cpu)
    if not backends.te_available():
        with pytest.raises(UserError, match="transformer_engine"):
            backends.resolve_backend("te", "nvfp4", cpu)
    model = ToyLM(n_layers=3)
    with pytest.raises(UserError, match="native-fp8"):
        PrecisionPolicy(PrecisionConfig(recipe="fp8", backend="native-fp8"), 3).apply(model)
    assert not backends.native_fp8_blockwise_available(cpu)


def _fake_transformer_engine(monkeypatch, calls):
    """A stand-in for transformer_engine with the recipe classes and Linear/autocast it exposes."""
    import contextlib
    import dataclasses
    import enum
    import types

    te = types.ModuleType("transformer_engine")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    pytorch = types.ModuleType("transformer_engine.pytorch")
    recipe.Format = enum.Enum("Format", "E2M1 E4M3 E5M2 HYBRID")

    @dataclasses.dataclass
    class NVFP4BlockScaling:
        disable_rht: bool = False
        disable_stochastic_rounding: bool = False
        disable_2d_quantization: bool = False

    recipe.NVFP4BlockScaling = NVFP4BlockScaling
    recipe.Float8BlockScaling = lambda fp8_format: ("block", fp8_format)
    recipe.Float8CurrentScaling = lambda fp8_format: ("current", fp8_format)

    class Linear(nn.Linear):
        def __init__(self, k, n, bias, params_dtype, device):
            super().__init__(k, n, bias=bias, dtype=params_dtype, device=device)

        def forward(self, x):  # TE computes in the activation dtype
            return nn.functional.linear(x, self.weight.to(x.dtype))

    @contextlib.contextmanager
    def autocast(enabled, recipe):
        calls.append(recipe)
        yield

    pytorch.Linear, pytorch.autocast = Linear, autocast
    te.common, te.pytorch, common.recipe = common, pytorch, recipe
    modules = {"": te, ".common": common, ".common.recipe": recipe, ".pytorch": pytorch}
    for suffix, mod in modules.items():
        monkeypatch.setitem(sys.modules, "transformer_engine" + suffix, mod)


def test_te_backend_maps_recipes_and_shares_the_weight(monkeypatch):
    """The TE glue without TE: recipe mapping, one shared master weight, loud errors."""
    from inkling_fp4.precision.recipes import fp8_recipe, nvfp4_recipe, rht_sign_vector
    from inkling_fp4.precision.te_linear import te_linear, te_recipe

    calls = []
    _fake_transformer_engine(monkeypatch, calls)
    r = te_recipe(nvfp4_recipe(rht=False, weight_2d=False))
    assert (r.disable_rht, r.disable_stochastic_rounding, r.disable_2d_quantization) == (True, False, True)
    assert te_recipe(fp8_recipe())[0] == "block"
    with pytest.raises(UserError, match="rht_signs"):
        te_recipe(nvfp4_recipe(rht_signs=rht_sign_vector("random", 1)))
    layer = QuantLinear(32, 16, layer_idx=0)
    layer.recipe = nvfp4_recipe()
    y = te_linear(layer, torch.randn(4, 32))
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and len(calls) == 1
    assert layer.weight.grad is not None and list(dict(layer.named_parameters())) == ["weight"]
