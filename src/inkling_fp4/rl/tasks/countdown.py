"""Countdown: combine the given numbers with ``+ - * /`` to reach a target (TinyZero's task).

    prompt:   Using the numbers [7, 3, 6], make an equation that equals 24. [...] write the
              equation inside <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>.
    solution: 7 + 3 = 10
              10 * 6 = 60
              60 is not 24, try again.
              7 - 3 = 4
              4 * 6 = 24
              So (7 - 3) * 6 = 24.
              <answer>(7 - 3) * 6</answer>
    answer:   {"target": 24, "numbers": [7, 3, 6]}

Levels: 1 has three numbers, 2 has four (TinyZero's 3-to-4 Countdown). Numbers are 1-99 (repeats
allowed); the target is 1-``MAX_TARGET`` and never one of the numbers, so no answer is a bare number.

A problem is built backwards from a solution (combine random pairs until one value, the target, is
left), so every problem is solvable and the worked solution ends in that construction. With
``failed_attempts`` the solution first shows other random combinations, each checked against the
target and dropped (the example above): a model that has seen a search can try again where its
first guess misses. The attempts are drawn from the problem's key, so a problem's text never
depends on the seed that drew it. Why ``<answer>`` tags: TinyZero's reward was designed around
them, so results compare with its curves. The split key is the sorted numbers and the target.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import partial

from inkling_fp4.rl import rewards
from inkling_fp4.rl.expression import Term, apply, leaf
from inkling_fp4.rl.tasks import Problem, draw

LEVELS = (1, 2)
NUMBERS = {1: 3, 2: 4}
"""How many numbers a problem of each level gives."""
NUMBER_RANGE = (1, 99)
MAX_TARGET = 100
MAX_VALUE = 10_000
"""Largest intermediate product, so that solutions stay the size of mental arithmetic."""
NO_SEARCH = (1.0,)
"""``failed_attempts`` of a worked solution that is the construction alone."""


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


def _term(numbers: list[int], plan: list[tuple[int, int, str]]) -> Term:
    items = [leaf(n) for n in numbers]
    for i, j, op in plan:
        items = [t for k, t in enumerate(items) if k not in (i, j)] + [apply(op, items[i], items[j])]
    return items[0]


def check_failed_attempts(chances: Sequence[float]) -> None:
    """Refuse ``failed_attempts`` that are not chances of 0, 1, 2, ... attempts summing to 1."""
    if not chances or min(chances) < 0 or abs(sum(chances) - 1) > 1e-6:
        raise ValueError(
            f"must be chances of 0, 1, 2, ... failed attempts that sum to 1 (e.g. [0.5, 0.3, 0.2]), "
            f"not {list(chances)}"
        )


def _failed_attempts(key: str, numbers: list[int], target: int, chances: Sequence[float]) -> list[Term]:
    """Combinations of all the numbers that miss the target, no two with the same steps (``53 / (51 + 2)``
    and ``(51 + 2) / 53`` read alike): k of them with chance ``chances[k]``, drawn from the problem's
    ``key``."""
    if len(chances) == 1:  # the construction alone: nothing to draw
        return []
    rng = random.Random(f"attempts {key}")
    want = rng.choices(range(len(chances)), weights=chances)[0]
    failed: list[Term] = []
    for _ in range(100 * len(chances)):  # level 1 has few combinations: give up rather than loop
        if len(failed) == want:
            break
        plan, value = _plan(rng, numbers)
        attempt = _term(numbers, plan)
        if value != target and all(t.steps != attempt.steps for t in failed):
            failed.append(attempt)
    return failed


def _problem(
    numbers: list[int],
    plan: list[tuple[int, int, str]],
    target: int,
    level: int,
    key: str,
    chances: Sequence[float],
) -> Problem:
    term = _term(numbers, plan)
    assert term.value == target, (term.text, target)
    prompt = (
        f"Using the numbers {numbers}, make an equation that equals {target}. Use +, -, * and / and "
        "parentheses, and each number at most once. Show your steps, then write the equation inside "
        "<answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
    )
    tries = "".join(
        "\n".join(t.steps) + f"\n{t.value} is not {target}, try again.\n"
        for t in _failed_attempts(key, numbers, target, chances)
    )
    solution = tries + "\n".join(term.steps) + f"\nSo {term.text} = {target}.\n<answer>{term.text}</answer>"
    return Problem(prompt, rewards.countdown_answer(numbers, target), solution, level)


def _make(
    rng: random.Random, level: int, chances: Sequence[float] = NO_SEARCH
) -> tuple[str, Callable[[], Problem]] | None:
    numbers = [rng.randint(*NUMBER_RANGE) for _ in range(NUMBERS[level])]
    plan, target = _plan(rng, numbers)
    if not 1 <= target <= MAX_TARGET or target in numbers:
        return None
    key = " ".join(map(str, sorted(numbers))) + f" -> {target}"
    return key, lambda: _problem(numbers, plan, target, level, key, chances)


def problems(
    split: str,
    n: int,
    seed: int,
    levels: Sequence[int] = LEVELS,
    failed_attempts: Sequence[float] = NO_SEARCH,
) -> list[Problem]:
    """``n`` problems of ``split`` ("train" or "eval"), as ``rl/tasks/__init__.py``'s :func:`draw`;
    ``failed_attempts[k]``: the chance that a worked solution shows k failed attempts first."""
    try:
        check_failed_attempts(failed_attempts)
    except ValueError as e:
        raise ValueError(f"failed_attempts {e}") from None
    return draw(partial(_make, chances=tuple(failed_attempts)), split, n, seed, levels, LEVELS)


def reward(prompt: str, completion: str, answer: str) -> float:
    """:func:`rewards.countdown`: 1.0 right, 0.1 well formed but wrong, 0.0 no parsable answer."""
    return rewards.countdown(prompt, completion, answer)
