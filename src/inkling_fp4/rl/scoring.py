"""Scoring completions with a reward function that may raise, hang, end its process or return nonsense.

A run must not die or stall on one bad reward call, so every call ends in one of ``OUTCOMES``: ``ok``
(a finite number) or reward 0 when it raised, ran past ``timeout_s``, returned no finite number
(invalid), raised KeyboardInterrupt (interrupted), ended its process (exited) or was killed by a
signal (crashed); the counts go to the step's metrics.

Built-in rewards are total functions of text and run in this process. A user's function
(``--reward``) runs in a forked worker, because a hung Python function cannot be stopped from another
thread and one that ends its process must not end the run; a fresh worker is forked after a timeout,
exit or crash. The worker ignores SIGINT (Ctrl-C reaches the whole process group; the run's handler
decides) and keeps SIGTERM's default.
"""

from __future__ import annotations

import faulthandler
import importlib
import inspect
import math
import multiprocessing as mp
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inkling_fp4.errors import ConfigError

OUTCOMES = ("ok", "raised", "timeout", "invalid", "interrupted", "exited", "crashed")
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
    # forked from the training loop: its SIGINT / SIGTERM handlers are the run's, not the worker's
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    faulthandler.disable()  # a segfault is reported as an outcome, not as a dump on the run's console
    while True:
        try:
            args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("value", fn(*args)))
        except KeyboardInterrupt:
            conn.send(("interrupted", "KeyboardInterrupt"))
        except SystemExit as e:
            conn.send(("exited", f"sys.exit({e.code!r})"))
        except BaseException as e:  # the user's code: report, never die
            conn.send(("raised", f"{type(e).__name__}: {e}"))


def _ending(exitcode: int | None) -> tuple[str, str]:
    """(outcome, message) of a worker that stopped answering: ``exitcode`` -N is signal N."""
    if exitcode is None:  # still running, yet its pipe is gone
        return "crashed", "the reward's process closed its pipe"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return "crashed", f"the reward's process was killed by {name}"
    return "exited", f"the reward's process exited with status {exitcode}"


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
        try:
            self._conn.send(args)
            if not self._conn.poll(self.timeout_s):
                self.close()  # a hung call: kill the worker; the next call forks a fresh one
                return "timeout", 0.0, f"no answer within {self.timeout_s:g} s"
            kind, value = self._conn.recv()
        except (EOFError, OSError):  # the pipe closed: the function ended the worker's process
            self._proc.join(self.timeout_s)
            outcome, message = _ending(self._proc.exitcode)
            self.close()
            return outcome, 0.0, message
        if kind != "value":
            return kind, 0.0, value
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
