"""Live gap: the same numbers as the offline analysis, from a baseline file that is still growing."""

import json

import numpy as np
import pytest

from inkling_fp4.compare.live import LiveGap
from inkling_fp4.compare.loss_gap import load_loss_metrics, train_gap
from inkling_fp4.errors import UserError
from metrics_fixture import STEPS, make_pair, write_run


def test_live_gap_equals_the_offline_smoothed_gap(tmp_path):
    a, b = make_pair(tmp_path, {"warmup": 0.03, "stable": 0.005, "decay": 0.012}, val_gaps=None)
    run, base = load_loss_metrics(a), load_loss_metrics(b)
    offline = train_gap(run, base, window=7)
    live = LiveGap(b, window=7)
    loss = run.curve("loss")
    got = [live.gap(int(s), float(v)) for s, v in zip(loss.steps, loss.values, strict=True)]
    np.testing.assert_allclose(got, offline.gap, rtol=0, atol=1e-12)
    assert live.at(50) == pytest.approx(base.curve("loss").values[43:50].mean())


def test_live_gap_rereads_a_growing_baseline_and_waits_for_whole_lines(tmp_path):
    b = write_run(tmp_path / "fp8", {1: 4.0, 2: 3.0}, precision="fp8")
    live = LiveGap(b, window=1)
    assert live.gap(2, 3.3) == pytest.approx(0.1)
    assert live.gap(3, 2.0) is None  # the baseline has not logged step 3 yet
    path = b / "metrics.jsonl"
    with open(path, "a") as f:
        f.write(json.dumps({"step": 3, "tokens": 96, "loss": 2.5})[:10])  # half a line
    assert live.at(3) is None
    with open(path, "a") as f:
        f.write(json.dumps({"step": 3, "tokens": 96, "loss": 2.5})[10:] + "\n")
    assert live.at(3) == 2.5
    assert live.gap(3, 2.0) == pytest.approx(-0.2)


def test_live_gap_after_a_resume_forgets_the_later_steps(tmp_path):
    b = write_run(tmp_path / "fp8", {s: 2.0 for s in range(1, 11)}, precision="fp8")
    live = LiveGap(b, window=3)
    for s in range(1, 9):
        live.gap(s, 3.0)
    # resumed from step 5: steps 6-8 are logged again with new losses
    assert live.gap(6, 2.2) == pytest.approx((3.0 + 3.0 + 2.2) / 3 / 2.0 - 1.0)


def test_live_gap_default_window_and_missing_baseline(tmp_path):
    b = write_run(tmp_path / "fp8", {s: 2.0 for s in range(1, STEPS + 1)}, precision="fp8")
    assert LiveGap(b).window == 5  # 5 logged rows of 1 step, more than 1% of 100 steps
    assert LiveGap(b).gap(1, float("nan")) is None
    with pytest.raises(UserError, match="does not exist"):
        LiveGap(tmp_path / "nope")
    empty = tmp_path / "starting"
    empty.mkdir()
    assert LiveGap(empty).at(1) is None  # the baseline has not written metrics yet
