"""The run directory's lock: a live holder refuses, a dead or garbled one is taken over, release
removes only our own lock, another host's lock is never taken over."""

import json
import os
import socket
import subprocess
import sys

import pytest

from inkling_fp4.errors import UserError
from inkling_fp4.runs.lock import RunLock, RunLockedError

HOLDER = """
import sys, time
from inkling_fp4.runs.lock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire()
print("locked", flush=True)
sys.stdin.read()  # hold it until the test closes stdin or kills us
"""


def _lock_file(run_dir, **record):
    (run_dir / ".lock").write_text(json.dumps(record))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_lock_file_and_release(tmp_path):
    run_dir = tmp_path / "run"
    with RunLock(run_dir) as lock:
        record = json.loads((run_dir / ".lock").read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert "T" in record["started"] and lock.took_over is None
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no temporary left
    assert not (run_dir / ".lock").exists()


def test_a_live_second_process_refuses_us_and_its_dead_lock_is_taken_over(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError) as err:
            RunLock(tmp_path).acquire()
        msg = str(err.value)
        assert "\n" not in msg and isinstance(err.value, UserError)
        assert (
            f"run directory {tmp_path} is in use by pid {child.pid} on host {socket.gethostname()} since "
            in msg
        )
        assert msg.endswith("wait for it or pass another --run-dir")
    finally:
        child.kill()  # dies holding the lock: no release
        child.wait()
    lock = RunLock(tmp_path)
    message = lock.acquire()
    assert message == lock.took_over and f"pid {child.pid}" in message and "is gone" in message
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()
    lock.release()


def test_the_same_process_twice_is_refused(tmp_path):
    with RunLock(tmp_path), pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
        RunLock(tmp_path).acquire()


def test_dead_pid_is_taken_over(tmp_path):
    pid = _dead_pid()
    _lock_file(tmp_path, pid=pid, host=socket.gethostname(), started="2020-01-01T00:00:00+00:00")
    with RunLock(tmp_path) as lock:
        assert f"pid {pid} on host {socket.gethostname()}" in lock.took_over and "is gone" in lock.took_over


def test_reused_pid_is_taken_over(tmp_path):
    """After a container restart the new run may get the old one's pid: ours, started after the lock."""
    _lock_file(tmp_path, pid=os.getpid(), host=socket.gethostname(), started="2001-01-01T00:00:00+00:00")
    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc: process start times are unknown")
    with RunLock(tmp_path) as lock:
        assert "started later" in lock.took_over


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json{",
        b"[1, 2]",
        b'{"pid": "12", "host": "h", "started": "t"}',
        b'{"pid": 0, "host": "h", "started": "t"}',
        b"\xff\xfe",
    ],
)
def test_garbled_lock_is_taken_over(tmp_path, content):
    (tmp_path / ".lock").write_bytes(content)
    with RunLock(tmp_path) as lock:
        assert "garbled" in lock.took_over
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


def test_release_removes_only_our_own_lock(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    other = {"pid": 1, "host": "elsewhere", "started": "2020-01-01T00:00:00+00:00"}
    _lock_file(tmp_path, **other)  # someone took it over meanwhile
    lock.release()
    assert json.loads((tmp_path / ".lock").read_text()) == other
    lock.release()  # twice: nothing to do


def test_another_hosts_lock_is_not_taken_over(tmp_path):
    _lock_file(tmp_path, pid=_dead_pid(), host="node-17", started="2020-01-01T00:00:00+00:00")
    with pytest.raises(RunLockedError) as err:
        RunLock(tmp_path).acquire()
    msg = str(err.value)
    assert "\n" not in msg and "on host node-17 since 2020-01-01T00:00:00+00:00" in msg
    assert "cannot check" in msg and f"delete {tmp_path / '.lock'} if that process is gone" in msg
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "node-17"


RACER = """
import sys
from inkling_fp4.runs.lock import RunLock, RunLockedError
try:
    RunLock(sys.argv[1]).acquire()
    print("ok", flush=True)
    sys.stdin.read()
except RunLockedError:
    print("locked", flush=True)
"""


def test_racing_takeovers_of_a_stale_lock_leave_one_holder(tmp_path):
    _lock_file(tmp_path, pid=_dead_pid(), host=socket.gethostname(), started="2020-01-01T00:00:00+00:00")
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, str(tmp_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    try:
        answers = sorted(r.stdout.readline().strip() for r in racers)
    finally:
        for r in racers:
            r.kill()
            r.wait()
    assert answers == ["locked"] * 5 + ["ok"]
