"""HybridLM: structure, packing, presets, parameter and FLOP counts, recipes, speed."""

import dataclasses
import importlib.util

import pytest
import torch

from inkling_fp4.config import RunConfig, from_dict
from inkling_fp4.errors import ConfigError
from inkling_fp4.model.attention import Attention
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.model.mamba2 import Mamba2Mixer
from inkling_fp4.model.mlp import MLP
from inkling_fp4.model.presets import PRESETS, model_preset
from inkling_fp4.precision.quant_linear import QuantLinear
from model_helpers import exact_model, random_doc_ids


def test_pattern_builds_blocks_with_layer_indices():
    model = HybridLM(ModelConfig(pattern="M-*M"))
    kinds = [type(b.mixer) for b in model.layers]
    assert kinds == [Mamba2Mixer, MLP, Attention, Mamba2Mixer]
    for i, block in enumerate(model.layers):
        assert block.layer_idx == i
        lins = [m for m in block.modules() if isinstance(m, QuantLinear)]
        assert lins and all(m.layer_idx == i for m in lins)
    assert isinstance(model.embed, torch.nn.Embedding) and isinstance(model.lm_head, torch.nn.Linear)
    assert model.lm_head.bias is None and model.lm_head.weight.data_ptr() != model.embed.weight.data_ptr()


def test_forward_backward_reaches_every_parameter():
    cfg = ModelConfig()
    model = HybridLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    logits = model(ids, doc_ids=random_doc_ids(2, 24, 3))
    assert logits.shape == (2, 24, cfg.vocab_size) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
        assert p.dtype == torch.float32, name


def test_packed_batch_equals_documents_run_separately():
    cfg = ModelConfig(pattern="M*-M", chunk_size=8)
    model = exact_model(cfg)
    L = 21
    ids = torch.randint(0, cfg.vocab_size, (2, L))
    docs = random_doc_ids(2, L, 3)
    docs[1] = 0  # one row holds a single document
    packed = model(ids, doc_ids=docs)
    whole = model(ids)
    torch.testing.assert_close(packed[1], whole[1], atol=1e-10, rtol=1e-10)
    for row in range(2):
        cuts = [0] + [t for t in range(1, L) if docs[row, t] != docs[row, t - 1]] + [L]
        for s, e in zip(cuts[:-1], cuts[1:], strict=True):
            alone = model(ids[row : row + 1, s:e])
            torch.testing.assert_close(packed[row : row + 1, s:e], alone, atol=1e-10, rtol=1e-10)
    # and documents do leak without doc_ids (the masking is doing the work)
    assert (whole[0] - packed[0]).abs().max() > 1e-4


def test_packed_batch_in_bf16_matches_within_bf16_tolerance():
    cfg = ModelConfig(pattern="M*-", chunk_size=8)
    torch.manual_seed(0)
    model = HybridLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 24))
    docs = torch.zeros(1, 24, dtype=torch.int32)
    docs[:, 10:] = 1
    packed = model(ids, doc_ids=docs)
    torch.testing.assert_close(packed[:, 10:], model(ids[:, 10:]), atol=3e-2, rtol=3e-2)


def test_output_projections_are_scaled_by_depth():
    cfg = ModelConfig(pattern="M-*-" * 4, d_model=128, ffn_dim=512, mamba_heads=16, mamba_head_dim=16)
    model = HybridLM(cfg)
    scaled = {"mamba.out_proj", "mlp.down_proj", "attn.o_proj"}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            want = cfg.init_std / (2 * cfg.n_layers) ** 0.5 if m.name in scaled else cfg.init_std
            assert abs(m.weight.std().item() / want - 1) < 0.1, m.name
    assert abs(model.embed.weight.std().item() / cfg.init_std - 1) < 0.05


def test_presets_and_explicit_fields():
    for name in PRESETS:
        cfg = ModelConfig(preset=name)
        assert cfg.d_model == PRESETS[name]["d_model"]
    cfg = from_dict(RunConfig, {"model": {"preset": "hybrid-350m", "chunk_size": 64, "d_model": 512}})
    assert cfg.model.d_model == 512 and cfg.model.chunk_size == 64 and cfg.model.ffn_dim == 4096
    assert from_dict(RunConfig, {"model": {"preset": "nemotron-h-12b"}}).model.chunk_size == 128
    again = ModelConfig(preset="hybrid-350m", **model_preset("tiny"))  # every field explicit
    assert dataclasses.replace(again, preset=None) == ModelConfig()  # the tiny preset is the defaults
    with pytest.raises(ConfigError, match="model.preset"):
        from_dict(RunConfig, {"model": {"preset": "huge"}})
    with pytest.raises(ConfigError, match="n_groups"):
        from_dict(RunConfig, {"model": {"mamba_heads": 6, "n_groups": 4}})


