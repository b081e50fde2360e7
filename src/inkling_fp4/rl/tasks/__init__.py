"""Built-in RL tasks: procedural problems with exact answers, generated offline from a seed.

Each task module has ``problems(split, n, seed, levels)`` and ``reward(prompt, completion, answer)``.

- The split: a problem is ``eval`` iff the BLAKE2b hash of its canonical text (``key``, e.g.
  countdown's numbers sorted) is divisible by ``EVAL_EVERY``. It depends on the problem alone, never
  the seed, so no train problem is ever an eval problem. (Python's ``hash`` varies per process.)
- :func:`draw`: one ``random.Random(seed)`` stream, other-split candidates skipped, the i-th problem of
  level ``levels[i % len(levels)]``. With replacement (a small level repeats); the same arguments give
  the same list everywhere, and a shorter list is a prefix of a longer one.
- :func:`held_out`: up to ``n`` *distinct* eval problems: repeats would make an accuracy look finer
  than the problems behind it.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

SPLITS = ("train", "eval")
EVAL_EVERY = 10
"""One problem in EVAL_EVERY (by hash) is held out for evaluation."""
MAX_TRIES = 100_000
"""Candidates drawn for one problem before giving up: reaching it means a split or level has none."""


@dataclass(frozen=True)
class Problem:
    prompt: str
    """The user message of a rollout (or of an SFT example)."""
    answer: str
    """What the task's reward compares against (its format is the task's)."""
    solution: str
    """A worked assistant answer ending in the final-answer format the reward reads (the SFT target)."""
    level: int
    """Difficulty level, as the task's module docstring defines it."""


def split_of(key: str) -> str:
    """``eval`` or ``train`` for the problem with canonical text ``key`` (see the module docstring)."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return "eval" if int.from_bytes(digest, "little") % EVAL_EVERY == 0 else "train"


Generator = Callable[[random.Random, int], tuple[str, Callable[[], Problem]] | None]
"""``make(rng, level) -> (key, build)``, or None for a rejected candidate. ``build()`` writes the text,
only for candidates of the wanted split (text is most of the cost). NOTE it draws nothing from ``rng``,
so what a seed gives does not depend on the split asked for."""


def draw(
    make: Generator, split: str, n: int, seed: int, levels: Sequence[int], all_levels: Sequence[int]
) -> list[Problem]:
    """``n`` problems of ``split`` from ``make`` (see the module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not '{split}'")
    if n < 0:
        raise ValueError(f"n must be >= 0, not {n}")
    levels = list(levels)
    if not levels or any(level not in all_levels for level in levels):
        raise ValueError(f"levels must be some of {list(all_levels)}, not {levels}")
    rng = random.Random(seed)
    out: list[Problem] = []
    for i in range(n):
        level = levels[i % len(levels)]
        for _ in range(MAX_TRIES):
            made = make(rng, level)
            if made is not None and split_of(made[0]) == split:
                out.append(made[1]())
                break
        else:
            raise RuntimeError(f"no {split} problem of level {level} in {MAX_TRIES} candidates")
    return out


HELD_OUT_DRAWS = 4
"""Candidates drawn per held-out problem asked for, before the repeats are dropped."""


HELD_OUT_SEED = 0
"""The held-out draw's seed, whatever the run's: runs of several seeds are scored on the same problems."""


def held_out(problems: Callable[..., list[Problem]], n: int, levels: Sequence[int]) -> list[Problem]:
    """Up to ``n`` distinct eval problems of a task's ``problems``, in draw order."""
    out: dict[str, Problem] = {}
    for p in problems("eval", HELD_OUT_DRAWS * n, HELD_OUT_SEED, levels):
        out.setdefault(p.prompt, p)
        if len(out) == n:
            break
    return list(out.values())
