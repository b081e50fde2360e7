"""Built-in SFT data: valid chat records of train-split problems, the documented mix, reproducible and
fast; every assistant turn earns its task's full reward."""

import hashlib
import json
import re
import time
from collections import Counter

import pytest

from data_corpus import fresh_rng
from inkling_fp4.data.builtin_tasks import BuiltinTasks
from inkling_fp4.data.chat import parse_record
from inkling_fp4.rl.expression import parse
from inkling_fp4.rl.rewards import arithmetic, countdown, countdown_answer
from inkling_fp4.rl.tasks import split_of

_ARITHMETIC = re.compile(r"Compute (.+)\. End your answer with #### followed by the result\.")
_COUNTDOWN = re.compile(r"Using the numbers \[([\d, ]+)\], make an equation that equals (\d+)\. ")


def _task(record: dict) -> tuple[str, str, str]:
    """(task, canonical key, answer string), read back from the user's text alone."""
    prompt = record["messages"][0]["content"]
    if m := _ARITHMETIC.fullmatch(prompt):
        value = parse(m[1]).value()
        assert value.denominator == 1
        return "arithmetic", m[1], str(value.numerator)
    m = _COUNTDOWN.match(prompt)
    numbers, target = [int(n) for n in m[1].split(", ")], int(m[2])
    key = " ".join(map(str, sorted(numbers))) + f" -> {target}"
    return "countdown", key, countdown_answer(numbers, target)


def test_records_are_chats_of_train_problems_that_earn_full_reward():
    seed = fresh_rng().randrange(2**31)
    data = BuiltinTasks(1000, seed)
    rows = list(data.iter_rows())
    assert len(rows) == 1000
    tasks = Counter()
    for i, record in enumerate(rows):
        chat = parse_record(record, f"record {i}")
        assert [m["role"] for m in chat.messages] == ["user", "assistant"] and not chat.empty_answer
        task, key, answer = _task(record)
        tasks[task] += 1
        assert split_of(key) == "train", (seed, key)  # the eval split stays unseen
        reward = arithmetic if task == "arithmetic" else countdown
        assert reward(record["messages"][0]["content"], record["messages"][1]["content"], answer) == 1.0
    assert (tasks["arithmetic"], tasks["countdown"]) == data.counts == (600, 400)


def test_describe_and_mix():
    data = BuiltinTasks(4000, 0)
    assert data.describe() == (
        "built-in tasks: 4000 worked examples (arithmetic levels 1, 2, 3, 4, 5: 2400, "
        "countdown: 1600), seed 0"
    )
    rows = list(data.iter_rows())
    kinds = [_task(r)[0] for r in rows]
    assert Counter(kinds) == {"arithmetic": 2400, "countdown": 1600}
    assert len(set(kinds[:50])) == 2 and len(set(kinds[-50:])) == 2  # interleaved, not in blocks
    levels = Counter()
    for record in rows:
        m = _ARITHMETIC.fullmatch(record["messages"][0]["content"])
        if m:
            levels[len(re.findall(r" [-+*/] ", m[1]))] += 1
    assert sum(levels.values()) == 2400 and set(levels) == {1, 2, 3, 4}  # operation counts of levels 1-5
    assert BuiltinTasks(5, 1).counts == (3, 2) and BuiltinTasks(0, 1).counts == (0, 0)
    assert list(BuiltinTasks(0, 1).iter_rows()) == []


def test_same_seed_same_records_everywhere():
    """Fixed algorithms only (random.Random streams, BLAKE2b), so this digest holds on every machine."""
    seed = fresh_rng().randrange(2**31)
    assert list(BuiltinTasks(300, seed).iter_rows()) == list(BuiltinTasks(300, seed).iter_rows())
    assert list(BuiltinTasks(300, seed).iter_rows()) != list(BuiltinTasks(300, seed + 1).iter_rows())
    text = json.dumps(list(BuiltinTasks(200, 0).iter_rows()), sort_keys=True)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == GOLDEN_DIGEST


GOLDEN_DIGEST = "d8eeef8a1b1d32f7"  # sha256 of BuiltinTasks(200, 0) as sorted-key JSON


def test_generation_is_fast():
    start = time.perf_counter()
    rows = list(BuiltinTasks(4000, fresh_rng().randrange(2**31)).iter_rows())
    elapsed = time.perf_counter() - start
    assert len(rows) == 4000 and elapsed < 1.0, f"{elapsed:.2f} s"


def test_rejects_a_negative_count():
    with pytest.raises(ValueError):
        BuiltinTasks(-1, 0)


def test_levels_give_arithmetic_of_those_levels_only():
    """sft.builtin_levels: the worked examples of an RL run on those levels, from the train split."""
    data = BuiltinTasks(300, 2, levels=[1, 2])
    assert data.counts == (300, 0) and "arithmetic levels 1, 2: 300, countdown: 0" in data.describe()
    rows = list(data.iter_rows())
    assert len(rows) == 300 and all(_task(r)[0] == "arithmetic" for r in rows)
    ops = Counter(
        len(re.findall(r" [-+*/] ", _ARITHMETIC.fullmatch(r["messages"][0]["content"])[1])) for r in rows
    )
    assert set(ops) == {1}  # levels 1 and 2 are one operation each
    assert all(split_of(_task(r)[1]) == "train" for r in rows)


def test_countdown_search_reaches_the_sft_data_and_is_checked():
    """sft.countdown_failed_attempts reaches the records (countdown only, every record still earns its
    full reward, the same prompts in the same order) and bad chances are refused with the fix."""
    from inkling_fp4.data.config import DataConfig
    from inkling_fp4.data.sft_config import SFTConfig
    from inkling_fp4.data.sft_data import _open

    seed = fresh_rng().randrange(2**31)
    sft = SFTConfig(builtin_examples=400, countdown_failed_attempts=[0.5, 0.3, 0.2])
    searched = list(_open(DataConfig(source="builtin"), sft, seed).iter_rows())
    plain = list(BuiltinTasks(400, seed).iter_rows())
    assert [r["messages"][0] for r in searched] == [r["messages"][0] for r in plain]
    tried = Counter()
    for s, p in zip(searched, plain, strict=True):
        task, _, answer = _task(s)
        reply = s["messages"][1]["content"]
        tried[task, "try again" in reply] += 1
        score = countdown if task == "countdown" else arithmetic
        assert score(s["messages"][0]["content"], reply, answer) == 1.0
        assert reply.endswith(p["messages"][1]["content"])
    assert tried["arithmetic", True] == 0 and tried["countdown", True] > 0.3 * tried["countdown", False]
    assert (
        "failed attempts shown with chances [0.5, 0.3, 0.2]"
        in _open(DataConfig(source="builtin"), sft, 0).describe()
    )
    for bad in ([], [0.7], [0.5, 0.6], [1.5, -0.5]):
        with pytest.raises(ValueError, match=r"sft.countdown_failed_attempts .* sum to 1"):
            SFTConfig(countdown_failed_attempts=bad)
