"""WSD learning rate at its boundaries for every decay shape, and the precision switch step."""

import math
import random

import pytest

from inkling_fp4.errors import ConfigError
from inkling_fp4.runs.schedule import PrecisionSchedule, WSDSchedule


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_wsd_boundaries(shape):
    # 100 steps, warmup 10, decay over the last 20 (steps 81..100), min ratio 0.1
    s = WSDSchedule(100, 10, 0.2, shape, 0.1)
    assert s.lr_ratio(1) == pytest.approx(0.1)  # 1/10: the first step already moves
    assert s.lr_ratio(5) == pytest.approx(0.5)
    assert s.lr_ratio(10) == 1.0  # end of warmup
    assert s.lr_ratio(11) == 1.0 and s.lr_ratio(80) == 1.0  # the whole stable phase
    assert s.lr_ratio(100) == pytest.approx(0.1)  # exactly min_ratio on the last step
    mid = {"linear": 0.5, "cosine": 0.5, "1-sqrt": 1 - math.sqrt(0.5)}[shape]
    assert s.lr_ratio(90) == pytest.approx(0.1 + 0.9 * mid)  # halfway through the decay
    first = {
        "linear": 1 - 1 / 20,
        "cosine": 0.5 * (1 + math.cos(math.pi / 20)),
        "1-sqrt": 1 - math.sqrt(1 / 20),
    }
    assert s.lr_ratio(81) == pytest.approx(0.1 + 0.9 * first[shape])
    assert s.lr_ratio(81) < 1.0
    assert [s.phase_at(k) for k in (1, 10, 11, 80, 81, 100)] == [
        "warmup", "warmup", "stable", "stable", "decay", "decay"
    ]  # fmt: skip
    assert s.first_decay_step == 81
    ratios = [s.lr_ratio(k) for k in range(81, 101)]
    assert all(a > b for a, b in zip(ratios, ratios[1:], strict=False))  # strictly decreasing decay


def test_wsd_fractional_warmup_no_decay_and_overlap():
    s = WSDSchedule(200, 0.05, 0.0, "cosine", 0.0)
    assert s.warmup_steps == 10 and s.lr_ratio(10) == 1.0 and s.lr_ratio(200) == 1.0
    assert s.phase_at(200) == "stable"
    # warmup (4 steps) longer than the stable part: the smaller ratio wins, the last step is min
    s = WSDSchedule(5, 4, 0.6, "linear", 0.0)
    assert s.first_decay_step == 3
    assert s.lr_ratio(3) == pytest.approx(min(3 / 4, 1 - 1 / 3))
    assert s.lr_ratio(5) == 0.0


def test_wsd_random_steps_in_range():
    total = random.randint(20, 500)
    s = WSDSchedule(total, random.randint(0, total // 4), random.random() * 0.5, "1-sqrt", 0.01)
    for k in random.sample(range(1, total + 1), 10):
        assert 0.0 < s.lr_ratio(k) <= 1.0


def test_precision_switch_resolution():
    wsd = WSDSchedule(100, 10, 0.2, "linear", 0.01)
    assert PrecisionSchedule("decay", wsd).switch_step == 81  # the first decay step
    assert PrecisionSchedule(0.8, wsd).switch_step == 81  # steps 81..100 are the last 20%
    assert PrecisionSchedule(37, wsd).switch_step == 37
    assert PrecisionSchedule(None, wsd).switch_step is None
    assert PrecisionSchedule("never", wsd).switch_step is None
    assert PrecisionSchedule("decay", WSDSchedule(100, 10, 0.0, "linear", 0.0)).switch_step is None
    p = PrecisionSchedule(37, wsd)
    assert not p.in_bf16(36) and p.in_bf16(37) and p.in_bf16(100)
    with pytest.raises(ConfigError, match="fraction"):
        PrecisionSchedule(1.5, wsd)
    with pytest.raises(ConfigError, match="switch_to_bf16"):
        PrecisionSchedule(0, wsd)
