"""The metrics logger: one interface, so the training loop never branches on where numbers go.

Every record goes to ``<run_dir>/metrics.jsonl`` (one JSON object per logged step, evaluation or
event), to wandb when enabled (offline unless WANDB_API_KEY is set, so a run never blocks on a
login), and to the console on rank 0. On resume the JSONL is cut back to the checkpoint's step, so
it describes one history. Every line is strict JSON: a non-finite number is written as ``null`` and
the record gains ``"nonfinite": [<the fields that were>]``, since strict readers (jq, JavaScript)
reject ``NaN`` / ``Infinity``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import sys
import uuid
from pathlib import Path

from tqdm import tqdm

METRICS_FILE = "metrics.jsonl"


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def step_line(step: int, total: int, r: dict) -> str:
    """``step   120/200 | loss 3.4512 | lr 3.00e-03 | gnorm 0.412 | tok/s 12,345 | mfu 41.2% | eta 1m23s``"""
    bad = r.get("nonfinite", ())

    def n(key: str, spec: str) -> str:
        return _num(r, key, spec, bad)

    width = len(str(total))
    line = (
        f"step {step:>{width}}/{total} | loss {n('loss', '.4f')} | lr {n('lr', '.2e')} | "
        f"gnorm {n('grad_norm', '.3f')} | tok/s {n('tokens_per_s', ',.0f')} | mfu {n('mfu', '.1%')} | "
        f"eta {format_duration(_float(r.get('eta_s')))} | {r['precision']}"
    )
    if "reward_mean" in r:  # an RL step's rollouts
        line += (
            f" | reward {n('reward_mean', '.3f')} acc {n('accuracy', '.2f')} "
            f"len {n('completion_len_mean', '.0f')}"
            f" | mismatch k3 {n('mismatch_k3', '.2e')} | gen tok/s {n('gen_tokens_per_s', ',.0f')}"
        )
    return line


def _num(r: dict, key: str, spec: str, nonfinite=()) -> str:
    """``r[key]`` formatted; ``nan`` / ``inf`` as such, a null named in ``nonfinite`` as ``nan``;
    missing: ``n/a``."""
    value = r.get(key)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "nan" if key in nonfinite else "n/a"
    value = float(value)
    return format(value, spec) if math.isfinite(value) else str(value)


def _float(value) -> float:
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else math.nan


def sanitize(record: dict) -> dict:
    """A copy of ``record`` that is strict JSON: each non-finite float (at any depth) becomes None,
    and ``"nonfinite"`` lists where they were (``loss``, ``layers[3]``, ``eval.loss``)."""
    found: list[str] = []

    def clean(value, where: str):
        if isinstance(value, bool) or value is None or isinstance(value, (str, int)):
            return value
        if isinstance(value, numbers.Real):  # float, numpy floats
            value = float(value)
            if math.isfinite(value):
                return value
            found.append(where)
            return None
        if isinstance(value, numbers.Integral):  # numpy integers
            return int(value)
        if isinstance(value, dict):
            return {k: clean(v, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return value

    out = clean(record, "")
    if found:
        out["nonfinite"] = found
    return out


def dumps(record: dict) -> str:
    return json.dumps(sanitize(record), allow_nan=False)


def _refuse_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def truncate_metrics(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (resume from the checkpoint at last_step).

    A line that is not a JSON object (cut short by a crash) is dropped; one with bare NaN / Infinity
    is rewritten as strict JSON. The file is replaced atomically, so a crash here leaves the old one."""
    if not path.is_file():
        return
    kept = []
    for raw in path.read_bytes().split(b"\n"):
        try:
            line = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            continue
        if not line:
            continue
        try:
            rec = json.loads(line, parse_constant=_refuse_constant)
        except ValueError:
            try:
                rec = json.loads(line)  # bare NaN / Infinity: kept, as strict JSON
                line = dumps(rec) if isinstance(rec, dict) else line
            except ValueError:
                continue  # a line cut short by a crash, or garbage
        if not isinstance(rec, dict):
            continue
        step = rec.get("step", 0)
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            continue
        if step <= last_step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


class MetricsLogger:
    """JSONL always, wandb when enabled, console and progress bar on rank 0."""

    def __init__(
        self,
        run_dir: Path,
        *,
        run_name: str,
        total_steps: int,
        start_step: int = 0,
        config: dict | None = None,
        wandb: bool = False,
        wandb_project: str = "fp4train",
        progress: bool = True,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.total = total_steps
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._wandb = None
        self._bar = None
        if not enabled:
            return
        if start_step:
            truncate_metrics(self.path, start_step)
        self._file = open(self.path, "a" if start_step else "w")
        if wandb:
            self._wandb = _start_wandb(Path(run_dir), run_name, wandb_project, config or {})
        if progress and sys.stderr.isatty():
            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict) -> None:
        """One JSON line (and a wandb row) for a step or an evaluation."""
        if not self.enabled:
            return
        self._file.write(dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            finite = {k: v for k, v in record.items() if _finite_number(v)}
            self._wandb.log(finite, step=record["step"])

    def log_step(self, record: dict) -> None:
        """A logged training step: JSONL, wandb, the console line and the progress bar."""
        if not self.enabled:
            return
        self.log(record)
        self.info(step_line(record["step"], self.total, record))
        if self._bar is not None:
            self._bar.set_postfix(
                loss=_num(record, "loss", ".3f"),
                tok_s=_num(record, "tokens_per_s", ",.0f"),
                mfu=_num(record, "mfu", ".1%"),
                refresh=False,
            )

    def advance(self, step: int) -> None:
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def event(self, step: int, kind: str, message: str, **fields) -> None:
        """Something that happened (precision switch, monitor trigger, checkpoint, resume)."""
        if not self.enabled:
            return
        self.log({"step": step, "event": kind, "message": message, **fields})
        self.info(message)

    def info(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=sys.stdout)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._bar = self._file = self._wandb = None


def _finite_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _start_wandb(run_dir: Path, name: str, project: str, config: dict):
    import wandb

    id_file = run_dir / "wandb_id.txt"
    run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return wandb.init(
        project=project, name=name, id=run_id, resume="allow", dir=str(run_dir), config=config, mode=mode
    )
