"""A level mix that follows the signal: each step draws a built-in task's levels in proportion to the
share of their recent groups that carried a signal (rewards not all equal).

A group of equal rewards teaches nothing. On a fixed mix, a level the policy has learnt fills with
groups all right while a level beyond it stays all wrong, so the share without signal grows as the
model improves. Weighting each level by its recent signal keeps the steps on the problems the policy
can still learn from (the aim of DAPO's dynamic sampling, without sampling more). A floor keeps every
level in every step, so a level that regains signal is seen to.

The signal of a level is a running mean (weight ``SMOOTHING`` on each new step) of its groups' share
with a signal; before a level's first groups it counts as 1 (an even mix). Every rank draws the step's
prompts from the same state and observes every rank's groups, so the ranks stay in step.
"""

from __future__ import annotations

import numpy as np

from inkling_fp4.errors import DataError
from inkling_fp4.rl.prompts import Prompt, PromptStream

SMOOTHING = 0.3
"""Weight of a step's share in a level's running signal: about the last three steps count."""


class LevelCurriculum:
    """Prompts drawn per level in proportion to the levels' signal; state: each level's stream
    position and running signal."""

    def __init__(self, prompts: list[Prompt], levels: list[int], seed: int, floor: float):
        if len(levels) < 2:
            raise DataError(
                f"rl.curriculum=signal mixes levels; the task has {levels}: set rl.curriculum=none"
            )
        self.levels, self.seed, self.floor = list(levels), seed, floor
        self.streams = {lv: PromptStream([p for p in prompts if p.level == lv], seed + lv) for lv in levels}
        empty = [lv for lv, s in self.streams.items() if not s.prompts]
        if empty:
            raise DataError(f"rl.curriculum=signal: the task drew no problem of level {empty}")
        self.signal = {lv: 1.0 for lv in levels}
        self.steps = 0

    def shares(self) -> dict[int, float]:
        """Level -> its share of the next step's prompts: ``floor / L`` each, the rest by signal."""
        total = sum(self.signal.values())
        even = 1.0 / len(self.levels)
        return {
            lv: self.floor * even + (1.0 - self.floor) * (s / total if total > 0 else even)
            for lv, s in self.signal.items()
        }

    def counts(self, n: int) -> dict[int, int]:
        """``n`` prompts split by :meth:`shares`, largest remainders first (ties to the lower level)."""
        exact = {lv: n * share for lv, share in self.shares().items()}
        counts = {lv: int(x) for lv, x in exact.items()}
        order = sorted(self.levels, key=lambda lv: (-(exact[lv] - counts[lv]), lv))
        for lv in order[: n - sum(counts.values())]:
            counts[lv] += 1
        return counts

    def take(self, n: int) -> list[Prompt]:
        """The next step's ``n`` prompts, the levels interleaved in a seeded order."""
        out = [p for lv, k in self.counts(n).items() for p in self.streams[lv].take(k)]
        order = np.random.default_rng([self.seed, self.steps]).permutation(len(out))
        self.steps += 1
        return [out[int(i)] for i in order]

    def observe(self, levels: list[int], no_signal: list[bool]) -> None:
        """A step's groups: the level and whether the group's rewards were all equal, of each."""
        for lv in self.levels:
            flags = [ns for group_level, ns in zip(levels, no_signal, strict=True) if group_level == lv]
            if flags:
                share = 1.0 - sum(flags) / len(flags)
                self.signal[lv] = (1.0 - SMOOTHING) * self.signal[lv] + SMOOTHING * share

    def state_dict(self) -> dict:
        return {
            "streams": {str(lv): s.state_dict() for lv, s in self.streams.items()},
            "signal": {str(lv): s for lv, s in self.signal.items()},
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict) -> None:
        if "streams" not in state or sorted(state["streams"]) != sorted(str(lv) for lv in self.levels):
            raise DataError(
                "the checkpoint's prompt position is not of rl.curriculum=signal over levels "
                f"{self.levels}; resume with the run's own rl.curriculum and rl.levels"
            )
        for lv, stream in self.streams.items():
            stream.load_state_dict(state["streams"][str(lv)])
        self.signal = {lv: float(state["signal"][str(lv)]) for lv in self.levels}
        self.steps = int(state["steps"])
