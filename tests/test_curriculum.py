"""rl/curriculum.py: the level mix follows each level's recent signal, keeps its floor, and resumes
where it stopped."""

import random

import pytest

from inkling_fp4.errors import DataError
from inkling_fp4.rl.curriculum import SMOOTHING, LevelCurriculum
from inkling_fp4.rl.prompts import Prompt


def pool(levels=(1, 2), n=50):
    return [Prompt(f"p{lv}-{i}", str(i), lv) for lv in levels for i in range(n)]


def test_an_even_mix_until_a_level_is_seen_then_the_signal_decides():
    c = LevelCurriculum(pool(), [1, 2], seed=0, floor=0.2)
    assert c.counts(64) == {1: 32, 2: 32}
    step = c.take(64)
    assert sorted(p.level for p in step).count(1) == 32
    c.observe([1] * 32 + [2] * 32, [False] * 32 + [True] * 32)  # level 1 all signal, level 2 none
    s1, s2 = 1.0, 1.0 - SMOOTHING
    assert c.signal == pytest.approx({1: s1, 2: s2})
    share1 = 0.1 + 0.8 * s1 / (s1 + s2)
    assert c.shares()[1] == pytest.approx(share1)
    assert sum(c.counts(64).values()) == 64 and c.counts(64)[1] == round(64 * share1)
    for _ in range(30):  # level 2 never carries a signal: it keeps the floor's share only
        c.observe([1, 2], [False, True])
    assert c.shares()[2] == pytest.approx(0.1, abs=1e-4) and c.counts(10) == {1: 9, 2: 1}


def test_counts_always_add_up_and_every_level_keeps_its_floor():
    rng = random.Random(0)
    c = LevelCurriculum(pool((1, 2, 3)), [1, 2, 3], seed=1, floor=0.3)
    for _ in range(50):
        n = rng.randint(1, 97)
        counts = c.counts(n)
        assert sum(counts.values()) == n and all(k >= 0 for k in counts.values())
        assert all(share >= 0.1 - 1e-12 for share in c.shares().values())
        c.observe([rng.choice([1, 2, 3]) for _ in range(8)], [rng.random() < 0.5 for _ in range(8)])
    assert LevelCurriculum(pool(), [1, 2], 0, floor=1.0).counts(9) == {1: 5, 2: 4}  # all floor: even


def test_fewer_groups_without_signal_than_the_fixed_mix_as_a_level_is_learnt():
    """A policy that solves level 1 more and more (its groups turn all right) and gains on level 2
    slowly: the fixed half-and-half mix sees ever more groups without signal (0.5 -> 0.65); the
    curriculum, moving to level 2, fewer."""

    def no_signal_rate(level, t):  # t in [0, 1]: the run's progress
        return 0.3 + 0.6 * t if level == 1 else 0.7 - 0.3 * t

    rng = random.Random(0)
    c = LevelCurriculum(pool(n=2000), [1, 2], seed=0, floor=0.2)
    shares, level1 = [], []
    for step in range(100):
        t = step / 99
        levels = [p.level for p in c.take(64)]
        flags = [rng.random() < no_signal_rate(lv, t) for lv in levels]
        c.observe(levels, flags)
        shares.append(sum(flags) / len(flags))
        level1.append(levels.count(1) / len(levels))

    def fixed(a, b):
        return sum(no_signal_rate(1, s / 99) + no_signal_rate(2, s / 99) for s in range(a, b)) / 2 / (b - a)

    def seen(a, b):
        return sum(shares[a:b]) / (b - a)

    assert seen(0, 100) < fixed(0, 100) - 0.02
    assert seen(90, 100) < fixed(90, 100) - 0.06  # where the two levels' signals differ most
    for a in range(0, 100, 10):  # never clearly worse (where the signals are alike it gains little)
        assert seen(a, a + 10) < fixed(a, a + 10) + 0.05, a
    assert level1[10] > 0.6 and level1[-1] < 0.3  # level 1 while it teaches, then level 2


def test_the_state_resumes_the_same_draws():
    a = LevelCurriculum(pool(), [1, 2], seed=3, floor=0.2)
    for _ in range(3):
        step = a.take(8)
        a.observe([p.level for p in step], [p.level == 2 for p in step])
    b = LevelCurriculum(pool(), [1, 2], seed=3, floor=0.2)
    b.load_state_dict(a.state_dict())
    assert [p.text for p in a.take(16)] == [p.text for p in b.take(16)]
    with pytest.raises(DataError, match="resume with the run's own rl.curriculum"):
        b.load_state_dict({"served": 3, "prompts": 100, "seed": 3})  # a fixed-mix run's state


def test_one_level_or_a_level_without_problems_is_refused():
    with pytest.raises(DataError, match="set rl.curriculum=none"):
        LevelCurriculum(pool(), [1], seed=0, floor=0.2)
    with pytest.raises(DataError, match="no problem of level"):
        LevelCurriculum(pool((1,)), [1, 2], seed=0, floor=0.2)
