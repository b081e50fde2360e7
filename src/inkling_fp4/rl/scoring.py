"""Scoring completions with a reward function that may raise, hang or return nonsense.

A reward is ``reward(prompt: str, completion: str, answer: str) -> float``: a built-in one
(``inkling_fp4.rl.rewards``) or the user's (``--reward MODULE:FUNCTION``). A policy-gradient run
must not die or stall on one bad call, so every call's outcome is one of

    ok        a finite number: the reward
    raised    the function raised: reward 0
    timeout   it ran past ``timeout_s``: reward 0
    invalid   it returned something that is not a finite number (NaN, None, a string): reward 0

and the counts are reported with the step's metrics. The built-in rewards are total functions of
text in linear time and run in this process. A user's function runs in a worker process (forked, so
it inherits the loaded module), because a Python function that hangs cannot be stopped from another
thread: on a timeout the worker is killed and a fresh one forked for the next call.
"""

from __future__ import annotations

import importlib
import inspect
import math
import multiprocessing as mp
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inkling_fp4.errors import ConfigError

OUTCOMES = ("ok", "raised", "timeout", "invalid")
RewardFn = Callable[[str, str, str], float]


@dataclass
class Scores:
    rewards: list[float]
    outcomes: Counter = field(default_factory=Counter)
    """How many calls ended each way (``OUTCOMES``)."""
    first_error: str | None = None
    """The first failure's message, for the log."""


def load_reward(spec: str) -> RewardFn:
    """``MODULE:FUNCTION`` -> the function, checked to take (prompt, completion, answer)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--reward {spec}: expected MODULE:FUNCTION, e.g. my_rewards:score")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises on import
        raise ConfigError(f"--reward {spec}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"--reward {spec}: {module_name} has no function {attr}")
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer")
    except TypeError:
        raise ConfigError(
            f"--reward {spec}: {attr}{inspect.signature(fn)} does not take (prompt, completion, answer)"
        ) from None
    except ValueError:  # builtins without a signature: trust them
        pass
    return fn


def _judge(value) -> tuple[str, float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "invalid", 0.0
    value = float(value)
    return ("ok", value) if math.isfinite(value) else ("invalid", 0.0)


def _worker(conn, fn: RewardFn) -> None:
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("value", fn(*args)))
        except Exception as e:  # the user's code: report, never die
            conn.send(("raised", f"{type(e).__name__}: {e}"))


class RewardRunner:
    """Scores batches with ``fn``; in a worker process with a timeout when ``isolate``."""

    def __init__(self, fn: RewardFn, timeout_s: float = 5.0, isolate: bool = True):
        self.fn, self.timeout_s, self.isolate = fn, timeout_s, isolate
        self._proc = self._conn = None

    def score(self, prompts: Sequence[str], completions: Sequence[str], answers: Sequence[str]) -> Scores:
        out = Scores([])
        for args in zip(prompts, completions, answers, strict=True):
            outcome, value, message = self._call(args)
            out.rewards.append(value)
            out.outcomes[outcome] += 1
            if outcome != "ok" and out.first_error is None:
                out.first_error = f"{outcome}: {message}"
        return out

    def _call(self, args) -> tuple[str, float, str]:
        if not self.isolate:
            try:
                value = self.fn(*args)
            except Exception as e:
                return "raised", 0.0, f"{type(e).__name__}: {e}"
            outcome, reward = _judge(value)
            return outcome, reward, repr(value)[:80]
        if self._proc is None:
            self._start()
        self._conn.send(args)
        if not self._conn.poll(self.timeout_s):
            self.close()  # a hung call: kill the worker; the next call forks a fresh one
            return "timeout", 0.0, f"no answer within {self.timeout_s:g} s"
        kind, value = self._conn.recv()
        if kind == "raised":
            return "raised", 0.0, value
        outcome, reward = _judge(value)
        return outcome, reward, repr(value)[:80]

    def _start(self) -> None:
        ctx = mp.get_context("fork")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, self.fn), daemon=True)
        self._proc.start()
        child.close()

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    def __del__(self):
        self.close()
