"""FP8 (E4M3 / E5M2) with current scaling: per tensor, or per block with FP32 scales.

The paper's baseline (arXiv 2509.25149, section 4; the DeepSeek-V3 recipe) is E4M3 for all GEMM
operands with FP32 scales per 1×128 block (activations, gradients) or 128×128 block (weights);
compare-baseline trains with these quantizers. Scaling, per tensor or block (Transformer Engine's rule):

    scale     = fp8_max / amax     (1 when amax == 0; FLT_MAX if the quotient overflows)
    data      = fp8(clamp(x · scale, -fp8_max, fp8_max))   (one round-half-even)
    scale_inv = 1 / scale          (stored; dequantize is data · scale_inv)

NOTE the clamp is needed: torch's FP32→FP8 cast does not saturate on every version, and ``x · scale``
can exceed fp8_max by one rounding.

Shapes: 1×bn blocks keep any leading dims (``scale_inv [..., N/bn]``); bm×bn tiles need 2-D x, with a
partial last row tile allowed (``scale_inv [ceil(M/bm), N/bn]``). N must be a multiple of bn unless
``pad``, which quantizes x zero-padded to ceil(N/bn)·bn columns (for a GEMM whose other operand is
padded). On CUDA the public functions run ``numerics/kernels/fp8_quantize.py`` (same bits); the
``*_ref`` functions are the reference. ``check=False`` skips the finiteness test (a host sync).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from inkling_fp4.errors import NumericsError
from inkling_fp4.numerics import checks
from inkling_fp4.numerics.formats import FLT_MAX

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dataclass
class FP8Tensor:
    """Tensorwise FP8: ``x ≈ data · scale_inv``."""

    data: torch.Tensor  # fp8, same shape as the input
    scale_inv: torch.Tensor  # float32 0-dim

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale_inv).to(dtype)


@dataclass
class FP8BlockTensor:
    """Blockwise FP8: each (bm, bn) block of ``data`` times its entry of ``scale_inv``."""

    data: torch.Tensor  # fp8 [..., N] (2-D [M, N] when bm > 1)
    scale_inv: torch.Tensor  # float32 [..., N/bn] or [ceil(M/bm), N/bn]
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        bm, bn = self.block
        scale_inv = self.scale_inv.repeat_interleave(bn, dim=-1)
        if bm > 1:
            scale_inv = scale_inv.repeat_interleave(bm, dim=0)[: self.data.shape[0]]
        return (self.data.float() * scale_inv).to(dtype)


def _fp8_max(dtype: torch.dtype, op: str) -> float:
    if dtype not in FP8_MAX:
        raise NumericsError(f"{op}: dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    return FP8_MAX[dtype]


def current_scale(amax: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, scale_inv) in FP32 from an amax tensor of any shape."""
    amax = amax.float()
    # NOTE: not ``fp8_max / amax``: torch evaluates scalar / tensor as reciprocal(tensor) · scalar.
    scale = torch.where(amax == 0, 1.0, (torch.full_like(amax, fp8_max) / amax).clamp(max=FLT_MAX))
    return scale, torch.reciprocal(scale)


def _cast(v: torch.Tensor, fp8_max: float, dtype: torch.dtype) -> torch.Tensor:
    return v.clamp_(-fp8_max, fp8_max).to(dtype)


def quantize_tensorwise_ref(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    name: str | None = None,
    *,
    amax: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
) -> FP8Tensor:
    """One FP32 scale for the whole tensor; the torch reference. Delayed scaling passes ``amax`` (values
    above it saturate) and ``record`` (an FP32 word that gets ``max(record, max|x|)``)."""
    op = "fp8.quantize_tensorwise"
    fp8_max = _fp8_max(dtype, op)
    checks.check_dtype(x, op=op, name=name)
    xf = x.float()
    own = xf.abs().amax() if xf.numel() else xf.new_zeros(())
    checks.check_finite(x, op=op, name=name, amax=own)
    if record is not None:
        record.copy_(torch.maximum(record, own.to(record.device)).reshape(record.shape))
    scale, scale_inv = current_scale(own if amax is None else amax.to(xf.device).reshape(()), fp8_max)
    return FP8Tensor(data=_cast(xf * scale, fp8_max, dtype), scale_inv=scale_inv)


