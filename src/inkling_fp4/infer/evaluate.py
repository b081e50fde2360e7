"""``fp4train eval``: a run's accuracy on a task's held-out problems, pass@1 greedy and pass@k.

Tasks: ``arithmetic`` and ``countdown`` (their ``eval`` split and rewards), or a jsonl FILE of
``{prompt, answer}`` / ``{question, answer}`` records checked with ``rl.rewards.numeric``. With
``--samples K`` > 1, K completions at ``sampler.temperature``: pass@1 (sampled) is the mean fraction
correct, pass@K the fraction of problems with one right (Chen et al. 2021's unbiased estimator at
n = k). The result is also appended to the run's ``metrics.jsonl`` as an ``eval`` event.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from inkling_fp4.errors import UserError
from inkling_fp4.infer.from_run import load_run_sampler
from inkling_fp4.rl import rewards
from inkling_fp4.rl.prompts import read_jsonl
from inkling_fp4.rl.tasks import held_out
from inkling_fp4.runs.directory import CONFIG_FILE
from inkling_fp4.runs.metrics import METRICS_FILE

TASKS = ("arithmetic", "countdown")


@dataclass
class EvalProblem:
    prompt: str
    answer: str


@dataclass
class EvalResult:
    task: str
    problems: int
    samples: int
    pass1_greedy: float
    pass1_sampled: float | None
    pass_k: float | None

    def table(self) -> str:
        k = self.samples
        head = ["task", "problems", "pass@1 greedy"]
        row = [self.task, str(self.problems), f"{self.pass1_greedy:.3f}"]
        if self.pass_k is not None:
            head += [f"pass@1 sampled (k={k})", f"pass@{k}"]
            row += [f"{self.pass1_sampled:.3f}", f"{self.pass_k:.3f}"]
        widths = [max(len(a), len(b)) for a, b in zip(head, row, strict=True)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in (head, row))


def task_problems(task: str, n: int) -> tuple[str, list[EvalProblem], Callable]:
    """(task name, held-out problems, reward) for a built-in task name or a jsonl file."""
    if task in TASKS:
        module = importlib.import_module(f"inkling_fp4.rl.tasks.{task}")
        problems = [EvalProblem(p.prompt, p.answer) for p in held_out(module.problems, n, module.LEVELS)]
        return task, problems, module.reward
    path = Path(task)
    problems = [EvalProblem(p.text, p.answer) for p in read_jsonl(path, "--task")]
    return path.name, problems[:n], rewards.numeric


def pass_rates(rewards_PK: list[list[float]]) -> tuple[float, float]:
    """(pass@1, pass@K) of K rewards per problem; partial credit (reward < 1) is not a pass."""
    right = [[r >= 1.0 for r in row] for row in rewards_PK]
    pass1 = sum(sum(row) / len(row) for row in right) / len(right)
    return pass1, sum(any(row) for row in right) / len(right)


def run_eval(
    from_run: Path | None, task: str, samples: int, n_problems: int, overrides: list[str] | None, echo=print
) -> EvalResult:
    if samples < 1:
        raise UserError(f"--samples {samples}: give at least 1")
    if n_problems < 1:
        raise UserError(f"--problems {n_problems}: give at least 1")
    rs = load_run_sampler(from_run, overrides, echo)
    cfg = rs.cfg.sampler
    if samples > 1 and cfg.temperature == 0:
        raise UserError(f"--samples {samples} draws samples: set sampler.temperature > 0 (it is 0, greedy)")
    name, problems, reward = task_problems(task, n_problems)
    prompts = [rs.encode(p.prompt, f"problem {i}") for i, p in enumerate(problems)]
    echo(f"eval: {name}, {len(problems)} problems; {rs.describe()}")
    sampler = rs.sampler

    def scores(completions, k):  # [problem][sample]
        got = [
            reward(problems[i // k].prompt, c.text, problems[i // k].answer)
            for i, c in enumerate(completions)
        ]
        return [got[i * k : (i + 1) * k] for i in range(len(problems))]

    sampled_cfg = sampler.cfg
    try:
        sampler.cfg = dataclasses.replace(sampled_cfg, temperature=0.0)
        greedy, _ = pass_rates(scores(sampler.generate(prompts), 1))
        pass1_sampled = pass_k = None
        if samples > 1:
            sampler.cfg = sampled_cfg
            drawn = scores(sampler.generate([p for p in prompts for _ in range(samples)]), samples)
            pass1_sampled, pass_k = pass_rates(drawn)
    finally:
        sampler.cfg = sampled_cfg
    result = EvalResult(name, len(problems), samples, greedy, pass1_sampled, pass_k)
    echo(result.table())
    echo(sampler.stats.describe())
    summary = result.table().splitlines()[1]
    row = {"step": rs.checkpoint.step, "event": "eval", "message": f"eval {name}: {summary}",
           "task": name, "problems": result.problems, "samples": samples, "pass@1": result.pass1_greedy,
           "sampler_precision": cfg.precision, "checkpoint": str(rs.checkpoint.path)}  # fmt: skip
    if pass_k is not None:
        row.update(
            {"pass@1_sampled": pass1_sampled, f"pass@{samples}": pass_k, "temperature": cfg.temperature}
        )
    if (rs.run_dir / CONFIG_FILE).is_file():  # a run directory (not an imported Nemotron-H one)
        with (rs.run_dir / METRICS_FILE).open("a") as f:
            f.write(json.dumps(row) + "\n")
        echo(f"appended to {rs.run_dir / METRICS_FILE}")
    return result
