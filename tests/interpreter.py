"""Triton kernels on the CPU: tests marked ``interpreted`` run in a child pytest with TRITON_INTERPRET=1.

The interpreter has to be switched on before triton is imported, and must not leak into the rest of
the test session, so each kernel test file has one parent test that re-runs that file's interpreter
tests in a child process (:func:`run_interpreted`). ``TRITON_INTERPRET=1 python -m pytest FILE`` runs
them directly.
"""

import os
import subprocess
import sys

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRET, reason="runs in the TRITON_INTERPRET=1 child process")


def run_interpreted(test_file: str, *select: str, timeout: int = 300) -> None:
    """Run the tests of ``test_file`` that ``select`` picks (pytest ``-k`` / ``-m`` arguments) under the
    interpreter; fail with the child's output if any of them fails."""
    pytest.importorskip("triton")
    if INTERPRET:
        pytest.skip("already running under the interpreter")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *select,
           test_file]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def kernel_test(fn):
    """A test that runs kernels: on a CUDA device (marked ``gpu``), or on CPU in the TRITON_INTERPRET=1
    child process that :func:`run_interpreted` starts with ``-m gpu``."""
    import torch

    marks = [
        pytest.mark.gpu,
        pytest.mark.skipif(
            not (INTERPRET or torch.cuda.is_available()),
            reason="runs on a CUDA device, or in the TRITON_INTERPRET=1 child process",
        ),
        # the interpreter's numpy warns where the adversarial inputs overflow on purpose
        pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered"),
    ]
    for mark in marks:
        fn = mark(fn)
    return fn


def interpreted_parent(test_file: str, *select: str):
    """The parent test of a file of :func:`kernel_test` tests (bind it to a ``test_*`` name there): on a
    machine without CUDA it runs them under the interpreter (``select``: pytest arguments, by default
    the kernel tests without the model ones), on one with CUDA they run directly."""
    import torch

    def test_kernels_under_triton_interpreter():
        if torch.cuda.is_available():
            pytest.skip("the kernel tests run on the GPU here")
        run_interpreted(test_file, *(select or ("-m", "gpu", "-k", "not model")))

    return test_kernels_under_triton_interpreter
