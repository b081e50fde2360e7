"""Reward functions: ``reward(prompt, completion, answer) -> float`` for each built-in task.

Rewards read the completion and the problem's answer string (the prompt is in the signature for user
rewards). A reward is a total function of text: whatever a model writes (unbalanced tags, a megabyte
of digits, ``((((`` ten thousand deep) it returns a number, never raises, in linear time. A malformed
*answer* string is a bug in the task and raises ValueError.

:func:`numeric` (GSM8K-style) compares final numbers as exact rationals. The final number is the
first after the last ``####``, else the first inside the last ``\\boxed{...}``, else the last of the
text. Numbers: optional thousands commas (``1,234``), a decimal part (``12.50``) or a denominator
(``3/4``; ``3/0`` is 3 and 0), a ``$`` and a minus before them, but not a minus after a letter, digit
or closing bracket (``2-3`` is 2 and 3). ``42.`` reads 42; ``0.5`` equals ``1/2``. In a box,
``\\frac{a}{b}`` of integers reads ``a/b``; other LaTeX is not understood. Numbers longer than
``MAX_NUMBER_CHARS`` are skipped.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from fractions import Fraction

from inkling_fp4.rl.expression import ExpressionError, parse

MAX_NUMBER_CHARS = 100
"""A longer run of digits is not an answer; also keeps int() below Python's 4300-digit limit."""
MAX_BOXED_CHARS = 1000
"""How far after ``\\boxed{`` its closing brace is looked for (an open box must not scan a megabyte)."""

# A number starts at a digit, and the pattern opens with a plain \d so that re's scan skips other text
# fast; the sign and "$" before it are read by hand (_sign). Every repeat is anchored by a digit or a
# literal, so no match attempt can backtrack over more than the number it is in: linear time.
_NUMBER = re.compile(
    r"(?P<int>\d(?:\d{0,2}(?:,\d{3})+(?!\d)|\d*))"  # 1,234 or 1234 ("1,2345" is 1 and 2345)
    r"(?:/(?P<den>0*[1-9]\d*)|(?P<dec>\.\d+))?"  # 3/4 (not 3/0: that is 3 and 0) or 12.50
)
_MINUS = "-\u2212"
_FRAC = re.compile(r"\\[dt]?frac\{([-\u2212]?\d+)\}\{(\d+)\}")
_LATEX_SPACES = re.compile(r"\\[,!;: ]|\{,\}")  # LaTeX thousands separators: "1\,000", "1{,}000" -> "1000"
_ANSWER_OPEN, _ANSWER_CLOSE = "<answer>", "</answer>"


def _short(match: re.Match) -> bool:
    return match.end() - match.start() <= MAX_NUMBER_CHARS


def _sign(text: str, start: int) -> int:
    """-1 when the number at ``text[start]`` has a minus before it (either side of an optional ``$``)
    that is not a hyphen or an operator: ``-5``, ``-$5``, ``$-5``, ``x = -5``; not ``2-5``, ``(a)-5``."""
    i = start - 1
    if i >= 0 and text[i] == "$":
        i -= 1
    if i < 0 or text[i] not in _MINUS:
        return 1
    before = text[i - 1] if i >= 1 else " "
    return 1 if before.isalnum() or before in "_)]" else -1


def _number(text: str, match: re.Match | None) -> Fraction | None:
    if match is None:
        return None
    integer = match["int"].replace(",", "")
    if match["den"] is not None:
        value = Fraction(int(integer), int(match["den"]))
    else:
        value = Fraction(integer + (match["dec"] or ""))
    return _sign(text, match.start()) * value


def _first_number(text: str) -> Fraction | None:
    return _number(text, next((m for m in _NUMBER.finditer(text) if _short(m)), None))


