"""Rewards: the answers models really write, countdown's three outcomes, and robustness to any text."""

import time
from fractions import Fraction

import pytest

from data_corpus import fresh_rng
from inkling_fp4.rl import expression
from inkling_fp4.rl.rewards import arithmetic, countdown, countdown_answer, exact, final_number, numeric

GSM8K_ANSWER = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"


@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("#### 72", GSM8K_ANSWER, 1.0),
        ("She sold 72 clips.", GSM8K_ANSWER, 1.0),
        ("She sold 48 + 24 = 72 clips, not 71.", "72", 0.0),  # the last number is the answer read
        ("####    72   ", "72", 1.0),
        ("#### 72.", "72", 1.0),  # a trailing period
        ("The total is 1,234.", "1234", 1.0),  # thousands separators
        ("#### $1,234.00", "#### 1234", 1.0),
        ("It costs $5.", "5", 1.0),
        ("#### -5", "-5", 1.0),
        ("#### 5", "-5", 0.0),
        ("x = -3", "-3", 1.0),
        ("#### \u22125", "-5", 1.0),  # a Unicode minus sign
        ("from 2-3", "3", 1.0),  # a hyphen after a digit is not a sign
        ("#### 42 apples, and then 43 pears", "42", 1.0),  # the first number after the last ####
        ("#### 41\nno wait\n#### 42\nbecause 6 * 7", "42", 1.0),
        ("first 5, then 7", "7", 1.0),  # the last number wins
        ("so \\boxed{17}, which is 18 - 1", "17", 1.0),  # a box beats the last number
        ("\\boxed{3} then \\boxed{4}", "4", 1.0),
        ("#### 5 and \\boxed{6}", "5", 1.0),  # #### beats a box
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{-3}{4}}", "-3/4", 1.0),
        ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
        ("\\boxed{x = 1\\,000}", "1000", 1.0),
        ("\\boxed{12", "12", 1.0),  # an unclosed box: the last number
        ("#### 3/4", "0.75", 1.0),
        ("#### 0.5", "1/2", 1.0),  # decimals and fractions are the same rationals
        ("#### 2/4", "1/2", 1.0),
        ("#### 3.50", "3.5", 1.0),
        ("#### 3.5", "3", 0.0),
        ("#### 1/0", "1", 1.0),  # not a fraction (zero denominator): the numbers 1 and 0
        ("I have no idea.", "5", 0.0),  # no number
        ("", "5", 0.0),
        ("I got 5 ####", "5", 1.0),  # nothing after ####: the next rule reads the text
        ("#### 5", "no number here", 0.0),  # an answer without a number rewards nothing
    ],
)
def test_numeric_on_tricky_answers(completion, answer, reward):
    assert numeric("", completion, answer) == reward


def test_boxed_reads_documented_latex():
    assert final_number("\\boxed{\\frac{1}{2}}") == Fraction(1, 2)
    assert final_number("\\boxed{\\sqrt{2}}") == 2  # not understood: the first number in the box
    assert final_number("\\boxed{\\frac{a}{b}}") is None
    assert final_number("\\boxed{}") is None
    assert final_number("\\boxed{1{,}000}") == 1000


def test_numeric_random_values_round_trip():
    rng = fresh_rng()
    for _ in range(500):
        value = Fraction(rng.randint(-(10**6), 10**6), rng.choice([1, 1, 2, 3, 4, 8, 10, 100]))
        if value.denominator == 1:
            text = f"{int(value):,}" if rng.random() < 0.5 else str(int(value))
        else:
            text = f"{value.numerator}/{value.denominator}"
        frame = rng.choice(["#### {}", "The answer is {}.", "\\boxed{{{}}}", "{}", "so #### {} done"])
        completion = frame.format(text)
        assert numeric("", completion, str(value)) == 1.0, (rng.seed_value, completion)
        assert numeric("", completion, str(value + 1)) == 0.0, (rng.seed_value, completion)


def test_exact():
    assert exact("", "#### Paris", "Paris") == 1.0
    assert exact("", "  the   cat \n sat ", "the cat sat") == 1.0
    assert exact("", "#### paris", "Paris") == 0.0  # case matters
    assert exact("", "#### a\n#### b", "b") == 1.0
    assert exact("", "#### b", "#### b") == 1.0  # the answer is read the same way
    assert exact("", "Paris, France", "Paris") == 0.0
    assert exact("", "", "") == 1.0


def test_arithmetic_is_numeric():
    rng = fresh_rng()
    for _ in range(200):
        a = rng.randint(-999, 999)
        completion = rng.choice([f"#### {a}", f"{a}", f"#### {a + 1}", "none", f"\\boxed{{{a}}}"])
        assert arithmetic("", completion, str(a)) == numeric("", completion, str(a))


# ---------------------------------------------------------------------- countdown

ANSWER = countdown_answer([3, 5, 7, 2], 24)


def _tag(expression_text: str) -> str:
    return f"Let me think. <answer>{expression_text}</answer>"


