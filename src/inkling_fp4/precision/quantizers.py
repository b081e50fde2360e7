"""One quantizer per operand format (picked once per spec): each takes the fused Triton kernels where
they run (``fused_kernels.fused_for``), else the torch reference of ``inkling_fp4.numerics``: same bits.

Arguments every quantizer takes (each ignores those its format has no use for):
``transpose``: quantize ``tᵀ`` (the wgrad operands, blocked along the tokens); ``codes``: keep the
packed tensor (to save for backward); ``values``: multiplied at once, so the fused kernels also write
the BF16 block values; ``amax``: the NVFP4 tensor amax from ``gemm.shared_nvfp4_amaxes`` (fused kernels
only), or a tensorwise FP8 operand's delayed-scaling amax, its own amax then going into ``record``
(``amax_history``); ``scale_with``: the partner NVFP4 operand's decode scale, so the fused kernels
also write the GEMM's output scale (``Operand.output_scale``).

On the fused path the NVFP4 NaN/Inf check is deferred to ``finite_guard`` unless eager checks are on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from inkling_fp4.numerics import fp8, mxfp4, nvfp4
from inkling_fp4.precision import finite_guard, fused_kernels
from inkling_fp4.precision.operand import Operand, pad_to
from inkling_fp4.precision.recipes import TENSORWISE, OperandQuant


def quantize(
    t: torch.Tensor,
    spec: OperandQuant,
    *,
    transpose: bool = False,
    signs: tuple[float, ...] | None = None,
    generator: torch.Generator | None = None,
    codes: bool = True,
    values: bool = False,
    name: str = "",
    amax: torch.Tensor | None = None,
    scale_with: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
) -> Operand:
    """``t`` [rows, contraction] (or ``tᵀ`` of t [contraction, rows]) quantized as ``spec`` says, zero-padded
    to whole blocks; the other arguments are the module docstring's."""
    scale_with = foldable_partner(scale_with)
    mr, mc = spec.multiple
    along = max(mc, 16 if spec.rht else 1)
    t = pad_to(t, along, mr) if transpose else pad_to(t, mr, along)
    return quantizer_for(spec)(
        t, spec, transpose=transpose, signs=signs, generator=generator, codes=codes, values=values,
        name=name, amax=amax, scale_with=scale_with, record=record,
    )  # fmt: skip


def foldable_partner(scale_with: torch.Tensor | None) -> torch.Tensor | None:
    """The partner operand's decode scale where it is one number; a row-scaled partner (a vector of
    scales) has no single output scale to fold into this operand's kernel: None."""
    return None if scale_with is not None and scale_with.dim() else scale_with


@functools.lru_cache(maxsize=64)
def quantizer_for(spec: OperandQuant) -> Callable[..., Operand]:
    """The quantizer of ``spec``'s format (see the module docstring)."""
    if spec.format == "nvfp4":
        return nvfp4_rows if spec.row_scaled else nvfp4_blocks
    if spec.format == "mxfp4":
        return mxfp4_blocks
    return fp8_scaled


def nvfp4_rows(t, spec: OperandQuant, *, transpose, codes, values, name, amax, **_) -> Operand:
    """fprop's x with one FP32 scale per row (``precision.activation_scale=row``)."""
    assert not transpose and amax is None, "a row-scaled operand is quantized along its rows alone"
    fused = fused_kernels.fused_for(t)
    if fused is None:
        return Operand(nvfp4.quantize_rows(t, name=name or None), spec)
    eager = finite_guard.eager()  # else no host sync: the NaN/Inf check is deferred
    dtype = torch.bfloat16 if values else None
    bv = fused.fake_quantize_row_scaled(t, keep_codes=codes, dtype=dtype, name=name or None,
                                        check_finite=eager)  # fmt: skip
    if not eager:
        finite_guard.record(bv.amax.amax(), f"NVFP4 operand '{name or 'unnamed'}'")
    return Operand(bv.quantized, spec, values=bv.values, decode_scale=bv.decode_scale)


