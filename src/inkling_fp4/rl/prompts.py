"""Where an RL run's prompts come from, in a seeded, resumable order, and its held-out problems.

A built-in task draws ``POOL`` train problems once and serves them in a seeded permutation per epoch
(the state is one counter); evaluation uses its ``eval`` split. A jsonl file (``--data``) holds
``{prompt, answer}`` or GSM8K's ``{question, answer}`` records; its last ``EVAL_FRACTION`` is held out.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from inkling_fp4.errors import DataError
from inkling_fp4.rl import rewards
from inkling_fp4.rl.config import TASKS, RLConfig
from inkling_fp4.rl.scoring import load_reward
from inkling_fp4.rl.tasks import held_out

POOL = 20_000
"""Train problems drawn for a built-in task (repeats come only after this many prompts)."""
RL_STREAM = 1 << 20
"""A built-in task's RL prompts are drawn from seed + RL_STREAM: with the SFT's own seed they would be
the first problems of the built-in SFT examples (data/builtin_tasks.py draws the same train split)."""
EVAL_FRACTION = 0.1


@dataclass
class Prompt:
    text: str
    """The user message."""
    answer: str
    level: int | None = None
    """A built-in task's difficulty level (the held-out figures are also given per level)."""


@dataclass
class TaskData:
    name: str
    train: list[Prompt]
    eval: list[Prompt]
    reward: Callable[[str, str, str], float]
    builtin: bool
    """A built-in reward: a total function of text, run in this process."""
    levels: list[int] = field(default_factory=list)
    """A built-in task's levels drawn (none for a jsonl task)."""


def load_task(cfg: RLConfig, seed: int) -> TaskData:
    """The task of ``cfg.task`` (a built-in name or a jsonl path), scored by ``cfg.reward`` if set."""
    data = _task(cfg, seed)
    if cfg.reward is not None:
        data.reward, data.builtin = load_reward(cfg.reward), False
    return data


def _task(cfg: RLConfig, seed: int) -> TaskData:
    if cfg.task in TASKS:
        module = importlib.import_module(f"inkling_fp4.rl.tasks.{cfg.task}")
        levels = cfg.levels or module.LEVELS
        bad = [lv for lv in levels if lv not in module.LEVELS]
        if bad:
            raise DataError(f"rl.levels {bad}: the {cfg.task} task has levels {list(module.LEVELS)}")
        train = [
            Prompt(p.prompt, p.answer, p.level)
            for p in module.problems("train", POOL, seed + RL_STREAM, levels)
        ]
        held = [
            Prompt(p.prompt, p.answer, p.level) for p in held_out(module.problems, cfg.eval_prompts, levels)
        ]
        return TaskData(cfg.task, train, held, module.reward, True, list(levels))
    records = read_jsonl(Path(cfg.task))
    n_eval = max(1, round(EVAL_FRACTION * len(records))) if len(records) > 1 else 0
    verify = rewards.numeric if cfg.verifier == "numeric" else rewards.exact
    train, held = records[: len(records) - n_eval], records[len(records) - n_eval :]
    return TaskData(Path(cfg.task).name, train, held[: cfg.eval_prompts], verify, True)


def read_jsonl(path: Path, flag: str = "--data") -> list[Prompt]:
    """The records of a jsonl file; a bad line is a one-line DataError naming ``flag``, file and line."""
    if not path.is_file():
        raise DataError(
            f"{flag} {path}: no such file; pass a jsonl of {{prompt, answer}} records, or one of the "
            f"built-in tasks ({' | '.join(TASKS)})"
        )
    out = []
    for i, raw in enumerate(path.read_bytes().splitlines()):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(
                f"{flag} {path}, line {i + 1}: not UTF-8 ({e.reason}); re-encode the file"
            ) from None
        except json.JSONDecodeError as e:
            raise DataError(f"{flag} {path}, line {i + 1}: not JSON ({e.msg})") from None
        prompt = record.get("prompt", record.get("question")) if isinstance(record, dict) else None
        answer = record.get("answer") if isinstance(record, dict) else None
        if not isinstance(prompt, str) or not prompt.strip() or not isinstance(answer, (str, int, float)):
            fields = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise DataError(
                f"{flag} {path}, line {i + 1}: expected {{prompt (or question): text, answer}}, got {fields}"
            )
        out.append(Prompt(prompt, str(answer)))
    if not out:
        raise DataError(f"{flag} {path} holds no record")
    return out


class PromptStream:
    """The train prompts in a seeded permutation per epoch; state: how many were served."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts, self.seed, self.served = prompts, seed, 0
        self._epoch, self._order = -1, np.zeros(0, np.int64)

    def take(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            epoch, pos = divmod(self.served, len(self.prompts))
            if epoch != self._epoch:
                self._epoch = epoch
                self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))
            out.append(self.prompts[int(self._order[pos])])
            self.served += 1
        return out

    def state_dict(self) -> dict:
        return {"served": self.served, "prompts": len(self.prompts), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["prompts"] != len(self.prompts) or state["seed"] != self.seed:
            raise DataError(
                f"the checkpoint's prompt position is for {state['prompts']} prompts and seed "
                f"{state['seed']}, "
                f"this run has {len(self.prompts)} and {self.seed}; resume with the same task and seed"
            )
        self.served = int(state["served"])
