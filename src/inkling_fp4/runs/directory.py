"""Starting or resuming a run directory: validate everything first, write second.

The run directory is the contract between commands (``config.yaml``, ``metrics.jsonl``,
``tokenizer.json``, ``checkpoints/``): a refused command must leave it byte for byte as it was, and
no sequence of failures may leave it in a state that only ``rm -rf`` fixes. Hence two phases:
:func:`plan_start` reads only (the recorded config, the newest checkpoint that verifies, what this
command changes), and every refusal happens there or in the stage's own checks after it; then
:meth:`RunStart.commit` writes the lock, the config or an amendment, and the tokenizer.

A resume may change only the ``AMENDABLE`` keys, recorded as dated lines in ``amendments.jsonl``
(``config.yaml`` keeps what the run started with); anything else would make the resumed run differ
from an uninterrupted one and is refused, naming the field. A directory with a config but no
complete checkpoint is a fresh start, said in the log.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from inkling_fp4.config import RunConfig, from_dict, save_config, to_dict
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.output_guard import RUN_FILES, check_location
from inkling_fp4.runs.checkpoint import Checkpoint, checkpoint_dirs, clean_stale_temporaries, latest_good
from inkling_fp4.runs.lock import RunLock
from inkling_fp4.runs.schedule import WSDSchedule

CONFIG_FILE = "config.yaml"
AMENDMENTS_FILE = "amendments.jsonl"
TOKENIZER_FILE = "tokenizer.json"

AMENDABLE = (
    "name",
    "train.steps",
    "train.stop_after",
    "train.log_every",
    "train.checkpoint_every",
    "eval.every",
    "eval.in_training_precision",
    "checkpoint.keep_last",
    "log.wandb",
    "log.wandb_project",
    "log.progress",
    "log.peak_flops",
    "data.cache_dir",
    "data.verify_checksums",
)
"""Keys a resume may change: they change how long the run goes and what it reports, not the numbers
of any step it trains."""


# ----------------------------------------------------------------------------------------------
# the recorded config


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def read_amendments(run_dir: Path) -> list[dict]:
    """The run's amendments, oldest first; a line cut short by a crash is ignored."""
    path = Path(run_dir) / AMENDMENTS_FILE
    if not path.is_file():
        return []
    found = []
    for raw in path.read_bytes().splitlines():
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and isinstance(record.get("changes"), dict):
            found.append(record)
    return found


def recorded_config_data(run_dir: Path) -> dict | None:
    """``config.yaml`` with every amendment applied, as plain data; None when there is no config."""
    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
        raise UserError(f"{path} is not readable as YAML ({str(e).splitlines()[0]}); restore it or "
                        "start a new --run-dir") from None  # fmt: skip
    if not isinstance(data, dict):
        raise UserError(f"{path} is not a run config (expected a mapping of sections); restore it or "
                        "start a new --run-dir")  # fmt: skip
    for record in read_amendments(run_dir):
        for key, (_, value) in record["changes"].items():
            *sections, leaf = key.split(".")
            node = data
            for part in sections:
                node = node.setdefault(part, {})
            node[leaf] = value
    return data


def recorded_config(run_dir: Path) -> RunConfig | None:
    data = recorded_config_data(run_dir)
    if data is None:
        return None
    try:
        return from_dict(RunConfig, data)
    except ConfigError as e:
        raise UserError(
            f"{Path(run_dir) / CONFIG_FILE} is not a config this version can read ({e})"
        ) from None


# ----------------------------------------------------------------------------------------------
# the plan


@dataclass
class RunStart:
    """What a command will do to its run directory, decided before anything is written."""

    run_dir: Path
    cfg: RunConfig
    checkpoint: Checkpoint | None
    fresh: bool
    """A new run (config.yaml written anew), as opposed to the continuation of ``checkpoint``."""
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    """Amended keys: (recorded value, new value)."""
    notes: list[str] = field(default_factory=list)
    """What the log should say about the start (fallbacks, fresh starts, schedule changes)."""
    lock: Any = None

    def commit(self, tokenizer=None, is_main: bool = True, extra_files: dict[str, str] | None = None) -> None:
        """Write the start: lock, config or amendment, tokenizer, other files; remove stale temporaries."""
        if not is_main:
            return
        run_dir = self.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.lock is None:
            self.lock = _acquire_lock(run_dir, self.notes)
        removed = _clean_temporaries(run_dir)
        if removed:
            names = ", ".join(p.name for p in removed)
            self.notes.append(f"removed stale temporary checkpoint directories: {names}")
        if self.fresh:
            for _, path in checkpoint_dirs(run_dir):  # incomplete leftovers: none verifies
                shutil.rmtree(path, ignore_errors=True)
            (run_dir / AMENDMENTS_FILE).unlink(missing_ok=True)
            save_config(self.cfg, run_dir / CONFIG_FILE)
        elif not (run_dir / CONFIG_FILE).is_file():  # checkpoints copied in without a config
            save_config(self.cfg, run_dir / CONFIG_FILE)
        elif self.changes:
            record = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "from_step": self.checkpoint.step if self.checkpoint else 0,
                "changes": {k: [a, b] for k, (a, b) in self.changes.items()},
            }
            with open(run_dir / AMENDMENTS_FILE, "a") as f:
                f.write(json.dumps(record) + "\n")
        if tokenizer is not None and (self.fresh or not (run_dir / TOKENIZER_FILE).is_file()):
            tokenizer.save(run_dir / TOKENIZER_FILE)
        for name, text in (extra_files or {}).items():
            (run_dir / name).write_text(text)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def plan_start(
    cfg: RunConfig, run_dir: Path, resume: bool, is_main: bool = True, baseline: Path | None = None
) -> RunStart:
    """Decide how ``cfg`` starts in ``run_dir``; reads only, but takes the lock of an existing directory
    so that no other process changes what it read. ``run_dir`` may not be the current directory, hold
    another run or an input of the run (:mod:`~inkling_fp4.output_guard`)."""
    run_dir = Path(run_dir)
    check_location(run_dir, "--run-dir", run_inputs(cfg, baseline), run=True)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file, not a directory; pass a directory path")
    exists = run_dir.is_dir() and any(run_dir.iterdir())
    if exists and not any((run_dir / name).exists() for name in RUN_FILES):
        raise UserError(f"{run_dir} is not empty and holds no run; pass a new or empty --run-dir")
    notes: list[str] = []
    lock = _acquire_lock(run_dir, notes) if (exists and is_main) else None
    try:
        start = _plan(cfg, run_dir, resume, exists)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    start.lock, start.notes = lock, notes + start.notes
    return start


