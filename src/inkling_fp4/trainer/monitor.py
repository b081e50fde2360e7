"""Noise monitor: catch loss and gradient-norm spikes and non-finite values before they land.

Low-precision training fails in two ways the optimizer cannot undo: a non-finite value (an overflowed
block, a NaN from a bad scale) poisons the FP32 master weights and Adam's moments for good, and a
single huge gradient kicks the weights far enough that the loss never comes back. Both show up in
two scalars the loop has anyway, the step's loss and its global gradient norm (before clipping).

The spike test is robust: over the last ``window`` accepted steps it takes the median and the median
absolute deviation (MAD), and calls a value a spike when its z-score
``(x - median) / max(1.4826 * MAD, min_rel_spread * |median|)`` exceeds the threshold (1.4826 * MAD
estimates the standard deviation of normal data; the MAD ignores the outliers a mean and std would
chase). Only upward deviations count: a loss that falls fast is good news. Triggered steps are not
added to the history, so one spike cannot widen the spread and hide the next. A grad norm must also
be at least ``grad_min_ratio`` times the median: the norm of real data moves by tens of percent from
batch to batch (on hybrid-125m a batch at 1.4-2.5x the median every hundred steps or so, at the same
steps in BF16, FP8 and NVFP4 runs), and a z-score over a flat history calls each of those a spike.

Two kinds of step are special. A loss that is not a fit to data (RL's clipped
surrogate, near zero and of either sign, exactly zero on a step where no group's rewards differ) has
no level to spike from, so ``watch_loss=False`` (the trainer passes it for a ``loss_fn`` whose
``fits_data`` is False) tests it for finiteness only. And a step whose
gradient is exactly zero (nothing to learn from) says nothing of the usual gradient scale: it is
accepted and kept out of the history, since a history of zeros would call the next real step a
spike of infinite z-score.

On a trigger the loop skips that step's update. ``max_triggers`` triggers within ``window`` steps
mean the recipe itself is the problem, and the monitor asks for a fallback to BF16, for
``fallback_steps`` steps or (0) for good.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from inkling_fp4.config.trainer import MonitorConfig

MAD_TO_STD = 1.4826


@dataclass
class Verdict:
    """What the monitor says about one step."""

    skip: bool = False
    """Do not apply this step's update."""
    reason: str = ""
    """'nonfinite', 'loss_spike' or 'grad_spike' when skip."""
    message: str = ""
    """One line for the console and the metrics."""
    start_fallback: bool = False
    """Too many triggers within the window: move to BF16 now."""


def robust_zscore(x: float, history: list[float], min_rel_spread: float) -> float:
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    spread = max(MAD_TO_STD * mad, min_rel_spread * abs(med), 1e-12)
    return (x - med) / spread


class NoiseMonitor:
    def __init__(self, cfg: MonitorConfig):
        self.cfg = cfg
        self.losses: deque[float] = deque(maxlen=cfg.window)
        self.grad_norms: deque[float] = deque(maxlen=cfg.window)
        self.trigger_steps: list[int] = []
        self.fallback_active = False
        self.fallback_end: int | None = None
        """First step back in the recipe after a fallback; None while active = BF16 for good."""

    def check(self, step: int, loss: float, grad_norm: float, watch_loss: bool = True) -> Verdict:
        """The verdict on one step; ``watch_loss=False`` for a loss that is not a fit to data (see
        the module docstring)."""
        if not self.cfg.enabled:
            return Verdict()
        verdict = self._test(loss, grad_norm, watch_loss)
        if not verdict.skip:
            if grad_norm > 0:
                self.losses.append(loss)
                self.grad_norms.append(grad_norm)
            return verdict
        self.trigger_steps = [s for s in self.trigger_steps if s > step - self.cfg.window] + [step]
        verdict.message = f"monitor: step {step} {verdict.message}; update skipped"
        if len(self.trigger_steps) >= self.cfg.max_triggers and not self.fallback_active:
            verdict.start_fallback = True
            self.fallback_active = True
            self.fallback_end = step + 1 + self.cfg.fallback_steps if self.cfg.fallback_steps else None
            self.trigger_steps = []
            until = f"for {self.cfg.fallback_steps} steps" if self.cfg.fallback_steps else "for good"
            verdict.message += (
                f"; {self.cfg.max_triggers} triggers within {self.cfg.window} steps: BF16 {until}"
            )
        return verdict

    def _test(self, loss: float, grad_norm: float, watch_loss: bool) -> Verdict:
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return Verdict(True, "nonfinite", f"non-finite loss {loss} / grad norm {grad_norm}")
        if len(self.grad_norms) < self.cfg.warmup:
            return Verdict()
        spread = self.cfg.min_rel_spread
        z = robust_zscore(loss, list(self.losses), spread) if watch_loss else -math.inf
        if z > self.cfg.loss_zscore:
            return Verdict(True, "loss_spike", f"loss spike {loss:.4f} (z {z:.1f} > {self.cfg.loss_zscore})")
        z = robust_zscore(grad_norm, list(self.grad_norms), spread)
        ratio = grad_norm / max(statistics.median(self.grad_norms), 1e-30)
        if z > self.cfg.grad_zscore and ratio >= self.cfg.grad_min_ratio:
            why = f"{ratio:.1f}x the median, z {z:.1f} > {self.cfg.grad_zscore}"
            return Verdict(True, "grad_spike", f"grad norm spike {grad_norm:.4g} ({why})")
        return Verdict()

    def fallback_ends_at(self, step: int) -> bool:
        """True on the step where a timed fallback is over (the loop restores the recipe)."""
        if self.fallback_active and self.fallback_end is not None and step >= self.fallback_end:
            self.fallback_active = False
            self.fallback_end = None
            return True
        return False

    def state_dict(self) -> dict:
        return {
            "losses": list(self.losses),
            "grad_norms": list(self.grad_norms),
            "trigger_steps": list(self.trigger_steps),
            "fallback_active": self.fallback_active,
            "fallback_end": self.fallback_end,
        }

    def load_state_dict(self, d: dict) -> None:
        kept = [
            (x, g) for x, g in zip(d["losses"], d["grad_norms"], strict=True) if g > 0
        ]  # as check() keeps
        self.losses = deque((x for x, _ in kept), maxlen=self.cfg.window)
        self.grad_norms = deque((g for _, g in kept), maxlen=self.cfg.window)
        self.trigger_steps = list(d["trigger_steps"])
        self.fallback_active = bool(d["fallback_active"])
        self.fallback_end = d["fallback_end"]
