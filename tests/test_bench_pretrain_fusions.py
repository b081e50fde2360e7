"""bench_pretrain.py --without: each named fused FP8 path is turned off (its ``applies`` answers False
whatever it is given; the paths themselves run on the GPU only), a name it does not know is
refused, and 'all' names every one."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

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
