"""Loss-gap analysis against hand-made metrics with known answers; phase summaries; compat refusal."""

import json
import math

import numpy as np
import pytest

from inkling_fp4.compare.compat import check_comparable, config_differences
from inkling_fp4.compare.loss_gap import (
    boundaries_from_config,
    default_window,
    load_loss_metrics,
    phase_summary,
    trailing_mean,
    train_gap,
    val_gap,
)
from inkling_fp4.compare.loss_summary import summarize
from inkling_fp4.compare.metrics import load_run_config, relative_gap
from inkling_fp4.config import RunConfig, apply_overrides, from_dict, to_dict
from inkling_fp4.errors import UserError
from metrics_fixture import DECAY_START, STEPS, TOKENS_PER_STEP, WARMUP_END, make_pair, phase_of, write_run

GAPS = {"warmup": 0.03, "stable": 0.005, "decay": 0.012}


def test_relative_gap_formula():
    assert relative_gap(3.03, 3.0) == pytest.approx(0.01)
    assert relative_gap(2.97, 3.0) == pytest.approx(-0.01)
    np.testing.assert_allclose(relative_gap(np.array([2.0, 4.4]), np.array([2.0, 4.0])), [0.0, 0.1])


def test_trailing_mean_known_answer():
    steps = np.array([1, 2, 3, 5, 10])
    values = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    # windows (s-3, s]: {1}, {1,2}, {1,2,3}, {3,5}, {10}
    np.testing.assert_allclose(trailing_mean(steps, values, 3), [1.0, 1.5, 2.0, 3.5, 5.0])
    np.testing.assert_allclose(trailing_mean(steps, values, 1), values)
    with pytest.raises(ValueError, match="window"):
        trailing_mean(steps, values, 0)


def test_trailing_mean_matches_naive_loop_on_random_steps():
    rng = np.random.default_rng()
    steps = np.unique(rng.integers(0, 500, size=120))
    values = rng.normal(3.0, 1.0, size=len(steps))
    window = int(rng.integers(1, 60))
    naive = [values[(steps > s - window) & (steps <= s)].mean() for s in steps]
    # prefix-sum differences carry an absolute error of about eps x the running sum (~1e-13 here)
    np.testing.assert_allclose(trailing_mean(steps, values, window), naive, rtol=1e-12, atol=1e-12)


def test_train_gap_without_smoothing_is_the_known_gap_per_step(tmp_path):
    a, b = make_pair(tmp_path, GAPS)
    g = train_gap(load_loss_metrics(a), load_loss_metrics(b), window=1)
    assert list(g.steps) == list(range(1, STEPS + 1))
    np.testing.assert_array_equal(g.tokens, g.steps * TOKENS_PER_STEP)
    expected = [GAPS[phase_of(s)] for s in g.steps]
    np.testing.assert_allclose(g.gap, expected, rtol=1e-9)


def test_a_constant_factor_gives_the_same_gap_under_any_smoothing(tmp_path):
    """The trailing mean is linear: (1.01 * L) smoothed is 1.01 * (L smoothed), whatever the noise."""
    a, b = make_pair(tmp_path, {"warmup": 0.01, "stable": 0.01, "decay": 0.01})
    for window in (1, 7, 50):
        g = train_gap(load_loss_metrics(a), load_loss_metrics(b), window)
        np.testing.assert_allclose(g.gap, 0.01, rtol=1e-9)


def test_smoothed_gap_equals_ratio_of_trailing_means(tmp_path):
    a, b = make_pair(tmp_path, GAPS)
    ma, mb = load_loss_metrics(a), load_loss_metrics(b)
    g = train_gap(ma, mb, window=9)
    sa = trailing_mean(ma.curve("loss").steps, ma.curve("loss").values, 9)
    sb = trailing_mean(mb.curve("loss").steps, mb.curve("loss").values, 9)
    np.testing.assert_allclose(g.gap, sa / sb - 1.0, rtol=1e-12)
    # deep inside the stable phase the window only holds stable-phase steps: exactly the stable gap
    i = list(g.steps).index(50)
    assert g.gap[i] == pytest.approx(GAPS["stable"], rel=1e-9)


