"""Run directories at the command line: refused commands leave every file as it was, accepted resume
changes are amendments, failed starts are not traps, locks, stale temporaries, exit codes."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inkling_fp4.cli import main
from model_helpers import SMALL_RUN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Overrides of a 4-step run with a checkpoint every 2 steps, and a finished run of it."""
    cache = tmp_path_factory.mktemp("cache")
    args = [*SMALL_RUN, f"data.cache_dir={cache}", "train.steps=4", "train.checkpoint_every=2",
            "eval.every=0", "train.warmup_steps=1"]  # fmt: skip
    run = tmp_path_factory.mktemp("runs") / "done"
    code, _, err = cli(["pretrain", "--run-dir", str(run), *args])
    assert code == 0, err
    return args, run


def cli(argv, monkeypatch=None):
    """(exit code, stdout, stderr) of ``fp4train argv`` in this process."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    old = sys.argv
    sys.argv = ["fp4train", *argv]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.argv = old
    return code, out.getvalue(), err.getvalue()


def tree_hash(root: Path) -> dict[str, str]:
    """Every file under ``root`` (hidden ones too) -> its sha256."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err and lines[0].startswith("error: "), err
    return lines[0]


def pretrained(tmp_path_factory, steps: int, *overrides: str) -> Path:
    """A small pretrain run of ``steps`` steps (its own data cache), for a module's tests to start from."""
    cache = tmp_path_factory.mktemp("cache")
    run = tmp_path_factory.mktemp("runs") / "pre"
    code, _, err = cli(["pretrain", "--run-dir", str(run), *SMALL_RUN, f"data.cache_dir={cache}",
                        f"train.steps={steps}", "eval.every=0", *overrides])  # fmt: skip
    assert code == 0, err
    return run


def copy_run(run: Path, tmp_path: Path) -> Path:
    dst = tmp_path / run.name
    shutil.copytree(run, dst)
    return dst


@pytest.mark.parametrize(
    "override, key",
    [
        ("precision.recipe=fp8", "precision.recipe"),
        ("train.seed=5", "train.seed"),
        ("model.d_model=64", "model.d_model"),
        ("model.vocab_size=1024", "model.vocab_size"),
        ("train.batch_size=8", "train.batch_size"),
    ],
)
def test_refused_resume_changes_leave_the_directory_as_it_was(small, tmp_path, override, key):
    _, done = small
    run = copy_run(done, tmp_path)
    before = tree_hash(run)
    code, _, err = cli(["pretrain", "--run-dir", str(run), "--resume", override])
    line = one_line(err)
    assert code == 2 and key in line and "--run-dir" in line
    assert tree_hash(run) == before
    # ... and a plain resume afterwards is not poisoned by it
    code, _, err = cli(["pretrain", "--run-dir", str(run), "--resume"])
    assert code == 0, err


def test_accepted_resume_change_is_an_amendment(small, tmp_path):
    from inkling_fp4.compare.metrics import load_run_config

    _, done = small
    run = copy_run(done, tmp_path)
    config_before = (run / "config.yaml").read_bytes()
    code, out, err = cli(["pretrain", "--run-dir", str(run), "--resume", "train.steps=6"])
    assert code == 0, err
    assert (run / "config.yaml").read_bytes() == config_before  # the original stays as it was
    (amendment,) = [json.loads(line) for line in (run / "amendments.jsonl").read_text().splitlines()]
    assert amendment["changes"] == {"train.steps": [4, 6]} and amendment["from_step"] == 4
    assert "time" in amendment
    assert "train.steps 4 -> 6" in out and "decaying since step" in out  # what happens to the schedule
    assert load_run_config(run).train.steps == 6  # what compare-baseline reads
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]


