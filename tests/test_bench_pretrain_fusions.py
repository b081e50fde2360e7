"""bench_pretrain.py's switches. --without: each named fused FP8 path is turned off (its ``applies``
answers False whatever it is given; the paths themselves run on the GPU only), a name it does not know
is refused, and 'all' names every one. --tiles: the NVFP4 quantizers' tiles are set, bad items refused.
--nvfp4-pair, --producer-amaxes: the trainer's switches are set."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    module = importlib.import_module("bench_pretrain")
    for name in module.FUSIONS:  # restored after the test: the patch is process-wide by design
        m = importlib.import_module(f"inkling_fp4.model.fused_fp8.{name}")
        monkeypatch.setattr(m, "applies", m.applies)
    return module


def test_without_turns_the_named_paths_off(bench):
    mlp = importlib.import_module("inkling_fp4.model.fused_fp8.mlp")
    norm = importlib.import_module("inkling_fp4.model.fused_fp8.norm")
    before = norm.applies
    assert bench.disable_fusions("mlp") == ["mlp"]
    assert mlp.applies(None, None, None) is False
    assert norm.applies is before  # the others untouched
    assert bench.disable_fusions("all") == list(bench.FUSIONS)
    for name in bench.FUSIONS:
        assert importlib.import_module(f"inkling_fp4.model.fused_fp8.{name}").applies() is False


def test_an_unknown_fusion_is_refused(bench):
    with pytest.raises(SystemExit, match="--without mlp_fp8: not one of norm"):
        bench.disable_fusions("mlp_fp8")


def test_tiles_set_the_quantizer_tiles_and_refuse_bad_items(bench, monkeypatch):
    from inkling_fp4.numerics.kernels import nvfp4_quantize, nvfp4_rht

    for module, attr in bench.TILES.values():  # restored after the test
        monkeypatch.setattr(module, attr, getattr(module, attr))
    assert bench.set_tiles("rows=4,512,1 rht=128,2,4") == ["rows=4,512,1", "rht=128,2,4"]
    assert nvfp4_quantize.ROW_TILE == (4, 512, 1)
    assert nvfp4_rht.QUANTIZE_TILE == (128, 2, 4)
    assert nvfp4_rht.AMAX_TILE == (256, 8, 4)  # not named: unchanged
    with pytest.raises(SystemExit, match="--tiles rht=1,2: give three integers"):
        bench.set_tiles("rht=1,2")
    with pytest.raises(SystemExit, match="--tiles cols=1,2,3: not one of rows"):
        bench.set_tiles("cols=1,2,3")


SWITCHES = {  # flag -> (module, attribute it sets, choice on, choice off, printed when on, when off)
    "--nvfp4-pair": ("precision.gemm", "FUSED_NVFP4_PAIR", "on", "off", "one pass", "two passes"),
    "--producer-amaxes": (
        "precision.gemm", "PRODUCER_NVFP4_AMAXES", "on", "off", "from its producer", "a pass of their own"
    ),
    "--tma-gemm": ("numerics.kernels.scaled_gemm", "TMA_FED", "on", "off", "fed by TMA", "fed by pointers"),
    "--rht-loads": ("numerics.kernels.nvfp4_rht", "WIDE_LOADS", "wide", "rows", "wide loads", "rows loads"),
    "--saved-x": ("precision.gemm", "SAVED_WGRAD_VALUES", "values", "codes", "BF16 values", "wgrad: codes"),
}  # fmt: skip


@pytest.mark.parametrize("flag", sorted(SWITCHES))
@pytest.mark.parametrize("on", [True, False])
def test_the_nvfp4_switches_set_the_trainers(bench, monkeypatch, capsys, flag, on):
    import importlib

    path, attr, choice_on, choice_off, said_on, said_off = SWITCHES[flag]
    module = importlib.import_module(f"inkling_fp4.{path}")
    monkeypatch.setattr(module, attr, not on)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)  # stops after the switches
    monkeypatch.setattr("sys.argv", ["bench_pretrain.py", flag, choice_on if on else choice_off])
    assert bench.main() == 2
    assert getattr(module, attr) is on
    assert (said_on if on else said_off) in capsys.readouterr().out


def test_the_model_is_built_as_the_trainer_builds_it(bench):
    """The bench times the trainer's model: the fused FP8 classes under delayed scaling, the NVFP4
    training classes (the producers' amaxes) under nvfp4, the plain ones otherwise; same weights."""
    from inkling_fp4.config import load_config
    from inkling_fp4.model.fused_fp8.layers import FusedFP8Block
    from inkling_fp4.model.fused_nvfp4_train import NVFP4TrainBlock
    from inkling_fp4.model.hybrid import Block

    cfg = load_config("tiny", ["train.device=cpu"])
    built = {recipe: bench.build_model(recipe, cfg, "cpu") for recipe in ("bf16", "nvfp4", bench.DELAYED)}
    expected = {"bf16": Block, "nvfp4": NVFP4TrainBlock, bench.DELAYED: FusedFP8Block}
    for recipe, model in built.items():
        assert {type(b) for b in model.layers} == {expected[recipe]}, recipe
    plain = built["bf16"].state_dict()
    for model in built.values():
        assert all(torch.equal(v, plain[k]) for k, v in model.state_dict().items())
