"""The noise monitor: non-finite values, robust spikes, fallback after repeated triggers, state."""

import math
import random

import pytest

from inkling_fp4.config.trainer import MonitorConfig
from inkling_fp4.trainer.monitor import NoiseMonitor, robust_zscore


def _feed(mon, n, start=1, loss=3.0, gnorm=1.0, noise=0.02):
    for k in range(start, start + n):
        v = mon.check(k, loss + random.gauss(0, noise), gnorm + random.gauss(0, noise))
        assert not v.skip, v.message
    return start + n


def test_robust_zscore_matches_definition():
    h = [random.gauss(5, 1) for _ in range(31)]
    med = sorted(h)[15]
    mad = sorted(abs(x - med) for x in h)[15]
    assert robust_zscore(9.0, h, 0.0) == pytest.approx((9.0 - med) / (1.4826 * mad))
    # a flat history: the relative floor sets the spread
    assert robust_zscore(1.2, [1.0] * 10, 0.05) == pytest.approx(0.2 / 0.05)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_is_caught_even_before_warmup(bad):
    mon = NoiseMonitor(MonitorConfig(warmup=5, window=10))
    v = mon.check(1, bad, 1.0)
    assert v.skip and v.reason == "nonfinite" and "skipped" in v.message
    assert mon.check(2, 3.0, bad).reason == "nonfinite"
    assert len(mon.losses) == 0  # triggered values never enter the history


def test_spikes_are_caught_and_normal_steps_are_not():
    mon = NoiseMonitor(MonitorConfig(warmup=10, window=20, max_triggers=5))
    k = _feed(mon, 30)
    v = mon.check(k, 30.0, 1.0)
    assert v.skip and v.reason == "loss_spike"
    v = mon.check(k + 1, 3.0, 50.0)
    assert v.skip and v.reason == "grad_spike"
    assert not mon.check(k + 2, 2.5, 0.5).skip  # a drop is good news, not a spike
    _feed(mon, 10, start=k + 3)


def test_a_loss_that_is_not_a_fit_is_tested_for_finiteness_only():
    """RL's surrogate loss: near zero, either sign. Its jumps are no spikes; NaN and grad spikes are."""
    mon = NoiseMonitor(MonitorConfig(warmup=10, window=20, max_triggers=50))
    for k in range(1, 31):
        assert not mon.check(k, random.gauss(0, 1e-3), 1.0 + random.gauss(0, 0.02), watch_loss=False).skip
    assert not mon.check(31, 5.0, 1.0, watch_loss=False).skip
    assert mon.check(31, 5.0, 1.0).reason == "loss_spike"  # the same value, as a cross-entropy
    assert mon.check(32, math.nan, 1.0, watch_loss=False).reason == "nonfinite"
    assert mon.check(33, 0.0, 50.0, watch_loss=False).reason == "grad_spike"


def test_zero_gradient_steps_stay_out_of_the_history():
    """RL steps without signal (every advantage 0) have loss and grad norm exactly 0. A history of
    them would make the next real step a spike of infinite z-score, and repeated, a BF16 fallback."""
    mon = NoiseMonitor(MonitorConfig(warmup=5, window=20, max_triggers=3))
    for k in range(1, 41):
        signal = k % 4 == 0  # one step in four has a gradient
        loss, gnorm = (random.gauss(0, 1e-3), 0.3 + random.uniform(0, 0.3)) if signal else (0.0, 0.0)
        v = mon.check(k, loss, gnorm, watch_loss=False)
        assert not v.skip, v.message
    assert len(mon.grad_norms) == 10 and all(g > 0 for g in mon.grad_norms)
    assert not mon.fallback_active
    assert not mon.check(41, 0.0, 0.0).skip and len(mon.grad_norms) == 10  # accepted, not recorded
    assert mon.check(42, 0.0, 30.0, watch_loss=False).reason == "grad_spike"  # a real spike still counts


def test_not_armed_before_warmup():
    mon = NoiseMonitor(MonitorConfig(warmup=10, window=20))
    _feed(mon, 9)
    assert not mon.check(10, 100.0, 100.0).skip  # only 9 values of history: no spike test yet


