"""Two processes on the CPU (gloo) through torchrun, as a user launches them: an FSDP2 run that stops,
writes its gathered checkpoint and resumes trains the same loss curve as one process does."""

import json
import os
import subprocess
import sys

import pytest

from inkling_fp4.config import load_config
from inkling_fp4.train import pretrain
from test_pretrain import SMALL
from test_pretrain import data_cache as data_cache  # the session's shared data cache (a fixture)

pytestmark = pytest.mark.slow


def _torchrun(run_dir, *args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "inkling_fp4",
           "pretrain", "--run-dir", str(run_dir), *args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_fsdp_two_processes_resume_and_match_one(tmp_path, data_cache):
    common = [*SMALL, f"data.cache_dir={data_cache}", "train.steps=8", "train.micro_batch_size=1",
              "train.checkpoint_every=4", "eval.every=0"]  # fmt: skip
    out = _torchrun(tmp_path / "fsdp", *common, "train.parallel=fsdp", "train.stop_after=4")
    assert out.count("run directory:") == 1  # rank 0 speaks for the run
    _torchrun(tmp_path / "fsdp", "--resume")
    fsdp = _losses(tmp_path / "fsdp")
    assert sorted(fsdp) == list(range(1, 9))
    one = _losses(pretrain.run(load_config("tiny", common), tmp_path / "one").run_dir)
    # the same global batches and weights; only the order of the gradient reductions differs
    assert all(abs(one[k] - fsdp[k]) < 1e-3 * one[k] for k in one)


def test_delayed_fp8_scaling_histories_agree_across_ranks(tmp_path, data_cache):
    """Each rank quantizes its own shard, so its amaxes differ; the max-reduce before each roll gives
    every rank the same history (and so the same scales), which the checkpoint holds per rank."""
    run = tmp_path / "ddp"
    _torchrun(
        run, *SMALL, f"data.cache_dir={data_cache}", "train.steps=3", "train.micro_batch_size=1",
        "eval.every=0", "precision.recipe=fp8-tensorwise", "precision.fp8_scaling=delayed",
        "precision.switch_to_bf16=never",
    )  # fmt: skip
    state = json.loads((run / "checkpoints" / "step_3" / "state.json").read_text())
    histories = [p["amax_history"] for p in state["precision"]]
    assert len(histories) == 2 and all(h["ready"] for h in histories)
    assert histories[0]["state"] == histories[1]["state"]
