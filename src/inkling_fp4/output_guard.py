"""Where a command may write: never over what it did not write.

Every command that writes (export, tokenizer, generate --out, compare-baseline --out, a stage's
run directory) asks here first, before any work, so a refused command has read its inputs at most.
Refused whatever ``--force`` says, in one line naming the path:

- the current directory, or a folder above it (replacing it would delete the shell's directory);
- an input of the same command (the ``--from`` source, a ``--prompts`` file, a baseline run) or a
  folder that holds one;
- a run directory, a folder that holds one, or one of a run directory's own entries (its
  ``config.yaml``, ``tokenizer.json``, ``checkpoints/`` ...): runs are only ever written by their stage.

An existing target (but an empty folder) is replaced only with ``--force``, and only when the
command recognises it as an earlier output of its own (an export by its marker file, a report by
its report.json, a tokenizer or a completions file by its content): :func:`check_output` returns
the line that says what is replaced.

This module sits at the top of the package beside :mod:`~inkling_fp4.errors` and imports nothing
else of it, so that every layer that writes (data's tokenizer command included) can reach it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from inkling_fp4.errors import UserError

RUN_FILES = ("config.yaml", "amendments.jsonl", "tokenizer.json", "metrics.jsonl", "checkpoints", "report",
             "profile", "wandb", "wandb_id.txt", ".lock", "chat_template.jinja")  # fmt: skip
"""What a run directory may hold (runs/directory.py writes them); a non-empty directory holding none
of these is not a run."""

NotOwn = Callable[[Path], "str | None"]
"""Why an existing path is not an earlier output of the command (None: it is one)."""


def is_run_dir(path: Path) -> bool:
    """A directory a stage has started in: it holds the recorded config or checkpoints."""
    return (path / "config.yaml").is_file() or (path / "checkpoints").is_dir()


def check_location(
    path: str | Path, option: str, inputs: Iterable[tuple[str, str | Path | None]] = (), *, run: bool = False
) -> None:
    """Refuse ``path`` when it is the current directory, an input (``(option, path)`` pairs; None and
    paths that do not exist are skipped), a run directory's entry or holds a run directory.

    ``run``: the path is a stage's own run directory, which may be a run (its own) but not hold one."""
    given, target = Path(path), Path(path).resolve()
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        what = "the current directory" if target == here else f"a folder above the current directory ({here})"
        raise UserError(f"{option} {given} is {what}; pass a new path for the output")
    for name, source in inputs:
        if source is None or not Path(source).exists():
            continue
        src = Path(source).resolve()
        if target == src or target in src.parents:
            what = "is" if target == src else "holds"
            raise UserError(
                f"{option} {given} {what} {name} {source}, an input of this command; pass a new path for the "
                "output"
            )
    for above in target.parents:
        if is_run_dir(above):
            entry = target.relative_to(above).parts[0]
            if entry in RUN_FILES:
                raise UserError(
                    f"{option} {given} is part of the run directory {_shown(above)} (its {entry}); only the "
                    "run's own stage writes there: pass a path outside it"
                )
            break
    if not target.is_dir():
        return
    if not run and is_run_dir(target):
        raise UserError(
            f"{option} {given} is a run directory; fp4train never replaces a run: pass a new path for the "
            "output"
        )
    held = _held_run(target)
    if held is not None:
        raise UserError(
            f"{option} {given} holds the run directory {_shown(held)}; fp4train never replaces a run: pass a "
            "new path for the output"
        )


def check_output(
    path: str | Path,
    option: str,
    command: str,
    *,
    kind: str,
    force: bool,
    not_own: NotOwn,
    inputs: Iterable[tuple[str, str | Path | None]] = (),
) -> str | None:
    """Refuse ``path`` as the ``kind`` ("file" or "directory") output of ``fp4train command`` unless it
    is new, or ``force`` is given and ``not_own`` recognises it; returns a line saying what will be
    replaced (None: nothing is)."""
    given = Path(path)
    check_location(given, option, inputs)
    if not given.exists() and not given.is_symlink():
        for above in given.absolute().parents:
            if above.exists():
                if not above.is_dir():
                    raise UserError(
                        f"{option} {given}: {_shown(above)} is a file, not a folder; pass another path"
                    )
                break
        return None
    if kind == "directory" and given.is_dir() and not any(given.iterdir()):
        return None  # an empty folder made for the output: nothing to replace
    if kind == "file" and given.is_dir():
        raise UserError(f"{option} {given} is a directory; pass a file path for the {command} output")
    if kind == "directory" and not given.is_dir():
        raise UserError(f"{option} {given} is a file; pass a directory path for the {command} output")
    if not force:
        raise UserError(
            f"{option} {given} exists; pass a new path, or --force to replace an earlier fp4train {command} "
            "output there"
        )
    why = not_own(given)
    if why is not None:
        raise UserError(
            f"{option} {given} exists and is not an earlier fp4train {command} output ({why}); --force "
            "replaces only those: move it or pass a new path"
        )
    return f"replacing {given}, an earlier fp4train {command} output"


def _held_run(root: Path) -> Path | None:
    """The first run directory below ``root`` (not ``root`` itself), or None."""
    for here, dirs, _ in os.walk(root):
        for name in sorted(dirs):
            if is_run_dir(Path(here) / name):
                return Path(here) / name
    return None


def _shown(path: Path) -> Path:
    """``path`` relative to the current directory where it lies below it (as the user wrote paths)."""
    try:
        return path.relative_to(Path.cwd().resolve())
    except ValueError:
        return path
