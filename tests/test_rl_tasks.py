"""RL tasks: the expression parser and writer against Python's own arithmetic, and the generated
problems: reproducible, split without overlap, shaped as documented, solved by their solutions."""

import ast
import json
import operator
import re
from collections import Counter
from fractions import Fraction

import pytest

from data_corpus import fresh_rng
from inkling_fp4.rl.expression import MAX_CHARS, ExpressionError, Term, apply, leaf, parse
from inkling_fp4.rl.rewards import countdown_answer
from inkling_fp4.rl.tasks import EVAL_EVERY, Problem, split_of
from inkling_fp4.rl.tasks import arithmetic as arith
from inkling_fp4.rl.tasks import countdown as cd

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


class Reference:
    """Python's parser (``ast``) and Fraction arithmetic on the same text: an independent evaluator
    that also reports the expression's shape."""

    def __init__(self, text: str):
        self.binops: list[str] = []
        self.constants: list[int] = []
        self.dividends: list[int] = []  # constants that are the left operand of a division
        self.results: list[Fraction] = []  # every operation's result, in evaluation order
        self.value = self._eval(ast.parse(text.strip(), mode="eval").body)

    def _eval(self, node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            self.constants.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -self._eval(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            self.binops.append(type(node.op).__name__)
            if isinstance(node.op, ast.Div) and isinstance(node.left, ast.Constant):
                self.dividends.append(node.left.value)
            result = _OPS[type(node.op)](self._eval(node.left), self._eval(node.right))
            self.results.append(result)
            return result
        raise ValueError(f"not arithmetic: {ast.dump(node)}")


def _reference_outcome(text: str):
    try:
        return Reference(text).value
    except (SyntaxError, ValueError):
        return "error"
    except ZeroDivisionError:
        return "zero"


def _our_outcome(text: str):
    try:
        expression = parse(text)
    except ExpressionError:
        return "error"
    try:
        return expression.value()
    except ZeroDivisionError:
        return "zero"


def _random_expression(rng, depth: int = 0) -> str:
    """Valid text with random spacing, unary minus and redundant parentheses."""
    sp = lambda: rng.choice(["", "", " ", "  ", "\t"])  # noqa: E731
    if depth > 3 or rng.random() < 0.3:
        text = str(rng.randint(0, 120))
    else:
        left, right = _random_expression(rng, depth + 1), _random_expression(rng, depth + 1)
        text = f"{left}{sp()}{rng.choice('+-*/')}{sp()}{right}"
    if rng.random() < 0.15:
        text = f"-{sp()}{text}"
    if rng.random() < 0.3:
        text = f"({sp()}{text}{sp()})"
    return text


def test_parse_matches_python_on_random_expressions():
    rng = fresh_rng()
    for _ in range(2000):
        text = _random_expression(rng)
        assert _our_outcome(text) == _reference_outcome(text), (rng.seed_value, text)
        if _our_outcome(text) not in ("error", "zero"):
            assert list(parse(text).numbers) == Reference(text).constants, (rng.seed_value, text)


def test_parse_accepts_and_rejects_what_python_does_on_random_strings():
    """Random strings over the expression alphabet (no 0: Python rejects "01"; no "." : Python reads
    "1." as a float): both parsers fail, or both give the same value or the same division by zero."""
    rng = fresh_rng()
    for _ in range(5000):
        text = "".join(rng.choice("123456789+-*/()  ") for _ in range(rng.randint(0, 14)))
        assert _our_outcome(text) == _reference_outcome(text), (rng.seed_value, text)


def test_parse_edge_cases():
    assert parse("1.5 * 2").value() == 3
    assert parse("6 / 4 * 2").value() == 3
    assert parse("2 - 3 - 4").value() == -5 and parse("64 / 4 / 2").value() == 8  # left-associative
    assert parse("--3").value() == 3 and parse("2*-3").value() == -6
    assert parse("07").numbers == (7,)
    cases = "|, |1 2|1 +|+1|(1|1)|()|2(3)|(1)(2)|1.|.5|2**3|2//3|1e3|１|²|٣|1 = 1|x|1,000|1 ! 2"
    for bad in cases.split("|"):
        with pytest.raises(ExpressionError):
            parse(bad)
    with pytest.raises(ZeroDivisionError):
        parse("1 / (2 - 2)").value()
    with pytest.raises(ExpressionError):
        parse("1" * (MAX_CHARS + 1))
    assert parse("(" * 100 + "1" + ")" * 100).value() == 1
    with pytest.raises(ExpressionError):
        parse("(" * 101 + "1" + ")" * 101)


def _random_term(rng, ops: int) -> Term:
    if ops == 0:
        return leaf(rng.randint(0, 30))
    k = rng.randint(0, ops - 1)
    left, right = _random_term(rng, k), _random_term(rng, ops - 1 - k)
    op = rng.choice("+-*/") if right.value != 0 else rng.choice("+-*")
    return apply(op, left, right)


def _check_steps(steps: list[str], text: str):
    """Each step is one right operation, and the steps are the text's own evaluation, in order."""
    results = []
    for step in steps:
        lhs, rhs = step.split(" = ")
        assert Reference(lhs).value == Reference(rhs).value, step
        assert len(re.findall(r" [-+*/] ", lhs)) == 1, step  # one operation ("(3/4)" is an operand)
        results.append(Reference(rhs).value)
    assert results == Reference(text).results, (steps, text)


def test_written_terms_mean_their_value():
    """The writer's text (minimal parentheses) reads back as its value in Python and in our parser,
    with one step per operation whose result is right."""
    rng = fresh_rng()
    for _ in range(1000):
        ops = rng.randint(0, 6)
        term = _random_term(rng, ops)
        reference = Reference(term.text)
        assert reference.value == term.value == parse(term.text).value(), (rng.seed_value, term.text)
        assert len(reference.binops) == len(term.steps) == ops
        _check_steps(term.steps, term.text)
    # parentheses where precedence or the tree needs them, no more
    a, b, c = leaf(8), leaf(4), leaf(2)
    assert apply("-", a, apply("-", b, c)).text == "8 - (4 - 2)"
    assert apply("-", apply("-", a, b), c).text == "8 - 4 - 2"
    assert apply("+", a, apply("-", b, c)).text == "8 + (4 - 2)"  # the text reads as the tree
    assert apply("/", a, apply("*", b, c)).text == "8 / (4 * 2)"
    assert apply("*", a, apply("/", b, c)).text == "8 * (4 / 2)"
    assert apply("-", apply("*", a, b), apply("/", b, c)).text == "8 * 4 - 4 / 2"
    assert apply("*", apply("+", a, b), c).text == "(8 + 4) * 2"
    assert apply("*", leaf(3), apply("-", leaf(2), leaf(5))).steps[-1] == "3 * (-3) = -9"


# ---------------------------------------------------------------------- task problems

TASKS = [(arith, arith.LEVELS), (cd, cd.LEVELS)]


def _key(module, problem: Problem) -> str:
    """The canonical text, rebuilt from the problem as a user sees it."""
    if module is arith:
        prompt = r"Compute (.+)\. End your answer with #### followed by the result\."
        return re.fullmatch(prompt, problem.prompt)[1]
    spec = json.loads(problem.answer)
    return " ".join(map(str, sorted(spec["numbers"]))) + f" -> {spec['target']}"


@pytest.mark.parametrize("module, levels", TASKS, ids=["arithmetic", "countdown"])
def test_same_seed_same_problems(module, levels):
    seed = fresh_rng().randrange(2**31)
    first = module.problems("train", 300, seed)
    assert module.problems("train", 300, seed) == first
    assert module.problems("train", 100, seed) == first[:100]  # a shorter list is a prefix
    assert module.problems("train", 300, seed + 1) != first
    assert module.problems("eval", 50, seed) != module.problems("eval", 50, seed + 1)
    assert [p.level for p in first] == [levels[i % len(levels)] for i in range(300)]
    one = module.problems("train", 20, seed, levels=[levels[-1]])
    assert {p.level for p in one} == {levels[-1]}


def test_problems_reproduce_exactly():
    """Seed 0 gives these problems on every machine (random.Random and BLAKE2b are fixed algorithms)."""
    assert [p.prompt.split(".")[0] for p in arith.problems("train", 5, 0)] == [
        "Compute 7 - 5",
        "Compute 36 * 17",
        "Compute (45 - 55) * 40",
        "Compute 71 * 2 / 2",
        "Compute (41 + 74) * (24 - 25)",
    ]
    assert [p.answer for p in cd.problems("eval", 2, 0)] == [
        countdown_answer(*pair) for pair in [([77, 25, 90], 12), ([96, 29, 8, 50], 9)]
    ]


@pytest.mark.parametrize("module", [arith, cd], ids=["arithmetic", "countdown"])
def test_train_and_eval_are_disjoint(module):
    seed = fresh_rng().randrange(2**31)
    train = {_key(module, p) for s in (seed, seed + 1) for p in module.problems("train", 1500, s)}
    evals = {_key(module, p) for s in (seed, seed + 1) for p in module.problems("eval", 500, s)}
    assert train and evals and not train & evals
    assert all(split_of(k) == "train" for k in train) and all(split_of(k) == "eval" for k in evals)
    # the eval split is a fraction 1/EVAL_EVERY of the candidates
    keys = [f"problem {i}" for i in range(20000)]
    share = sum(split_of(k) == "eval" for k in keys) / len(keys)
    assert abs(share - 1 / EVAL_EVERY) < 0.01


def test_every_level_has_both_splits():
    for module, levels in TASKS:
        for level in levels:
            for split in ("train", "eval"):
                assert len(module.problems(split, 3, 0, levels=[level])) == 3


def test_problems_validate_arguments():
    for module, _ in TASKS:
        with pytest.raises(ValueError, match="split"):
            module.problems("test", 1, 0)
        with pytest.raises(ValueError, match="levels"):
            module.problems("train", 1, 0, levels=[9])
        with pytest.raises(ValueError, match="levels"):
            module.problems("train", 1, 0, levels=[])
        assert module.problems("train", 0, 0) == []


def test_arithmetic_problems_are_shaped_as_documented_and_solved():
    rng = fresh_rng()
    seed = rng.randrange(2**31)
    for split in ("train", "eval"):
        for p in arith.problems(split, 3000 if split == "train" else 1000, seed):
            text = _key(arith, p)
            ref = Reference(text)
            spec = arith.SPECS[p.level]
            assert str(ref.value) == p.answer, (seed, text)  # an independent evaluation of the answer
            assert ref.value.denominator == 1 and abs(ref.value) <= arith.MAX_VALUE
            lo, hi = spec.operations
            assert lo <= len(ref.binops) <= hi, (seed, text)
            used = {"Add": "+", "Sub": "-", "Mult": "*", "Div": "/"}
            assert {used[b] for b in ref.binops} <= set(spec.operators), (seed, text)
            operands = Counter(ref.constants) - Counter(ref.dividends)
            assert all(spec.operands[0] <= c <= spec.operands[1] for c in operands), (seed, text)
            assert all(c <= arith.MAX_DIVIDEND for c in ref.dividends)
            if p.level == 1:
                assert ref.value >= 0
            assert p.solution.endswith(f"\n#### {p.answer}")
            steps = p.solution.split("\n")[:-1]
            _check_steps(steps, text)
            assert all(Fraction(s.split(" = ")[1]).denominator == 1 for s in steps)  # exact divisions
            assert arith.reward(p.prompt, p.solution, p.answer) == 1.0, (seed, p.solution)
            wrong = p.solution.rsplit("#### ", 1)[0] + f"#### {ref.value + 1}"
            assert arith.reward(p.prompt, wrong, p.answer) == 0.0


def test_countdown_problems_are_shaped_as_documented_and_solved():
    rng = fresh_rng()
    seed = rng.randrange(2**31)
    shown = Counter()  # failed attempts shown before the right one
    chances = (0.5, 0.3, 0.2)
    for split in ("train", "eval"):
        for p in cd.problems(split, 2000 if split == "train" else 500, seed, failed_attempts=chances):
            spec = json.loads(p.answer)
            numbers, target = spec["numbers"], spec["target"]
            assert len(numbers) == cd.NUMBERS[p.level]
            assert all(cd.NUMBER_RANGE[0] <= n <= cd.NUMBER_RANGE[1] for n in numbers)
            assert isinstance(target, int) and 1 <= target <= cd.MAX_TARGET and target not in numbers
            assert f"Using the numbers {numbers}, make an equation that equals {target}." in p.prompt
            assert "<answer>" in p.prompt and "at most once" in p.prompt
            equation = re.fullmatch(r"(?s).*\nSo (.+) = (\d+)\.\n<answer>(.+)</answer>", p.solution)
            assert equation and equation[1] == equation[3] and int(equation[2]) == target, p.solution
            ref = Reference(equation[3])
            assert ref.value == target and Counter(ref.constants) == Counter(numbers), (seed, p.solution)
            *attempts, last = p.solution.split(", try again.\n")
            steps = last.split("\n")[:-2]
            assert len(steps) == len(numbers) - 1
            _check_steps(steps, equation[3])
            assert all(int(s.split(" = ")[1]) > 0 for s in steps)  # every intermediate a positive integer
            tried = set()
            for attempt in attempts:  # each a right computation of all the numbers that misses the target
                *steps, check = attempt.split("\n")
                assert len(steps) == len(numbers) - 1 and check.endswith(f" is not {target}"), attempt
                value = int(check.removesuffix(f" is not {target}"))
                assert value != target and int(steps[-1].split(" = ")[1]) == value, attempt
                for step in steps:
                    lhs, rhs = step.split(" = ")
                    assert Reference(lhs).value == Reference(rhs).value > 0, step
                used = Counter(numbers)  # every given number once, every result used once after it appears
                for step in steps:
                    lhs, rhs = step.split(" = ")
                    for operand in map(int, re.split(r" [-+*/] ", lhs)):
                        assert used[operand] > 0, (numbers, attempt)
                        used[operand] -= 1
                    used[int(rhs)] += 1
                assert +used == Counter([value]), (numbers, attempt)
                tried.add(tuple(steps))
            assert len(tried) == len(attempts) <= len(chances) - 1, (seed, p.solution)
            shown[len(attempts)] += 1
            assert cd.reward(p.prompt, p.solution, p.answer) == 1.0, (seed, p.solution)
            wrong = p.solution.replace("<answer>", "<answer>1 + ")
            assert cd.reward(p.prompt, wrong, p.answer) < 1.0
    # as many attempts as the chances say, within 4 binomial sigmas (a level-1 problem with fewer
    # wrong combinations than drawn shows fewer: rare, so the bound holds)
    n = sum(shown.values())
    for k, chance in enumerate(chances):
        assert abs(shown[k] / n - chance) < 4 * (chance * (1 - chance) / n) ** 0.5 + 0.005, (seed, shown)
    # the same problems whatever the solutions show, and by default the construction alone
    plain = cd.problems("train", 300, seed)
    searched = cd.problems("train", 300, seed, failed_attempts=chances)
    assert [(p.prompt, p.answer) for p in plain] == [(p.prompt, p.answer) for p in searched]
    assert not any("try again" in p.solution for p in plain)
    assert all(p.solution.endswith(q.solution) for p, q in zip(searched, plain, strict=True))
    for bad in ((), (0.5, 0.6), (1.2, -0.2)):
        with pytest.raises(ValueError, match="failed_attempts"):
            cd.problems("train", 1, seed, failed_attempts=bad)


def test_failed_attempts_never_repeat_their_steps_where_two_orders_read_alike():
    """[51, 2, 53]: ``(51 + 2) / 53`` and ``53 / (51 + 2)`` are different terms with the same steps, and a
    solution showing both would show one attempt twice."""
    for k in range(500):
        for numbers in ([51, 2, 53], [3, 3, 6], [4, 4, 4, 4]):
            failed = cd._failed_attempts(f"key {k}", numbers, 7, (0.0, 0.0, 1.0))
            assert len(failed) == 2 and failed[0].steps != failed[1].steps, (numbers, k, failed)


def test_held_out_problems_are_distinct_and_capped_by_the_split():
    """The held-out set an evaluation scores (a rollout's, fp4train eval's) has no repeats: level 1
    has only 23 eval problems, so asking for 128 gives those 23 (each counted once), while the harder
    levels give all 128, distinct."""
    from inkling_fp4.infer.evaluate import task_problems
    from inkling_fp4.rl.config import RLConfig
    from inkling_fp4.rl.prompts import load_task
    from inkling_fp4.rl.tasks import held_out

    for module in (arith, cd):
        got = held_out(module.problems, 300, module.LEVELS)
        assert len(got) == 300 == len({p.prompt for p in got})
    _, evals, _ = task_problems("arithmetic", 300)
    assert len({p.prompt for p in evals}) == len(evals) == 300
    easy = load_task(RLConfig(levels=[1], eval_prompts=128), 0).eval
    level_one = {p.prompt for p in arith.problems("eval", 2000, 0, levels=[1])}
    assert {p.text for p in easy} == level_one and len(easy) == len(level_one) < 128
    mixed = load_task(RLConfig(levels=[1, 2, 3], eval_prompts=128), 0).eval
    assert len(mixed) == 128 == len({p.text for p in mixed})
    assert all(split_of(p.text.split(".")[0].removeprefix("Compute ")) == "eval" for p in mixed)


def test_rl_prompts_are_not_the_builtin_sft_examples():
    """The built-in SFT examples and a built-in task's RL prompts come from one train split; drawn with
    one seed they would be the same problems (RL would score the SFT's training set). Countdown's RL
    pool meets the SFT's 80,000 problems only by chance: a few of 3 numbers, under 1.5% of them."""
    from inkling_fp4.data.builtin_tasks import BuiltinTasks
    from inkling_fp4.rl.config import RLConfig
    from inkling_fp4.rl.prompts import load_task

    examples = BuiltinTasks(20_000, 0)
    sft = {row["messages"][0]["content"] for row in examples.iter_rows()}
    _, n_countdown = examples.counts
    for levels in ([1, 2], [1], [2]):  # [1, 2]: the SFT's own mix (with its seed: every problem shared)
        rl = load_task(RLConfig(task="countdown", levels=levels), 0).train[:n_countdown]
        shared = sum(p.text in sft for p in rl)
        assert shared <= 0.015 * len(rl), (levels, shared)
        assert {p.level for p in rl} == set(levels)
