"""A CUDA graph capture of forwards (and backwards) whose GEMMs are quantized.

Two things in the quantizers must be arranged for a capture, for the training step's graph
(``train/graphed_step.py``) and the decode step's (``model/decode_graph.py``) alike:

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

from inkling_fp4.precision import finite_guard


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
