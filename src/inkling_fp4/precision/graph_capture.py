"""A CUDA graph capture of forwards (and backwards) whose GEMMs are quantized.

Two things in the quantizers must be arranged for a capture, for the training step's graph
(``trainer/graphed_step.py``) and the decode step's (``model/graphed_decoder.py``) alike:

- the NVFP4 amax words: the amax pass reduces into a word with an atomic max, taken from a pool
  zeroed once (``numerics/kernels/amax.py``). A graph replays into the same words, so the capture
  takes them from a new pool buffer whose zero fill is part of the graph, and every replay starts
  from zero (a word zeroed once, before the capture, would carry the largest amax of every earlier
  replay into the next). A new pool after the capture keeps eager code off the graph's words;
- the deferred NaN/Inf records (``precision/finite_guard.py``): inside the capture they go to a list
  of the capture's own, and no check runs (a check reads the device, which invalidates a capture).
  The caller copies their amaxes out after each replay (``finite_guard.record_replay``).
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
    """``torch.cuda.graph(graph)`` for quantized GEMMs (see the module docstring); yields the list the
    capture's NaN/Inf records go to."""
    from inkling_fp4.numerics.kernels.amax import start_new_pool  # needs triton: imported here

    try:
        with finite_guard.capturing() as records, torch.cuda.graph(graph):
            start_new_pool(device)  # amax words zeroed inside the graph, on every replay
            yield records
    finally:
        start_new_pool(device)  # ... and never handed to eager code


def graph_blocker(model: nn.Module, world_size: int, device: torch.device) -> str | None:
    """Why a training step of ``model`` as its layers' recipes stand now cannot be replayed as a CUDA
    graph, or None when it can. Ask again after every precision change."""
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
