"""Checkpoints: exact round trip, atomic layout, keep-last-K, corrupt ones detected and skipped, a full
disk or a kill mid-prune never leaves a half-written step directory."""

import errno
import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from inkling_fp4.config.trainer import OptimConfig
from inkling_fp4.errors import UserError
from inkling_fp4.runs import checkpoint as ckpt_mod
from inkling_fp4.runs.checkpoint import (
    CheckpointError,
    DiskFullError,
    check_processes,
    checkpoint_dirs,
    checkpoint_report,
    clean_stale_temporaries,
    from_json,
    latest_good,
    load_checkpoint,
    save_checkpoint,
    to_json,
)
from inkling_fp4.trainer.optimizer import build_optimizer, load_optimizer_tensors, optimizer_tensors


def _state(step):
    """The shape the training loop writes: one data / rng / precision entry per process."""
    return {
        "data": [{"position": step * 7, "order": torch.randperm(5)}],
        "rng": [
            {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        ],
        "precision": [{"recipe": "nvfp4"}],
        "monitor": {"losses": [1.0, 2.0]},
    }


def _save(run_dir, step, keep=10, size=(4, 8)):
    model = {"w": torch.randn(*size), "b": torch.randn(8, dtype=torch.bfloat16)}
    opt = {"w.exp_avg": torch.randn(*size), "w.step": torch.tensor(float(step))}
    return save_checkpoint(run_dir, step, model, opt, _state(step), keep_last=keep), model, opt


def test_round_trip_is_exact(tmp_path):
    path, model, opt = _save(tmp_path, 3)
    assert path == tmp_path / "checkpoints" / "step_3"
    files = sorted(p.name for p in path.iterdir())
    assert files == ["model.safetensors", "optimizer.safetensors", "state.json"]
    ck = load_checkpoint(path)
    assert ck.step == 3
    for k in model:
        assert torch.equal(ck.model[k], model[k]) and ck.model[k].dtype == model[k].dtype
    assert torch.equal(ck.optimizer["w.step"], opt["w.step"])
    assert ck.state["data"][0]["position"] == 21
    assert torch.equal(ck.state["rng"][0]["torch"], torch.get_rng_state())
    random.setstate(ck.state["rng"][0]["python"])  # the restored states are usable as they are
    np.random.set_state(ck.state["rng"][0]["numpy"])
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


def test_json_tensor_round_trip_odd_dtypes():
    obj = {"a": torch.tensor(2.5), "b": torch.zeros(0, 3), "c": (1, [torch.tensor([True, False])]), "d": None}
    back = from_json(json.loads(json.dumps(to_json(obj))))
    assert back["a"].item() == 2.5 and back["b"].shape == (0, 3)
    assert back["c"][0] == 1 and back["c"][1][0].tolist() == [True, False] and back["d"] is None


def test_keep_last(tmp_path):
    for s in (1, 2, 3, 4, 5):
        _save(tmp_path, s, keep=2)
    assert [s for s, _ in checkpoint_dirs(tmp_path)] == [4, 5]


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_state", "bad_json", "missing"])
def test_bad_checkpoint_is_detected_and_previous_used(tmp_path, damage):
    _save(tmp_path, 10)
    path, _, _ = _save(tmp_path, 20)
    f = path / "model.safetensors"
    if damage == "truncate":
        f.write_bytes(f.read_bytes()[:-17])
    elif damage == "flip":
        data = bytearray(f.read_bytes())
        data[random.randrange(len(data))] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "no_state":
        (path / "state.json").unlink()  # an interrupted write never gets this far
    elif damage == "bad_json":
        (path / "state.json").write_text('{"step": 20, "sha')
    else:
        (path / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match="step_20"):
        load_checkpoint(path)
    reports = []
    ck = latest_good(tmp_path, report=reports.append)
    assert ck is not None and ck.step == 10
    assert len(reports) == 1 and "step_20" in reports[0]


def test_no_checkpoint(tmp_path):
    assert latest_good(tmp_path) is None


def test_optimizer_state_round_trip_continues_identically():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = build_optimizer(model, OptimConfig(lr=1e-2))
    x = torch.randn(16, 8)

    def step(m, o):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()

    for _ in range(3):
        step(model, opt)
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = optimizer_tensors(opt, model)
    assert {"0.weight.exp_avg", "0.weight.exp_avg_sq", "0.weight.step"} <= set(saved_opt)
    twin = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    twin.load_state_dict(saved_model)
    twin_opt = build_optimizer(twin, OptimConfig(lr=1e-2))
    load_optimizer_tensors(twin_opt, twin, saved_opt)
    step(model, opt)
    step(twin, twin_opt)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_weight_decay_groups():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.lin = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)
            self.A_log = nn.Parameter(torch.zeros(2, 2))
            self.A_log._no_weight_decay = True

    m = M()
    opt = build_optimizer(m, OptimConfig(weight_decay=0.1))
    decayed = {id(p) for p in opt.param_groups[0]["params"]}
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0.0
    assert id(m.embed.weight) in decayed and id(m.lin.weight) in decayed
    assert not {id(m.lin.bias), id(m.norm.weight), id(m.A_log)} & decayed
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)


