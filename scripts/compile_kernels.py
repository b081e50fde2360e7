"""Compile the Triton kernels that GPU tests launch, for a GPU this machine does not have.

    PYTHONPATH=src:tests python -O scripts/compile_kernels.py [--arch 90] -m gpu tests/test_X.py [-k ...]

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python, not Triton's compiler, so what only the
compiler refuses (a value it needs as a constexpr, a layout it cannot lower) shows first on the GPU.
This runs the selected ``kernel_test`` tests on CPU tensors with Triton's real compiler behind a
stand-in driver for sm_<arch> (front end, LLVM and the wheel's ptxas), launching nothing: every kernel
and specialisation the tests reach is compiled, and the script exits 1 if any fails to compile. Run
it with ``python -O``: the tests' assertions then do not stop them on the unlaunched (empty) outputs.
The tests' own pass/fail means nothing here; their kernels' compilation is the result.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import os
import pkgutil
import sys

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

# the modules whose launchers check a tensor's device at call time (their import-time flags stay off,
# so the kernels and helpers are the compiled forms)
CALL_TIME_CHECKS = (
    "inkling_fp4.model.conv_triton",
    "inkling_fp4.model.glue_kernels.common",
    "inkling_fp4.model.glue_kernels.gated_norm_kernels",
)


class _Compiled(Exception):
    """Raised after a kernel compiled: its launch is skipped."""


class OfflineDriver:
    """The driver calls a launch makes before compiling, for sm_<arch> and no device."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_benchmarker(self):  # autotuning: every config compiled, the first one "fastest"
        def bench(fn, quantiles=None, **kwargs):
            fn()
            return [1.0] * len(quantiles) if quantiles else 1.0

        return bench


def _gpu_rounding() -> bool:
    """``nvfp4_rht.native_bf16`` as on the GPU: the kernels compile their native FP32 -> BF16 cast."""
    return True


def _raise_compiled(*args, **kwargs):
    raise _Compiled


def install(arch: int) -> tuple[collections.Counter, dict]:
    """Compile, never launch: returns the compiled counts by kernel and the compile errors."""
    knobs.runtime.interpret = False
    driver.set_active(OfflineDriver(arch))
    knobs.runtime.jit_post_compile_hook = _raise_compiled
    compiled, errors = collections.Counter(), {}
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        name = self.fn.__name__
        try:
            run(self, *args, grid=grid, warmup=warmup, **kwargs)
        except _Compiled:
            compiled[name] += 1
        except triton.compiler.errors.CompilationError as e:
            errors.setdefault(name, str(e)[-2000:])
        except AttributeError as e:  # a cached specialisation reaching the (absent) launcher: compiled
            if "launcher" not in str(e):
                raise

    JITFunction.run = compile_only
    return compiled, errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (Hopper), 100")
    args, pytest_args = p.parse_known_args()
    compiled, errors = install(args.arch)
    import inkling_fp4
    from inkling_fp4.numerics.kernels import nvfp4_rht

    for module in pkgutil.walk_packages(inkling_fp4.__path__, "inkling_fp4."):
        importlib.import_module(module.name)  # every kernel decorated before the flag below is set
    os.environ["TRITON_INTERPRET"] = "1"  # read at call time: the launchers take CPU tensors
    for name in CALL_TIME_CHECKS:
        sys.modules[name].INTERPRET = True
    for module in list(sys.modules.values()):  # the flag would also pick the interpreter's BF16 rounding
        if getattr(module, "native_bf16", None) is nvfp4_rht.native_bf16:
            module.native_bf16 = _gpu_rounding
    import pytest

    import interpreter  # tests/: its kernel_test marks run the tests under the flag

    interpreter.INTERPRET = True
    pytest.main(["-q", "-o", "addopts=", "-p", "no:cacheprovider", "--assert=plain", *pytest_args])
    print(f"compiled for sm_{args.arch}: " + ", ".join(f"{k} x{v}" for k, v in sorted(compiled.items())))
    for name, message in errors.items():
        print(f"\n=== {name} does not compile\n{message}")
    print(f"{len(errors)} kernel(s) failed to compile" if errors else "every kernel reached compiled")
    return 1 if errors or not compiled else 0


if __name__ == "__main__":
    sys.exit(main())
