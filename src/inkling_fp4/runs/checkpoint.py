"""Checkpoints: directories written atomically, verified on load, the newest good one found on resume.

A checkpoint is ``checkpoints/step_<N>/`` (the state after N optimizer steps) with

    model.safetensors       parameters and buffers, by name (FP32 master weights)
    optimizer.safetensors   optimizer state flattened to "<param name>.<key>" tensors
    state.json              step, data position, RNG states, schedule / precision / monitor state,
                            and the sha256 of the two safetensors files; written LAST

Nothing half-written is ever left under a ``step_<N>`` name: a checkpoint is written into a hidden
temporary directory renamed into place at the end, and one is deleted (pruned, or replaced by a newer
write of its step) only after an atomic rename to a hidden temporary. Free space is checked first
(the files are serialized in memory, so their size is known exactly).

On load the checksums and state.json's shape are checked; a bad checkpoint is reported with its
reason and the previous good one is used (:func:`latest_good`). Tensors inside state.json are stored
as base64 bytes with their dtype and shape, so the JSON round-trips exactly.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from inkling_fp4.errors import DISK_FULL_ERRNOS, DiskFullError, UserError
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
TMP_PREFIX = ".tmp_"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# Room kept free beyond the files themselves: directory entries and filesystem metadata, and the
# metrics and log lines the run goes on writing.
_SPACE_MARGIN = 1 << 20


class CheckpointError(UserError):
    """A checkpoint directory that is incomplete, truncated, altered, unreadable or malformed."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    state: dict


# ----------------------------------------------------------------------------------------------
# JSON with tensors


def to_json(obj):
    """Plain-JSON form of nested dicts / lists / tuples / tensors / numpy arrays (exact)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {"__tensor__": base64.b64encode(raw).decode(), "dtype": str(t.dtype), "shape": list(t.shape)}
    if isinstance(obj, np.ndarray):
        return {
            "__ndarray__": base64.b64encode(obj.tobytes()).decode(),
            "dtype": str(obj.dtype),
            "shape": list(obj.shape),
        }
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_json(v) for v in obj]}
    if isinstance(obj, list):
        return [to_json(v) for v in obj]
    return obj


def from_json(obj):
    """Inverse of :func:`to_json`."""
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            dtype = getattr(torch, obj["dtype"].removeprefix("torch."))
            raw = bytearray(base64.b64decode(obj["__tensor__"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(obj["shape"]).clone()
        if "__ndarray__" in obj:
            arr = np.frombuffer(base64.b64decode(obj["__ndarray__"]), dtype=obj["dtype"])
            return arr.reshape(obj["shape"]).copy()
        if "__tuple__" in obj:
            return tuple(from_json(v) for v in obj["__tuple__"])
        return {k: from_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------------------------
# write


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete-looking ``step_<N>`` directories, oldest first (not yet verified)."""
    root = Path(run_dir) / "checkpoints"
    try:
        if not root.is_dir():
            return []
        found = [
            (int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()
        ]
    except OSError as e:
        raise CheckpointError(f"cannot list {root} ({e.strerror or e}); check its permissions") from None
    return sorted(found)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor],
    state: dict,
    keep_last: int,
) -> Path:
    """Write ``checkpoints/step_<step>`` atomically, then drop all but the newest ``keep_last``.

    Raises :class:`DiskFullError` when the disk cannot take it, before or during the write; nothing of
    this checkpoint then remains on disk (the caller still holds the state in memory)."""
    root = Path(run_dir) / "checkpoints"
    final = root / f"step_{step}"
    tmp = root / f"{TMP_PREFIX}step_{step}_{os.getpid()}"
    blobs = {
        MODEL_FILE: save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.items()}),
        OPTIMIZER_FILE: save_safetensors({k: v.detach().cpu().contiguous() for k, v in optimizer.items()}),
    }
    record = {"step": step, "sha256": {name: _sha256(data) for name, data in blobs.items()}, **to_json(state)}
    blobs[STATE_FILE] = json.dumps(record).encode()  # last: its presence marks completion
    try:
        root.mkdir(parents=True, exist_ok=True)
        _check_free_space(root, final, sum(len(data) for data in blobs.values()))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, data in blobs.items():
            _write_synced(tmp / name, data)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            raise _disk_full(final, sum(len(d) for d in blobs.values()), root, e.strerror) from None
        raise
    if final.exists():
        _remove_dir(final)  # a step written again, by a run resumed from before it
    os.rename(tmp, final)
    for _, old in checkpoint_dirs(run_dir)[:-keep_last]:
        _remove_dir(old)
    return final


