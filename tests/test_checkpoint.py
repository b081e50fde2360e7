"""Checkpoints: exact round trip, atomic layout, keep-last-K, corrupt ones detected and skipped."""

import json
import random

import numpy as np
import pytest
import torch
from torch import nn

from inkling_fp4.errors import UserError
from inkling_fp4.train.checkpoint import (
    CheckpointError,
    check_processes,
    checkpoint_dirs,
    from_json,
    latest_good,
    load_checkpoint,
    save_checkpoint,
    to_json,
)
from inkling_fp4.train.config import OptimConfig
from inkling_fp4.train.optimizer import build_optimizer, load_optimizer_tensors, optimizer_tensors


def _state(step):
    return {
        "data": {"position": step * 7, "order": torch.randperm(5)},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
    }


def _save(run_dir, step, keep=10):
    model = {"w": torch.randn(4, 8), "b": torch.randn(8, dtype=torch.bfloat16)}
    opt = {"w.exp_avg": torch.randn(4, 8), "w.step": torch.tensor(float(step))}
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
    assert ck.state["data"]["position"] == 21
    assert torch.equal(ck.state["rng"]["torch"], torch.get_rng_state())
    random.setstate(ck.state["rng"]["python"])  # the restored states are usable as they are
    np.random.set_state(ck.state["rng"]["numpy"])
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
