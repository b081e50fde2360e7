"""The replica check before each checkpoint, in two gloo processes: ranks with equal weights pass,
one bit of one parameter on one rank is caught and named, one process has nothing to check."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from inkling_fp4 import distributed as D
from inkling_fp4.trainer.replicas import ReplicaDivergence, check_replicas, checksums
from test_pretrain import SMALL
from test_pretrain import data_cache as data_cache  # the session's shared data cache (a fixture)

pytestmark = pytest.mark.slow


def _model(bf16: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    return model.to(torch.bfloat16) if bf16 else model


CASES = [(bf16, flip) for bf16 in (False, True) for flip in (None, "1.weight")]
"""(BF16 weights, the parameter of which rank 1 flips a bit or None), checked one after another by the
same two processes (each start of two processes costs seconds)."""


def _rank(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        info = D.DistInfo(rank=rank, world_size=2)
        for bf16, flip in CASES:
            model = _model(bf16)
            if flip is not None and rank == 1:  # one bit of one element: the smallest divergence there is
                p = dict(model.named_parameters())[flip]
                with torch.no_grad():
                    flat = p.view(-1).view(torch.int16 if p.dtype == torch.bfloat16 else torch.int32)
                    flat[int(torch.randint(flat.numel(), ()))] ^= 1
            try:
                check_replicas(model, info, step=7)
                out[rank, bf16, flip] = "ok"
            except ReplicaDivergence as e:
                out[rank, bf16, flip] = str(e)
    finally:
        dist.destroy_process_group()


def test_equal_ranks_pass_and_one_flipped_bit_is_named():
    port = 29_500 + int(torch.randint(2_000, ()))
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, out), nprocs=2, join=True)
        got = dict(out)
    for bf16 in (False, True):
        assert (got[0, bf16, None], got[1, bf16, None]) == ("ok", "ok"), bf16
        flipped = got[0, bf16, "1.weight"]
        assert flipped == got[1, bf16, "1.weight"], bf16
        assert flipped.startswith("step 7: the 2 ranks hold different weights"), (bf16, flipped)
        assert "1 of 4 parameters, first 1.weight" in flipped, (bf16, flipped)


def test_one_process_is_not_checked_and_any_bit_changes_a_checksum():
    model = _model(bf16=False)
    check_replicas(model, D.DistInfo(), step=1)  # a single rank has nothing to compare
    names, before = checksums(model)
    p = model[0].bias
    with torch.no_grad():
        p.view(-1).view(torch.int32)[3] ^= 1 << int(torch.randint(32, ()))
    after = checksums(model)[1]
    changed = (before != after).any(1).nonzero().flatten().tolist()
    assert [names[i] for i in changed] == ["0.bias"]


def test_a_run_whose_ranks_drift_stops_before_its_checkpoint(tmp_path, data_cache):
    """torchrun, DDP: one rank's weights nudged after step 1 stop the run at its step-2 checkpoint with
    one line (exit 1) and leave no checkpoint of either copy."""
    run = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(Path(__file__).with_name("divergent_rank.py")), "pretrain", "--run-dir", str(run), *SMALL,
           f"data.cache_dir={data_cache}", "train.steps=4", "train.micro_batch_size=1",
           "train.checkpoint_every=2", "eval.every=0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "step 2: the 2 ranks hold different weights (1 of " in proc.stderr, proc.stderr[-3000:]
    assert not re.search(r'File ".*inkling_fp4', proc.stderr)  # one line; torchrun's own report follows
    assert not list(run.glob("checkpoints/step_*"))
