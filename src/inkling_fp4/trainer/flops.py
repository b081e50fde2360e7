"""Model FLOPs utilisation (MFU): model FLOPs per second over the device's dense BF16 peak.

MFU counts the FLOPs the model needs (``model.flops_per_token``), not those executed, so
recomputation, quantization and emulation overheads lower it instead of inflating it. The peak is
the dense BF16 rate even for FP8 / NVFP4 runs, so all precisions share one scale (an FP8 run can
exceed what BF16 ever could).
"""

from __future__ import annotations

import torch

# Dense (no sparsity) BF16 tensor-core peaks, FLOP/s per device, from the vendors' datasheets.
_PEAK_BF16 = (
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
)


def peak_flops(device: torch.device, override: float | None = None) -> float | None:
    """Peak dense BF16 FLOP/s of one ``device``; None where unknown (CPU, unlisted GPUs)."""
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in _PEAK_BF16 if key in name), None)


def mfu(flops_per_token: float, tokens_per_s: float, n_devices: int, peak: float | None) -> float | None:
    """Fraction of the aggregate peak; None when the peak is unknown."""
    if peak is None or tokens_per_s <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * n_devices)