@pytest.mark.parametrize(
    "completion, reward",
    [
        (_tag("3 * 7 + 5 - 2"), 1.0),
        ("<answer>  3*7 +5-2 \n</answer>", 1.0),  # extra whitespace
        (_tag("(5 + 7) * 2"), 1.0),  # a number may be left unused
        (_tag("3 * 7 + 5 - 2 = 24"), 1.0),  # a trailing "= target"
        (_tag("3 * 7 + 5 - 2 = 25"), 0.1),  # a wrong claimed result
        (_tag("3 * 7 + 5 - 2 = 24 = 24"), 0.0),
        (_tag("3 * 7 + 5 - 2 = x"), 0.0),
        (_tag("7 * 3 + 3"), 0.1),  # 3 used twice
        (_tag("4 * 6"), 0.1),  # numbers not given
        (_tag("24"), 0.1),
        (_tag("7 / (5 - 3 - 2)"), 0.1),  # a division by zero
        (_tag("3 * 7 + 5"), 0.1),  # a wrong value
        (_tag("3 * (7 + 5"), 0.0),  # unbalanced
        (_tag("3 ** 7"), 0.0),
        (_tag("3 x 7 + 5 - 2"), 0.0),
        (_tag("2(7 + 5)"), 0.0),  # implicit multiplication
        (_tag(""), 0.0),
        (_tag("__import__('os')"), 0.0),
        ("3 * 7 + 5 - 2", 0.0),  # no tags
        ("<answer>3 * 7 + 5 - 2", 0.0),  # no closing tag
        ("3 * 7 + 5 - 2</answer>", 0.0),  # no opening tag
        (_tag("4 * 6") + " " + _tag("3 * 7 + 5 - 2"), 1.0),  # the last tag counts
        (_tag("3 * 7 + 5 - 2") + " " + _tag("4 * 6"), 0.1),
        (_tag("3 * 7 + 5 - 2") + " <answer>oops", 1.0),  # an unclosed tag after it is not an answer
        (_tag("-(2 - 7) * 3 + 5 + 4"), 0.1),  # 4 is not given
        (_tag("-(2 - 7) * 3 + 5 + 2 + 2"), 0.1),  # 2 twice
    ],
)
def test_countdown_cases(completion, reward):
    assert countdown("", completion, ANSWER) == reward


def test_countdown_exact_fractions_and_repeated_numbers():
    assert countdown("", _tag("6 / (1 - 3 / 4)"), countdown_answer([1, 3, 4, 6], 24)) == 1.0
    assert countdown("", _tag("6 / (1 - 3 / 4)"), countdown_answer([1, 3, 4, 6], 23)) == 0.1
    assert countdown("", _tag("6 + 6 + 12"), countdown_answer([6, 6, 12], 24)) == 1.0
    assert countdown("", _tag("6 + 6 + 6 + 6"), countdown_answer([6, 6, 12], 24)) == 0.1


def test_countdown_depth_and_length_bounds():
    inner = "3 * 7 + 5 - 2"
    deep = "(" * expression.MAX_DEPTH + inner + ")" * expression.MAX_DEPTH
    assert countdown("", _tag(deep), ANSWER) == 1.0
    deeper = "(" + deep + ")"
    assert countdown("", _tag(deeper), ANSWER) == 0.0
    long = " " * (expression.MAX_CHARS - len(inner)) + inner
    assert countdown("", _tag(long), ANSWER) == 1.0
    assert countdown("", _tag(" " + long), ANSWER) == 0.0


def test_countdown_rejects_a_malformed_answer_string():
    for bad in [
        "24",
        '{"target": 24}',
        '{"target": "24", "numbers": [1]}',
        "{not",
        '{"target": 1, "numbers": [2.5]}',
    ]:
        with pytest.raises(ValueError):
            countdown("", _tag("1 + 2"), bad)


# ---------------------------------------------------------------------- robustness

_PIECES = (
    "####|\\boxed{|{|}|<answer>|</answer>|(|)|+|-|*|/|=|.|,|$| |\n|\u2212|\\frac{"
    "|1|23|0|999,999|3/4|0.5|x|日本|\x00|²|٣"
).split("|")


def _rewards(completion: str) -> list[float]:
    answers = [("72", numeric), ("Paris", exact), ("7", arithmetic), (ANSWER, countdown)]
    return [fn("prompt", completion, answer) for answer, fn in answers]


def test_rewards_never_raise_on_random_text():
    rng = fresh_rng()
    for _ in range(2000):
        completion = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 40)))
        got = _rewards(completion)
        assert set(got[:3]) <= {0.0, 1.0} and got[3] in (0.0, 0.1, 1.0), (rng.seed_value, completion)
    for _ in range(300):  # arbitrary code points, surrogates excluded
        code_points = [rng.choice([rng.randrange(0, 0xD800), rng.randrange(0x20, 0x7F)]) for _ in range(60)]
        completion = "".join(map(chr, code_points))
        _rewards(completion)


ADVERSARIAL = {
    "digits": "9" * 1_000_000,
    "thousands": "111," * 250_000 + "1",
    "fractions": "1/" * 500_000,
    "decimals": "1." * 500_000,
    "minus": "-" * 1_000_000,
    "dollar-space": "$" + " " * 1_000_000 + "x",
    "markers": "####" * 250_000,
    "boxes": "\\boxed{" * 150_000,
    "braces": "\\boxed{" + "{" * 1_000_000,
    "open tags": "<answer>" * 125_000 + "</answer>",
    "close tags": "</answer>" * 110_000,
    "deep parens": "<answer>" + "(" * 10_000 + "1" + ")" * 10_000 + "</answer>",
    "deep open": "<answer>" + "(" * 10_000 + "</answer>",
    "huge answer": "<answer>" + "1 + " * 250_000 + "1</answer>",
    "equals": "<answer>" + "=" * 1_000_000 + "</answer>",
    "tagged digits": "<answer>" + "9" * 1_000_000 + "</answer>",
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_rewards_are_fast_on_adversarial_text(name):
    completion = ADVERSARIAL[name]
    start = time.perf_counter()
    got = _rewards(completion)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"{name}: {elapsed:.2f} s"
    assert got[3] == 0.0  # none of these holds a parsable equation
