"""RMS normalisation: the pre-norm of every block and the gated, grouped norm inside the Mamba-2 mixer.

Both normalise in FP32 (or wider) whatever the activation dtype (a BF16 mean of squares over thousands of
channels loses the low bits that matter here). They return the autocast dtype when autocast is on
(training on a GPU): the residual stream is FP32, but what a norm feeds is a GEMM input, which is
rounded to BF16 (or quantized) anyway, so writing it in BF16 saves a cast pass forward and backward
and halves what the quantizers read. Without autocast (CPU, tests) they return the input's dtype.
Norm gains are 1-D, so the optimizer gives them no weight decay.

On CUDA each runs as one fused kernel per direction (:mod:`inkling_fp4.model.compiled`): rms_norm,
add_rms_norm and skip_gated_rms_norm as hand-written Triton kernels
(:mod:`inkling_fp4.model.glue_kernels`), gated_rms_norm through ``torch.compile``. The functions here
are the references those are tested against. The Mamba-2 output norm also takes the D skip
(``y + D x``), so the FP32 sum never makes its own pass.

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
    """The dtype a norm writes (or a GEMM input takes) for a result computed in ``dtype`` on
    ``device``: the autocast dtype of that device when autocast is on there and narrower, else
    ``dtype`` itself."""
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
    """The pre-norm residual step: h = x + y (x's promoted dtype, FP32 for the FP32 residual stream)
    and rms_norm(h) in ``out_dtype``, as one Triton kernel per direction on CUDA: h is written once
    and never read back for the norm, and the backward adds the two gradients of h in the norm's
    kernel instead of a pass of its own. x, y: [..., D] (one shape) -> (h, norm(h)). ``dy_into`` is
    for the kernel (where its backward writes y's gradient, ``model/residual_fp8.py``); autograd
    allocates the reference's gradients."""
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
    """Mamba-2's output: ``gated_rms_norm(y + D x, z)``. y, x: [..., H, P]; D: [H]; z: [..., H P].
    The skip sum takes the promoted dtype of y, x and D (FP32 for the FP32 D), and so does the result
    unless ``out_dtype`` is given. ``dz_into`` is for the kernel (where its backward writes dz,
    :mod:`~inkling_fp4.model.grad_slab`); autograd allocates the reference's gradients."""
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
        """x, y: [..., D] -> (x + y, this norm of it): a residual add fused with the next norm.
        ``dy_into``: where the kernel's backward writes y's gradient (``model/residual_fp8.py``)."""
        h_dtype = torch.promote_types(x.dtype, y.dtype)
        return add_rms_norm(x, y, self.weight, self.eps, output_dtype(h_dtype, x.device), dy_into)


class GatedRMSNorm(nn.Module):
    """Mamba-2's output norm: normalise ``y * silu(z)`` in G groups of D/G channels, then scale.

    The gate is applied before normalising (``norm_before_gate=False`` in the Mamba code), and the
    groups match the G groups of B/C, so a group's statistics never mix heads of different groups,
    which keeps the layer's output independent of how heads are split across tensor-parallel ranks.
    """

    def __init__(self, dim: int, n_groups: int, eps: float):
        super().__init__()
        self.eps = eps
        self.n_groups = n_groups
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # y, z: [..., D]
        return gated_rms_norm(y, z, self.weight, self.n_groups, self.eps)
