"""Deterministic mode (``train.deterministic``): the same config, seed and data give the same bits.

Why: two GPU runs of one config differ from the first steps on (loss 8.9219 vs 8.9223 at step 10 of
hybrid-125m) and drift apart by a percent or two, as much as the NVFP4-vs-FP8 gap the comparison is
after. The last bits move because some kernels add the same numbers in an order that changes from
run to run; training amplifies any difference. Three switches pin the order down:

- ``torch.use_deterministic_algorithms(True)``: torch ops take their deterministic kernels (the
  flash and memory-efficient attention backward among them, which otherwise accumulate dQ with
  atomics) and torch.compile's generated reductions keep a fixed config instead of the fastest by
  timing. It is strict (``warn_only=False``): an op without a deterministic kernel raises rather
  than warns. NOTE warn_only=True is not a milder form of the same: in that mode torch keeps the
  non-deterministic attention backward and only warns, so the run would not be reproducible.
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (when unset): cuBLAS is deterministic only with a fixed
  workspace per stream; torch refuses cuBLAS GEMMs in strict mode without it. cuBLAS, and torch's
  workspace allocation, read the variable once, when the first cuBLAS handle is made, so it must be
  set before the first GEMM on the GPU: the loop switches the mode before it builds the model.
- The SSD Triton kernels run their first autotune candidate instead of the fastest by timing
  (:func:`inkling_fp4.model.ssd_kernels.tuning.set_fixed_configs`): the candidates differ in the
  block sizes of their reduction loops, so the choice, made by timing in each process, changes the
  order of the sums.

What is already order-independent and needs nothing: the NVFP4 quantizers' ``atomic_max`` of
non-negative amaxes (a maximum does not depend on the order), the stochastic-rounding streams (seeded
per run) and the fixed-grid Triton kernels (one program per output tile, sums in a fixed order).

The price is speed (the deterministic attention backward, untimed kernel configs) and that the mode is
process-wide: it stays on for the rest of the process. ``enable_determinism`` returns the settings it
replaced so a caller that runs something else afterwards can restore them.
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""Eight cuBLAS workspaces of 4 MiB per stream: the larger of the two settings cuBLAS documents as
reproducible (the other, ``:16:8``, is smaller and can be slower)."""


@dataclass(frozen=True)
class DeterminismSettings:
    """The process-wide switches that deterministic mode sets, as they were at one moment."""

    algorithms: bool
    warn_only: bool
    cublas_workspace: str | None
    fixed_kernel_configs: bool


def _kernel_tuning():
    """The SSD kernels' tuning module, or None where triton is not installed (a CPU install without the
    ``gpu`` extra: then no kernel autotunes, and there is nothing to fix)."""
    if importlib.util.find_spec("triton") is None:
        return None
    from inkling_fp4.model.ssd_kernels import tuning  # needs triton

    return tuning


def current_settings() -> DeterminismSettings:
    tuning = _kernel_tuning()
    return DeterminismSettings(
        algorithms=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        fixed_kernel_configs=tuning is not None and tuning.fixed_configs(),
    )


def restore_settings(settings: DeterminismSettings) -> None:
    """Put the switches back as ``settings`` holds them (cuBLAS handles already made keep theirs)."""
    torch.use_deterministic_algorithms(settings.algorithms, warn_only=settings.warn_only)
    if settings.cublas_workspace is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = settings.cublas_workspace
    tuning = _kernel_tuning()
    if tuning is not None:
        tuning.set_fixed_configs(settings.fixed_kernel_configs)


def enable_determinism() -> DeterminismSettings:
    """Make the rest of this process bit-reproducible on the GPU; returns the settings it replaced.

    Call it before the first GEMM on the GPU (see the module docstring for why)."""
    before = current_settings()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    torch.use_deterministic_algorithms(True, warn_only=False)
    tuning = _kernel_tuning()
    if tuning is not None:
        tuning.set_fixed_configs(True)
    return before


def describe() -> str:
    """One log line saying what the mode pinned down."""
    return (
        "determinism: on (torch deterministic algorithms, strict; CUBLAS_WORKSPACE_CONFIG="
        f"{os.environ.get('CUBLAS_WORKSPACE_CONFIG')}; SSD kernels on their first autotune config)"
    )


def seed_everything(seed: int) -> None:
    """Seed the global generators (torch, Python, NumPy): the first thing every stage does."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
