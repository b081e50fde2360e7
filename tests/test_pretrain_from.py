"""Continued pretraining: pretrain --from a run starts from its weights, model and tokenizer."""

import json

import pytest

from model_helpers import SMALL_RUN
from test_run_dir import cli, one_line

pytestmark = pytest.mark.slow


def losses(run):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_pretrain_from_a_run_starts_where_it_ended(tmp_path):
    common = [*SMALL_RUN, f"data.cache_dir={tmp_path / 'cache'}", "eval.every=0", "train.warmup_steps=2"]
    base = tmp_path / "base"
    code, _, err = cli(["pretrain", "--run-dir", str(base), *common, "train.steps=20"])
    assert code == 0, err
    more = tmp_path / "more"
    code, out, err = cli(["pretrain", "--from", str(base), "--run-dir", str(more), *common, "train.steps=4",
                          "model.d_model=32"])  # fmt: skip
    assert code == 0, err
    assert "init: weights and model from" in out and "step_20" in out
    assert (more / "tokenizer.json").read_bytes() == (base / "tokenizer.json").read_bytes()
    first, base_first, base_last = losses(more)[0], losses(base)[0], losses(base)[-1]
    assert abs(first - base_last) < 0.3 * (base_first - base_last)  # it starts near where base ended
    code, _, err = cli(["pretrain", "--from", str(base), "--run-dir", str(tmp_path / "x"), *common,
                        "model.d_model=64"])  # fmt: skip
    assert code == 2 and "model.d_model=64 disagrees" in one_line(err) and not (tmp_path / "x").exists()
    code, _, err = cli(["pretrain", "--from", str(base), "--resume", "--run-dir", str(more)])
    assert code == 2 and "drop --from" in one_line(err)