def _last_number(text: str) -> Fraction | None:
    last = None
    for match in _NUMBER.finditer(text):  # only the last one is converted: a Fraction costs microseconds
        if _short(match):
            last = match
    return _number(text, last)


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (nested braces balanced), or None when there is no box
    or it does not close within MAX_BOXED_CHARS."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    start += len("\\boxed{")
    depth = 1
    for i in range(start, min(len(text), start + MAX_BOXED_CHARS)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def final_number(text: str) -> Fraction | None:
    """The final answer's number in ``text`` (the rules of :func:`numeric`), or None."""
    marker = text.rfind("####")
    if marker >= 0:
        value = _first_number(text[marker + 4 :])
        if value is not None:
            return value
    box = _boxed(text)
    if box is not None:
        value = _first_number(_FRAC.sub(r"\1/\2", _LATEX_SPACES.sub("", box)))
        if value is not None:
            return value
    return _last_number(text)


def numeric(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the completion's final number equals the answer's (see the module docstring), else 0.0."""
    expected = final_number(answer)
    if expected is None:
        return 0.0
    return 1.0 if final_number(completion) == expected else 0.0


def _final_text(text: str) -> str:
    marker = text.rfind("####")
    return " ".join((text[marker + 4 :] if marker >= 0 else text).split())


def exact(prompt: str, completion: str, answer: str) -> float:
    """1.0 when the text after the last ``####`` (else all of it), whitespace collapsed, equals the
    answer's read the same way; case matters."""
    return 1.0 if _final_text(completion) == _final_text(answer) else 0.0


def arithmetic(prompt: str, completion: str, answer: str) -> float:
    """The arithmetic task's reward: :func:`numeric` (its prompts ask for ``#### <result>``)."""
    return numeric(prompt, completion, answer)


# ---------------------------------------------------------------------- countdown


def countdown_answer(numbers: list[int], target: int) -> str:
    """The answer string of a countdown problem: ``{"target": 24, "numbers": [3, 5, 7, 2]}``."""
    return json.dumps({"target": target, "numbers": list(numbers)})


def _read_countdown_answer(answer: str) -> tuple[list[int], int]:
    problem = f'countdown answer must be JSON {{"target": int, "numbers": [int, ...]}}, not {answer!r}'
    try:
        spec = json.loads(answer)
        numbers, target = spec["numbers"], spec["target"]
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(problem) from e
    if not (isinstance(target, int) and isinstance(numbers, list) and all(type(n) is int for n in numbers)):
        raise ValueError(problem)
    return numbers, target


def _answer_tag(text: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>`` (two reverse searches, linear)."""
    close = text.rfind(_ANSWER_CLOSE)
    if close < 0:
        return None
    open_ = text.rfind(_ANSWER_OPEN, 0, close)
    return None if open_ < 0 else text[open_ + len(_ANSWER_OPEN) : close]


def countdown(prompt: str, completion: str, answer: str) -> float:
    """TinyZero's Countdown reward for the equation inside the last ``<answer>...</answer>``.

    - 1.0: it evaluates exactly (``6 / 4 * 2`` is 3) to the target, each given number used at most as
      often as given; an optional trailing ``= N`` must be the target too.
    - 0.1: it parses but is wrong (value, numbers, division by zero, ``= N``).
    - 0.0: no complete answer tag, or its content does not parse.

    NOTE not every number must be used (the prompt says "at most once"; TinyZero's checker wants
    exactly once).
    """
    numbers, target = _read_countdown_answer(answer)
    body = _answer_tag(completion)
    if body is None:
        return 0.0
    claimed = None
    if "=" in body:
        body, _, rhs = body.partition("=")
        rhs = rhs.strip()
        if not (rhs.isascii() and rhs.isdigit()) or len(rhs) > MAX_NUMBER_CHARS:
            return 0.0
        claimed = int(rhs)
    try:
        expression = parse(body)
    except ExpressionError:
        return 0.0
    if Counter(expression.numbers) - Counter(Fraction(n) for n in numbers):
        return 0.1  # a number used more often than given, or not given at all
    try:
        value = expression.value()
    except ZeroDivisionError:
        return 0.1
    return 1.0 if value == target and claimed in (None, target) else 0.1
