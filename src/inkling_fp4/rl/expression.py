"""Arithmetic expressions as text: a safe parser and exact evaluator, and the writer the tasks use.

A reward parses text a model wrote (the countdown equation), so the parser accepts only non-negative
integer or decimal literals, ``+ - * /``, unary minus, parentheses and whitespace. It never calls
``eval``: model text is data, and ``eval`` could run code or take forever (``9**9**9``). With no power
operator every value is a ``Fraction`` bounded by the text's length.

Parsing is one shunting-yard pass (no recursion, linear time) with the usual precedence, so
``parse(t).value()`` equals Python's value of the text on ``Fraction``s. The writer (``leaf``,
``apply``) builds a :class:`Term` with its worked steps (``"48 * 2 = 96"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

MAX_CHARS = 1000
"""Longest expression text parsed: bounds the work and the Fractions' size whatever a completion holds."""
MAX_DEPTH = 100
"""Deepest parenthesis nesting parsed: keeps the operator stack small and rejects ``((((...`` early."""

_BINARY = {"+": 1, "-": 1, "*": 2, "/": 2}
_NEG = "neg"  # unary minus on the operator stack and in the postfix sequence
_NEG_PRECEDENCE = 3


class ExpressionError(ValueError):
    """The text is not an arithmetic expression of the accepted form (or exceeds the bounds)."""


@dataclass(frozen=True)
class Expression:
    """A parsed expression in reverse Polish order: ``postfix`` holds Fraction operands and the
    operators ``+ - * /`` and ``"neg"``; ``numbers`` the literals in the order they are written."""

    postfix: tuple[Fraction | str, ...]
    numbers: tuple[Fraction, ...]

    def value(self) -> Fraction:
        """The exact value; raises ZeroDivisionError when some division has a zero divisor."""
        stack: list[Fraction] = []
        for item in self.postfix:
            if isinstance(item, Fraction):
                stack.append(item)
            elif item == _NEG:
                stack.append(-stack.pop())
            else:
                b, a = stack.pop(), stack.pop()
                stack.append(_binary(item, a, b))
        return stack[0]


def _binary(op: str, a: Fraction, b: Fraction) -> Fraction:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b  # Fraction raises ZeroDivisionError on b == 0


def _is_digit(c: str) -> bool:
    return "0" <= c <= "9"  # ASCII only: str.isdigit admits '²' and digits of other scripts


def _literal(text: str, i: int) -> tuple[Fraction, int]:
    """The number at ``text[i]`` (digits, optionally ``.`` and more digits) and the index after it."""
    j = i
    while j < len(text) and _is_digit(text[j]):
        j += 1
    if j + 1 < len(text) and text[j] == "." and _is_digit(text[j + 1]):
        j += 1
        while j < len(text) and _is_digit(text[j]):
            j += 1
    return Fraction(text[i:j]), j


def parse(text: str) -> Expression:
    """Parse ``text`` (see the module docstring); raises ExpressionError on anything else, including
    implicit multiplication (``2(3)``)."""
    if len(text) > MAX_CHARS:
        raise ExpressionError(f"longer than {MAX_CHARS} characters")
    postfix: list[Fraction | str] = []
    numbers: list[Fraction] = []
    ops: list[str] = []  # operator stack: binary operators, "neg" and "("
    depth, i, want_operand = 0, 0, True
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
            continue
        if want_operand:
            if _is_digit(c):
                value, i = _literal(text, i)
                postfix.append(value)
                numbers.append(value)
                want_operand = False
                continue
            if c == "(":
                depth += 1
                if depth > MAX_DEPTH:
                    raise ExpressionError(f"nested deeper than {MAX_DEPTH}")
                ops.append("(")
            elif c == "-":
                ops.append(_NEG)
            else:
                raise ExpressionError(f"expected a number at {i}, found {c!r}")
        elif c in _BINARY:
            # Left-associative: pop operators of higher or equal precedence (unary minus binds tightest).
            while ops and ops[-1] != "(" and _precedence(ops[-1]) >= _BINARY[c]:
                postfix.append(ops.pop())
            ops.append(c)
            want_operand = True
        elif c == ")":
            while ops and ops[-1] != "(":
                postfix.append(ops.pop())
            if not ops:
                raise ExpressionError(f"unmatched ')' at {i}")
            ops.pop()
            depth -= 1
        else:
            raise ExpressionError(f"expected an operator at {i}, found {c!r}")
        i += 1
    if want_operand:
        raise ExpressionError("the expression is empty or ends with an operator")
    while ops:
        op = ops.pop()
        if op == "(":
            raise ExpressionError("unclosed '('")
        postfix.append(op)
    return Expression(tuple(postfix), tuple(numbers))


def _precedence(op: str) -> int:
    return _NEG_PRECEDENCE if op == _NEG else _BINARY[op]


# ---------------------------------------------------------------------- writing expressions


@dataclass(frozen=True)
class Term:
    """An expression written out: ``text`` (parenthesized as :func:`apply` says), its exact ``value``, the
    ``precedence`` of its outermost operator (3 for a number, 2 for ``* /``, 1 for ``+ -``) and the
    ``steps`` that compute it, one clause per operator in evaluation order."""

    text: str
    value: int | Fraction
    """An int when integral (much faster than Fraction over thousands of candidates), else a Fraction."""
    precedence: int
    steps: tuple[str, ...] = ()


def leaf(n: int) -> Term:
    """A non-negative integer literal (negative values only ever arise from operators)."""
    assert n >= 0, n
    return Term(str(n), n, 3)


def show(value: int | Fraction) -> str:
    """A value as a step writes it: ``12``, ``-7``, ``3/4``."""
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def _exact(op: str, a: int | Fraction, b: int | Fraction) -> int | Fraction:
    if op != "/":
        return _binary(op, a, b)
    q = Fraction(a) / b  # raises ZeroDivisionError on b == 0
    return q.numerator if q.denominator == 1 else q


def _operand(value: int | Fraction) -> str:
    """A step's operand: "5 - (-7)" and "(3/4) * 2", so that a step is one operation as written."""
    return f"({show(value)})" if value < 0 or value.denominator != 1 else show(value)


def apply(op: str, left: Term, right: Term) -> Term:
    """``left op right``, parenthesized so the text parses back to this very tree: ``a + (b - c)`` keeps
    its parentheses although equal in value, since a reader would otherwise evaluate another tree
    than the steps. Raises ZeroDivisionError for ``x / 0``."""
    precedence = _BINARY[op]
    a = f"({left.text})" if left.precedence < precedence else left.text
    b = f"({right.text})" if right.precedence <= precedence else right.text
    value = _exact(op, left.value, right.value)
    step = f"{_operand(left.value)} {op} {_operand(right.value)} = {show(value)}"
    return Term(f"{a} {op} {b}", value, precedence, left.steps + right.steps + (step,))
