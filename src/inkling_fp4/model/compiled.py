"""The fast CUDA forms of the model's elementwise glue: hand-written Triton kernels for the five
functions called in every block, ``torch.compile`` for the rest.

A layer runs chains of small elementwise ops, each a memory pass; a fused form runs a chain as one
kernel per direction. The five hot functions get Triton kernels because a ``torch.compile``'d call costs
far more host time than one autograd Function around one launch, and small models wait on the host.

Each glue function is written once in PyTorch (the reference, run on CPU and in the tests) and a
decorator picks its fast form on CUDA tensors: :func:`cuda_kernel` (a Triton function, imported on
first use) or :func:`cuda_compiled`. Inside a compiled model the plain function is traced instead.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator

import torch

_ENABLED = [True]
_KERNEL_PACKAGE = "inkling_fp4.model.glue_kernels"


@contextlib.contextmanager
def reference_glue() -> Iterator[None]:
    """Within this context every decorated function runs its plain PyTorch form."""
    previous = _ENABLED[0]
    _ENABLED[0] = False
    try:
        yield
    finally:
        _ENABLED[0] = previous


def glue_enabled() -> bool:
    """False inside :func:`reference_glue` (the plain PyTorch forms run)."""
    return _ENABLED[0]


def fast_forms_on(first: torch.Tensor) -> bool:
    """Whether a decorated function called with ``first`` as its first argument runs its fast form."""
    return _ENABLED[0] and first.is_cuda and not torch.compiler.is_compiling()


def _cuda_dispatch(fn: Callable, build_fast: Callable[[], Callable]) -> Callable:
    """``fn``, or where :func:`fast_forms_on` says so the callable ``build_fast`` returns (built once)."""
    fast = None

    @functools.wraps(fn)
    def dispatch(*args, **kwargs):
        nonlocal fast
        if not fast_forms_on(args[0]):
            return fn(*args, **kwargs)
        if fast is None:
            fast = build_fast()
        return fast(*args, **kwargs)

    dispatch.reference = fn
    return dispatch


def cuda_compiled(fn: Callable) -> Callable:
    """``fn``, run through ``torch.compile`` on CUDA tensors (judged by the first argument)."""
    return _cuda_dispatch(fn, lambda: torch.compile(fn))


def cuda_kernel(name: str) -> Callable[[Callable], Callable]:
    """Decorate a reference function to run, on CUDA tensors, the Triton function ``name`` =
    "module.function" of ``model/glue_kernels``, which takes and returns what the reference does."""
    module_name, _, function_name = name.rpartition(".")
    if not module_name:
        raise ValueError(f"cuda_kernel takes 'module.function', got {name!r}")

    def load_kernel() -> Callable:
        return getattr(importlib.import_module(f"{_KERNEL_PACKAGE}.{module_name}"), function_name)

    return lambda fn: _cuda_dispatch(fn, load_kernel)