def nvfp4_blocks(
    t, spec: OperandQuant, *, transpose, signs, generator, codes, values, name, amax, scale_with, **_
) -> Operand:
    """NVFP4 in 1x16 or 16x16 blocks under one tensor scale; after the RHT where the spec has it."""
    fused = fused_kernels.fused_for(t)
    assert amax is None or fused is not None, "a shared amax needs the fused NVFP4 kernels"
    sign_t = fused_kernels.signs_on(signs, t.device)  # for the fused kernels, on the operand's device
    kw = dict(stochastic=spec.stochastic, generator=generator, name=name or None)
    fused_kw = dict(
        keep_codes=codes, dtype=torch.bfloat16 if values else None, amax=amax,
        check_finite=finite_guard.eager(), scale_with=scale_with, **kw,
    )  # fmt: skip
    if transpose and spec.rht:
        if fused is not None:
            return fused_operand(fused.fake_quantize_rht_t(t, sign_t, **fused_kw), spec, name, scale_with)
        return Operand(nvfp4.quantize_rht_t(t, sign_t, **kw), spec)
    src = t.t().contiguous() if transpose else t
    if spec.rht:
        src = nvfp4.rht(src, fused_kernels.signs_on(signs, torch.device("cpu")))  # signs read on the host
    block_2d = spec.block == (16, 16)
    if fused is not None:
        bv = fused.fake_quantize(src, block_2d=block_2d, **fused_kw)
        return fused_operand(bv, spec, name, scale_with)
    return Operand(nvfp4.quantize(src, block_2d=block_2d, **kw), spec)


def mxfp4_blocks(t, spec: OperandQuant, *, transpose, signs, generator, codes, values, name, **_) -> Operand:
    """MXFP4 in 1x32 blocks with E8M0 scales; after the RHT where the spec has it."""
    src = t.t().contiguous() if transpose else t
    if spec.rht:
        src = nvfp4.rht(src, fused_kernels.signs_on(signs, torch.device("cpu")))
    # On CUDA no host sync for the NaN/Inf check (as for NVFP4): a non-finite block gets the E8M0
    # NaN scale, so the output and the loss turn NaN and the noise monitor skips the step.
    check = not src.is_cuda or finite_guard.eager()
    kw = dict(stochastic=spec.stochastic, generator=generator, name=name, check=check)
    if not values:
        return Operand(mxfp4.quantize(src, **kw), spec)
    # One pass on CUDA: the kernel writes the BF16 block values (and the codes only if kept).
    q, v = mxfp4.quantize_with_values(src, keep_codes=codes, **kw)
    return Operand(q, spec, values=v)


def fp8_scaled(t, spec: OperandQuant, *, transpose, name, amax, record, **_) -> Operand:
    """E4M3 / E5M2 under one tensor scale (current or delayed) or in 1x128 / 128x128 blocks."""
    dtype = torch.float8_e4m3fn if spec.format == "e4m3" else torch.float8_e5m2
    # On CUDA no finiteness check (a host sync): NaN/Inf shows as an Inf scale_inv and output.
    check = not t.is_cuda
    if spec.block == TENSORWISE:
        src = t.t() if transpose else t
        q = fp8.quantize_tensorwise(src, dtype=dtype, name=name, check=check, amax=amax, record=record)
        return Operand(q, spec)
    if transpose and spec.block == (1, 128):  # xᵀ / dyᵀ along tokens (any width), one kernel on CUDA
        return Operand(fp8.quantize_blockwise_t(t, dtype=dtype, name=name, check=check), spec)
    src = t.t().contiguous() if transpose else t
    return Operand(fp8.quantize_blockwise(src, block=spec.block, dtype=dtype, name=name, check=check), spec)


def fused_operand(bv, spec: OperandQuant, name: str, scale_with: torch.Tensor | None) -> Operand:
    """An Operand from a fused NVFP4 kernel's result; its amax goes to the deferred NaN/Inf check."""
    if not finite_guard.eager():
        finite_guard.record(bv.amax, f"NVFP4 operand '{name or 'unnamed'}'")
    output_scale = None if scale_with is None else (scale_with, bv.output_scale)
    return Operand(
        bv.quantized, spec, values=bv.values, decode_scale=bv.decode_scale, output_scale=output_scale
    )
