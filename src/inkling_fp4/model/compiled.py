"""The fast CUDA forms of the model's elementwise glue: hand-written Triton kernels for the five
functions called in every block, ``torch.compile`` for the rest.

Why fuse at all: around its GEMMs and the scan, a layer runs chains of small elementwise ops (a gated
group norm is some ten of them, forward and backward), each one a full pass over a [B, L, width]
tensor. On the GPU those passes, not FLOPs, are the cost: in eager mode they doubled a Mamba-2 layer's
time. A fused form runs each chain as one kernel per direction with the same math.

Why Triton kernels for rms_norm, add_rms_norm, skip_gated_rms_norm, squared_relu and dt_softplus: they
run in every block, some ninety calls per training step forward plus as many backward, and a
``torch.compile``'d call costs 0.3-0.4 ms of host time (guards, the AOT-autograd runtime wrappers,
inductor's Python launchers). Small models' steps wait on the host, not the GPU, so that overhead
adds straight to the step time. One autograd Function around one Triton launch per direction costs
a fraction of it (:mod:`inkling_fp4.model.glue_kernels`). The rest (the loss's per-chunk softmax, a
few calls per step; gated_rms_norm, which the mixer's fused skip path replaces) stay compiled: there
the host time is small and compiling is cheaper to maintain than a kernel.

One definition of the math: each glue function is written once in plain PyTorch (the reference, what
runs on CPU and in the tests) and a decorator picks its fast form on CUDA tensors only:
:func:`cuda_kernel` names the Triton function, imported on first use (triton is optional and CPU runs
never import it), and :func:`cuda_compiled` compiles the reference itself. CPU runs never pay for
either. Inside a model that is itself being compiled, the plain function is traced into the
enclosing graph instead. :func:`reference_glue` switches the fast forms off (the benchmark's and the
tests' fast-versus-reference checks); ``fn.reference`` is the plain function of a decorated ``fn``.
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
    """Within this context every :func:`cuda_compiled` and :func:`cuda_kernel` function runs its
    plain PyTorch form."""
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
    """``fn`` itself, except where :func:`fast_forms_on` says otherwise: then the callable that
    ``build_fast`` returns (built on first use) with the same arguments."""
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
    """``fn`` itself, except on CUDA tensors (judged by the first argument), where it runs through
    ``torch.compile`` (built on first use)."""
    return _cuda_dispatch(fn, lambda: torch.compile(fn))


def cuda_kernel(name: str) -> Callable[[Callable], Callable]:
    """Decorate a reference function so that, on CUDA tensors (judged by the first argument), it runs
    the Triton function ``name`` = "module.function" of :mod:`inkling_fp4.model.glue_kernels` with the
    same arguments; that module is imported on first use. The kernel function must take the
    reference's arguments and return what it returns."""
    module_name, _, function_name = name.rpartition(".")
    if not module_name:
        raise ValueError(f"cuda_kernel takes 'module.function', got {name!r}")

    def load_kernel() -> Callable:
        return getattr(importlib.import_module(f"{_KERNEL_PACKAGE}.{module_name}"), function_name)

    return lambda fn: _cuda_dispatch(fn, load_kernel)
