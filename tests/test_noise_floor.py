"""The noise floor of a comparison: the FP8 baseline trained again from other initial weights.

Hand-made runs with known gaps (metrics_fixture): the band is the largest |judged gap| of the repeat
per phase, and each verdict says in which phases a run's judged gap lies beyond it. Then the pieces
that make the repeat: the plan, the compatibility rule, ``train.init_seed`` in the loop, and the
command line for existing runs.
"""

import json

import numpy as np
import pytest
import torch

from inkling_fp4.compare.compat import check_comparable, config_differences
from inkling_fp4.compare.loss_report import wandb_summary
from inkling_fp4.compare.loss_summary import summarize
from inkling_fp4.compare.report import write_report
from inkling_fp4.config import load_config, to_dict
from inkling_fp4.errors import UserError
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.train.compare_baseline import NOISE, compare_runs, plan_runs
from inkling_fp4.train.pretrain import initial_weights_rng as _initial_weights_rng
from metrics_fixture import baseline_losses, make_pair, phase_of, write_run

GAPS = {"warmup": 0.03, "stable": 0.005, "decay": 0.012}
FP8 = ["precision.switch_to_bf16=never"]


def noise_gap(step: int) -> float:
    """The repeat's gap to the baseline: alternating +0.8% / -0.9% in the stable phase, +0.4% after."""
    phase = phase_of(step)
    if phase == "stable":
        return 0.008 if step % 2 else -0.009
    return 0.004 if phase == "decay" else 0.02


def _runs(tmp_path, init_seed=1, precision="fp8"):
    """(nvfp4 run, fp8 baseline, fp8 repeat from init_seed) with the gaps above."""
    seed = int(np.random.default_rng().integers(1 << 30))
    a, b = make_pair(tmp_path, GAPS, seed=seed)
    base = baseline_losses(np.random.default_rng(seed))  # the baseline's losses, drawn as make_pair did
    repeat = {s: v * (1.0 + noise_gap(s)) for s, v in base.items()}
    overrides = (
        [*FP8, f"train.init_seed={init_seed}"] if precision == "fp8" else [f"train.init_seed={init_seed}"]
    )
    c = write_run(tmp_path / NOISE, repeat, precision=precision, overrides=overrides)
    return a, b, c


def test_band_is_the_largest_absolute_judged_gap_of_the_repeat(tmp_path):
    a, b, c = _runs(tmp_path)
    comparison = summarize({"nvfp4": a, NOISE: c}, b, window=1, noise_label=NOISE)
    assert comparison.noise.label == NOISE
    assert comparison.noise.band["stable"] == pytest.approx(0.009)
    assert comparison.noise.band["decay"] == pytest.approx(0.004)
    main = comparison.main.verdict
    assert main.within is True and main.beyond_noise == ("decay",)
    assert "beyond the noise floor in decay" in main.line
    assert "stable +0.50% vs ±0.90%" in main.line and "decay +1.20% vs ±0.40%" in main.line
    assert f"from {NOISE} vs fp8" in main.line
    repeat = comparison.runs[NOISE].verdict
    assert repeat.beyond_noise is None and "noise floor" not in repeat.line


def test_without_a_repeat_verdicts_say_nothing_of_noise(tmp_path):
    a, b, _ = _runs(tmp_path)
    comparison = summarize({"nvfp4": a}, b, window=1)
    assert comparison.noise is None
    assert comparison.main.verdict.beyond_noise is None and "noise" not in comparison.main.verdict.line


def test_report_shows_the_band_and_each_runs_standing(tmp_path):
    a, b, c = _runs(tmp_path)
    out = write_report(
        summarize({"nvfp4": a, NOISE: c}, b, window=1, noise_label=NOISE), tmp_path / "rep", wandb=False
    )
    data = json.loads((out / "report.json").read_text())
    assert data["noise_floor"]["label"] == NOISE
    assert data["noise_floor"]["band"]["stable"] == pytest.approx(0.009)
    assert data["runs"]["nvfp4"]["verdict"]["beyond_noise"] == ["decay"]
    md = (out / "report.md").read_text()
    assert "**Noise floor:**" in md and "stable ±0.90%, decay ±0.40%" in md
    assert "| paper's bounds | noise floor |" in md  # the gap table's last column
    assert "| beyond in decay |" in md and "| (the repeat) |" in md
    summary = wandb_summary(data)
    assert summary["compare/noise_floor/decay"] == pytest.approx(0.004)
    assert summary["compare/nvfp4/beyond_noise_floor"] == 1.0


def test_plan_adds_the_baseline_with_only_another_init_seed():
    cfg = load_config("tiny", ["train.seed=5"])
    plan = plan_runs(cfg, noise=True)
    base, repeat = plan[0], plan[-1]
    assert repeat.label == NOISE and repeat.cfg.train.init_seed == 6
    assert repeat.cfg.precision == base.cfg.precision
    diffs = config_differences(to_dict(repeat.cfg), to_dict(base.cfg))
    assert [d[0] for d in diffs] == ["train.init_seed"]
    assert NOISE not in [p.label for p in plan_runs(cfg)]


def test_compat_refuses_another_init_seed_unless_allowed(tmp_path):
    a = write_run(tmp_path / "a", {1: 3.0}, precision="fp8")
    b = write_run(tmp_path / "b", {1: 3.0}, precision="fp8", overrides=["train.init_seed=3"])
    with pytest.raises(UserError, match=r"train\.init_seed \(None vs 3\)"):
        check_comparable(a, b)
    check_comparable(a, b, allow=("train.init_seed",))


def test_compare_runs_takes_a_noise_run_and_checks_it(tmp_path):
    a, b, c = _runs(tmp_path / "ok")
    out = compare_runs(a, b, tmp_path / "out", noise_run=c)
    data = json.loads((out / "report.json").read_text())
    assert data["noise_floor"]["label"] == NOISE  # (smoothed: the alternating stable noise averages out)
    assert "decay" in data["runs"]["nvfp4"]["verdict"]["beyond_noise"]
    _, b2, same = _runs(tmp_path / "same", init_seed=0)  # train.seed 0: the baseline's own weights
    with pytest.raises(UserError, match="same weights as the baseline"):
        compare_runs(a, b2, tmp_path / "o2", noise_run=same)
    _, b3, other = _runs(tmp_path / "prec", precision="nvfp4")
    with pytest.raises(UserError, match="precision"):
        compare_runs(a, b3, tmp_path / "o3", noise_run=other)


TINY_MODEL = ModelConfig(vocab_size=64)


def _weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_init_seed_changes_only_the_initial_weights():
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    with _initial_weights_rng(None, cpu):
        plain = _weights(HybridLM(TINY_MODEL))
    torch.manual_seed(0)
    unwrapped = _weights(HybridLM(TINY_MODEL))
    torch.manual_seed(0)
    with _initial_weights_rng(7, cpu):
        other = _weights(HybridLM(TINY_MODEL))
    after_other = torch.rand(4)
    torch.manual_seed(7)
    from_seed_7 = _weights(HybridLM(TINY_MODEL))
    assert torch.equal(plain, unwrapped)  # no init_seed: the run as before
    assert not torch.equal(plain, other)
    assert torch.equal(other, from_seed_7)  # drawn from init_seed alone
    torch.manual_seed(0)
    assert torch.equal(after_other, torch.rand(4))  # the global stream resumes where it was