def test_nemotron_h_12b_counts_12_3b_parameters(monkeypatch):
    cfg = ModelConfig(preset="nemotron-h-12b")
    # Built on the meta device (shapes, no memory). The layers' own normal_ init on meta tensors goes
    # through a slow first-time Python decomposition, and counting needs no values.
    monkeypatch.setattr(torch.nn.init, "normal_", lambda t, *args, **kwargs: t)
    with torch.device("meta"):
        model = HybridLM(cfg)
    assert len(cfg.pattern) == 62 and cfg.pattern.count("*") == 6 and cfg.pattern.count("M") == 28
    n = model.num_params()
    assert abs(n / 12.3e9 - 1) < 0.02, n
    # by hand: embeddings + 28 Mamba-2 + 28 MLP + 6 attention layers (+ norms)
    d, V, E, G, N, H, k = 5120, 131072, 10240, 8, 128, 160, 4
    mamba = d * (2 * E + 2 * G * N + H) + (E + 2 * G * N) * (k + 1) + 3 * H + E + E * d + d
    mlp = 2 * d * 20480 + d
    attn = d * (40 + 16) * 128 + 40 * 128 * d + d
    assert n == 2 * V * d + 28 * mamba + 28 * mlp + 6 * attn + d


def test_flops_per_token_by_hand():
    cfg = ModelConfig(pattern="M*-", chunk_size=16)
    model = HybridLM(cfg)
    L = 256
    d, V = cfg.d_model, cfg.vocab_size
    E, G, N, H, P = cfg.d_inner, cfg.n_groups, cfg.d_state, cfg.mamba_heads, cfg.mamba_head_dim
    matmuls = d * (2 * E + 2 * G * N + H) + E * d + d * 8 * 16 + 4 * 16 * d + 2 * d * cfg.ffn_dim + d * V
    attn = 3 * 2 * 2 * 4 * 16 * L / 2  # fwd+bwd, QK^T and AV, 4 heads x 16, causal
    scan = 3 * (G * 16 * N + H * 16 * P + 4 * H * P * N)
    assert model.flops_per_token(L) == pytest.approx(6 * matmuls + attn + scan)


def test_bf16_autocast_forward_runs():
    cfg = ModelConfig()
    model = HybridLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids, doc_ids=random_doc_ids(1, 16, 2))
    assert torch.isfinite(logits.float()).all()


RECIPES = ("bf16", "fp8", "fp8-tensorwise", "nvfp4", "mxfp4")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_runs_forward_and_backward(recipe):
    if importlib.util.find_spec("inkling_fp4.precision.policy") is None:
        pytest.skip("inkling_fp4.precision.policy (PrecisionPolicy) is not built yet")
    from inkling_fp4.precision.config import PrecisionConfig
    from inkling_fp4.precision.policy import PrecisionPolicy

    cfg = ModelConfig()
    torch.manual_seed(0)
    model = HybridLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    docs = random_doc_ids(2, 32, 2)
    reference = model(ids, doc_ids=docs).detach()
    pcfg = PrecisionConfig(recipe=recipe, backend="emulated", bf16_first_layers=0, bf16_last_layers=0)
    policy = PrecisionPolicy(pcfg, cfg.n_layers)
    policy.apply(model)
    logits = model(ids, doc_ids=docs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    assert torch.isfinite(logits.float()).all()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    if recipe != "bf16":
        assert all(m.recipe.name == recipe for m in model.modules() if isinstance(m, QuantLinear))
        # the recipe is in effect: the logits move, by about the format's precision
        rel = ((logits.float() - reference.float()).norm() / reference.float().norm()).item()
        assert 0 < rel < 0.5, rel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fast_paths_match_the_reference_under_autocast():
    """On the GPU the Mamba layers take the Triton scan and the compiled conv; under BF16 autocast the
    loss, logits and gradients match the reference paths to BF16 accuracy, on packed documents."""
    cfg = ModelConfig(pattern="M*-M-", chunk_size=64)
    torch.manual_seed(0)
    model = HybridLM(cfg).cuda()
    ids = torch.randint(0, cfg.vocab_size, (2, 256), device="cuda")
    docs = random_doc_ids(2, 256, 4).cuda()
    results = []
    for impl in ("fast", "reference"):
        for m in model.modules():
            if isinstance(m, Mamba2Mixer):
                m.ssd_impl = "auto" if impl == "fast" else "reference"
                m.conv_impl = "compiled" if impl == "fast" else "reference"
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, doc_ids=docs)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
        results.append([logits.float()] + [p.grad.float() for p in model.parameters()])
    for fast, ref in zip(*results, strict=True):
        assert ((fast - ref).norm() / ref.norm()).item() < 2e-2