def test_fallback_after_max_triggers_then_timed_return():
    mon = NoiseMonitor(MonitorConfig(warmup=5, window=20, max_triggers=3, fallback_steps=4))
    k = _feed(mon, 10)
    assert not mon.check(k, math.nan, 1.0).start_fallback
    assert not mon.check(k + 1, math.nan, 1.0).start_fallback
    v = mon.check(k + 2, math.nan, 1.0)
    assert v.start_fallback and "BF16 for 4 steps" in v.message and mon.fallback_active
    assert not mon.check(k + 3, math.nan, 1.0).start_fallback  # already in fallback
    assert not any(mon.fallback_ends_at(s) for s in range(k + 3, k + 7))
    assert mon.fallback_ends_at(k + 7) and not mon.fallback_active


def test_old_triggers_leave_the_window():
    mon = NoiseMonitor(MonitorConfig(warmup=5, window=10, max_triggers=2))
    k = _feed(mon, 10)
    mon.check(k, math.nan, 1.0)
    k = _feed(mon, 12, start=k + 1)
    assert not mon.check(k, math.nan, 1.0).start_fallback  # the first trigger is 13 steps old


def test_fallback_for_good_and_state_round_trip():
    cfg = MonitorConfig(warmup=5, window=10, max_triggers=1, fallback_steps=0)
    mon = NoiseMonitor(cfg)
    k = _feed(mon, 8)
    assert mon.check(k, math.inf, 1.0).start_fallback
    assert not any(mon.fallback_ends_at(s) for s in range(k, k + 1000, 50))
    other = NoiseMonitor(cfg)
    other.load_state_dict(mon.state_dict())
    assert other.state_dict() == mon.state_dict()
    assert list(other.losses) == list(mon.losses)


def test_a_saved_history_with_zero_gradient_steps_loads_without_them():
    """A checkpoint whose monitor recorded RL steps without signal (before they were kept out) resumes
    with the history check() would have kept, so its first real step is no spike."""
    cfg = MonitorConfig(warmup=3, window=10)
    state = NoiseMonitor(cfg).state_dict() | {"losses": [0.0, 0.01, 0.0, -0.02, 0.0, 0.005],
                                             "grad_norms": [0.0, 0.4, 0.0, 0.5, 0.0, 0.45]}  # fmt: skip
    mon = NoiseMonitor(cfg)
    mon.load_state_dict(state)
    assert list(mon.grad_norms) == [0.4, 0.5, 0.45] and list(mon.losses) == [0.01, -0.02, 0.005]
    assert not mon.check(7, 0.01, 0.6, watch_loss=False).skip


def test_disabled_monitor_passes_everything():
    mon = NoiseMonitor(MonitorConfig(enabled=False))
    assert not mon.check(1, math.nan, math.nan).skip


def test_grad_norm_must_also_be_a_multiple_of_the_median():
    """Over a flat history a 2x grad norm has a huge z-score, but batches of real data move the norm
    that much: below grad_min_ratio times the median it is not a spike; at or above it, it is."""
    mon = NoiseMonitor(MonitorConfig(warmup=10, window=20, max_triggers=5, grad_min_ratio=3.0))
    k = _feed(mon, 30, noise=0.001)
    v = mon.check(k, 3.0, 2.9)
    assert not v.skip and robust_zscore(2.9, list(mon.grad_norms), 0.05) > 30
    v = mon.check(k + 1, 3.0, 3.1)
    assert v.skip and v.reason == "grad_spike" and "3.1x the median" in v.message
    relaxed = NoiseMonitor(MonitorConfig(warmup=10, window=20, grad_min_ratio=1.0))
    k = _feed(relaxed, 30, noise=0.001)
    assert relaxed.check(k, 3.0, 1.5).skip  # ratio 1: the z-score alone decides
    with pytest.raises(ValueError, match="grad_min_ratio"):
        MonitorConfig(grad_min_ratio=0.5)
