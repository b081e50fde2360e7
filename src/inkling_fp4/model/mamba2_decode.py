"""One decoding step of a Mamba-2 layer between its two GEMMs, as one fused Triton kernel and its torch twin.

Given in_proj's output for one new token per sequence, ``zxbcdt`` [B, 2E + 2GN + H] (Order: [z, x, B, C,
dt]), and the layer's cache (conv window [B, C, k-1], SSM state S [B, H, P, N]):

    window = [conv_state, xBC]                       # [B, C, k]: the last k-1 inputs, then this one
    conv_state <- window[:, :, 1:]                   # the shift
    xBC    = silu(sum_j window[.., j] w[.., j] + b)  # depthwise conv + SiLU, rounded to xBC's dtype
    dt     = softplus(dt_raw + dt_bias)              # [B, H] FP32, then max(dt, dt_min_clamp) when set
    S      <- exp(dt A) S + (dt x) B^T               # A = -exp(A_log); head h reads group h // (H/G)
    y      = S C + D x                               # [B, H, P]
    h      = norm(y * silu(z)) * w                   # RMS over G groups of E/G channels

``h`` [B, E] is out_proj's input. The kernel (one launch for some twenty eager ones) runs one program
per (sequence, head); the group's last program to finish applies the group norm and only then shifts
the shared B and C windows. Its summation order differs from the twin's: equal up to FP32 rounding.

Shape letters: B batch, E d_inner (= H P), C conv channels (E + 2 G N), H heads, P head dim, G groups,
N state, k conv width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inkling_fp4.model.compiled import fast_forms_on
from inkling_fp4.model.norm import at_least_fp32


def mamba_decode_ref(
    zxbcdt: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    out_dtype: torch.dtype,
    dt_min_clamp: float = 0.0,
) -> torch.Tensor:
    """The torch twin of :func:`mamba_decode`: same arguments, same in-place state updates -> h [B, E]."""
    Bsz, Hh, P, N = ssm_state.shape
    E, C = Hh * P, conv_state.shape[1]
    z, xBC_in, dt_raw = zxbcdt.split([E, C, Hh], -1)
    window = torch.cat([conv_state, xBC_in[..., None].to(conv_state.dtype)], -1)  # [B, C, k]
    conv_state.copy_(window[..., 1:])
    conv = (at_least_fp32(window) * conv_weight).sum(-1) + conv_bias  # [B, C]
    xBC = F.silu(conv).to(xBC_in.dtype)
    x, Bm, Cm = xBC.split([E, n_groups * N, n_groups * N], -1)
    cdt = ssm_state.dtype
    x = x.unflatten(-1, (Hh, P)).to(cdt)  # [B, H, P]
    Bh = Bm.unflatten(-1, (n_groups, N)).to(cdt).repeat_interleave(Hh // n_groups, dim=1)  # [B, H, N]
    Ch = Cm.unflatten(-1, (n_groups, N)).to(cdt).repeat_interleave(Hh // n_groups, dim=1)
    dt = F.softplus(at_least_fp32(dt_raw) + dt_bias)  # [B, H]
    if dt_min_clamp > 0:
        dt = dt.clamp(min=dt_min_clamp)
    dt = dt.to(cdt)
    decay = torch.exp(dt * -torch.exp(A_log.to(cdt)))[..., None, None]  # [B, H, 1, 1]
    ssm_state.copy_(decay * ssm_state + (dt[..., None] * x)[..., None] * Bh[:, :, None, :])
    y = torch.einsum("bhpn,bhn->bhp", ssm_state, Ch) + x * D.to(cdt)[:, None]  # [B, H, P]
    g = (y.flatten(-2) * F.silu(at_least_fp32(z).to(cdt))).unflatten(-1, (n_groups, -1))  # [B, G, E/G]
    h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * norm_weight
    return h.to(out_dtype)


def mamba_decode(
    zxbcdt: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor,
    n_groups: int,
    eps: float,
    out_dtype: torch.dtype,
    dt_min_clamp: float = 0.0,
    done: torch.Tensor | None = None,
    w_decode: torch.Tensor | None = None,
):
    """The fused decode step; ``done`` [B, G + 1] int32 is the kernel's count of finished heads per
    group and of finished groups per row (``MambaState.done``; None: a zeroed one per call). With
    ``w_decode`` (out_proj's weight decode scale) it returns (h, h's NVFP4 row operand: values, out_scale,
    largest row amax), as the row quantizer would make it (``model/fused_nvfp4_decode.py``)."""
    from inkling_fp4.model.decode_kernels import mamba_decode_triton  # needs triton

    return mamba_decode_triton(
        zxbcdt, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight,
        n_groups, eps, out_dtype, dt_min_clamp, done, w_decode,
    )  # fmt: skip


def fused_decode_applies(zxbcdt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> bool:
    """Whether :func:`mamba_decode` takes these inputs (CUDA, FP32 state, conv width <= 4), else the twin."""
    ok_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    return (
        fast_forms_on(zxbcdt)
        and ssm_state.dtype == torch.float32
        and conv_state.shape[-1] <= 3
        and zxbcdt.dtype in ok_dtypes
        and conv_state.dtype in ok_dtypes
        and ssm_state.is_contiguous()
        and conv_state.is_contiguous()
    )
