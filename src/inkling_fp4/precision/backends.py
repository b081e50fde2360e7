"""Which kernels compute a recipe's GEMMs on this machine, chosen once and said out loud.

- ``emulated`` (any device): exact block values multiplied in BF16 with FP32 accumulation, FP32
  tensor scales on the output; only the accumulation order differs from a tensor core.
- ``native-fp8`` (sm_89+, FP8 recipes): ``torch._scaled_mm``. Blockwise 1×128/128×128 scaling needs
  cuBLAS ≥ 12.9 on Hopper; it is probed once per device against emulation, and emulated (and
  reported by :func:`describe_backend`) where it fails.
- ``te`` (Blackwell, sm_100+): Transformer Engine, imported lazily only when used.

``auto`` picks the fastest faithful one; a backend the machine lacks is a UserError, never a fallback.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from inkling_fp4.errors import UserError
from inkling_fp4.precision import native_fp8

FP8_RECIPES = ("fp8", "fp8-tensorwise")
TE_RECIPES = ("nvfp4", "fp8", "fp8-tensorwise")


def hardware_summary(device: torch.device) -> str:
    """'NVIDIA H200 (sm_90)' or 'CPU only (no CUDA device)': what error messages and logs name."""
    if device.type != "cuda":
        if torch.cuda.is_available():
            return f"CPU tensors (CUDA device present: {torch.cuda.get_device_name()})"
        return "CPU only (no CUDA device)"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=1)
def te_available() -> bool:
    """Whether ``transformer_engine.pytorch`` imports here (checked once, imported only if present)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # a broken or CPU-only install counts as absent
        return False
    return True


def resolve_backend(requested: str, recipe_name: str, device: torch.device) -> str:
    """The backend that will run ``recipe_name`` on ``device`` for the config value ``requested``."""
    if recipe_name == "bf16":
        return "emulated"
    cap = _capability(device)
    if requested == "auto":
        if cap >= (10, 0) and recipe_name in TE_RECIPES and te_available():
            return "te"
        if cap >= (8, 9) and recipe_name in FP8_RECIPES:
            return "native-fp8"
        return "emulated"
    if requested == "emulated":
        return "emulated"
    if requested == "native-fp8":
        if recipe_name not in FP8_RECIPES:
            raise UserError(
                f"precision.backend=native-fp8 runs only the fp8 recipes, not '{recipe_name}'; "
                "use backend=emulated (any device) or te (Blackwell), or backend=auto"
            )
        if cap < (8, 9):
            raise UserError(
                f"precision.backend=native-fp8 needs an FP8 GPU (sm_89 or newer), found "
                f"{hardware_summary(device)}; use precision.backend=emulated or auto"
            )
        return "native-fp8"
    if requested == "te":
        if recipe_name not in TE_RECIPES:
            raise UserError(
                f"precision.backend=te has no '{recipe_name}' recipe (Transformer Engine runs "
                f"{', '.join(TE_RECIPES)}); use precision.backend=emulated"
            )
        if not te_available():
            raise UserError(
                "precision.backend=te needs transformer_engine.pytorch, which does not import here "
                f"(found {hardware_summary(device)}); install it (pip install 'fp4train[te]') "
                "or use precision.backend=auto"
            )
        if recipe_name == "nvfp4" and cap < (10, 0):
            raise UserError(
                "precision.backend=te runs NVFP4 only on Blackwell (sm_100 or newer), found "
                f"{hardware_summary(device)}; use precision.backend=emulated or auto"
            )
        if cap < (8, 9):
            raise UserError(
                f"precision.backend=te needs an FP8 GPU (sm_89 or newer), found "
                f"{hardware_summary(device)}; use precision.backend=emulated or auto"
            )
        return "te"
    raise AssertionError(f"backend {requested} passed config validation but is not handled")


_BLOCKWISE_PROBE: dict[tuple[str, int], frozenset] = {}


def native_fp8_blockwise_out_dtypes(device: torch.device) -> frozenset:
    """Output dtypes for which the fp8 recipe's blockwise GEMMs run natively and match emulation."""
    if device.type != "cuda" or _capability(device) < (8, 9):
        return frozenset()
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _BLOCKWISE_PROBE:
        _BLOCKWISE_PROBE[key] = native_fp8.probe_native_fp8_blockwise(torch.device("cuda", key[1]))
    return _BLOCKWISE_PROBE[key]


def native_fp8_blockwise_available(device: torch.device) -> bool:
    return bool(native_fp8_blockwise_out_dtypes(device))


def describe_backend(backend: str, recipe_name: str, device: torch.device) -> str:
    """One phrase for the run log: which kernels run, including any emulated fallback."""
    if backend == "native-fp8" and recipe_name == "fp8" and not native_fp8_blockwise_available(device):
        return (
            "native-fp8 (blockwise torch._scaled_mm unavailable in this torch/cuBLAS build: "
            "1x128/128x128 GEMMs emulated)"
        )
    if backend == "te":
        return "te (Transformer Engine)"
    return backend
