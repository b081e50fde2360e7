"""Importing a Nemotron-H directory (transformers' layout) wherever a run is loaded: a random
NemotronH built and saved with transformers loads with its logits, export -> import -> export gives
the same bytes, and what fp4train's model lacks is refused in one line naming it."""

import json

import pytest
import torch

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import UserError
from inkling_fp4.interop.hf_writer import hf_tensors, tokenizer_files, write_hf
from inkling_fp4.interop.load_run import find_checkpoint, load_run, load_run_checkpoint
from inkling_fp4.interop.nemotron_h import model_config
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.train import sft
from inkling_fp4.train.from_run_config import from_run_config
from test_export_hf import CFG as EXPORT_CFG
from test_export_hf import _fp32_forward, export, rel
from test_run_dir import cli, tree_hash

transformers = pytest.importorskip("transformers")

HF = dict(
    vocab_size=320,
    hidden_size=32,
    hybrid_override_pattern="M*-M-*M",
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    mamba_num_heads=8,
    mamba_head_dim=8,
    n_groups=4,
    ssm_state_size=8,
    conv_kernel=4,
    chunk_size=8,
    time_step_min=0.01,
    time_step_limit=(0.01, float("inf")),  # the clamp of transformers from 5.25 (before: time_step_min)
    max_position_embeddings=64,
)


@pytest.fixture(scope="module")
def tokenizer():
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    return Tokenizer.train_bpe(texts, vocab_size=300, show_progress=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """A random NemotronHForCausalLM, saved by transformers, with a tokenizer beside it."""
    torch.manual_seed(0)
    hf = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**HF)).eval()
    with torch.no_grad():  # transformers' init gives every dt_bias the same softplus: spread them
        for layer in hf.model.layers:
            if hasattr(layer.mixer, "dt_bias"):
                layer.mixer.dt_bias.copy_(torch.linspace(-6.0, 0.0, HF["mamba_num_heads"]))
    out = tmp_path_factory.mktemp("nemotron") / "nemotron-h-tiny"
    hf.save_pretrained(out)
    for name, text in tokenizer_files(tokenizer, 64).items():
        (out / name).write_text(text)
    return hf, out


def exact(model):
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.forward = _fp32_forward.__get__(m)
    return model.eval()


def test_a_transformers_nemotron_h_imports_with_its_logits(saved, tokenizer):
    hf, path = saved
    cfg, model, tok = load_run(path)
    assert cfg.model.pattern == "M*-M-*M" and cfg.model.n_groups == 4 and cfg.model.dt_min_clamp == 0.01
    assert tok.content_hash == tokenizer.content_hash and cfg.data.seq_len == 64
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert rel(exact(model)(ids), hf(ids).logits) < 1e-5
    _, ckpt = find_checkpoint(path)
    assert ckpt.path == path and ckpt.step == 0
    assert load_run_checkpoint(path)[3].path == path


def test_export_import_export_gives_identical_bytes(saved, tmp_path):
    _, path = saved
    cfg, model, tok = load_run(path)
    write_hf(tmp_path / "a", cfg.model, tok, hf_tensors(model), max_len=cfg.data.seq_len)
    cfg2, model2, tok2 = load_run(tmp_path / "a")
    write_hf(tmp_path / "b", cfg2.model, tok2, hf_tensors(model2), max_len=cfg2.data.seq_len)
    assert tree_hash(tmp_path / "a") == tree_hash(tmp_path / "b")


def test_sft_takes_a_nemotron_h_directory(saved):
    _, path = saved
    cfg = from_run_config(None, ["data.seq_len=32"], path, stage="sft", default_recipe=sft.DEFAULT_RECIPE)
    assert cfg.stage == "sft" and cfg.init_from == str(path) and cfg.model.pattern == "M*-M-*M"


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(hybrid_override_pattern="M*E-"), "E (MoE)"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings=True"),
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act='silu'"),
        (dict(use_bias=True, mamba_proj_bias=True), "mamba_proj_bias=True, use_bias=True"),
        (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers=1"),
    ],
)
def test_what_fp4train_lacks_is_refused_naming_it(change, named):
    config = {"model_type": "nemotron_h", **HF, **change}
    with pytest.raises(UserError, match="config.json") as e:
        model_config(config)
    assert named in str(e.value) and "\n" not in str(e.value)