def test_phase_boundaries_from_config(tmp_path):
    a, b = make_pair(tmp_path, GAPS)
    bounds = boundaries_from_config(load_run_config(a))
    assert (bounds.warmup_end, bounds.decay_start, bounds.switch_step) == (
        WARMUP_END,
        DECAY_START,
        DECAY_START,
    )
    assert boundaries_from_config(load_run_config(b)).switch_step is None  # switch_to_bf16=never

    def bounds_of(*overrides):
        return boundaries_from_config(
            from_dict(RunConfig, apply_overrides({}, ["train.steps=200", *overrides]))
        )

    assert bounds_of("train.warmup_steps=0.05").warmup_end == 11  # warmup is steps 1-10
    assert bounds_of("precision.switch_to_bf16=120").switch_step == 120
    assert bounds_of("precision.switch_to_bf16=0.75").switch_step == 151  # steps 151-200 in BF16
    assert bounds_of("precision.recipe=bf16").switch_step is None
    no_decay = bounds_of("train.decay_fraction=0.0")
    assert no_decay.decay_start == 201 and no_decay.switch_step is None


def test_phase_summary_known_answers(tmp_path):
    a, b = make_pair(tmp_path, GAPS)
    g = train_gap(load_loss_metrics(a), load_loss_metrics(b), window=1)
    ph = phase_summary(g, boundaries_from_config(load_run_config(a)))
    assert set(ph) == {"warmup", "stable", "decay", "after_switch", "end"}
    assert (ph["warmup"].first_step, ph["warmup"].last_step, ph["warmup"].points) == (1, WARMUP_END - 1, 10)
    assert (ph["stable"].first_step, ph["stable"].last_step) == (WARMUP_END, DECAY_START - 1)
    assert (ph["decay"].first_step, ph["decay"].last_step) == (DECAY_START, STEPS)
    assert ph["decay"].first_tokens == DECAY_START * TOKENS_PER_STEP
    for phase in ("warmup", "stable", "decay"):
        st = ph[phase]
        assert st.mean == pytest.approx(GAPS[phase]) and st.max == pytest.approx(GAPS[phase])
        assert st.min == pytest.approx(GAPS[phase]) and st.last == pytest.approx(GAPS[phase])
    assert ph["after_switch"] == ph["decay"]
    assert ph["end"].points == 1 and ph["end"].last_step == STEPS
    assert ph["end"].last == pytest.approx(GAPS["decay"])


def test_phase_summary_of_a_varying_gap_matches_direct_statistics(tmp_path):
    rng = np.random.default_rng()
    base = {s: 4.0 + rng.random() for s in range(1, STEPS + 1)}
    run = {s: v * (1.0 + rng.normal(0.0, 0.01)) for s, v in base.items()}
    a = write_run(tmp_path / "a", run)
    b = write_run(tmp_path / "b", base, precision="fp8")
    g = train_gap(load_loss_metrics(a), load_loss_metrics(b), window=1)
    ph = phase_summary(g, boundaries_from_config(load_run_config(a)))
    stable = [run[s] / base[s] - 1.0 for s in range(WARMUP_END, DECAY_START)]
    assert ph["stable"].mean == pytest.approx(np.mean(stable), rel=1e-9)
    assert ph["stable"].max == pytest.approx(max(stable), rel=1e-9)
    assert ph["stable"].last == pytest.approx(stable[-1], rel=1e-9)


def test_val_gap_aligned_by_step(tmp_path):
    a, b = make_pair(
        tmp_path, GAPS, val_gaps={"warmup": 0.0, "stable": 0.004, "decay": 0.002}, precision_penalty=0.01
    )
    g = val_gap(load_loss_metrics(a), load_loss_metrics(b), bf16=True)
    assert list(g.steps) == [20, 40, 60, 80, 90, 100]
    np.testing.assert_allclose(g.gap, [0.004, 0.004, 0.004, 0.004, 0.002, 0.002], rtol=1e-9)
    g = val_gap(load_loss_metrics(a), load_loss_metrics(b))  # in each run's training precision
    np.testing.assert_allclose(g.gap, 1.01 * (1 + np.array([0.004] * 4 + [0.002] * 2)) - 1, rtol=1e-9)
    # the report's validation gap is the BF16 evaluation, as the paper's
    c = summarize({"nvfp4": a}, b, window=1)
    expected = val_gap(load_loss_metrics(a), load_loss_metrics(b), bf16=True)
    np.testing.assert_array_equal(c.main.val.gap, expected.gap)


