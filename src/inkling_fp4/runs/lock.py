"""One process per run directory: a lock file ``<run_dir>/.lock`` that says who holds it.

Two processes training into one run directory would interleave checkpoints and prune each other's.
The lock (JSON ``{"pid", "host", "started", "token"}``) is hard-linked into place from a temporary
file, so a reader never sees it half-written. A stale lock is taken over: one that names this host
and a dead pid, or a live pid started after the lock was written (a restarted container often
reuses the old pid), or a garbled one. A lock from another host never is: this host cannot tell
whether its process lives. Takeovers re-read the lock under an ``flock`` on the run directory, so
two processes that found the same stale lock cannot both end up holding it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import secrets
import socket
from pathlib import Path

from inkling_fp4.errors import DISK_FULL_ERRNOS, DiskFullError, UserError

LOCK_FILE = ".lock"
# A pid whose process started this long after the lock was written was reused (the lock's time has
# whole seconds, /proc's start time clock ticks).
_REUSE_SLACK_S = 2.0


class RunLockedError(UserError):
    """The run directory is held by another live process (or by one on another host)."""


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


class RunLock:
    """``with RunLock(run_dir) as lock: ...``, or ``acquire()`` / ``release()``."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.took_over: str | None = None
        """After :meth:`acquire`: a line for the log when a stale lock was taken over, else None."""
        self._record: dict | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._record is not None

    def acquire(self) -> str | None:
        """Take the lock (making the run directory) or raise RunLockedError; returns ``took_over``."""
        if self.held:
            raise AssertionError(f"{self.path} is already held by this RunLock")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": _now(),
            "token": secrets.token_hex(8),
        }
        self.took_over = None
        for _ in range(3):  # create; or take a stale lock over and create again
            if self._create(record):
                self._record = record
                return self.took_over
            with self._directory_flock():
                current, problem = self._read()
                if current is None and problem is None:
                    continue  # released meanwhile: try again
                verdict = problem or self._stale(current)
                if verdict is None:
                    raise RunLockedError(self._in_use(current))
                self.path.unlink(missing_ok=True)  # under the flock: still the stale lock we read
                self.took_over = f"run lock: took over {self.path}: {verdict}"
        raise RunLockedError(
            f"run directory {self.run_dir}: the lock {self.path} keeps changing hands; "
            "another process is starting in it: wait for it or pass another --run-dir"
        )

    def release(self) -> None:
        """Remove the lock file if it is still ours (it is left alone if someone took it over)."""
        if self._record is None:
            return
        with self._directory_flock():
            current, _ = self._read()
            if current == self._record:
                self.path.unlink(missing_ok=True)
        self._record = None

    # ------------------------------------------------------------------ internals

    def _create(self, record: dict) -> bool:
        """Atomically create the lock file holding ``record``; False when one exists."""
        tmp = self.run_dir / f"{LOCK_FILE}.tmp-{record['pid']}-{record['token']}"
        try:
            with open(tmp, "x") as f:
                f.write(json.dumps(record))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno in DISK_FULL_ERRNOS:  # exit 1 like every full disk: nothing to fix in the command
                raise DiskFullError(
                    f"no room on the disk for the lock file {self.path} (the write failed: {e.strerror}); "
                    "free some space on that disk and run the command again"
                ) from None
            raise UserError(
                f"cannot create the lock file {self.path} ({e.strerror or e}); check that the run "
                "directory is writable"
            ) from None
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> tuple[dict | None, str | None]:
        """(the lock's record, None), (None, None) when there is no lock, or (None, why it is garbled)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None, None
        except OSError as e:
            return None, f"the lock file is unreadable ({e.strerror or e})"
        try:
            record = json.loads(raw)
        except ValueError:
            return None, f"the lock file is garbled ({raw[:40]!r})"
        shape = {"pid": int, "host": str, "started": str}
        if (
            not isinstance(record, dict)
            or not all(
                isinstance(record.get(k), t) and not isinstance(record.get(k), bool) for k, t in shape.items()
            )
            or record["pid"] <= 0  # os.kill(0 or -1, 0) would ask about whole process groups
        ):
            return None, f"the lock file is garbled ({raw[:40]!r})"
        return record, None

    def _stale(self, record: dict) -> str | None:
        """Why the holder of ``record`` is gone, or None when it may live."""
        if record["host"] != socket.gethostname():
            return None
        pid = record["pid"]
        holder = f"pid {pid} on host {record['host']} (since {record['started']})"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"{holder} is gone"
        except PermissionError:
            pass  # alive, under another user
        except OSError:  # a pid out of range, e.g. garbage that parsed as a number
            return f"{holder} cannot exist"
        started = _process_start(pid)
        try:
            locked = datetime.datetime.fromisoformat(record["started"]).timestamp()
        except ValueError:
            return None  # no time to compare: the live pid may be the holder
        if started is not None and started > locked + _REUSE_SLACK_S:
            return f"{holder} is gone (that pid now belongs to a process started later)"
        return None

    def _in_use(self, record: dict) -> str:
        who = f"pid {record['pid']} on host {record['host']} since {record['started']}"
        if record["host"] != socket.gethostname():
            return (
                f"run directory {self.run_dir} is in use by {who}, which this host "
                f"({socket.gethostname()}) cannot check; wait for it or pass another --run-dir, or delete "
                f"{self.path} if that process is gone"
            )
        return f"run directory {self.run_dir} is in use by {who}; wait for it or pass another --run-dir"

    @contextlib.contextmanager
    def _directory_flock(self):
        fd = os.open(self.run_dir, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing drops the flock


def _process_start(pid: int) -> float | None:
    """Unix time at which process ``pid`` started (Linux /proc), or None where that is unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime"))
        ticks = int(stat.rpartition(")")[2].split()[19])  # field 22: starttime, after "pid (comm)"
        return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
