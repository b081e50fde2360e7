"""A CUDA graph capture of forwards (and backwards) whose GEMMs are quantized.

For the training step's graph (``trainer/graphed_step.py``) and the decode step's
(``model/graphed_decoder.py``). Two things must be arranged:

- NVFP4 amax words (atomic-max targets from a pool zeroed once, ``numerics/kernels/amax.py``): the
  capture takes a new pool whose zero fill is part of the graph, so each replay starts from zero; a
  new pool after the capture keeps eager code off the graph's words.
- deferred NaN/Inf records go to the capture's own list and no check runs (a device read invalidates
  a capture); the caller copies them out after each replay (``finite_guard.record_replay``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from inkling_fp4.precision import finite_guard
from inkling_fp4.precision.quant_linear import QuantLinear


@contextlib.contextmanager
def quantized_graph(graph: torch.cuda.CUDAGraph, device: torch.device) -> Iterator[list]:
    """``torch.cuda.graph(graph)`` for quantized GEMMs; yields the list of the capture's NaN/Inf records."""
    from inkling_fp4.numerics.kernels.amax import start_new_pool  # needs triton: imported here

    try:
        with finite_guard.capturing() as records, torch.cuda.graph(graph):
            start_new_pool(device)  # amax words zeroed inside the graph, on every replay
            yield records
    finally:
        start_new_pool(device)  # ... and never handed to eager code


def graph_blocker(model: nn.Module, world_size: int, device: torch.device) -> str | None:
    """Why a training step of ``model`` under its current recipes cannot be a CUDA graph, or None.
    Ask again after every precision change."""
    if device.type != "cuda":
        return "CUDA graphs need a CUDA device"
    if world_size > 1:
        return "CUDA graphs are single-process here (DDP all-reduces from hooks inside the backward)"
    if finite_guard.eager():
        return "eager finite checks (FP4TRAIN_EAGER_FINITE_CHECKS) read the device at every quantization"
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.recipe is not None and m.recipe.backend == "te":
            return "the Transformer Engine backend is not captured as a CUDA graph here"
    return None