def clean_stale_temporaries(run_dir: Path) -> list[Path]:
    """Remove (and return) the hidden ``checkpoints/.tmp_*`` entries a kill or a full disk left behind.
    Call it only under the run directory's lock: then no process is writing one, whatever pid it names."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        if not p.name.startswith(TMP_PREFIX):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p)
    return removed


def _remove_dir(path: Path) -> None:
    """Delete a checkpoint directory without ever exposing it half-deleted under its own name."""
    hidden = path.with_name(f"{TMP_PREFIX}prune_{path.name}")
    shutil.rmtree(hidden, ignore_errors=True)
    os.rename(path, hidden)  # atomic: from here on it is a temporary, whatever happens to the delete
    shutil.rmtree(hidden, ignore_errors=True)


def _check_free_space(root: Path, final: Path, nbytes: int) -> None:
    if shutil.disk_usage(root).free < nbytes + _SPACE_MARGIN:
        raise _disk_full(final, nbytes, root)


def _disk_full(final: Path, nbytes: int, root: Path, failure: str | None = None) -> DiskFullError:
    where = next(p for p in (root, *root.parents) if p.is_dir())  # root itself may not be made yet
    free = shutil.disk_usage(where).free
    failed = f"; the write failed: {failure}" if failure else ""
    return DiskFullError(
        f"no room for checkpoint {final.name} in {root}: it needs {format_bytes(nbytes + _SPACE_MARGIN)} "
        f"(its files and a {format_bytes(_SPACE_MARGIN)} margin) and {format_bytes(free)} is free{failed}; "
        "free some space on that disk (or lower checkpoint.keep_last) and continue with --resume"
    )


def format_bytes(n: int) -> str:
    """``1536`` -> ``1.5 KiB``: sizes in messages."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------------------------
# read


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify one checkpoint directory; CheckpointError says what is wrong with it."""
    path = Path(path)
    try:
        return _load(path)
    except OSError as e:  # PermissionError and the like, on the directory or one of its files
        what = Path(e.filename).name if e.filename else "it"
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror or e})") from None


def _load(path: Path) -> Checkpoint:
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"{path}: no {STATE_FILE} (incomplete checkpoint)")
    try:
        record = json.loads((path / STATE_FILE).read_bytes())
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError alike
        raise CheckpointError(f"{path}: {STATE_FILE} is not valid JSON ({e})") from None
    problem = _state_problem(record, path)
    if problem:
        raise CheckpointError(f"{path}: {STATE_FILE} {problem}")
    sums = record.pop("sha256")
    step = record.pop("step")
    tensors = {}
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        data = (path / name).read_bytes()
        if _sha256(data) != sums[name]:
            raise CheckpointError(f"{path}: {name} fails its sha256 check (truncated or altered)")
        try:
            loaded = load_safetensors(data)
        except Exception as e:  # safetensors' Rust errors derive from Exception only
            raise CheckpointError(
                f"{path}: {name} is not a valid safetensors file ({_first_line(e)})"
            ) from None
        tensors[name] = dict(sorted(loaded.items()))  # NOTE: its order varies by process
    try:
        state = from_json(record)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        raise CheckpointError(f"{path}: {STATE_FILE} holds a malformed tensor ({_first_line(e)})") from None
    return Checkpoint(path, step, tensors[MODEL_FILE], tensors[OPTIMIZER_FILE], state)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


# What the training loop reads from state.json: one entry per process for the per-rank pieces.
_PER_PROCESS = ("data", "rng", "precision")


def _state_problem(record, path: Path) -> str | None:
    """Why ``record`` is not the state.json the training loop writes, or None when it is."""
    if not isinstance(record, dict):
        return f"is a JSON {type(record).__name__}, not an object"
    missing = [k for k in ("step", "sha256", *_PER_PROCESS, "monitor") if k not in record]
    if missing:
        return f"lacks {', '.join(missing)}"
    step = record["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"has step {step!r}, not a step count"
    m = _STEP_DIR.match(path.name)
    if m and int(m.group(1)) != step:
        return f"says step {step} in a directory of step {m.group(1)}"
    sums = record["sha256"]
    if not isinstance(sums, dict) or not all(
        isinstance(sums.get(n), str) for n in (MODEL_FILE, OPTIMIZER_FILE)
    ):
        return f"has no sha256 of {MODEL_FILE} and {OPTIMIZER_FILE}"
    for key in _PER_PROCESS:
        value = record[key]
        if not isinstance(value, list) or not value or not all(isinstance(v, dict) for v in value):
            return f"has '{key}' of the wrong shape (a list of one object per process expected)"
    counts = {key: len(record[key]) for key in _PER_PROCESS}
    if len(set(counts.values())) > 1:
        return f"has per-process entries of different lengths ({counts})"
    if not isinstance(record["monitor"], dict):
        return "has 'monitor' of the wrong shape (an object expected)"
    return None


def check_processes(path: Path, state: dict, processes: int) -> None:
    """Refuse to resume ``path`` on another number of processes than wrote it: its state holds each
    process's data position and random state (``state["data"]`` has one entry per process)."""
    written = len(state["data"])
    if written != processes:
        how = "without torchrun" if written == 1 else f"under torchrun --nproc_per_node {written}"
        raise UserError(
            f"{path} was written by {written} process(es) and this run has {processes}; resume it {how}, "
            "or start a new run directory"
        )