def test_check_processes_names_the_process_count_to_resume_with(tmp_path):
    check_processes(tmp_path, {"data": [{}, {}]}, 2)  # the same count: resumes
    with pytest.raises(UserError, match=r"written by 2 process\(es\) and this run has 1.*--nproc_per_node 2"):
        check_processes(tmp_path, {"data": [{}, {}]}, 1)
    with pytest.raises(UserError, match=r"written by 1 process\(es\) and this run has 4.*without torchrun"):
        check_processes(tmp_path, {"data": [{}]}, 4)


# ----------------------------------------------------------------------------------------------
# malformed, unreadable and unparsable checkpoints


def _rewrite_state(path, change):
    record = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps(change(record)))


WRONG_SHAPES = {
    "a list": (lambda r: [r], "JSON list"),
    "a string": (lambda r: "step 20", "JSON str"),
    "no step": (lambda r: {k: v for k, v in r.items() if k != "step"}, "lacks step"),
    "no sha256": (lambda r: {k: v for k, v in r.items() if k != "sha256"}, "lacks sha256"),
    "no data": (lambda r: {k: v for k, v in r.items() if k != "data"}, "lacks data"),
    "no rng": (lambda r: {k: v for k, v in r.items() if k != "rng"}, "lacks rng"),
    "no precision": (lambda r: {k: v for k, v in r.items() if k != "precision"}, "lacks precision"),
    "no monitor": (lambda r: {k: v for k, v in r.items() if k != "monitor"}, "lacks monitor"),
    "step a string": (lambda r: {**r, "step": "20"}, "not a step count"),
    "step of another dir": (lambda r: {**r, "step": 19}, "directory of step 20"),
    "sha256 a list": (lambda r: {**r, "sha256": []}, "no sha256"),
    "data a dict": (lambda r: {**r, "data": r["data"][0]}, "'data' of the wrong shape"),
    "data of strings": (lambda r: {**r, "data": ["x"]}, "'data' of the wrong shape"),
    "rng per process mismatch": (lambda r: {**r, "rng": r["rng"] * 2}, "different lengths"),
    "monitor a list": (lambda r: {**r, "monitor": []}, "'monitor' of the wrong shape"),
    "bad tensor": (
        lambda r: {**r, "monitor": {"t": {"__tensor__": "@@", "dtype": "x", "shape": [1]}}},
        "tensor",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_SHAPES))
def test_state_of_the_wrong_shape_is_a_checkpoint_error(tmp_path, case):
    change, reason = WRONG_SHAPES[case]
    _save(tmp_path, 10)
    path, _, _ = _save(tmp_path, 20)
    _rewrite_state(path, change)
    with pytest.raises(CheckpointError, match="step_20") as err:
        load_checkpoint(path)
    assert reason in str(err.value) and "\n" not in str(err.value)
    reports = []
    assert latest_good(tmp_path, report=reports.append).step == 10
    assert len(reports) == 1 and reason in reports[0]


def test_unreadable_file_is_a_checkpoint_error(tmp_path, monkeypatch):
    _save(tmp_path, 10)
    path, _, _ = _save(tmp_path, 20)
    real = Path.read_bytes

    def read_bytes(self):  # root reads a chmod 000 file anyway: refuse like a user without the right
        if self.parent == path and self.name == "model.safetensors":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(CheckpointError, match="step_20: cannot read model.safetensors .Permission denied"):
        load_checkpoint(path)
    assert latest_good(tmp_path, report=lambda _: None).step == 10


def test_unreadable_directory_is_a_checkpoint_error(tmp_path, monkeypatch):
    _save(tmp_path, 10)
    path, _, _ = _save(tmp_path, 20)
    real = Path.is_file

    def is_file(self):  # what stat raises in a directory without the search (x) permission
        if self.parent == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "is_file", is_file)
    with pytest.raises(CheckpointError, match="step_20: cannot read state.json .Permission denied"):
        load_checkpoint(path)
    assert latest_good(tmp_path, report=lambda _: None).step == 10


