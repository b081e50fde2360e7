"""Warmup-stable-decay learning rate and the precision schedule that rides on it.

The NVFP4 paper trains with WSD and switches the GEMMs to BF16 for the last stretch of the run,
which closes most of the remaining loss gap to FP8; so both schedules count the same steps, and
"the first decay step" is a precision switch point.

Steps are counted from 1 (step k is the k-th optimizer update) and a run has ``total`` steps:

    warmup  1 .. W          ratio k / W (reaches 1 on step W)
    stable  W+1 .. F-1      ratio 1
    decay   F .. total      ratio falls from just below 1 to min_ratio exactly on step ``total``

with ``F = total - round(decay_fraction * total) + 1`` the first decay step. When warmup and decay
overlap (very short runs) the smaller ratio wins.
"""

from __future__ import annotations

import math

from inkling_fp4.errors import ConfigError


class WSDSchedule:
    """LR multiplier (of optim.lr) and phase name for each 1-based step."""

    def __init__(
        self,
        total_steps: int,
        warmup: int | float,
        decay_fraction: float,
        shape: str = "linear",
        min_ratio: float = 0.0,
    ):
        if shape not in ("linear", "cosine", "1-sqrt"):
            raise ConfigError(f"decay shape '{shape}' is not one of linear, cosine, 1-sqrt")
        self.total = total_steps
        self.warmup_steps = warmup if isinstance(warmup, int) else round(warmup * total_steps)
        self.decay_steps = round(decay_fraction * total_steps)
        self.first_decay_step = total_steps - self.decay_steps + 1
        """F: the first step of the decay (total + 1 when there is no decay)."""
        self.shape = shape
        self.min_ratio = min_ratio

    def lr_ratio(self, step: int) -> float:
        ratio = 1.0
        if step <= self.warmup_steps:
            ratio = step / self.warmup_steps
        if step >= self.first_decay_step:
            p = min(1.0, (step - self.first_decay_step + 1) / self.decay_steps)  # (0, 1], 1 on the last step
            if self.shape == "linear":
                frac = 1.0 - p
            elif self.shape == "cosine":
                frac = 0.5 * (1.0 + math.cos(math.pi * p))
            else:  # 1-sqrt (Hägele et al. 2024)
                frac = 1.0 - math.sqrt(p)
            ratio = min(ratio, self.min_ratio + (1.0 - self.min_ratio) * frac)
        return ratio

    def phase_at(self, step: int) -> str:
        if step >= self.first_decay_step:
            return "decay"
        if step <= self.warmup_steps:
            return "warmup"
        return "stable"


class PrecisionSchedule:
    """Resolves ``precision.switch_to_bf16`` to the first step that trains in BF16 (or None).

    An int is that step; a float in (0, 1) a fraction of the run (0.8 of 100 steps: steps 81..100 in
    BF16); 'decay' the first decay step of ``wsd``; None or 'never' no switch."""

    def __init__(self, switch_to_bf16: str | int | float | None, wsd: WSDSchedule):
        self.switch_step = self._resolve(switch_to_bf16, wsd)

    @staticmethod
    def _resolve(value: str | int | float | None, wsd: WSDSchedule) -> int | None:
        if value is None or value == "never":
            return None
        if value == "decay":
            return wsd.first_decay_step if wsd.decay_steps > 0 else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(
                f"precision.switch_to_bf16={value!r}: use a step, a fraction in (0, 1), 'decay' or 'never'"
            )
        if isinstance(value, float):
            if not 0.0 < value < 1.0:
                raise ConfigError(
                    f"precision.switch_to_bf16={value}: a float is a fraction of the run and must be in "
                    "(0, 1); write a step as an integer"
                )
            return math.floor(value * wsd.total) + 1
        if value < 1:
            raise ConfigError(f"precision.switch_to_bf16={value}: a step must be >= 1")
        return value

    def in_bf16(self, step: int) -> bool:
        return self.switch_step is not None and step >= self.switch_step
