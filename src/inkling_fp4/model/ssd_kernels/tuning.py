"""How the SSD kernels are compiled: matmul operand types, autotune configs, the interpreter switch,
and the fixed-config switch of deterministic runs.

Chunk matmuls go through :func:`mma`: operands rounded to the input dtype (BF16 on the fast path),
FP32 accumulation; FP32 inputs get ``input_precision="ieee"`` (no TF32). Triton's interpreter
(``TRITON_INTERPRET=1``) multiplies BF16 operands as raw integers and truncates FP32 -> BF16, so there
:func:`cast_rne` rounds operands to BF16 and widens them to FP32: the GPU's products, exactly.

Deterministic runs (``train.deterministic``): autotune candidates differ in their reduction block
sizes, so a choice made by timing changes the last bits from process to process.
:func:`set_fixed_configs` makes every kernel declared with :func:`autotune` take its first candidate.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_INTERPRET = tl.constexpr(INTERPRET)

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def operand_types(dtype: torch.dtype) -> tuple[tl.dtype, tl.dtype, str]:
    """Input dtype -> (IN_DTYPE operands are rounded to, MM_DTYPE tl.dot sees, PRECISION)."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"SSD kernels take bfloat16, float16 or float32 inputs, not {dtype}")
    in_dtype = _TL_DTYPES[dtype]
    mm_dtype = tl.float32 if INTERPRET else in_dtype
    return in_dtype, mm_dtype, "ieee" if mm_dtype == tl.float32 else "tf32"


def _cast_rne(v, DTYPE: tl.constexpr):
    """v rounded to DTYPE to nearest (what the GPU does; emulated for BF16 under the interpreter)."""
    if _INTERPRET and DTYPE == tl.bfloat16:
        # Veltkamp split: hi = v rounded to nearest with 8 significant bits, BF16's precision, so the
        # interpreter's truncating cast below is exact.
        v = v.to(tl.float32)
        split = v * 65537.0  # 2^16 + 1
        return (split - (split - v)).to(DTYPE)
    else:
        return v.to(DTYPE)


def _mma(a, b, acc, IN_DTYPE: tl.constexpr, MM_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ b with a, b rounded to IN_DTYPE, FP32 accumulation."""
    a = cast_rne(a, IN_DTYPE).to(MM_DTYPE)
    b = cast_rne(b, IN_DTYPE).to(MM_DTYPE)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# The interpreter re-patches triton.language on every call of a @triton.jit helper (~10 ms each); the
# helpers run as plain Python there, which the interpreter executes the same way.
cast_rne = _cast_rne if INTERPRET else triton.jit(_cast_rne)
mma = _mma if INTERPRET else triton.jit(_mma)


def configs(candidates: list[tuple[dict, int]], num_stages: int = 2) -> list[triton.Config]:
    """Autotune candidates from (block sizes, num_warps) pairs; only the first under the interpreter."""
    out = [triton.Config(dict(blocks), num_warps=w, num_stages=num_stages) for blocks, w in candidates]
    return out[:1] if INTERPRET else out


def block_size(dim: int) -> int:
    """A whole-dimension block: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, triton.next_power_of_2(dim))


_fixed_configs = False
_tuners: list = []  # every Autotuner made by autotune() below


def fixed_configs() -> bool:
    """Whether the SSD kernels run their first autotune candidate instead of the fastest one."""
    return _fixed_configs


def set_fixed_configs(on: bool) -> None:
    """Run every SSD kernel with its first candidate config (on) or the fastest by timing (off). Changing
    the mode forgets the choices made: triton calls the prune hook only for shapes it has not tuned yet."""
    global _fixed_configs
    if on != _fixed_configs:
        for tuner in _tuners:
            tuner.cache.clear()
    _fixed_configs = on


def first_config_when_fixed(configs: list, named_args: dict | None = None, **kwargs) -> list:
    """triton's ``early_config_prune`` hook: only ``configs[0]`` in fixed mode (no timing), else all.
    NOTE older triton passed only (configs, named_args), hence the defaults."""
    return list(configs[:1]) if _fixed_configs else list(configs)


CACHE_TIMINGS = "cache_results" in inspect.signature(triton.autotune).parameters
"""Whether this triton keeps autotune timings on disk. Without it every process (each command, each RL
run) times every candidate of every kernel again for each new shape before its first step; with it
the choice is read back from triton's cache, keyed by the kernel's source, the GPU, the candidates and
the shape key, so a later process also picks the same tile."""


def autotune(candidates: list[triton.Config], key: list[str]) -> Callable:
    """``triton.autotune`` with the fixed-config hook and on-disk timings, for every autotuned kernel of
    the package."""
    cached = {"cache_results": True} if CACHE_TIMINGS else {}

    def decorate(kernel):
        tuner = triton.autotune(
            configs=candidates,
            key=key,
            prune_configs_by={"early_config_prune": first_config_when_fixed},
            **cached,
        )(kernel)
        _tuners.append(tuner)
        return tuner

    return decorate
