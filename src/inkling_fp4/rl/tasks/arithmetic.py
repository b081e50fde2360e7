"""Arithmetic: compute an integer expression, answer after ``####``.

    prompt:   Compute 37 + 48 * 2. End your answer with #### followed by the result.
    solution: 48 * 2 = 96
              37 + 96 = 133
              #### 133
    answer:   133

Levels (operations are binary ``+ - * /``; operands are non-negative integer literals):

    level  operations  operands  operators  notes
    1      1           0-9       + -        the result is never negative
    2      1           0-99      + - *
    3      2           0-99      + - *      precedence matters: 37 + 48 * 2, (45 - 55) * 40
    4      2-3         1-99      + - * /    a literal dividend may have 3 digits
    5      3-4         1-99      + - * /    as level 4, longer

An expression is a random binary tree written with the parentheses that make it read as that tree,
so the steps evaluate in the order a reader would. Every division is exact, so no rounding convention
is needed. Why ``####``: it is GSM8K's final-answer marker, which :func:`rewards.numeric` reads first,
so one reward serves this task and GSM8K-style data. One operation per solution line teaches the
procedure, not a memorised value. The split key is the expression text.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inkling_fp4.rl import rewards
from inkling_fp4.rl.expression import Term, apply, leaf, show
from inkling_fp4.rl.tasks import Problem, draw

LEVELS = (1, 2, 3, 4, 5)
MAX_VALUE = 10_000
"""Largest magnitude of any intermediate or final value."""
DIVISORS = (2, 12)
"""Range of a literal divisor, and of the multiple a literal dividend is of its divisor."""
MAX_DIVIDEND = 999
"""Largest literal dividend (built as a multiple of the divisor's value)."""


@dataclass(frozen=True)
class Level:
    """One row of the level table in the module docstring."""

    operations: tuple[int, int]
    """Fewest and most binary operations."""
    operands: tuple[int, int]
    """Smallest and largest operand literal (a literal dividend may exceed it, up to MAX_DIVIDEND)."""
    operators: str
    non_negative: bool = False
    """Order a subtraction's operands so that the result is not negative."""


SPECS = {
    1: Level((1, 1), (0, 9), "+-", non_negative=True),
    2: Level((1, 1), (0, 99), "+-*"),
    3: Level((2, 2), (0, 99), "+-*"),
    4: Level((2, 3), (1, 99), "+-*/"),
    5: Level((3, 4), (1, 99), "+-*/"),
}


def _division(rng: random.Random, ops: int, level: Level) -> Term | None:
    """``x / d`` with a literal divisor of x's value, or ``m / y`` with m a literal multiple of y's."""
    lo, hi = DIVISORS
    if rng.random() < 0.5:
        left = _term(rng, ops, level)
        if left is None or left.value == 0:
            return None
        divisors = [d for d in range(lo, hi + 1) if left.value % d == 0]
        return apply("/", left, leaf(rng.choice(divisors))) if divisors else None
    right = _term(rng, ops, level)
    if right is None or right.value <= 0 or lo * right.value > MAX_DIVIDEND:
        return None
    multiple = rng.randint(lo, min(hi, MAX_DIVIDEND // int(right.value)))
    return apply("/", leaf(multiple * int(right.value)), right)


def _term(rng: random.Random, ops: int, level: Level) -> Term | None:
    """A random expression of exactly ``ops`` operations, or None for a rejected candidate."""
    if ops == 0:
        return leaf(rng.randint(*level.operands))
    op = rng.choice(level.operators)
    if op == "/":
        term = _division(rng, ops - 1, level)
    else:
        k = rng.randint(0, ops - 1)
        left, right = _term(rng, k, level), _term(rng, ops - 1 - k, level)
        if left is None or right is None:
            return None
        if op == "-" and level.non_negative and left.value < right.value:
            left, right = right, left
        term = apply(op, left, right)
    return term if term is not None and abs(term.value) <= MAX_VALUE else None


def _problem(term: Term, level: int) -> Problem:
    result = show(term.value)
    prompt = f"Compute {term.text}. End your answer with #### followed by the result."
    return Problem(prompt, result, "\n".join(term.steps) + f"\n#### {result}", level)


def _make(rng: random.Random, level: int) -> tuple[str, Callable[[], Problem]] | None:
    spec = SPECS[level]
    term = _term(rng, rng.randint(*spec.operations), spec)
    return None if term is None else (term.text, lambda: _problem(term, level))


def problems(split: str, n: int, seed: int, levels: Sequence[int] = LEVELS) -> list[Problem]:
    """``n`` problems of ``split`` ("train" or "eval"), as ``rl/tasks/__init__.py``'s :func:`draw`."""
    return draw(_make, split, n, seed, levels, LEVELS)


def reward(prompt: str, completion: str, answer: str) -> float:
    return rewards.arithmetic(prompt, completion, answer)
