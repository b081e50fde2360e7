"""Built-in SFT data: worked examples of the built-in RL tasks, generated offline from a seed.

Why: ``fp4train sft`` then ``rollout`` must run offline, and RL from a small model only learns when
some rollouts already earn a reward; worked solutions teach the answer formats first.

Each record is one user turn (the prompt) and one assistant turn (the worked solution):

    {"messages": [{"role": "user", "content": "Compute 7 - 5. End your answer with ..."},
                  {"role": "assistant", "content": "7 - 5 = 2\\n#### 2"}]}

``ARITHMETIC_SHARE`` arithmetic, the rest countdown, in a seeded shuffle. Only train-split problems
are used, so the eval split stays unseen; the same ``(n, seed)`` gives the same records everywhere.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

from inkling_fp4.rl.tasks import arithmetic, countdown

ARITHMETIC_SHARE = 0.6
"""Fraction of the examples that are arithmetic (the rest are countdown)."""


@dataclass
class BuiltinTasks:
    """``n`` worked examples of the built-in tasks (see the module docstring)."""

    n: int
    seed: int
    name: str = "builtin"
    levels: list[int] | None = None
    """Arithmetic levels only (None: every level of both tasks, in the mix above)."""
    failed_attempts: tuple[float, ...] = countdown.NO_SEARCH
    """Chances of 0, 1, 2, ... failed attempts shown before a countdown solution (countdown.problems)."""

    def __post_init__(self):
        if self.n < 0:
            raise ValueError(f"the number of built-in examples must be >= 0, not {self.n}")

    @property
    def counts(self) -> tuple[int, int]:
        """(arithmetic, countdown) examples."""
        n_arithmetic = self.n if self.levels is not None else round(self.n * ARITHMETIC_SHARE)
        return n_arithmetic, self.n - n_arithmetic

    def iter_rows(self) -> Iterator[dict]:
        n_arithmetic, n_countdown = self.counts
        queues = [
            iter(arithmetic.problems("train", n_arithmetic, self.seed, self.levels or arithmetic.LEVELS)),
            iter(countdown.problems("train", n_countdown, self.seed, failed_attempts=self.failed_attempts)),
        ]
        order = [0] * n_arithmetic + [1] * n_countdown
        random.Random(self.seed).shuffle(order)
        for task in order:
            problem = next(queues[task])
            yield {
                "messages": [
                    {"role": "user", "content": problem.prompt},
                    {"role": "assistant", "content": problem.solution},
                ]
            }

    def describe(self) -> str:
        n_arithmetic, n_countdown = self.counts
        levels = ", ".join(map(str, self.levels or arithmetic.LEVELS))
        search = (
            ""
            if tuple(self.failed_attempts) == countdown.NO_SEARCH
            else (f", failed attempts shown with chances {list(self.failed_attempts)}")
        )
        return (
            f"built-in tasks: {self.n} worked examples (arithmetic levels {levels}: {n_arithmetic}, "
            f"countdown: {n_countdown}{search}), seed {self.seed}"
        )
