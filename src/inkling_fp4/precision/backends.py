"""Which kernels compute a recipe's GEMMs on this machine, chosen once and said out loud.

Three backends, one per kind of hardware support:

- ``emulated`` (any device): quantize with the reference/Triton quantizers, multiply the exact
  dequantized block values in BF16 (FP32 accumulation), apply the FP32 tensor scales to the output.
  Bit-faithful to the formats; only the accumulation order differs from a tensor core.
- ``native-fp8`` (CUDA sm_89 and newer, FP8 recipes only): real FP8 tensor cores through
  ``torch._scaled_mm``. Per-tensor scaling works everywhere FP8 does; the 1×128/128×128 blockwise
  scaling of the paper's FP8 baseline needs a torch built against cuBLAS ≥ 12.9 on Hopper. Whether
  it runs is probed once per device (a small GEMM checked against emulation); where it does not,
  those GEMMs are emulated and :func:`describe_backend` says so.
- ``te`` (Blackwell, sm_100+): NVIDIA Transformer Engine's NVFP4 / FP8 recipes, imported lazily and
  only when asked for or picked by ``auto``; nothing else in the package needs it.

``auto`` picks the fastest faithful one. Asking for a backend the hardware or install lacks is a
:class:`~inkling_fp4.errors.UserError` that names the hardware found, never a silent fallback.
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
    """The backend that will run ``recipe_name`` on ``device``: emulated | native-fp8 | te.

    ``requested`` is the config value (auto | emulated | native-fp8 | te). The bf16 recipe needs no
    backend and always resolves to ``emulated`` (plain torch GEMMs).
    """
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
    """Output dtypes for which ``torch._scaled_mm`` runs the fp8 recipe's 1×128 × 128×128 and
    1×128 × 1×128 GEMMs on ``device`` (empty on CPU and wherever the torch build or cuBLAS lacks
    blockwise scaling). Probed once per device with small GEMMs checked against emulation."""
    if device.type != "cuda" or _capability(device) < (8, 9):
        return frozenset()
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _BLOCKWISE_PROBE:
        _BLOCKWISE_PROBE[key] = native_fp8.probe_native_fp8_blockwise(torch.device("cuda", key[1]))
    return _BLOCKWISE_PROBE[key]


def native_fp8_blockwise_available(device: torch.device) -> bool:
    """Whether the fp8 recipe's blockwise GEMMs run natively on ``device`` (see above)."""
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
