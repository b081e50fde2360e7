"""The model's elementwise glue (norms, gates, squared ReLU, dt) fused by ``torch.compile`` on CUDA.

Why: around its GEMMs and the scan, a layer runs chains of small elementwise ops (a gated group norm is
some ten of them, forward and backward), each one a full pass over a [B, L, width] tensor. On the GPU
those passes, not FLOPs, are the cost: in eager mode they doubled a Mamba-2 layer's time. Compiling
each glue function fuses its chain into one kernel per direction with the same math.

One definition of the math: each glue function is written once in plain PyTorch (the reference, what
runs on CPU and in the tests) and :func:`cuda_compiled` wraps it, so the compiled form runs only on
CUDA tensors. CPU runs never pay for compilation. Inside a model that is itself being compiled the
plain function is traced into the enclosing graph instead. :func:`reference_glue` switches the
compiled forms off (the benchmark's and the tests' fast-versus-reference checks).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

_ENABLED = [True]


@contextlib.contextmanager
def reference_glue() -> Iterator[None]:
    """Within this context every :func:`cuda_compiled` function runs its plain PyTorch form."""
    previous = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = previous


def cuda_compiled(fn: Callable) -> Callable:
    """``fn`` itself, except on CUDA tensors (judged by the first argument), where it runs through
    ``torch.compile`` (built on first use)."""
    compiled = None

    @functools.wraps(fn)
    def dispatch(*args):
        nonlocal compiled
        if not (_ENABLED[0] and args[0].is_cuda) or torch.compiler.is_compiling():
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args)

    dispatch.reference = fn
    return dispatch
