"""Noise monitor: catch loss and gradient-norm spikes and non-finite values before they land.

Low-precision training fails in two ways the optimizer cannot undo: a non-finite value poisons the
FP32 weights and Adam's moments for good, and one huge gradient kicks the weights so far the loss
never recovers. Both show in the step's loss and global gradient norm (before clipping).

Spike test, over the last ``window`` accepted steps: z = ``(x - median) / max(1.4826 * MAD,
min_rel_spread * |median|)`` (1.4826 * MAD estimates a normal std, ignoring outliers). Only upward
deviations count, and triggered steps stay out of the history so one spike cannot hide the next. A
grad norm must also be ``grad_min_ratio`` times the median: real batches move it by tens of percent,
which a z-score over a flat history would call spikes.

A loss that is not a fit to data (RL's surrogate) is tested for finiteness only (``watch_loss=False``);
a zero-gradient step is accepted but kept out of the history (zeros make an infinite z-score). On a
trigger the loop skips the update; ``max_triggers`` within ``window`` steps ask for BF16, for
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
        """The verdict on one step; ``watch_loss=False`` for a loss that is not a fit to data."""
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
