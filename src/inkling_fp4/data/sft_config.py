"""Supervised fine-tuning data configuration: which tokens are trained, what happens to long
examples, the held-out split, and the size of the built-in task data (``data/sft_data.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inkling_fp4.rl.tasks import countdown

LOSS_ON = ("assistant", "completion", "all")
OVERLONG = ("truncate", "drop")


@dataclass
class SFTConfig:
    loss_on: str = "assistant"
    """Which target tokens are trained: assistant | completion | all (see ``data/chat.py``)."""
    overlong: str = "truncate"
    """An example longer than data.seq_len + 1 tokens: truncate (keep its head; dropped if the head has
    no trained token) or drop; counted either way."""
    val_fraction: float = 0.05
    """Fraction of the records held out for the validation loss (at least one of two or more)."""
    builtin_examples: int = 4000
    """Worked examples generated for data.source=builtin (the built-in RL tasks, from train.seed)."""
    builtin_levels: list[int] | None = None
    """A list: arithmetic of those levels only (to start RL on them); None: all levels and countdown."""
    countdown_failed_attempts: list[float] = field(default_factory=lambda: [1.0])
    """Chances that a built-in countdown solution shows 0, 1, 2, ... failed attempts (each a wrong
    combination checked against the target) before the right one: [1.0] the construction alone,
    [0.5, 0.3, 0.2] a short search (docs/RL.md)."""

    def __post_init__(self):
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"sft.loss_on must be one of {', '.join(LOSS_ON)}, not '{self.loss_on}'")
        if self.overlong not in OVERLONG:
            raise ValueError(f"sft.overlong must be one of {', '.join(OVERLONG)}, not '{self.overlong}'")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ValueError("sft.val_fraction must be in [0, 0.5)")
        if self.builtin_examples < 2:
            raise ValueError("sft.builtin_examples must be >= 2")
        if self.builtin_levels is not None and (
            not self.builtin_levels or any(lv not in range(1, 6) for lv in self.builtin_levels)
        ):
            raise ValueError(f"sft.builtin_levels must be some of [1, 2, 3, 4, 5], not {self.builtin_levels}")
        try:
            countdown.check_failed_attempts(self.countdown_failed_attempts)
        except ValueError as e:
            raise ValueError(f"sft.countdown_failed_attempts {e}") from None