def test_failed_start_writes_nothing_and_leaves_no_trap(small, tmp_path):
    args, _ = small
    run = tmp_path / "new"
    code, _, err = cli(["pretrain", "--run-dir", str(run), *args, "data.source=/no/such/corpus.jsonl"])
    assert code == 2 and "/no/such/corpus.jsonl" in one_line(err)
    assert not run.exists()
    code, _, err = cli(["pretrain", "--run-dir", str(run), *args, "model.vocab_size=256"])
    assert code == 2 and "vocab_size" in one_line(err) and not run.exists()
    # a start interrupted before its first checkpoint left a config and metrics: not a trap
    run.mkdir()
    (run / "config.yaml").write_text("name: leftover\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    for resume in ([], ["--resume"]):
        code, out, err = cli(["pretrain", "--run-dir", str(run), *resume, *args, "train.steps=2"])
        assert code == 0, err
        assert "holds no complete checkpoint" in out
        shutil.rmtree(run / "checkpoints")


def test_run_dir_that_is_a_file(small, tmp_path):
    args, _ = small
    f = tmp_path / "afile"
    f.write_text("x")
    for resume in ([], ["--resume"]):
        code, _, err = cli(["pretrain", "--run-dir", str(f), *resume, *args])
        assert code == 2 and "is a file" in one_line(err) and f.read_text() == "x"


def test_non_finite_lr_is_refused_before_any_write(small, tmp_path):
    args, _ = small
    for value in ("nan", "inf", "-1", "0"):
        code, _, err = cli(["pretrain", "--run-dir", str(tmp_path / "r"), *args, f"optim.lr={value}"])
        assert code == 2 and "optim.lr" in one_line(err) and not (tmp_path / "r").exists()


def test_stale_temporaries_are_removed_and_bad_checkpoints_listed(small, tmp_path):
    _, done = small
    run = copy_run(done, tmp_path)
    (run / "checkpoints" / ".tmp_step_6_12345").mkdir()
    (run / "checkpoints" / ".tmp_step_6_12345" / "model.safetensors").write_bytes(b"partial")
    for step in (2, 4):  # every checkpoint bad: refused, each one's reason listed, nothing changed
        f = run / "checkpoints" / f"step_{step}" / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-10])
    before = tree_hash(run)
    code, _, err = cli(["pretrain", "--run-dir", str(run), "--resume"])
    line = one_line(err)
    assert code == 2 and "step_2" in line and "step_4" in line and "sha256" in line
    assert tree_hash(run) == before
    shutil.rmtree(run / "checkpoints" / "step_4")  # the user moves the bad ones away
    shutil.rmtree(run / "checkpoints" / "step_2")
    code, out, err = cli(["pretrain", "--run-dir", str(run), "--resume"])
    assert code == 0, err
    assert not any(p.name.startswith(".tmp") for p in (run / "checkpoints").iterdir())


def test_state_json_of_the_wrong_shape_falls_back(small, tmp_path):
    _, done = small
    run = copy_run(done, tmp_path)
    (run / "checkpoints" / "step_4" / "state.json").write_text("[1, 2, 3]")
    code, out, err = cli(["pretrain", "--run-dir", str(run), "--resume", "train.steps=5"])
    assert code == 0, err
    assert "resumed from" in out and "step_2" in out


def test_a_live_lock_refuses_a_second_process_and_a_dead_one_is_taken_over(small, tmp_path):
    _, done = small
    run = copy_run(done, tmp_path)
    hold = (
        "import sys, time\nfrom pathlib import Path\nfrom inkling_fp4.runs.lock import RunLock\n"
        f"RunLock(Path({str(run)!r})).acquire()\nprint('locked', flush=True)\ntime.sleep(60)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree_hash(run)
        code, _, err = cli(["pretrain", "--run-dir", str(run), "--resume", "train.steps=5"])
        assert code == 2 and str(holder.pid) in one_line(err) and tree_hash(run) == before
    finally:
        holder.kill()
        holder.wait()
    code, out, err = cli(["pretrain", "--run-dir", str(run), "--resume", "train.steps=5"])
    assert code == 0, err
    assert str(holder.pid) in out and not (run / ".lock").exists()  # taken over, said, released


def _spawn(run: Path, args: list[str], *extra: str, code: str = "") -> subprocess.Popen:
    """``fp4train pretrain`` in a child process, after ``code`` (test hooks) runs there."""
    argv = ["fp4train", "pretrain", "--run-dir", str(run), *args, *extra]
    script = f"import sys\n{code}\nsys.argv = {argv!r}\nfrom inkling_fp4.cli import main\nmain()\n"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)  # fmt: skip


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_interrupt_exit_codes(small, tmp_path, sig, code):
    args, _ = small
    run = tmp_path / "run"
    proc = _spawn(run, args, "train.steps=200")
    for line in proc.stdout:  # the first logged step: training is under way
        if line.startswith("step "):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert "--resume" in err and signal.Signals(sig).name in err and "Traceback" not in err
    assert any((p / "state.json").is_file() for p in (run / "checkpoints").iterdir())


SECOND_SIGINT = """
import hashlib, json, os, signal
from pathlib import Path
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.runs import checkpoint
_loss, _write, calls = HybridLM.loss, checkpoint._write_synced, {{"loss": 0, "write": 0}}
def saved():  # every file of the run's checkpoints now: none may change from here on
    root = Path({run!r}) / "checkpoints"
    return {{str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}}
def loss(self, *args, **kwargs):  # once per step
    calls["loss"] += 1
    if calls["loss"] == 3:
        print("saved", json.dumps(saved()), flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during step 3
        if {in_step}:
            os.kill(os.getpid(), signal.SIGINT)  # and again before step 3 is done
    return _loss(self, *args, **kwargs)
def write(path, data):
    if calls["loss"] >= 3:
        calls["write"] += 1
        if calls["write"] in {in_write}:
            os.kill(os.getpid(), signal.SIGINT)  # again while step 3's checkpoint is written
    _write(path, data)
HybridLM.loss, checkpoint._write_synced = loss, write
"""