def quantize_blockwise_ref(
    x: torch.Tensor,
    block: tuple[int, int] = (1, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    name: str | None = None,
) -> FP8BlockTensor:
    """One FP32 scale per (bm, bn) block: (1, 128) for activations/gradients, (128, 128) for weights."""
    op = "fp8.quantize_blockwise"
    fp8_max = _fp8_max(dtype, op)
    bm, bn = block
    if bm < 1 or bn < 1:
        raise NumericsError(f"{op}: block must be two positive sizes, got {block}")
    checks.check_input(x, op=op, block=bn, name=name, ndim=2 if bm > 1 else None)
    xf = x.float()
    n = xf.shape[-1]
    magnitude = xf.abs().unflatten(-1, (n // bn, bn))  # [..., N/bn, bn]
    if bm == 1:
        block_amax = magnitude.amax(-1)  # [..., N/bn]
    else:
        pad = -xf.shape[0] % bm
        if pad:
            magnitude = torch.cat([magnitude, magnitude.new_zeros(pad, *magnitude.shape[1:])])
        tiles = magnitude.unflatten(0, (magnitude.shape[0] // bm, bm))  # [ceil(M/bm), bm, N/bn, bn]
        block_amax = tiles.amax(dim=(1, 3))  # [ceil(M/bm), N/bn]
    checks.check_finite(x, op=op, name=name, amax=block_amax)
    scale, scale_inv = current_scale(block_amax, fp8_max)
    if bm > 1:
        scale = scale.repeat_interleave(bm, dim=0)[: xf.shape[0]]  # [M, N/bn]
    scaled = (xf.unflatten(-1, (n // bn, bn)) * scale[..., None]).flatten(-2)
    return FP8BlockTensor(data=_cast(scaled, fp8_max, dtype), scale_inv=scale_inv, block=(bm, bn))


def quantize_blockwise_t_ref(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, name: str | None = None
) -> FP8BlockTensor:
    """xᵀ [N, M] in 1×128 blocks (along x's first dim, the tokens) for x: [M, N]; the reference."""
    checks.check_input(x, op="fp8.quantize_blockwise_t", block=1, name=name, ndim=2)
    return quantize_blockwise_ref(x.t().contiguous(), block=(1, 128), dtype=dtype, name=name)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType | None:
    """The Triton FP8 kernel module, or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from inkling_fp4.numerics.kernels import fp8_quantize  # needs triton

    return fp8_quantize


def _pad_last(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = -x.shape[-1] % block if x.dim() else 0
    return F.pad(x, (0, pad)) if pad else x


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def quantize_tensorwise(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    name: str | None = None,
    *,
    check: bool = True,
    amax: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
) -> FP8Tensor:
    """One FP32 scale for the whole tensor; Triton on CUDA."""
    if not (x.is_cuda and x.dim() > 0 and x.numel() and _kernels()):
        return quantize_tensorwise_ref(x, dtype=dtype, name=name, amax=amax, record=record)
    checks.check_dtype(x, op="fp8.quantize_tensorwise", name=name)
    out = _tensorwise_kernel(x, dtype, "fp8.quantize_tensorwise", name, check, amax, record, cols=False)
    return FP8Tensor(data=out["data"].view(x.shape), scale_inv=out["scale_inv"])


def _tensorwise_kernel(x, dtype, op: str, name, check: bool, amax, record, *, cols: bool) -> dict:
    from inkling_fp4.numerics.kernels.amax import abs_max  # needs triton

    _fp8_max(dtype, op)
    x2 = _rows_2d(x)
    own = abs_max(x2) if amax is None or check else None  # delayed: only for the check
    scale_amax = own if amax is None else amax.reshape(1)
    kernels = _kernels()
    out = kernels.quantize_fp8(
        x2, dtype, mode=kernels.MODE_TENSOR, rows=True, cols=cols, amax=scale_amax, record=record
    )
    if check:
        checks.check_finite(x, op=op, name=name, amax=own)
    return out


def quantize_tensorwise_pair(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    name: str | None = None,
    *,
    check: bool = True,
    amax: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
) -> tuple[FP8Tensor, FP8Tensor]:
    """(x [M, N], xᵀ [N, M]) in tensorwise FP8 for 2-D x: one scale, so xᵀ's codes are x's transposed.
    Hopper's FP8 GEMMs want the contraction dim contiguous: x serves the fprop, xᵀ the wgrad."""
    op = "fp8.quantize_tensorwise_pair"
    checks.check_input(x, op=op, block=1, name=name, ndim=2)
    if not (x.is_cuda and x.numel() and _kernels()):
        q = quantize_tensorwise_ref(x, dtype=dtype, name=name, amax=amax, record=record)
        return q, FP8Tensor(data=q.data.t().contiguous(), scale_inv=q.scale_inv)
    out = _tensorwise_kernel(x, dtype, op, name, check, amax, record, cols=True)
    scale_inv = out["scale_inv"]
    return FP8Tensor(data=out["data"], scale_inv=scale_inv), FP8Tensor(
        data=out["data_t"], scale_inv=scale_inv
    )


def transpose_fp8(data: torch.Tensor) -> torch.Tensor:
    """``data.t().contiguous()`` for 2-D FP8 data, in one Triton pass on CUDA (torch's is slow)."""
    op = "fp8.transpose_fp8"
    _fp8_max(data.dtype, op)
    if data.dim() != 2:
        raise NumericsError(f"{op}: 2-D data expected, got shape {tuple(data.shape)}")
    if data.is_cuda and _kernels() is not None:
        from inkling_fp4.numerics.kernels.fp8_epilogue import transpose_bytes  # needs triton

        return transpose_bytes(data.contiguous())[0]
    return data.t().contiguous()


def tensorwise_pair_from_rows(rows: torch.Tensor, amax: torch.Tensor) -> tuple[FP8Tensor, FP8Tensor]:
    """(x, xᵀ) from FP8 bytes [M, N] a producer wrote under the delayed ``amax`` (``fp8_epilogue.py``)."""
    op = "fp8.tensorwise_pair_from_rows"
    fp8_max = _fp8_max(rows.dtype, op)
    if rows.dim() != 2:
        raise NumericsError(f"{op}: 2-D data expected, got shape {tuple(rows.shape)}")
    if rows.is_cuda and _kernels() is not None:
        from inkling_fp4.numerics.kernels.fp8_epilogue import transpose_bytes  # needs triton

        cols, scale_inv = transpose_bytes(rows.contiguous(), amax.reshape(1).float(), fp8_max)
    else:
        _, scale_inv = current_scale(amax.reshape(()), fp8_max)
        cols = rows.t().contiguous()
    return FP8Tensor(rows, scale_inv), FP8Tensor(cols, scale_inv)


def squared_relu_ref(h: torch.Tensor, dout: torch.Tensor | None = None) -> torch.Tensor:
    """relu(h)², or with ``dout`` its gradient 2·dout·h where h > 0, in h's dtype with one rounding
    (the model's squared ReLU, ``model/mlp.py``)."""
    hf = h.float()
    if dout is None:
        r = torch.relu(hf)
        return (r * r).to(h.dtype)
    return torch.where(hf <= 0, 0.0, (dout.float() * hf) * 2.0).to(h.dtype)


def quantize_squared_relu_pair(
    h: torch.Tensor,
    dout: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float8_e4m3fn,
    name: str | None = None,
    *,
    amax: torch.Tensor,
    record: torch.Tensor | None = None,
    check: bool = True,
) -> tuple[FP8Tensor, FP8Tensor]:
    """:func:`quantize_tensorwise_pair` of ``squared_relu_ref(h, dout)`` for BF16 h [M, N], without storing
    that [tokens, ffn] tensor on CUDA. Needs a delayed scale: a current one would need its amax first."""
    op = "fp8.quantize_squared_relu_pair"
    checks.check_input(h, op=op, block=1, name=name, ndim=2)
    if h.dtype != torch.bfloat16 or (dout is not None and (dout.shape != h.shape or dout.dtype != h.dtype)):
        raise NumericsError(f"{op}: h must be bfloat16 and dout, if given, bfloat16 of h's shape")
    kernels = _kernels() if h.is_cuda and h.numel() else None
    if kernels is None:
        return quantize_tensorwise_pair(
            squared_relu_ref(h, dout), dtype=dtype, name=name, check=check, amax=amax, record=record
        )
    _fp8_max(dtype, op)
    h2 = h if h.stride(-1) == 1 else h.contiguous()
    if dout is not None and dout.stride() != h2.stride():
        dout = dout.contiguous()
        h2 = h2.contiguous()
    act = kernels.ACT_SQUARED_RELU if dout is None else kernels.ACT_SQUARED_RELU_GRAD
    out = kernels.quantize_fp8(
        h2, dtype, mode=kernels.MODE_TENSOR, rows=True, cols=True, amax=amax.reshape(1), record=record,
        act=act, dout=dout,
    )  # fmt: skip
    if check:  # the debugging path: the BF16 tensor after all, for its amax
        from inkling_fp4.numerics.kernels.amax import abs_max  # needs triton

        checks.check_finite(h, op=op, name=name, amax=abs_max(squared_relu_ref(h, dout)))
    rows, cols = (FP8Tensor(data=out[k], scale_inv=out["scale_inv"]) for k in ("data", "data_t"))
    return rows, cols


def quantize_blockwise(
    x: torch.Tensor,
    block: tuple[int, int] = (1, 128),
    dtype: torch.dtype = torch.float8_e4m3fn,
    name: str | None = None,
    *,
    check: bool = True,
    pad: bool = False,
) -> FP8BlockTensor:
    """Blockwise FP8 (see ``quantize_blockwise_ref``); Triton on CUDA for (1, 128) and (128, 128), whose
    1×128 ``scale_inv`` is a transposed view (outer-dim major, what the GEMM reads)."""
    kernels = _kernels() if x.is_cuda and block in ((1, 128), (128, 128)) else None
    if kernels is None:
        return quantize_blockwise_ref(
            _pad_last(x, block[1]) if pad else x, block=block, dtype=dtype, name=name
        )
    op = "fp8.quantize_blockwise"
    _fp8_max(dtype, op)
    checks.check_input(x, op=op, block=1 if pad else block[1], name=name, ndim=2 if block[0] > 1 else None)
    mode = kernels.MODE_TILE if block[0] > 1 else kernels.MODE_BLOCKS
    out = kernels.quantize_fp8(_rows_2d(x), dtype, mode=mode, pad_to_block=pad)
    scale_inv = out["scale_inv"]
    if check:
        checks.check_finite(x, op=op, name=name, amax=scale_inv)
    n_padded = out["data"].shape[-1]  # N, or NP with ``pad``
    if block[0] == 1 and x.dim() != 2:
        scale_inv = scale_inv.reshape(*x.shape[:-1], n_padded // block[1])
    data = out["data"].view(*x.shape[:-1], n_padded)
    return FP8BlockTensor(data=data, scale_inv=scale_inv, block=block)


def quantize_blockwise_t(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, name: str | None = None, *, check: bool = True
) -> FP8BlockTensor:
    """xᵀ [N, M] in 1×128 blocks along the tokens for x [M, N] (M % 128 == 0): a wgrad operand."""
    out = _along_tokens(x, dtype, name, check, rows=False, op="fp8.quantize_blockwise_t")
    if out is None:
        return quantize_blockwise_t_ref(x, dtype=dtype, name=name)
    return FP8BlockTensor(data=out["data_t"], scale_inv=out["scale_inv_t"], block=(1, 128))


def quantize_blockwise_pair(
    x: torch.Tensor,
    dtype: torch.dtype = torch.float8_e4m3fn,
    name: str | None = None,
    *,
    check: bool = True,
    pad: bool = False,
) -> tuple[FP8BlockTensor, FP8BlockTensor]:
    """(x [M, NP] in 1×128 blocks along N, xᵀ [NP, M] along M) for 2-D x, M % 128 == 0, from one read on
    CUDA: an activation's fprop and wgrad operands. NP = N, or ceil(N/128)·128 with ``pad``."""
    out = _along_tokens(x, dtype, name, check, rows=True, op="fp8.quantize_blockwise_pair", pad=pad)
    if out is None:
        xp = _pad_last(x, 128) if pad else x
        return quantize_blockwise_ref(xp, (1, 128), dtype, name), quantize_blockwise_t_ref(xp, dtype, name)
    return (
        FP8BlockTensor(data=out["data"], scale_inv=out["scale_inv"], block=(1, 128)),
        FP8BlockTensor(data=out["data_t"], scale_inv=out["scale_inv_t"], block=(1, 128)),
    )


def _along_tokens(
    x: torch.Tensor, dtype, name, check: bool, *, rows: bool, op: str, pad: bool = False
) -> dict | None:
    """Kernel outputs for xᵀ in 1×128 token blocks (and x in row blocks if ``rows``); None off CUDA."""
    kernels = _kernels() if x.is_cuda else None
    if kernels is None:
        return None
    _fp8_max(dtype, op)
    checks.check_input(x, op=op, block=128 if rows and not pad else 1, name=name, ndim=2)
    checks.check_rows(x, op=op, block=128, what="the blocked dim of xᵀ", name=name)
    out = kernels.quantize_fp8(
        _rows_2d(x), dtype, mode=kernels.MODE_BLOCKS, rows=rows, cols=True, pad_to_block=pad
    )
    if check:  # every element lies in one token block: xᵀ's scales see any NaN/Inf
        checks.check_finite(x, op=op, name=name, amax=out["scale_inv_t"])
    return out
