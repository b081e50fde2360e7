"""Countdown: combine the given numbers with ``+ - * /`` to reach a target (TinyZero's task).

    prompt:   Using the numbers [7, 3, 6], make an equation that equals 24. [...] write the
              equation inside <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>.
    solution: 7 - 3 = 4
              4 * 6 = 24
              So (7 - 3) * 6 = 24.
              <answer>(7 - 3) * 6</answer>
    answer:   {"target": 24, "numbers": [7, 3, 6]}

Levels: 1 has three numbers, 2 has four (TinyZero's 3-to-4 Countdown). Numbers are 1-99 (repeats
allowed); the target is 1-``MAX_TARGET`` and never one of the numbers, so no answer is a bare number.

A problem is built backwards from a solution (combine random pairs until one value, the target, is
left), so every problem is solvable and the worked solution is that construction. Why ``<answer>``
tags: TinyZero's reward was designed around them, so results compare with its curves. The split key
is the sorted numbers and the target.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from inkling_fp4.rl import rewards
from inkling_fp4.rl.expression import apply, leaf
from inkling_fp4.rl.tasks import Problem, draw

LEVELS = (1, 2)
NUMBERS = {1: 3, 2: 4}
"""How many numbers a problem of each level gives."""
NUMBER_RANGE = (1, 99)
MAX_TARGET = 100
MAX_VALUE = 10_000
"""Largest intermediate product, so that solutions stay the size of mental arithmetic."""


def _plan(rng: random.Random, numbers: list[int]) -> tuple[list[tuple[int, int, str]], int]:
    """Combine random pairs until one value is left: the steps ``(i, j, op)`` (the result appended) and
    the final value. Plain ints: most candidates are rejected by their target before any text."""
    values, plan = list(numbers), []
    while len(values) > 1:
        i = rng.randrange(len(values))
        j = rng.randrange(len(values) - 1)
        j += j >= i  # a second, different item
        if values[i] < values[j]:
            i, j = j, i
        a, b = values[i], values[j]  # a >= b: a subtraction takes the larger first
        ops = "+" + "-" * (a > b) + "*" * (a * b <= MAX_VALUE) + "/" * (b > 1 and a % b == 0)
        op = rng.choice(ops)
        result = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else a // b
        values = [v for k, v in enumerate(values) if k not in (i, j)] + [result]
        plan.append((i, j, op))
    return plan, values[0]


def _problem(numbers: list[int], plan: list[tuple[int, int, str]], target: int, level: int) -> Problem:
    items = [leaf(n) for n in numbers]
    for i, j, op in plan:
        items = [t for k, t in enumerate(items) if k not in (i, j)] + [apply(op, items[i], items[j])]
    term = items[0]
    assert term.value == target, (term.text, target)
    prompt = (
        f"Using the numbers {numbers}, make an equation that equals {target}. Use +, -, * and / and "
        "parentheses, and each number at most once. Show your steps, then write the equation inside "
        "<answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
    )
    solution = "\n".join(term.steps) + f"\nSo {term.text} = {target}.\n<answer>{term.text}</answer>"
    return Problem(prompt, rewards.countdown_answer(numbers, target), solution, level)


def _make(rng: random.Random, level: int) -> tuple[str, Callable[[], Problem]] | None:
    numbers = [rng.randint(*NUMBER_RANGE) for _ in range(NUMBERS[level])]
    plan, target = _plan(rng, numbers)
    if not 1 <= target <= MAX_TARGET or target in numbers:
        return None
    key = " ".join(map(str, sorted(numbers))) + f" -> {target}"
    return key, lambda: _problem(numbers, plan, target, level)


def problems(split: str, n: int, seed: int, levels: Sequence[int] = LEVELS) -> list[Problem]:
    """``n`` problems of ``split`` ("train" or "eval"), as ``rl/tasks/__init__.py``'s :func:`draw`."""
    return draw(_make, split, n, seed, levels, LEVELS)


def reward(prompt: str, completion: str, answer: str) -> float:
    """:func:`rewards.countdown`: 1.0 right, 0.1 well formed but wrong, 0.0 no parsable answer."""
    return rewards.countdown(prompt, completion, answer)
