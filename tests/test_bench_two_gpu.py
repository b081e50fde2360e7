"""scripts/bench_two_gpu.py end to end on CPU (--tiny, two gloo processes): every command runs, RL
on two ranks trains (so the replica check compared trained weights), the summary reads what the runs
logged, and the run resumed under torchrun continues the straight run's losses exactly. The SFT run
RL starts from is the one ``bench_rl.py --tiny --until sft`` makes (tested in test_bench_rl.py), its
commands run in this process; without --from the script asks bench_rl.py for it."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_run_dir import cli

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_two_gpu.py"


def _losses(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {str(r["step"]): r["loss"] for r in rows if "loss" in r and "event" not in r}


def _scripts():
    sys.path.insert(0, str(SCRIPT.parent))
    import bench_rl
    import bench_two_gpu

    return bench_rl, bench_two_gpu


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The SFT run of ``bench_rl.py --tiny --until sft``: its pretrain and sft commands, in this process."""
    bench_rl, _ = _scripts()
    root = tmp_path_factory.mktemp("base")
    a = bench_rl.parse_args(
        ["--tiny", "--out", str(root), "--pretrain-set", f"data.cache_dir={root / 'cache'}"]
    )
    stages = bench_rl.plan(a, bench_rl.TINY)
    for name in ("pretrain", "sft"):
        (job,) = stages[name]
        code, _, err = cli(job.args)
        assert code == 0, err
    return root / "sft"


def test_without_from_the_base_is_bench_rl_until_sft_with_the_pretrain_sets(tmp_path, monkeypatch, capsys):
    _, b = _scripts()
    calls = []
    monkeypatch.setattr(
        b.subprocess, "run", lambda cmd, **kw: calls.append(cmd) or SimpleNamespace(returncode=1)
    )
    out = tmp_path / "out"
    assert b.main(["--tiny", "--out", str(out), "--pretrain-set", "a=1", "--pretrain-set", "b=2"]) == 1
    bench_rl = [sys.executable, str(SCRIPT.parent / "bench_rl.py"), "--out", str(out / "base")]
    assert calls == [
        [*bench_rl, "--until", "sft", "--tiny", "--pretrain-set", "a=1", "--pretrain-set", "b=2"]
    ]
    assert "the base failed (bench_rl.py --until sft" in capsys.readouterr().err


def test_bench_two_gpu_on_cpu(base, tmp_path):
    (tmp_path / "len_reward.py").write_text("def reward(prompt, completion, answer):\n"
                                            "    return (len(completion) % 5) / 4\n")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = tmp_path / "out"
    cache = f"data.cache_dir={tmp_path / 'cache'}"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--from", str(base), "--rl-set",
           "rl.reward=len_reward:reward", "--pretrain-set", cache]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads((out / "summary.json").read_text())
    assert [c["rc"] for c in data["commands"]] == [0] * 7 and data["replicas_identical"]
    for name in ("rl-1", "rl-2"):
        assert data["rl"][name]["steps"] == 2 and data["rl"][name]["grad_norm"] > 0
    pre = data["pretrain"]
    for name in ("pretrain-1", "pretrain-ddp", "pretrain-fsdp", "pretrain-resumed"):
        assert pre[name]["losses"] == _losses(out / name) and pre[name]["steps"] == 4
    assert pre["pretrain-ddp"]["largest_loss_gap_to_one"] < 1e-3
    assert pre["pretrain-resumed"]["largest_loss_gap_to_straight"] == 0.0
    assert "| pretrain-fsdp | 4 |" in (out / "summary.md").read_text()


def test_bench_two_gpu_refuses_a_used_out_and_a_from_without_checkpoints(tmp_path, capsys):
    _, b = _scripts()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    for args in (
        ["--out", str(tmp_path / "used")],
        ["--out", str(tmp_path / "new"), "--from", str(tmp_path)],
    ):
        code, err = b.main(["--tiny", *args]), capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "new").exists()


def test_the_replica_verdict_reads_the_two_rank_run(tmp_path):
    """Finished: the check passed at every checkpoint; stopped by it: no; failed otherwise: unknown."""
    _, b = _scripts()

    log = tmp_path / "logs" / "rl-2.log"
    log.parent.mkdir()
    assert b.replicas_identical(tmp_path, [b.Command("rl-2", [], 2, rc=0)]) is True
    log.write_text("error: step 4: the 2 ranks hold different weights (3 of 40 parameters, ...)")
    assert b.replicas_identical(tmp_path, [b.Command("rl-2", [], 2, rc=1)]) is False
    log.write_text("CUDA out of memory")
    assert b.replicas_identical(tmp_path, [b.Command("rl-2", [], 2, rc=1)]) is None