def test_runs_logging_at_different_steps_align_on_the_shared_ones(tmp_path):
    rng = np.random.default_rng()
    base = {s: 3.0 + rng.random() for s in range(1, STEPS + 1)}
    run = {s: 1.02 * base[s] for s in range(2, STEPS + 1, 2)}
    a = write_run(tmp_path / "a", run)
    b = write_run(tmp_path / "b", base, precision="fp8")
    g = train_gap(load_loss_metrics(a), load_loss_metrics(b), window=1)
    assert list(g.steps) == list(range(2, STEPS + 1, 2))
    np.testing.assert_allclose(g.gap, 0.02, rtol=1e-9)


def test_metrics_loading_keeps_last_row_skips_bad_lines_and_nonfinite(tmp_path):
    train = {1: 4.0, 2: 3.9, 3: 3.8}
    extra = [
        json.dumps({"step": 2, "tokens": 64, "loss": 3.5}),  # the same step again after a resume
        '{"step": 3, "tokens": 96, "lo',  # a line cut short by a crash
        json.dumps({"step": 4, "tokens": 128, "loss": float("nan")}),
        json.dumps({"event": "precision_switch", "step": 3}),
    ]
    m = load_loss_metrics(write_run(tmp_path / "r", train, extra_lines=extra))
    assert list(m.curve("loss").steps) == [1, 2, 3]
    assert list(m.curve("loss").values) == [4.0, 3.5, 3.8]
    assert m.skipped_lines == 1 and m.nonfinite == 1
    assert m.precision[1] == "nvfp4"


def test_missing_or_empty_run_dir_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="metrics.jsonl"):
        load_loss_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="no training or validation losses"):
        load_loss_metrics(tmp_path)
    with pytest.raises(UserError, match="config.yaml"):
        load_run_config(tmp_path)


def test_default_window_covers_rows_and_a_fraction_of_the_run():
    cfg = from_dict(RunConfig, apply_overrides({}, ["train.steps=10000", "train.log_every=10"]))
    assert default_window(cfg) == 100  # 1% of 10000 > 5 rows of 10
    cfg = from_dict(RunConfig, apply_overrides({}, ["train.steps=100", "train.log_every=10"]))
    assert default_window(cfg) == 50  # 5 logged rows


def test_verdict_within_and_outside_the_papers_bounds(tmp_path):
    a, b = make_pair(tmp_path / "in", GAPS)
    c = summarize({"nvfp4": a}, b, window=1)
    v = c.main.verdict
    assert v.within is True
    assert [(k.phase, k.bound, round(k.value, 12)) for k in v.checks] == [
        ("stable", 0.01, 0.005),
        ("decay", 0.015, 0.012),
    ]
    assert "within the paper's bounds" in v.line
    assert "stable max gap +0.50% (< 1%, 0.50 pp to spare)" in v.line
    assert "decay max gap +1.20% (< 1.5%, 0.30 pp to spare)" in v.line

    a, b = make_pair(tmp_path / "out", {"warmup": 0.0, "stable": 0.013, "decay": 0.01})
    v = summarize({"nvfp4": a}, b, window=1).main.verdict
    assert v.within is False
    assert (
        "outside the paper's bounds" in v.line and "stable max gap +1.30% (>= 1%, over by 0.30 pp)" in v.line
    )


