"""Delayed FP8 scaling (precision/amax_history.py and its use by QuantLinear and the trainer), on CPU.

The history is checked against a plain-Python model of the rule over random step sequences (skipped
steps, layers that record nothing, NaN amaxes); the layer against current scaling (before any step
is rolled in: the same bits) and against a GEMM written out by hand from the reference quantizer
(after: the scale from the history, values above it saturated).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from inkling_fp4.errors import ConfigError
from inkling_fp4.numerics import fp8
from inkling_fp4.precision.amax_history import CURRENT, HISTORY, USED, AmaxHistory
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.precision.recipes import fp8_tensorwise_recipe


def _model_of_the_rule(events, layers: int, length: int):
    """(used, history) per (layer, operand) after ``events``: [(skipped, {(l, o): amax})]."""
    hist = {(l, o): [] for l in range(layers) for o in (0, 1, 2)}
    for skipped, recorded in events:
        if skipped:
            continue
        for key, value in recorded.items():
            value = value if math.isfinite(value) else 0.0
            hist[key] = ([value] + hist[key])[:length]
    return {k: (max(v, default=0.0), v + [0.0] * (length - len(v))) for k, v in hist.items()}


@pytest.mark.parametrize("length", [1, 3, 16])
def test_history_follows_the_rule(length):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    layers = 4
    h = AmaxHistory(layers, length, torch.device("cpu"))
    events = []
    for _ in range(40):
        skipped = rng.random() < 0.15
        recorded = {}
        for key in [(l, o) for l in range(layers) for o in (0, 1, 2)]:
            if rng.random() < 0.8:  # some rows record nothing this step (a layer in BF16)
                v = rng.choice([rng.uniform(0, 10) * 10 ** rng.randint(-8, 8), 0.0, math.inf, math.nan])
                used, rec = h.row(*key)
                rec.copy_(torch.maximum(rec, torch.tensor([v], dtype=torch.float32).nan_to_num(math.inf)))
                recorded[key] = float(torch.tensor(v, dtype=torch.float32).nan_to_num(math.inf))
        h.end_step(skipped)
        events.append((skipped, recorded))
        want = _model_of_the_rule(events, layers, length)
        for key, (used, hist) in want.items():
            row = h.state[key[0], key[1]]
            assert row[USED].item() == used, (seed, key, row.tolist(), used)
            assert row[HISTORY:].tolist() == hist, (seed, key)
            assert row[CURRENT].item() == -1.0
    assert h.ready


def test_history_is_not_ready_until_a_step_is_kept():
    h = AmaxHistory(2, 4, torch.device("cpu"))
    h.row(0, 0)[1].fill_(3.0)
    h.end_step(skipped=True)
    assert not h.ready and h.state[0, 0, USED].item() == 0.0 and h.state[0, 0, CURRENT].item() == -1.0
    h.row(0, 0)[1].fill_(3.0)
    h.end_step(skipped=False, reduce_max=lambda t: t.mul_(2))  # stands in for a max across ranks
    assert h.ready and h.state[0, 0, USED].item() == 6.0


def test_history_checkpoint_round_trip_is_exact_and_shape_checked():
    h = AmaxHistory(3, 5, torch.device("cpu"))
    h.state.copy_(torch.randn(h.state.shape).abs() * 1e-7)
    h.ready = True
    g = AmaxHistory(3, 5, torch.device("cpu"))
    g.load_state_dict(h.state_dict())
    assert torch.equal(g.state, h.state) and g.ready
    with pytest.raises(ConfigError, match="amax_history"):
        AmaxHistory(3, 4, torch.device("cpu")).load_state_dict(h.state_dict())


def test_config_refuses_delayed_scaling_without_one_scale_per_tensor():
    with pytest.raises(ValueError, match="fp8-tensorwise"):
        PrecisionConfig(recipe="fp8", fp8_scaling="delayed")
    with pytest.raises(ValueError, match="amax_history"):
        PrecisionConfig(recipe="fp8-tensorwise", fp8_scaling="delayed", amax_history=0)
    assert "delayed" in fp8_tensorwise_recipe(delayed=True).describe()


def _layer(recipe, seed=0):
    torch.manual_seed(seed)
    m = QuantLinear(256, 192, layer_idx=0)
    m.recipe = recipe
    return m


def _fwd_bwd(m, x, dy):
    x = x.clone().requires_grad_(True)
    y = m(x)
    y.backward(dy)
    return y.detach(), x.grad, m.weight.grad


def _inputs(amax_scale=1.0, seed=None):
    g = torch.Generator().manual_seed(random.randrange(2**31) if seed is None else seed)
    x = torch.randn(64, 256, generator=g) * amax_scale
    dy = torch.randn(64, 192, generator=g) * 1e-4 * amax_scale
    return x, dy


def test_layer_records_and_matches_current_scaling_before_the_first_step():
    delayed, current = _layer(fp8_tensorwise_recipe(delayed=True)), _layer(fp8_tensorwise_recipe())
    h = AmaxHistory(1, 4, torch.device("cpu"))
    delayed.amax_history = h
    x, dy = _inputs()
    got, want = _fwd_bwd(delayed, x, dy), _fwd_bwd(current, x, dy)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert h.row(0, 0)[1].item() == x.abs().max().item()
    assert h.row(0, 1)[1].item() == dy.bfloat16().abs().max().item()  # y is BF16, so is its gradient
    assert h.row(0, 2)[1].item() == delayed.weight.abs().max().item()


def test_layer_scales_from_the_history_once_a_step_is_rolled_in():
    m = _layer(fp8_tensorwise_recipe(delayed=True))
    h = AmaxHistory(1, 4, torch.device("cpu"))
    m.amax_history = h
    x0, dy0 = _inputs()
    _fwd_bwd(m, x0, dy0)
    h.end_step(skipped=False)
    m.weight.grad = None
    w0_amax = m.weight.abs().max().item()
    with torch.no_grad():
        m.weight.mul_(2.0)  # outgrows its history, as x and dy below: the largest values saturate
    x, dy = _inputs(amax_scale=4.0)  # 4x the history
    y, dx, dw = _fwd_bwd(m, x, dy)
    x_amax, dy_amax, w_amax = h.state[0, 0, USED], h.state[0, 1, USED], h.state[0, 2, USED]
    assert x_amax.item() == x0.abs().max().item() and dy_amax.item() == dy0.bfloat16().abs().max().item()
    assert w_amax.item() == w0_amax
    # by hand from the reference quantizer: x, dy and W at the history's scales
    xq = fp8.quantize_tensorwise_ref(x, torch.float8_e4m3fn, amax=x_amax)
    dyq = fp8.quantize_tensorwise_ref(dy.bfloat16(), torch.float8_e5m2, amax=dy_amax)
    wq = fp8.quantize_tensorwise_ref(m.weight.detach(), torch.float8_e4m3fn, amax=w_amax)
    for q in (xq, wq):  # saturated codes: the delayed scales are in use
        assert (q.data.float().abs() == 448.0).any()
    xd, dyd, wd = xq.dequantize(), dyq.dequantize(), wq.dequantize()
    torch.testing.assert_close(y.float(), (xd @ wd.t()).bfloat16().float(), rtol=0, atol=0)
    torch.testing.assert_close(dx, dyd @ wd, rtol=1e-6, atol=0)  # dx in x's dtype (FP32)
    torch.testing.assert_close(dw, dyd.t() @ xd, rtol=1e-6, atol=0)
    assert h.row(0, 0)[1].item() == x.abs().max().item()  # this step's amaxes recorded for the next
    assert h.row(0, 2)[1].item() == m.weight.abs().max().item()


def test_policy_gives_quantized_layers_their_rows_and_checkpoints_the_history():
    from inkling_fp4.model.config import ModelConfig
    from inkling_fp4.model.hybrid import HybridLM

    cfg = ModelConfig(pattern="M*-M", vocab_size=256)
    model = HybridLM(cfg)
    pc = PrecisionConfig(recipe="fp8-tensorwise", fp8_scaling="delayed", amax_history=3)
    policy = PrecisionPolicy(pc, cfg.n_layers)
    policy.apply(model)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert policy.amax_history.state.shape == (len(layers), 3, 2 + 3)  # x, dy, W
    assert [m.amax_index for m in layers] == list(range(len(layers)))
    assert all((m.amax_history is policy.amax_history) == (m.recipe is not None) for m in layers)
    assert any(m.recipe is None for m in layers) and any(m.recipe is not None for m in layers)
    assert "delayed scaling, 3-step amax history" in policy.describe(model)
    ids = torch.randint(0, 256, (2, 32))
    model.forward_hidden(ids).float().square().sum().backward()
    policy.end_step(skipped=False)
    state = policy.state_dict()
    other = PrecisionPolicy(pc, cfg.n_layers)
    other.apply(HybridLM(cfg))
    other.load_state_dict(state)
    assert other.amax_history.ready and torch.equal(other.amax_history.state, policy.amax_history.state)
    quantized = [m.amax_index for m in layers if m.recipe is not None]
    assert (policy.amax_history.state[quantized, :, USED] > 0).all()
