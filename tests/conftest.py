"""Set-up of the test session shared by every module."""

import os


def pytest_configure(config):
    """Under pytest-xdist (one worker per core): one CPU thread per worker and per child process it
    starts, since two workers of two spinning OpenMP threads each on two cores slow every torch test
    several times over; and a torchrun port of its own per worker (``PET_MASTER_PORT``, inherited by the
    children), since two two-process runs on two workers at once would both bind 29500."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...
    if worker is None:
        return
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    os.environ["PET_MASTER_PORT"] = str(29_400 - int(worker.removeprefix("gw")))
    import torch

    torch.set_num_threads(1)