def _second_sigint(tmp_path, small, in_step=False, in_write=()):
    """A run that gets Ctrl-C during step 3 and again, in step 3 or as its checkpoint's ``in_write``-th
    files are written: (run directory, exit code, stdout, stderr, the checkpoint files when the first
    Ctrl-C came)."""
    args, _ = small
    run = tmp_path / "run"
    hook = SECOND_SIGINT.format(run=str(run), in_step=in_step, in_write=set(in_write))
    proc = _spawn(run, args, "train.steps=8", code=hook)
    out, err = proc.communicate(timeout=120)
    saved = json.loads(next(line for line in out.splitlines() if line.startswith("saved "))[6:])
    return run, proc.returncode, out, err, saved


def test_a_second_sigint_in_the_step_stops_at_once_and_says_where_resume_starts(small, tmp_path):
    from inkling_fp4.runs.checkpoint import latest_good

    run, code, out, err, saved = _second_sigint(tmp_path, small, in_step=True)
    resume = f"fp4train pretrain --resume --run-dir {run}"
    assert code == 130 and err.strip().splitlines() == [
        f"stopped at once by SIGINT, no new checkpoint written; {resume} starts from step 2"
    ], err
    assert tree_hash(run / "checkpoints") == saved and list(saved) == [
        f"step_2/{name}" for name in ("model.safetensors", "optimizer.safetensors", "state.json")
    ]  # step 2's checkpoint as it was, no other (not even a temporary one)
    assert latest_good(run).path.name == "step_2"  # where --resume starts, as said


def test_a_second_sigint_while_the_checkpoint_is_written_lets_it_finish(small, tmp_path):
    from inkling_fp4.runs.checkpoint import latest_good

    run, code, out, err, saved = _second_sigint(tmp_path, small, in_write=[1])
    resume = f"fp4train pretrain --resume --run-dir {run}"
    assert code == 130 and err.strip().splitlines() == [
        f"interrupted by SIGINT after step 3 (checkpoint written); continue with {resume}"
    ], err  # said once
    assert "finishing the checkpoint being written" in out and "interrupted" not in out, out
    assert latest_good(run).path.name == "step_3"
    after = tree_hash(run / "checkpoints")
    assert {k: after[k] for k in saved} == saved and sorted({k.split("/")[0] for k in after}) == [
        "step_2",
        "step_3",
    ]


def test_a_third_sigint_while_the_checkpoint_is_written_stops_at_once_without_it(small, tmp_path):
    run, code, out, err, saved = _second_sigint(tmp_path, small, in_write=[1, 2])
    resume = f"fp4train pretrain --resume --run-dir {run}"
    assert code == 130 and err.strip().splitlines() == [
        f"stopped at once by SIGINT, no new checkpoint written; {resume} starts from step 2"
    ], err
    assert "finishing the checkpoint being written" in out
    assert tree_hash(run / "checkpoints") == saved  # step 3's files gone, temporary directory included


KILL_AT = """
import os, signal, shutil
from inkling_fp4.runs import checkpoint
_write, _rmtree, calls = checkpoint._write_synced, shutil.rmtree, {{"write": 0, "prune": 0}}
def write(path, data):
    calls["write"] += 1
    if calls["write"] == {write}:
        os.kill(os.getpid(), signal.SIGKILL)  # in the middle of a checkpoint's files
    _write(path, data)
def rmtree(path, *a, **k):
    if ".tmp_prune" in str(path):
        calls["prune"] += 1
        if calls["prune"] == {prune}:
            os.kill(os.getpid(), signal.SIGKILL)  # in the middle of pruning an old checkpoint
    _rmtree(path, *a, **k)
checkpoint._write_synced, shutil.rmtree = write, rmtree
"""


def test_kills_at_any_moment_resume_bit_exact_without_leftovers(small, tmp_path):
    """SIGKILL during a checkpoint's write, during pruning, and at a random moment; after each a
    plain --resume; the losses equal an uninterrupted run's and no temporary directory is left."""
    import random

    args, _ = small
    common = [*args, "train.steps=10", "train.checkpoint_every=1", "checkpoint.keep_last=2"]
    straight = tmp_path / "straight"
    assert _spawn(straight, common).wait(timeout=300) == 0
    run = tmp_path / "killed"
    hooks = [KILL_AT.format(write=5, prune=10**9), KILL_AT.format(write=10**9, prune=3), ""]
    for i, hook in enumerate(hooks):
        proc = _spawn(run, common, *(["--resume"] if i else []), code=hook)
        if not hook:  # a kill at a random moment of training: after a random step's log line, well
            target = random.randint(1, 8)  # before the last step (a tiny step takes milliseconds)
            for line in proc.stdout:
                if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= target:
                    break
            time.sleep(random.uniform(0.0, 0.05))
            proc.kill()
        assert proc.wait(timeout=300) == -signal.SIGKILL
    assert _spawn(run, common, "--resume").wait(timeout=300) == 0
    assert not [p for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]
    assert all((p / "state.json").is_file() for p in (run / "checkpoints").iterdir())

    def losses(d):
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows if "loss" in r}

    assert losses(run) == losses(straight) and sorted(losses(run)) == list(range(1, 11))