def latest_good(run_dir: Path, report: Callable[[str], None] = print) -> Checkpoint | None:
    """The newest checkpoint of ``run_dir`` that verifies; each bad one on the way is reported."""
    for _, path in reversed(checkpoint_dirs(run_dir)):
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            report(f"checkpoint: skipping bad checkpoint: {e}")
            continue
        return ckpt
    return None


def checkpoint_report(run_dir: Path) -> list[tuple[Path, str]]:
    """Every checkpoint of ``run_dir``, newest first, with "ok" or what is wrong with it (loaded in full)."""
    verdicts = []
    for _, path in reversed(checkpoint_dirs(run_dir)):
        try:
            load_checkpoint(path)
        except CheckpointError as e:
            verdicts.append((path, str(e).removeprefix(f"{path}: ")))
            continue
        verdicts.append((path, "ok"))
    return verdicts


# ----------------------------------------------------------------------------------------------
# what a run puts in: model tensors and RNG states


def model_tensors(model: nn.Module):
    """Parameters and persistent buffers, each once (tied weights appear under their first name)."""
    yield from model.named_parameters()
    persistent = {k for k in model.state_dict()}
    yield from ((k, b) for k, b in model.named_buffers() if k in persistent)


def load_model_tensors(model: nn.Module, tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Copy a checkpoint's tensors into ``model`` in place; the names must match exactly."""
    names = [k for k, _ in model_tensors(model)]
    missing = sorted(set(names) - set(tensors))
    extra = sorted(set(tensors) - set(names))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint does not match the model (missing {missing[:3]}, unexpected {extra[:3]}); "
            "resume with the config the run was started with"
        )
    with torch.no_grad():
        for name, t in model_tensors(model):
            t.copy_(tensors[name].to(device))


def build_model(
    model_cfg: ModelConfig, device: str | torch.device, tensors: dict[str, torch.Tensor] | None = None,
    source: str | Path | None = None,
) -> HybridLM:  # fmt: skip
    """A HybridLM built on ``device`` (its initial weights drawn from the global generator, as every
    build does) with ``tensors`` copied in unless None. ``source``: what ``--from`` named; a tensor
    mismatch is then a UserError naming it, else the CheckpointError."""
    device = torch.device(device)
    with torch.device(device):
        model = HybridLM(model_cfg)
    if tensors is None:
        return model
    try:
        load_model_tensors(model, tensors, device)
    except CheckpointError as e:
        if source is None:
            raise
        raise UserError(f"--from {source}: {e}") from None
    return model


def rng_state(device: torch.device) -> dict:
    """Every global RNG a step may draw from: torch (CPU, and ``device`` when CUDA), python, numpy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
