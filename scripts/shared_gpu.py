"""Several processes on one GPU through the CUDA MPS daemon (bench_rl.py's and sweep_rl.py's runs).

Without MPS the GPU runs one process's context at a time: a run's decode steps, whose small kernels
leave most of the SMs idle, hold the others off. Through the daemon the runs' kernels run side by
side (BENCHMARKS.md, "RL end to end": the eight runs' training side 0.62x as long). The daemon is
optional: where it is missing or a client cannot reach the GPU through it, the runs time-slice.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

MPS_CONTROL = "nvidia-cuda-mps-control"
MPS_PROBE = "import torch; x = torch.ones(256, 256, device='cuda'); print(float((x @ x).sum().item()))"
"""A client of the daemon before the runs: one that cannot reach the GPU through it turns MPS off."""


@dataclass
class Mps:
    """One command's MPS control daemon: its pipe and log directories are the command's own, so a
    daemon someone else runs is left alone."""

    binary: str
    directory: Path

    @property
    def env(self) -> dict[str, str]:
        """What a client needs to find the daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.directory / "pipe"),
                "CUDA_MPS_LOG_DIRECTORY": str(self.directory / "log")}  # fmt: skip

    def clients(self) -> int:
        """Client connections the daemon's log recorded (0 when it has none)."""
        log = self.directory / "log" / "control.log"
        text = log.read_text(errors="replace") if log.is_file() else ""
        return sum("new client" in line.lower() for line in text.splitlines())

    def stop(self) -> None:
        subprocess.run([self.binary], input="quit\n", text=True, env={**os.environ, **self.env},
                       capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(self.directory, ignore_errors=True)


@dataclass
class Sharing:
    """How the runs of one command share the GPU: what each run's environment needs (nothing when
    they time-slice) and one line that says how and why."""

    line: str
    env: dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def share_gpu(mode: str, device: str, width: int, env: dict[str, str], echo=print) -> Iterator[Sharing]:
    """Within this context ``width`` runs on ``device`` share the GPU through the MPS daemon where it
    starts (see :func:`start_mps`); on the way out the daemon's client connections are added to the
    line and the daemon is quit."""
    mps, line = start_mps(mode, device, width, env, echo)
    sharing = Sharing(line, mps.env if mps is not None else {})
    try:
        yield sharing
    finally:
        if mps is not None:
            sharing.line += f"; {mps.clients()} client connections"
            mps.stop()


def start_mps(mode: str, device: str, width: int, env: dict[str, str], echo=print) -> tuple[Mps | None, str]:
    """The daemon for ``width`` runs at once on ``device`` (None where it does not apply or does not
    start: the runs then time-slice the GPU), and one line that says which and why. ``env``: the runs'
    environment, which the probe client gets too (with the daemon's variables)."""
    if mode == "off":
        return None, "time-sliced (--mps off)"
    if not device.startswith("cuda"):
        return None, f"not at all (the runs are on {device})"
    if width < 2:
        return None, "one run at a time"
    binary = shutil.which(MPS_CONTROL)
    if binary is None:
        return None, f"time-sliced ({MPS_CONTROL} is not on PATH)"
    mps = Mps(binary, Path(tempfile.mkdtemp(prefix="fp4train-mps-")))
    for name in ("pipe", "log"):
        (mps.directory / name).mkdir()
    started = subprocess.run([binary, "-d"], env={**os.environ, **mps.env}, capture_output=True, text=True,
                             timeout=60)  # fmt: skip
    if started.returncode != 0:
        shutil.rmtree(mps.directory, ignore_errors=True)
        why = (started.stderr or started.stdout).strip().splitlines()[-1:] or [f"exit {started.returncode}"]
        return None, f"time-sliced (the MPS daemon did not start: {why[0]})"
    probe = subprocess.run([sys.executable, "-c", MPS_PROBE], env={**env, **mps.env},
                           capture_output=True, text=True, timeout=180)  # fmt: skip
    if probe.returncode != 0:
        mps.stop()
        why = probe.stderr.strip().splitlines()[-1:] or [f"exit {probe.returncode}"]
        return None, f"time-sliced (a client could not use the GPU through MPS: {why[0]})"
    echo(f"MPS: control daemon up ({mps.directory}): the runs' kernels share the GPU")
    return mps, "MPS (the runs' kernels side by side)"