def test_verdict_undetermined_when_a_phase_has_no_steps(tmp_path):
    rng = np.random.default_rng()
    base = {s: 3.0 + rng.random() for s in range(1, 60)}  # stopped before the decay
    a = write_run(tmp_path / "a", {s: 1.001 * v for s, v in base.items()})
    b = write_run(tmp_path / "b", base, precision="fp8")
    v = summarize({"nvfp4": a}, b, window=1).main.verdict
    assert v.within is None and "decay: no logged steps" in v.line


# ---------------------------------------------------------------------------------------------- compat


def test_compat_accepts_runs_that_differ_only_in_precision_and_logging(tmp_path):
    a = write_run(tmp_path / "a", {1: 3.0}, overrides=["precision.rht=false", "train.log_every=5"])
    b = write_run(tmp_path / "b", {1: 3.0}, precision="fp8", overrides=["data.cache_dir=/elsewhere"])
    check_comparable(a, b)


def test_compat_refuses_different_seed_data_or_schedule_naming_every_key(tmp_path):
    a = write_run(tmp_path / "a", {1: 3.0})
    b = write_run(
        tmp_path / "b", {1: 3.0}, overrides=["train.seed=7", "data.seq_len=32", "train.decay_fraction=0.3"]
    )
    with pytest.raises(UserError) as e:
        check_comparable(a, b)
    msg = str(e.value)
    for key in ("train.seed (0 vs 7)", "data.seq_len (16 vs 32)", "train.decay_fraction (0.2 vs 0.3)"):
        assert key in msg
    assert str(a) in msg and str(b) in msg and "rerun" in msg


@pytest.mark.parametrize(
    "override, key",
    [
        ("data.source=/data/other.jsonl", "data.source"),
        ("train.warmup_steps=20", "train.warmup_steps"),
        ("optim.lr=0.01", "optim.lr"),
        ("model.d_model=128", "model.d_model"),
        ("train.steps=120", "train.steps"),
    ],
)
def test_compat_refuses_each_kind_of_difference(tmp_path, override, key):
    a = write_run(tmp_path / "a", {1: 3.0})
    b = write_run(tmp_path / "b", {1: 3.0}, overrides=[override])
    with pytest.raises(UserError, match=key.replace(".", r"\.")):
        check_comparable(a, b)


def test_a_key_missing_from_an_older_config_counts_as_its_default():
    full = to_dict(RunConfig())
    old = to_dict(RunConfig())
    del old["train"]["seed"]
    assert config_differences(full, old) == []
    old["train"]["seed"] = 5
    assert config_differences(full, old) == [("train.seed", 0, 5)]


def test_summaries_are_finite_and_json_ready(tmp_path):
    a, b = make_pair(tmp_path, GAPS)
    from inkling_fp4.compare.loss_summary import comparison_to_dict

    data = json.loads(json.dumps(comparison_to_dict(summarize({"nvfp4": a}, b))))
    r = data["runs"]["nvfp4"]
    assert r["final"]["val"]["gap"] == pytest.approx(GAPS["decay"])
    assert all(math.isfinite(x) for x in r["series"]["train"]["gap"])


def test_judged_max_ignores_points_whose_window_reaches_into_the_previous_phase(tmp_path):
    a, b = make_pair(tmp_path, GAPS)
    window = 6
    g = train_gap(load_loss_metrics(a), load_loss_metrics(b), window)
    ph = phase_summary(g, boundaries_from_config(load_run_config(a)), window)
    # the first stable steps still average warmup rows (3% gap) into their window ...
    assert ph["stable"].max > GAPS["stable"] + 0.005
    # ... the judged max starts once the window (s-6, s] lies inside the stable phase (s >= 16)
    assert ph["stable"].settled_max == pytest.approx(GAPS["stable"], rel=1e-9)
    assert ph["decay"].settled_max == pytest.approx(GAPS["decay"], rel=1e-9)
    # a phase shorter than the window is judged on its last point
    short = phase_summary(g, boundaries_from_config(load_run_config(a)), window=50)
    assert short["decay"].settled_max == pytest.approx(short["decay"].last)
    v = summarize({"nvfp4": a}, b, window=window).main.verdict
    assert [round(c.value, 12) for c in v.checks] == [GAPS["stable"], GAPS["decay"]]
