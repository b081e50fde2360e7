"""Checkpoints: directories written atomically, verified on load, the newest good one found on resume.

A checkpoint is ``checkpoints/step_<N>/`` (the state after N optimizer steps) with

    model.safetensors       parameters and buffers, by name (FP32 master weights)
    optimizer.safetensors   optimizer state flattened to "<param name>.<key>" tensors
    state.json              step, data position, RNG states, schedule / precision / monitor state,
                            and the sha256 of the two safetensors files; written LAST

Everything is written into a hidden temporary directory that is renamed into place at the end, so a
crash leaves either the old set of checkpoints or the new one, never a half-written ``step_<N>``.
On load the checksums are recomputed: a truncated or altered file is reported and the previous good
checkpoint is used instead (:func:`latest_good`). Tensors inside state.json (RNG states, generator
states) are stored as base64 bytes with their dtype and shape, so the JSON round-trips exactly.
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

from inkling_fp4.errors import UserError

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError):
    """A checkpoint directory that is incomplete, truncated or altered."""


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
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(found)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor],
    state: dict,
    keep_last: int,
) -> Path:
    """Write ``checkpoints/step_<step>`` atomically, then drop all but the newest ``keep_last``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp_step_{step}_{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    blobs = {
        MODEL_FILE: save_safetensors({k: v.detach().cpu().contiguous() for k, v in model.items()}),
        OPTIMIZER_FILE: save_safetensors({k: v.detach().cpu().contiguous() for k, v in optimizer.items()}),
    }
    for name, data in blobs.items():
        _write_synced(tmp / name, data)
    record = {"step": step, "sha256": {name: _sha256(data) for name, data in blobs.items()}, **to_json(state)}
    _write_synced(tmp / STATE_FILE, json.dumps(record).encode())  # last: its presence marks completion
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    for _, old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


# ----------------------------------------------------------------------------------------------
# read


def load_checkpoint(path: Path) -> Checkpoint:
    """Read and verify one checkpoint directory; CheckpointError says what is wrong with it."""
    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise CheckpointError(f"{path}: no {STATE_FILE} (incomplete checkpoint)")
    try:
        record = json.loads(state_file.read_text())
        sums = record.pop("sha256")
        step = int(record.pop("step"))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: {STATE_FILE} is unreadable ({e})") from None
    tensors = {}
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        data = f.read_bytes()
        if _sha256(data) != sums.get(name):
            raise CheckpointError(f"{path}: {name} fails its sha256 check (truncated or altered)")
        tensors[name] = dict(sorted(load_safetensors(data).items()))  # NOTE: its order varies by process
    return Checkpoint(path, step, tensors[MODEL_FILE], tensors[OPTIMIZER_FILE], from_json(record))


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