def run_inputs(cfg: RunConfig, baseline: Path | None = None) -> list[tuple[str, str | Path | None]]:
    """What a run reads besides its own directory, by the option that names it."""
    return [("--from", cfg.init_from), ("--baseline", baseline), ("data.source", cfg.data.source),
            ("data.tokenizer", cfg.data.tokenizer), ("rl.task", cfg.rl.task)]  # fmt: skip


def _plan(cfg: RunConfig, run_dir: Path, resume: bool, exists: bool) -> RunStart:
    complete = [(s, p) for s, p in checkpoint_dirs(run_dir) if (p / "state.json").is_file()]
    if not resume:
        if complete:
            raise UserError(
                f"run directory {run_dir} already holds a run (checkpoints up to step {complete[-1][0]}); "
                "pass --resume to continue it or --run-dir to start a new one elsewhere"
            )
        notes = [f"{run_dir} holds no complete checkpoint: starting the run afresh"] if exists else []
        return RunStart(run_dir, cfg, None, fresh=True, notes=notes)
    if not complete:
        where = f"{run_dir} holds no complete checkpoint" if exists else f"{run_dir} does not exist yet"
        return RunStart(run_dir, cfg, None, fresh=True, notes=[f"--resume: {where}: starting a new run"])
    reasons: list[str] = []
    ckpt = latest_good(run_dir, report=reasons.append)
    if ckpt is None:
        raise UserError(
            f"--resume: no checkpoint of {run_dir} verifies ({'; '.join(reasons)}); move the bad ones "
            "away to start afresh, or start a new --run-dir"
        )
    recorded = recorded_config(run_dir)
    changes = {}
    notes = list(reasons)
    if recorded is not None:
        changes = _allowed_changes(recorded, cfg, run_dir)
        notes += _schedule_notes(recorded, cfg, ckpt.step)
        if changes:
            notes.append("amended: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
    if ckpt.step > cfg.train.steps:
        raise ConfigError(
            f"train.steps={cfg.train.steps} is below the checkpoint's step {ckpt.step}; the run is past it"
        )
    return RunStart(run_dir, cfg, ckpt, fresh=False, changes=changes, notes=notes)


def _allowed_changes(recorded: RunConfig, cfg: RunConfig, run_dir: Path) -> dict[str, tuple[Any, Any]]:
    old, new = flatten(to_dict(recorded)), flatten(to_dict(cfg))
    changes = {k: (old.get(k), v) for k, v in new.items() if not _same(old.get(k), v)}
    refused = [k for k in changes if k not in AMENDABLE]
    if refused:
        k = refused[0]
        a, b = changes[k]
        raise ConfigError(
            f"--resume cannot change {k} ({a!r} -> {b!r}): the resumed run would differ from an "
            f"uninterrupted one; resume without it, or start a new --run-dir (a resume may change "
            f"{', '.join(AMENDABLE)})"
        )
    return changes


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _schedule_notes(recorded: RunConfig, cfg: RunConfig, step: int) -> list[str]:
    """What a new ``train.steps`` does to the schedule of a run that is at ``step``."""
    if recorded.train.steps == cfg.train.steps:
        return []
    t = recorded.train

    def wsd(total: int) -> WSDSchedule:
        return WSDSchedule(total, t.warmup_steps, t.decay_fraction, t.decay_shape, t.min_lr_ratio)

    old, new = wsd(recorded.train.steps), wsd(cfg.train.steps)
    nxt = step + 1
    line = (
        f"train.steps {recorded.train.steps} -> {cfg.train.steps}: the schedule is the new run length's "
        f"(decay from step {new.first_decay_step}); step {nxt} trains at {new.lr_ratio(nxt):.3g} x optim.lr "
        f"(the old schedule: {old.lr_ratio(min(nxt, old.total)):.3g})"
    )
    if step >= old.first_decay_step:
        line += f"; the run had been decaying since step {old.first_decay_step}, so its LR rises again"
    return [line]


def _acquire_lock(run_dir: Path, notes: list[str]):
    lock = RunLock(run_dir)
    took_over = lock.acquire()
    if took_over:
        notes.append(took_over)
    return lock


def _clean_temporaries(run_dir: Path) -> list[Path]:
    return clean_stale_temporaries(run_dir)