def test_full_disk_is_one_line_and_keeps_the_older_checkpoints(small, tmp_path):
    args, _ = small
    hook = """
import errno
from inkling_fp4.runs import checkpoint
_write, calls = checkpoint._write_synced, {"n": 0}
def write(path, data):
    calls["n"] += 1
    if calls["n"] >= 4:  # the second checkpoint's files: the disk is full from now on
        raise OSError(errno.ENOSPC, "No space left on device")
    _write(path, data)
checkpoint._write_synced = write
"""
    run = tmp_path / "run"
    proc = _spawn(run, args, "train.steps=6", code=hook)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-2000:]
    line = one_line(err)
    assert "space" in line and str(run) in line
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_2"] and (run / "checkpoints" / "step_2" / "state.json").is_file()


def test_unreadable_checkpoint_falls_back_to_an_older_one(small, tmp_path, monkeypatch):
    """As root every file is readable, so the PermissionError of another user's file is injected."""
    _, done = small
    run = copy_run(done, tmp_path)
    newest = run / "checkpoints" / "step_4"
    real = Path.read_bytes

    def read_bytes(self):
        if newest in self.parents:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    code, out, err = cli(["pretrain", "--run-dir", str(run), "--resume", "train.steps=5"])
    assert code == 0, err
    assert "step_4" in out and "resumed from" in out and "step_2" in out


def test_invalid_utf8_in_a_jsonl_source_is_one_line_with_the_offset(small, tmp_path):
    args, _ = small
    bad = tmp_path / "corpus.jsonl"
    good = "".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 20}) + "\n" for i in range(40))
    bad.write_bytes(good.encode() + b'{"text": "caf\xe9"}\n')
    run = tmp_path / "r"
    code, _, err = cli(["pretrain", "--run-dir", str(run), *args, f"data.source={bad}"])
    line = one_line(err)
    assert code == 2 and str(bad) in line and f"byte {len(good.encode()) + 13}" in line
    assert "data.encoding_errors=replace" in line and not run.exists()


def test_resume_survives_invalid_utf8_and_garbage_in_metrics(small, tmp_path):
    from inkling_fp4.compare.loss_gap import load_loss_metrics

    _, done = small
    run = copy_run(done, tmp_path)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "loss": 1.0, "note": "\xff\xfe"}\n{"step": 4, "lo\n\x00\x01 garbage\n')
    code, _, err = cli(["pretrain", "--run-dir", str(run), "--resume", "train.steps=5"])
    assert code == 0, err
    lines = (run / "metrics.jsonl").read_bytes().decode("utf-8").splitlines()  # valid UTF-8 again
    rows = [json.loads(x, parse_constant=lambda c: pytest.fail(f"bare {c}")) for x in lines]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert len(load_loss_metrics(run).curve("loss")) == 5


def test_out_of_gpu_memory_is_one_line_and_resume_goes_on(small, tmp_path, monkeypatch):
    """Running out of accelerator memory is a resource problem, not a bug: one line with what was asked
    and what to lower (exit 1), the checkpoints written before it kept, and --resume finishes the run
    as the uninterrupted one did."""
    import torch

    from inkling_fp4.trainer.trainer import Trainer

    args, done = small
    real, calls = Trainer.step, {"n": 0}

    def step(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # after the step-2 checkpoint
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.17 GiB. GPU 0 has ...")
        return real(self, *a, **kw)

    monkeypatch.setattr(Trainer, "step", step)
    run = tmp_path / "run"
    code, _, err = cli(["pretrain", "--run-dir", str(run), *args])
    line = one_line(err)
    assert code == 1 and "out of GPU memory (tried to allocate 1.17 gib)" in line
    assert "train.micro_batch_size" in line and "--resume" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    monkeypatch.setattr(Trainer, "step", real)
    code, _, err = cli(["pretrain", "--run-dir", str(run), "--resume"])
    assert code == 0, err

    def losses(r):
        rows = map(json.loads, (r / "metrics.jsonl").read_text().splitlines())
        return [(x["step"], x["loss"]) for x in rows if "loss" in x]

    assert losses(run) == losses(done)
    # any other error is a bug and keeps its traceback
    monkeypatch.setattr(Trainer, "step", lambda self, *a, **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli(["pretrain", "--run-dir", str(tmp_path / "bug"), *args])
