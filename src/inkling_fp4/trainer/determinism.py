"""Deterministic mode (``train.deterministic``): the same config, seed and data give the same bits.

Why: two GPU runs of one config drift apart by as much as the NVFP4-vs-FP8 gap under study, because
some kernels sum in an order that changes from run to run. Three switches pin the order down:

- ``torch.use_deterministic_algorithms(True)``, strict. NOTE ``warn_only=True`` is not a milder form:
  torch then keeps the non-deterministic attention backward (dQ by atomics) and only warns.
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (when unset): required by cuBLAS, and read once when the first
  cuBLAS handle is made, so the mode must be on before the first GPU GEMM.
- The SSD Triton kernels run their first autotune candidate, not the fastest by timing (candidates
  differ in the block sizes of their reductions).

Already order-independent: the quantizers' ``atomic_max`` of amaxes, the seeded stochastic rounding,
the fixed-grid Triton kernels. The mode costs speed and is process-wide; ``enable_determinism``
returns the settings it replaced.
"""

from __future__ import annotations

import importlib.util
import os
import random
from dataclasses import dataclass

import numpy as np
import torch

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""The larger of cuBLAS's two documented reproducible settings (``:16:8`` can be slower)."""


@dataclass(frozen=True)
class DeterminismSettings:
    """The process-wide switches that deterministic mode sets, as they were at one moment."""

    algorithms: bool
    warn_only: bool
    cublas_workspace: str | None
    fixed_kernel_configs: bool


def _kernel_tuning():
    """The SSD kernels' tuning module, or None without triton (then nothing autotunes)."""
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
    """Make the rest of this process bit-reproducible (call before any GPU GEMM); returns the old settings."""
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
