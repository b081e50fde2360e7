"""fp4train export --format hf: transformers' NemotronHForCausalLM loads it and gives fp4train's
logits (FP32, FP32 GEMMs on both sides; the dt clamp in the fields every transformers version reads),
AutoTokenizer loads the tokenizer and chat template, the directory loads back into fp4train, and
model.dt_min_clamp (transformers' time_step_limit[0]) holds in training and decoding forwards."""

import json
import types

import pytest
import torch
import torch.nn.functional as F

from inkling_fp4.data.chat import render
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.interop.hf_writer import hf_tensors, write_hf
from inkling_fp4.interop.load_run import load_run
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision.quant_linear import QuantLinear
from model_helpers import exact_model
from test_run_dir import cli, one_line, pretrained

transformers = pytest.importorskip("transformers")

CFG = dict(
    pattern="M*-M-*M",
    vocab_size=320,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    mamba_heads=8,
    mamba_head_dim=8,
    n_groups=4,
    d_state=8,
    chunk_size=8,
)
"""All three layer kinds, 4 B/C groups of 2 heads each, GQA 4:2."""


def _fp32_forward(self, x, pair_x=None, dy_fp8=None):
    return F.linear(x, self.weight.to(x.dtype))


def fp32_model(cfg: ModelConfig, seed: int = 0) -> HybridLM:
    """A HybridLM in FP32 whose QuantLinear GEMMs are plain FP32 matmuls (as transformers' nn.Linear)."""
    torch.manual_seed(seed)
    model = HybridLM(cfg)
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.forward = types.MethodType(_fp32_forward, m)
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    return Tokenizer.train_bpe(texts, vocab_size=300, show_progress=False)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def export(tmp_path, cfg, tokenizer, name="hf"):
    model = fp32_model(cfg)
    write_hf(tmp_path / name, cfg, tokenizer, hf_tensors(model), max_len=64)
    return model, tmp_path / name


def test_transformers_loads_the_export_with_fp4train_logits(tmp_path, tokenizer):
    cfg = ModelConfig(**CFG, dt_min_clamp=0.02)
    model, out = export(tmp_path, cfg, tokenizer)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron_h" and config["hybrid_override_pattern"] == "M*-M-*M"
    assert config["layers_block_type"][:3] == ["linear_attention", "full_attention", "mlp"]
    assert config["time_step_min"] == 0.02  # the clamp up to transformers 5.24
    assert config["time_step_limit"] == [0.02, float("inf")]  # from 5.25 on
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "NemotronHForCausalLM"
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
        unclamped = fp32_model(ModelConfig(**CFG))(ids)  # same weights (same seed), no dt clamp
    assert rel(theirs, ours) < 1e-5
    assert rel(unclamped, ours) > 1e-4  # the clamp acts on this model: exporting it is what matched


def test_export_without_the_clamp_loads_and_matches(tmp_path, tokenizer):
    cfg = ModelConfig(**CFG)
    model, out = export(tmp_path, cfg, tokenizer)
    assert json.loads((out / "config.json").read_text())["time_step_min"] == 0.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel(hf(ids).logits, model(ids)) < 1e-5


def test_auto_tokenizer_reads_the_run_tokenizer_and_chat_template(tmp_path, tokenizer):
    _, out = export(tmp_path, ModelConfig(**CFG), tokenizer)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    text = "def g(y):\n    return y + 1\n"
    assert auto(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert auto.apply_chat_template(messages, tokenize=False) == render(tokenizer, messages)
    prompt = auto.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|><|assistant|>")


def test_the_export_loads_back_into_fp4train(tmp_path, tokenizer):
    cfg = ModelConfig(**CFG, dt_min_clamp=0.02)
    model, out = export(tmp_path, cfg, tokenizer)
    cfg2, back, tok2 = load_run(out)
    for key in (
        "pattern",
        "d_model",
        "n_heads",
        "n_kv_heads",
        "ffn_dim",
        "mamba_heads",
        "mamba_head_dim",
        "n_groups",
        "d_state",
        "conv_kernel",
        "dt_min_clamp",
        "norm_eps",
        "vocab_size",
    ):
        assert getattr(cfg2.model, key) == getattr(cfg, key), key
    assert tok2.content_hash == tokenizer.content_hash
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k


def test_dt_clamp_holds_in_decoding():
    """prefill + decode_step give the sequence forward's logits with the clamp on (FP64, exact GEMMs)."""
    cfg = ModelConfig(**CFG, dt_min_clamp=0.05)
    model = exact_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(ids)  # [B, L, V]
        cache = model.allocate_cache(2, 10, dtype=torch.float64)
        steps = [model.prefill(ids[:, :4], torch.tensor([4, 4]), cache)]
        steps += [model.decode_step(ids[:, t], cache) for t in range(4, 10)]
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 3 + i], rtol=1e-9, atol=1e-9)


def test_dt_min_clamp_is_validated():
    with pytest.raises(ValueError, match="dt_min_clamp"):
        ModelConfig(dt_min_clamp=-1.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A pretrain run of 2 steps with NVFP4 layers (the tiny recipe keeps the first and last in BF16)."""
    return pretrained(tmp_path_factory, 2, "model.pattern=M*-M*-", "model.n_groups=2")


def test_cli_export_hf_of_a_run(run, tmp_path):
    code, out, err = cli(["export", "--from", str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert code == 0, err
    assert "export hf:" in out and "step 2" in out and f"wrote {tmp_path / 'hf'}" in out
    cfg, model, _ = load_run(tmp_path / "hf")
    _, own, _ = load_run(run)
    assert cfg.model.pattern == "M*-M*-" and all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), own.state_dict().values(), strict=True)
    )
    code, _, err = cli(["export", "--from", str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert code == 2 and "exists" in one_line(err)
    code, _, err = cli(
        ["export", "--from", str(run), "--step", "7", "--format", "hf", "--out", str(tmp_path / "x")]
    )
    assert code == 2 and "step_7" in one_line(err)
    code, _, err = cli(["export", "--from", str(run), "--format", "gguf", "--out", str(tmp_path / "y")])
    assert code == 2 and "hf, nvfp4-modelopt" in one_line(err)
    code, out, _ = cli(["info", "--from", str(run)])
    assert code == 0 and "a pretrain run, checkpoint step_2 (step 2)" in out and "pattern M*-M*-" in out


def test_cli_export_without_from_takes_the_newest_run(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(["export", "--format", "hf", "--out", "x"])
    assert code == 2 and "fp4train pretrain" in one_line(err) and not (tmp_path / "x").exists()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "pre").symlink_to(run)
    code, out, err = cli(["export", "--format", "hf", "--out", "x"])
    assert code == 0, err
    assert (
        "--from: runs/pre (pretrain run, step 2), the run under runs/ whose last checkpoint" in out
        and (tmp_path / "x" / "config.json").is_file()
    )