INF = {"__float__": "Infinity"}  # as transformers writes infinity into config.json


@pytest.mark.parametrize(
    "fields, clamp, init_min",
    [
        (dict(time_step_min=0.02), 0.0, 0.02),  # no limit: transformers' default (0, inf), no clamp
        (dict(time_step_min=0.02, time_step_limit=[0.0, INF]), 0.0, 0.02),  # time_step_min: init only
        (dict(time_step_min=0.02, time_step_limit=[0.05, INF]), 0.05, 0.02),
        (dict(time_step_min=0.0, time_step_limit=[0.001, INF]), 0.001, None),
    ],
)
def test_the_dt_clamp_is_time_step_limits_floor(fields, clamp, init_min):
    hf = {k: v for k, v in HF.items() if not k.startswith("time_step")}
    cfg = model_config({"model_type": "nemotron_h", **hf, **fields})
    assert cfg.dt_min_clamp == clamp
    assert cfg.dt_min == (ModelConfig().dt_min if init_min is None else init_min)


@pytest.mark.skipif(
    tuple(int(v) for v in transformers.__version__.split(".")[:2]) < (5, 25),
    reason="transformers before 5.25 clamps dt at time_step_min",
)
def test_an_import_clamps_dt_where_transformers_does(tmp_path, tokenizer):
    """time_step_min 0.02 with time_step_limit [0, inf]: transformers does not clamp, nor does the
    import (a model on which a 0.02 clamp moves the logits, so taking time_step_min would fail)."""
    _, out = export(tmp_path, ModelConfig(**EXPORT_CFG, dt_min_clamp=0.02), tokenizer)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "time_step_limit": [0.0, INF]}))
    cfg, model, _ = load_run(out)
    assert cfg.model.dt_min_clamp == 0.0 and cfg.model.dt_min == 0.02
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = exact(model)(ids), hf(ids).logits
        clamped = exact(load_run(out)[1])  # the same weights, the clamp set by hand
        for m in clamped.modules():
            if hasattr(m, "dt_min_clamp"):
                m.dt_min_clamp = 0.02
        assert rel(ours, theirs) < 1e-5 and rel(clamped(ids), theirs) > 1e-4


@pytest.mark.parametrize("limit", [[0.0, 1.0], [-0.1, INF], "0, inf", [0.0]])
def test_a_dt_limit_fp4train_cannot_express_is_refused(limit):
    with pytest.raises(UserError, match="time_step_limit=") as e:
        model_config({"model_type": "nemotron_h", **HF, "time_step_limit": limit})
    assert "\n" not in str(e.value)


def test_a_quantized_or_unrelated_directory_is_refused(saved, tmp_path):
    _, path = saved
    other = tmp_path / "q"
    other.mkdir()
    config = json.loads((path / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "modelopt"}})
    )
    with pytest.raises(UserError, match="quantized checkpoint"):
        load_run(other)
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="not a run directory"):
        load_run(other)


def test_info_says_what_a_nemotron_h_directory_holds(saved):
    _, path = saved
    code, out, err = cli(["info", "--from", str(path)])
    assert code == 0, err
    assert (
        "a Nemotron-H directory" in out and "pattern M*-M-*M (7 layers)" in out and "dt_min_clamp 0.01" in out
    )


def test_pretrain_continues_a_nemotron_h_directory(saved, tmp_path):
    """pretrain --from a Nemotron-H directory: its model and tokenizer, this recipe's training."""
    _, path = saved
    run = tmp_path / "cont"
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"def g{i}(x):\n    return x - {i}\n" for i in range(300)))
    code, out, err = cli(["pretrain", "--from", str(path), "--run-dir", str(run), f"data.source={corpus}",
                          f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32", "train.batch_size=4",
                          "train.steps=2", "eval.every=0", "log.progress=false",
                          "data.text_sample_by=paragraph", "model.d_model=32"])  # fmt: skip
    assert code == 0, err
    assert f"init: weights and model from {path}" in out
    cfg = load_run(run)[0]
    assert cfg.init_from == str(path) and cfg.model.pattern == "M*-M-*M" and cfg.model.n_groups == 4
    code, _, err = cli(
        ["pretrain", "--from", str(path), "--run-dir", str(tmp_path / "x"), "model.d_model=64"]
    )
    assert code == 2 and "model.d_model=64 disagrees" in err
