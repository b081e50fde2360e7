"""Deterministic mode: the SSD and conv kernels' fixed-config hook, the process-wide switch, the config
field and a tiny pretraining run with ``train.deterministic=true``.

Bit-reproducibility itself is a GPU property (scripts/check_determinism.py checks it on CUDA); here the
switches are checked to be set, cleared and restored, and the hook to be what triton calls.
"""

import os

import pytest
import torch
import triton
import triton.language as tl

from inkling_fp4.config import load_config
from inkling_fp4.errors import ConfigError
from inkling_fp4.model import conv_triton
from inkling_fp4.model.ssd_kernels import (
    chunk_scan,
    chunk_states,
    scan_grads_bc,
    scan_grads_x,
    state_grads,
    tuning,
)
from inkling_fp4.trainer import determinism
from model_helpers import SMALL_RUN

AUTOTUNED = [
    chunk_scan._chunk_scan_kernel,
    chunk_states._chunk_states_kernel,
    scan_grads_bc._scan_grads_bc_kernel,
    scan_grads_x._scan_grads_x_kernel,
    state_grads._state_grads_kernel,
    conv_triton._conv_silu_pointwise,
    conv_triton._conv_silu_bwd,
]


@pytest.fixture
def restore_determinism():
    """Whatever a test switches on is switched back, so the rest of the suite runs as before."""
    before = determinism.current_settings()
    yield
    determinism.restore_settings(before)
    assert determinism.current_settings() == before


def _candidates(n):
    sizes = torch.randperm(4)[:n].tolist()  # fresh block sizes each run: the hook must not care
    return [triton.Config({"BLOCK": 16 << s}, num_warps=4) for s in sizes]


@triton.jit
def _copy_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.mark.parametrize("n", [1, 3])
def test_hook_keeps_all_candidates_when_off_and_only_the_first_when_on(n, restore_determinism):
    configs = _candidates(n)
    original = list(configs)
    tuning.set_fixed_configs(False)
    assert tuning.first_config_when_fixed(configs, {"n": 5}) == configs
    tuning.set_fixed_configs(True)
    pruned = tuning.first_config_when_fixed(configs, {"n": 5}, BLOCK_P=64)
    assert len(pruned) == 1 and pruned[0] is configs[0]
    assert tuning.first_config_when_fixed(configs) == [configs[0]]  # the two-argument form
    assert configs == original  # the candidate list itself is left alone


def test_hook_through_the_installed_triton_autotuner(restore_determinism):
    """Triton calls the hook itself (``Autotuner.prune_configs``) with its own signature."""
    configs = _candidates(3)
    tuner = triton.autotune(
        configs=configs, key=["n"], prune_configs_by={"early_config_prune": tuning.first_config_when_fixed}
    )(_copy_kernel)
    tuner.nargs = {"x_ptr": None, "y_ptr": None, "n": 7}
    tuning.set_fixed_configs(False)
    assert tuner.prune_configs({}) == configs
    tuning.set_fixed_configs(True)
    assert tuner.prune_configs({"EXTRA": 1}) == [configs[0]]


def test_every_autotuned_kernel_has_the_hook_and_forgets_its_choices_on_a_switch(restore_determinism):
    tuning.set_fixed_configs(False)
    for tuner in AUTOTUNED:
        assert isinstance(tuner, triton.runtime.Autotuner)
        assert tuner.early_config_prune is tuning.first_config_when_fixed
        assert len(tuner.configs) > 1  # several candidates outside the interpreter: the hook matters
        tuner.cache[("timed", 1)] = tuner.configs[-1]
    tuning.set_fixed_configs(False)  # no change of mode: choices kept
    assert all(("timed", 1) in tuner.cache for tuner in AUTOTUNED)
    tuning.set_fixed_configs(True)
    assert all(not tuner.cache for tuner in AUTOTUNED)
    for tuner in AUTOTUNED:
        tuner.cache[("fixed", 1)] = tuner.configs[0]
    tuning.set_fixed_configs(False)
    assert all(not tuner.cache for tuner in AUTOTUNED)


@pytest.mark.skipif(not tuning.CACHE_TIMINGS, reason="this triton keeps no autotune timings on disk")
def test_every_autotuned_kernel_keeps_its_timings_on_disk():
    """A later process reads the choice back instead of timing every candidate before its first step."""
    assert all(tuner.cache_results for tuner in AUTOTUNED)
    assert not any(c.pre_hook for tuner in AUTOTUNED for c in tuner.configs)  # else triton skips the cache


def test_enable_sets_every_switch_and_restore_undoes_them(monkeypatch, restore_determinism):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    tuning.set_fixed_configs(False)
    before = determinism.enable_determinism()
    assert before == determinism.DeterminismSettings(False, False, None, False)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: see the module docstring
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert tuning.fixed_configs()
    assert "determinism: on" in determinism.describe() and ":4096:8" in determinism.describe()
    determinism.restore_settings(before)
    assert determinism.current_settings() == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_enable_keeps_a_workspace_setting_the_user_chose(monkeypatch, restore_determinism):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    before = determinism.enable_determinism()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and before.cublas_workspace == ":16:8"


def test_config_field_defaults_off_and_overrides_like_every_field():
    assert load_config("tiny").train.deterministic is False
    assert load_config("tiny", ["train.deterministic=true"]).train.deterministic is True
    assert load_config("tiny", ["train.deterministic=false"]).train.deterministic is False
    with pytest.raises(ConfigError, match="train.deterministic"):
        load_config("tiny", ["train.deterministic=sometimes"])


SMALL = [*SMALL_RUN, "train.steps=3", "eval.every=0"]


def test_pretrain_with_deterministic_mode(tmp_path, capsys, monkeypatch, restore_determinism):
    import json

    from safetensors.torch import load_file

    from inkling_fp4.train import pretrain

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(False)
    tuning.set_fixed_configs(False)

    def train(name):
        overrides = [*SMALL, f"data.cache_dir={tmp_path / 'data'}", "train.deterministic=true"]
        run_dir = pretrain.run(load_config("tiny", overrides), tmp_path / name).run_dir
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        weights = load_file(run_dir / "checkpoints" / "step_3" / "model.safetensors")
        return [r["loss"] for r in rows if "loss" in r], weights

    losses_a, weights_a = train("a")
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert tuning.fixed_configs() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    out = capsys.readouterr().out
    assert out.count("determinism: on") == 1
    losses_b, weights_b = train("b")  # the mode already on: a second run in the process is the same
    assert len(losses_a) == 3 and losses_a == losses_b
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
