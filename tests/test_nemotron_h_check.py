"""A Nemotron-H directory is checked before anything is built or written from it: each bad config
key, layer count, safetensors header, file size, tensor name, dtype, shape or value is one line
(exit 2) naming the file, the key or tensor, what was found and what was expected, through every
command that takes it as --from (info, sft, pretrain, export)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.interop.hf_writer import hf_tensors, write_hf
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from test_run_dir import cli, one_line, tree_hash

WEIGHTS = "model.safetensors"
Q = "backbone.layers.1.mixer.q_proj.weight"
IN_PROJ = "backbone.layers.0.mixer.in_proj.weight"


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A small Nemotron-H directory (all three layer kinds, GQA) as the hf export writes it."""
    cfg = ModelConfig(pattern="M*-M", vocab_size=320, d_model=32, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      mamba_heads=4, mamba_head_dim=8, n_groups=2, d_state=8, chunk_size=8)  # fmt: skip
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]
    tokenizer = Tokenizer.train_bpe(texts, vocab_size=300, show_progress=False)
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("nemotron") / "nh"
    write_hf(out, cfg, tokenizer, hf_tensors(HybridLM(cfg)), max_len=64)
    return out


def _config(change):
    def mutate(d):
        config = json.loads((d / "config.json").read_text())
        change(config)
        (d / "config.json").write_text(json.dumps(config))

    return mutate


def _tensors(change):
    def mutate(d):
        tensors = load_file(str(d / WEIGHTS))
        change(tensors)
        save_file(tensors, str(d / WEIGHTS))

    return mutate


def _truncate(d):
    data = (d / WEIGHTS).read_bytes()
    (d / WEIGHTS).write_bytes(data[:-100])


def _garbage(d):
    (d / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")


def _nan(tensors):
    tensors[IN_PROJ][0, 0] = float("nan")


CASES = {
    "no hidden_size": (_config(lambda c: c.pop("hidden_size")), ["config.json", "hidden_size is missing",
                                                                   "expected a positive integer"]),
    "hidden_size text": (_config(lambda c: c.update(hidden_size="sixty-four")),
                         ["config.json", "hidden_size is 'sixty-four'", "expected a positive integer"]),
    "ffn negative": (_config(lambda c: c.update(intermediate_size=-64)), ["intermediate_size is -64"]),
    "eps zero": (_config(lambda c: c.update(layer_norm_epsilon=0)), ["layer_norm_epsilon is 0",
                                                                     "expected a number > 0"]),
    "layer count": (_config(lambda c: c.update(num_hidden_layers=9)), ["num_hidden_layers is 9",
                                                                      "has 4 layers", "expected 4"]),
    "pattern disagrees": (_config(lambda c: c.update(hybrid_override_pattern="MM-M")),
                          ["hybrid_override_pattern is 'MM-M'", "'M*-M'"]),
    "wrong shape": (_tensors(lambda t: t.update({Q: t[Q][:-2].contiguous()})),
                    [WEIGHTS, Q, "has shape [30, 32]", "config.json predicts [32, 32]"]),
    "int dtype": (_tensors(lambda t: t.update({Q: t[Q].to(torch.int32)})),
                  [WEIGHTS, Q, "is I32", "expected a floating-point dtype"]),
    "missing tensor": (_tensors(lambda t: t.pop("lm_head.weight")), ["no tensor lm_head.weight",
                                                                     "predicts it with shape [320, 32]"]),
    "extra tensor": (_tensors(lambda t: t.update({"backbone.extra.bias": torch.zeros(3)})),
                     ["backbone.extra.bias", "no place for"]),
    "truncated": (_truncate, [WEIGHTS, "the file is truncated", "its header declares"]),
    "garbage": (_garbage, [WEIGHTS, "header is not a JSON object"]),
}  # fmt: skip


def bad_copy(good, tmp_path, mutate):
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    mutate(bad)
    return bad


def refused(argv, bad, *absent):
    """One line, exit 2, the directory unchanged and nothing written at ``absent``."""
    before = tree_hash(bad)
    code, out, err = cli(argv)
    assert code == 2, (out, err)
    assert tree_hash(bad) == before and not any(p.exists() for p in absent)
    return one_line(err)


@pytest.mark.parametrize("case", list(CASES))
def test_each_bad_directory_is_one_line_naming_what_is_wrong(good, tmp_path, case):
    mutate, named = CASES[case]
    bad = bad_copy(good, tmp_path, mutate)
    line = refused(["info", "--from", str(bad)], bad)
    assert line.startswith(f"error: --from {bad}: ") and all(n in line for n in named), line


def test_the_good_directory_passes(good):
    code, out, err = cli(["info", "--from", str(good)])
    assert code == 0 and "pattern M*-M (4 layers)" in out, err


@pytest.mark.parametrize("command", ["sft", "pretrain", "export"])
@pytest.mark.parametrize("case", ["wrong shape", "NaN"])
def test_every_command_refuses_before_writing(good, tmp_path, command, case):
    """sft, pretrain and export --from check the directory before any run directory, data cache or
    export is written; a NaN is named, not taken for a learning-rate problem."""
    mutate = _tensors(_nan) if case == "NaN" else CASES[case][0]
    bad = bad_copy(good, tmp_path, mutate)
    target, cache = tmp_path / "target", tmp_path / "cache"
    if command == "export":
        argv = ["export", "--from", str(bad), "--format", "hf", "--out", str(target)]
    else:
        argv = [command, "--from", str(bad), "--run-dir", str(target), f"data.cache_dir={cache}",
                "train.steps=2", "data.seq_len=32", "log.progress=false"]  # fmt: skip
    line = refused(argv, bad, target, cache)
    if case == "NaN":
        assert f"{WEIGHTS}: tensor {IN_PROJ} holds NaN (1 of its" in line and "lr" not in line
    else:
        assert Q in line and "predicts [32, 32]" in line
