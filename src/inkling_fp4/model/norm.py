"""RMS normalisation: the pre-norm of every block and the gated, grouped norm inside the Mamba-2 mixer.

Both normalise in FP32 (or wider): a BF16 mean of squares over thousands of channels loses bits that
matter. Under autocast they return the autocast dtype (their output is a GEMM input, rounded anyway),
saving a cast pass each way. These are the references of the fast CUDA forms (``model/compiled.py``).

Shape letters: D normalised width, G groups, H heads, P head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inkling_fp4.model.compiled import cuda_compiled, cuda_kernel


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in FP32, or unchanged when already wider (FP64 exactness tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def output_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a norm writes (or a GEMM input takes) for a result computed in ``dtype``: the device's
    autocast dtype when autocast is on there and narrower, else ``dtype``."""
    if dtype.is_floating_point and torch.is_autocast_enabled(device.type):
        narrow = torch.get_autocast_dtype(device.type)
        if torch.finfo(narrow).bits < torch.finfo(dtype).bits:
            return narrow
    return dtype


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@cuda_kernel("norm_kernels.rms_norm")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None):
    """x: [..., D] -> x / rms(x) * weight in ``out_dtype`` (default x's), normalised in FP32 (or wider)."""
    return (_rms_normalize(at_least_fp32(x), eps) * weight).to(out_dtype or x.dtype)


@cuda_kernel("norm_kernels.add_rms_norm")
def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, dy_into=None
):
    """The pre-norm residual step: x, y: [..., D] -> (h = x + y in the promoted dtype, rms_norm(h) in
    ``out_dtype``), fused on CUDA. ``dy_into``: for the kernel's backward
    (``model/fused_fp8/residual.py``)."""
    h = x + y
    return h, rms_norm.reference(h, weight, eps, out_dtype)


@cuda_compiled
def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_groups: int, eps: float):
    """y, z: [..., D] -> norm(y * silu(z)) * weight over G groups of D/G channels, in y's dtype."""
    h = at_least_fp32(y) * F.silu(at_least_fp32(z))
    h = _rms_normalize(h.unflatten(-1, (n_groups, -1)), eps).flatten(-2)  # [..., G, D/G]
    return (h * weight).to(y.dtype)


@cuda_kernel("gated_norm_kernels.skip_gated_rms_norm")
def skip_gated_rms_norm(
    y: torch.Tensor,
    x: torch.Tensor,
    D: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    n_groups: int,
    eps: float,
    out_dtype: torch.dtype | None = None,
    dz_into=None,
) -> torch.Tensor:
    """Mamba-2's output: ``gated_rms_norm(y + D x, z)``. y, x: [..., H, P]; D: [H]; z: [..., H P]. The
    skip sum is in the promoted dtype of y, x and D. ``dz_into``: for the kernel's backward."""
    y = (y + x * D[:, None]).flatten(-2)  # [..., H P]
    h = gated_rms_norm.reference(y, z, weight, n_groups, eps)
    return h if out_dtype is None else h.to(out_dtype)


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight over the last dim (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D]
        return rms_norm(x, self.weight, self.eps, output_dtype(x.dtype, x.device))

    def add_and_norm(
        self, x: torch.Tensor, y: torch.Tensor, dy_into=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x, y: [..., D] -> (x + y, this norm of it); ``dy_into`` as for :func:`add_rms_norm`."""
        h_dtype = torch.promote_types(x.dtype, y.dtype)
        return add_rms_norm(x, y, self.weight, self.eps, output_dtype(h_dtype, x.device), dy_into)


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: normalise ``y * silu(z)`` in G groups of D/G channels, then scale. The gate
    comes first (Mamba's ``norm_before_gate=False``); the groups are those of B/C, so the output does not
    depend on how heads split across tensor-parallel ranks."""

    def __init__(self, dim: int, n_groups: int, eps: float):
        super().__init__()
        self.eps = eps
        self.n_groups = n_groups
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # y, z: [..., D]
        return gated_rms_norm(y, z, self.weight, self.n_groups, self.eps)