def test_unlistable_checkpoints_folder_is_a_checkpoint_error(tmp_path, monkeypatch):
    _save(tmp_path, 10)

    def iterdir(self):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", iterdir)
    with pytest.raises(
        CheckpointError, match="cannot list .*checkpoints .Permission denied.; check its permissions"
    ):
        latest_good(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_state_file_by_mode(tmp_path):
    _save(tmp_path, 10)
    path, _, _ = _save(tmp_path, 20)
    (path / "state.json").chmod(0)
    try:
        with pytest.raises(CheckpointError, match="cannot read state.json"):
            load_checkpoint(path)
    finally:
        (path / "state.json").chmod(0o644)


def test_safetensors_that_fails_to_parse_is_a_checkpoint_error(tmp_path):
    _save(tmp_path, 10)
    path, _, _ = _save(tmp_path, 20)
    garbage = b"\xff" * 64  # its sha256 matches state.json, its content is no safetensors file
    (path / "model.safetensors").write_bytes(garbage)
    _rewrite_state(
        path, lambda r: {**r, "sha256": {**r["sha256"], "model.safetensors": ckpt_mod._sha256(garbage)}}
    )
    with pytest.raises(CheckpointError, match="model.safetensors is not a valid safetensors file"):
        load_checkpoint(path)
    assert latest_good(tmp_path, report=lambda _: None).step == 10


def test_checkpoint_report_gives_every_verdict(tmp_path):
    for s in (1, 2, 3):
        _save(tmp_path, s)
    (tmp_path / "checkpoints" / "step_3" / "state.json").write_text("[]")
    (tmp_path / "checkpoints" / "step_1" / "optimizer.safetensors").unlink()
    verdicts = checkpoint_report(tmp_path)
    assert [p.name for p, _ in verdicts] == ["step_3", "step_2", "step_1"]
    assert verdicts[0][1] == "state.json is a JSON list, not an object"
    assert verdicts[1][1] == "ok"
    assert verdicts[2][1] == "optimizer.safetensors is missing"


# ----------------------------------------------------------------------------------------------
# full disk, stale temporaries, a kill while pruning


def _only_complete_checkpoints(run_dir):
    root = run_dir / "checkpoints"
    visible = [p for p in root.iterdir() if not p.name.startswith(".")]
    assert all((p / "state.json").is_file() for p in visible), visible
    return sorted(p.name for p in visible)


def test_clean_stale_temporaries(tmp_path):
    _save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    for name in (".tmp_step_2_99999", ".tmp_prune_step_0", f".tmp_step_3_{os.getpid()}"):
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(b"partial")
    removed = clean_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == [
        ".tmp_prune_step_0",
        ".tmp_step_2_99999",
        f".tmp_step_3_{os.getpid()}",
    ]
    assert sorted(p.name for p in root.iterdir()) == ["step_1"]
    assert clean_stale_temporaries(tmp_path) == [] and clean_stale_temporaries(tmp_path / "none") == []


def test_too_little_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(ckpt_mod.shutil, "disk_usage", lambda _: usage._replace(free=512 << 10))
    with pytest.raises(DiskFullError) as err:
        _save(tmp_path, 2)
    msg = str(err.value)
    assert "\n" not in msg and "step_2" in msg and str(tmp_path / "checkpoints") in msg
    assert "needs 1.0 MiB" in msg and "512.0 KiB is free" in msg and "--resume" in msg
    assert _only_complete_checkpoints(tmp_path) == ["step_1"]
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_disk_full_while_writing_leaves_nothing(tmp_path, monkeypatch, code):
    _save(tmp_path, 1)
    real = ckpt_mod._write_synced

    def write(path, data):
        if path.name == "optimizer.safetensors":
            path.write_bytes(data[: len(data) // 2])  # half of it reached the disk
            raise OSError(code, os.strerror(code))
        real(path, data)

    monkeypatch.setattr(ckpt_mod, "_write_synced", write)
    with pytest.raises(DiskFullError, match=f"step_2 .*the write failed: {os.strerror(code)}"):
        _save(tmp_path, 2)
    assert _only_complete_checkpoints(tmp_path) == ["step_1"]
    assert not list((tmp_path / "checkpoints").glob(".tmp*"))


def test_other_write_errors_also_leave_nothing(tmp_path, monkeypatch):
    def write(path, data):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_mod, "_write_synced", write)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2)
    assert not list((tmp_path / "checkpoints").iterdir())


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, where the platform lets us mount one (root, or a permissive container)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("precheck", [True, False])
def test_full_small_filesystem(small_disk, monkeypatch, precheck):
    _save(small_disk, 1)
    if not precheck:  # the disk fills up midway through the write: a real ENOSPC
        monkeypatch.setattr(ckpt_mod, "_check_free_space", lambda *a: None)
    with pytest.raises(DiskFullError, match="the write failed" if not precheck else "is free;"):
        _save(small_disk, 2, size=(512, 1024))  # 4 MiB of tensors on a 4 MiB disk
    assert _only_complete_checkpoints(small_disk) == ["step_1"]
    assert not list((small_disk / "checkpoints").glob(".tmp*"))
    assert load_checkpoint(small_disk / "checkpoints" / "step_1").step == 1


def test_prune_killed_midway_leaves_no_step_without_state(tmp_path, monkeypatch):
    for s in (1, 2):
        _save(tmp_path, s, keep=2)
    real = shutil.rmtree

    def killed_rmtree(path, ignore_errors=False):
        path = Path(path)
        if path.exists() and "prune" in path.name:
            (path / "state.json").unlink()  # the delete got this far, then the process was killed
            raise KeyboardInterrupt
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 3, keep=2)
    monkeypatch.undo()
    assert _only_complete_checkpoints(tmp_path) == ["step_2", "step_3"]
    assert [p.name for p in clean_stale_temporaries(tmp_path)] == [".tmp_prune_step_1"]
    assert latest_good(tmp_path).step == 3


def test_writing_a_step_again_replaces_it(tmp_path):
    _save(tmp_path, 5)
    _, model, _ = _save(tmp_path, 5)
    assert torch.equal(load_checkpoint(tmp_path / "checkpoints" / "step_5").model["w"], model["w"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_5"]
