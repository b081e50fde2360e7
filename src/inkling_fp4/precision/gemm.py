"""The GEMMs of a quantized linear layer: exact emulation on any device, native FP8 on Hopper.

Every GEMM here is in "NT" form, ``out [Ra, Rb] = a [Ra, C] · bᵀ`` with both operands blocked along
the contraction dim C, because that is the only way block scales can be applied by a tensor core.
An :class:`Operand` is a quantized tensor (the numerics types) plus a ``transposed`` flag: a 16×16
tiled weight W [N, K] serves as the fprop operand as stored and as the dgrad operand Wᵀ [K, N]
without a second quantization (its tiles are the same either way).

Emulated NVFP4 / MXFP4 (why it is exact): an E2M1 element times its E4M3 (or E8M0) block scale has
at most 6 significant bits and fits BF16 exactly, so ``block_values()`` (code · block scale, no
tensor scale) is an exact BF16 tensor. Two such tensors are multiplied with FP32 accumulation and
the two FP32 per-tensor decode scales multiply the FP32 output, as the Blackwell epilogue does
(a row-scaled activation, ``precision.activation_scale=row``, brings one decode scale per row:
its [M, 1] column multiplies the output's rows);
only the accumulation order differs from the hardware. The tensor scale is never folded into the
BF16 operand (that would round it). On CUDA a BF16 GEMM accumulates in FP32 and ``torch.mm(...,
out_dtype=torch.float32)`` keeps the FP32 result; where a torch build lacks that overload we run
an IEEE FP32 GEMM on the (exact) BF16 values instead. On CPU, BF16 matmul accumulation is not
guaranteed to be FP32, so the values are widened to FP32 first (exact) and multiplied in FP32.
The FP32 result is scaled and rounded to the output dtype in one pass (one rounding, as on the
hardware). On CUDA the NVFP4 and MXFP4 quantizers write the BF16 block values in the same pass that
computes the codes (``numerics/kernels``' fused ``fake_quantize*`` and ``mxfp4_quantize``): an operand
multiplied at once never goes through packed codes. A saved NVFP4 operand is expanded from its codes
by one kernel; a saved MXFP4 one by the torch decode.

Emulated FP8: dequantize to FP32 (exact: an FP8 value times an FP32 scale is one FP32 product) and
multiply in IEEE FP32 (TF32 is switched off around the call, since TF32 would round the operands).

Native FP8 on Hopper (``torch._scaled_mm``, its layouts and the probe that decides whether to trust
it): :mod:`inkling_fp4.precision.native_fp8`; :mod:`inkling_fp4.precision.gemm_backend` picks one or the
other per GEMM.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from inkling_fp4.numerics import fp8
from inkling_fp4.precision import fused_kernels
from inkling_fp4.precision.operand import Operand, pad_to
from inkling_fp4.precision.quantizers import quantize
from inkling_fp4.precision.recipes import TENSORWISE, OperandQuant

__all__ = ["Operand", "pad_to", "quantize"]  # re-exported: the GEMMs' callers take operands from here


def shared_nvfp4_amaxes(
    t: torch.Tensor,
    row_spec: OperandQuant | None,
    token_spec: OperandQuant | None,
    signs: tuple[float, ...] | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both NVFP4 tensor amaxes of t [M, C] from one read: ``max |t|`` for ``row_spec`` (1x16 along
    C) and ``max |rht(tᵀ)|`` for ``token_spec`` (RHT, 1x16 along the tokens M), as ``amax=`` for
    :func:`quantize`. (None, None) where the fused kernels do not run or the specs are not that pair.
    Zero padding changes neither amax, so t is read unpadded (tokens padded to 16 if need be)."""
    pair = (
        row_spec is not None and token_spec is not None
        and row_spec.format == "nvfp4" and token_spec.format == "nvfp4"
        and row_spec.block != (16, 16) and not row_spec.rht and token_spec.rht and not row_spec.row_scaled
    )  # fmt: skip
    fused = fused_kernels.fused_for(t) if pair else None
    if fused is None:
        return None, None
    return fused.abs_max_pair(pad_to(t, 16, 1), fused_kernels.signs_on(signs, t.device))


def fp8_operand_pair(
    t: torch.Tensor,
    row_spec: OperandQuant | None,
    token_spec: OperandQuant | None,
    name: str = "",
    *,
    amax: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
    squared_relu: bool = False,
    dout: torch.Tensor | None = None,
) -> tuple[Operand, Operand] | None:
    """Both FP8 operands of t [M, C] from one read: t in 1×128 blocks along C (fprop x, dgrad dy)
    and tᵀ in 1×128 blocks along the tokens M (wgrad xᵀ, dyᵀ), as :func:`quantize` makes them
    separately; or, for tensorwise specs, t and tᵀ with one scale (the GEMMs then need no transposed
    copy of FP8 bytes). None unless the specs are such a pair (the same FP8 format and block, no RHT;
    1×128 blocks also need M a multiple of 128); then quantize each as usual.

    A width C that is not a multiple of 128 (a Mamba in_proj's 6176) is zero-padded to
    Cp = ceil(C/128)·128 by the quantizer itself, with no padded or transposed copy of t:
    rows operand [M, Cp], the bits of :func:`quantize` (which pads the contraction to 128, as it does
    for the other operand of that GEMM, W's 128×128 tiles); tokens operand [Cp, M], whose first
    rows are those of ``quantize(t, transpose=True)`` (padded to 16 rows only) and the rest zero
    codes: extra zero rows of the wgrad output [Cp, K], which ``matmul(..., size=...)`` crops.

    ``amax`` / ``record``: delayed scaling of a tensorwise pair (see :func:`quantize`).
    ``squared_relu``: the pair of relu(t)² (with ``dout``: of its gradient for that upstream
    gradient) instead of t, computed by the quantizer (``fp8.quantize_squared_relu_pair``); a
    delayed tensorwise pair only.

    No finiteness check on CUDA (as :func:`quantize`): NaN/Inf shows as an Inf scale_inv and output.
    """
    pair = (
        row_spec is not None and row_spec == token_spec and row_spec.format in ("e4m3", "e5m2")
        and row_spec.block in ((1, 128), TENSORWISE) and not row_spec.rht and t.dim() == 2
    )  # fmt: skip
    if not pair:
        assert not squared_relu, "the fused squared ReLU is for delayed tensorwise pairs"
        return None
    dtype = torch.float8_e4m3fn if row_spec.format == "e4m3" else torch.float8_e5m2
    if row_spec.block == TENSORWISE:  # any M; tᵀ's codes are t's transposed, written by the same pass
        mr, mc = row_spec.multiple  # both dims padded with zeros as quantize pads them (no copy if whole)
        tp = pad_to(t, mr, mc)
        if squared_relu:  # relu(0)² and its gradient at 0 are 0: the padding stays zeros
            assert row_spec.delayed and amax is not None, "the fused squared ReLU needs a delayed scale"
            rows, cols = fp8.quantize_squared_relu_pair(
                tp, None if dout is None else pad_to(dout, mr, mc), dtype=dtype, name=name or None,
                check=not t.is_cuda, amax=amax, record=record,
            )  # fmt: skip
        else:
            rows, cols = fp8.quantize_tensorwise_pair(
                tp, dtype=dtype, name=name or None, check=not t.is_cuda, amax=amax, record=record
            )
        return Operand(rows, row_spec), Operand(cols, token_spec)
    assert not squared_relu, "the fused squared ReLU is for delayed tensorwise pairs"
    if t.shape[0] % 128:
        return None
    # rows: [M, Cp]; cols: [Cp, M]
    rows, cols = fp8.quantize_blockwise_pair(t, dtype=dtype, name=name or None, check=not t.is_cuda, pad=True)
    return Operand(rows, row_spec), Operand(cols, token_spec)


# -- emulation -----------------------------------------------------------------------------------


def _values(op: Operand) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(exact values [rows, contraction], FP32 decode scale to apply to the output or None)."""
    if op.spec.format == "nvfp4":
        if op.values is not None:
            v, scale = op.values, op.decode_scale
        else:
            fused = fused_kernels.fused_for(op.q.codes)
            v = fused.block_values(op.q) if fused is not None else op.q.block_values(torch.bfloat16)
            scale = op.decode_scale if op.decode_scale is not None else op.q.decode_scale
    elif op.spec.format == "mxfp4":  # no tensor scale: nothing to apply to the output
        v = op.values if op.values is not None else op.q.block_values(torch.bfloat16)
        scale = None
    else:
        v, scale = op.q.dequantize(torch.float32), None
    return (v.t() if op.transposed else v), scale


@contextlib.contextmanager
def _ieee_fp32():
    """FP32 matmuls in full FP32 (no TF32 rounding of the operands) for the duration."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous


@functools.lru_cache(maxsize=8)
def mm_out_dtype_supported(device: torch.device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=torch.float32)`` runs on ``device`` (newer torch)."""
    a = torch.ones(16, 16, dtype=torch.bfloat16, device=device)
    try:
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, C] · b [C, N] with FP32 accumulation and FP32 output, for exact BF16 or FP32 values."""
    if a.dtype == torch.float32 or b.dtype == torch.float32:
        with _ieee_fp32():
            return torch.mm(a.float(), b.float())
    if a.device.type != "cuda":
        # NOTE CPU BF16 matmul may accumulate in BF16: widen (exact) and multiply in FP32.
        return torch.mm(a.float(), b.float())
    if mm_out_dtype_supported(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    with _ieee_fp32():  # exact but slower: the BF16 values are exact in FP32
        return torch.mm(a.float(), b.float())


def emulated_matmul(
    a: Operand, b: Operand, out_dtype: torch.dtype = torch.float32, size: tuple[int, int] | None = None
) -> torch.Tensor:
    """out [Ra, Rb] = a · bᵀ, exactly as a block-scaled tensor core computes it (see top).

    ``size`` crops padded rows/cols; the FP32 result is rounded once to ``out_dtype`` after the
    tensor scales are applied (one pass: scale and cast together).
    """
    av, sa = _values(a)  # av: [Ra, C]
    bv, sb = _values(b)  # bv: [Rb, C]
    acc = mm_fp32_out(av, bv.t())  # acc: [Ra, Rb] FP32
    if size is not None:
        acc = acc[: size[0], : size[1]]
    if sa is None:
        return acc.to(out_dtype)
    scale = _output_scale(a, sa, b, sb)  # sa · sb, applied once in FP32
    if scale.dim():  # a row-scaled a: [Ra, 1], one scale per output row
        scale = scale[: acc.shape[0]]
    if out_dtype == torch.float32:
        return acc.mul_(scale)
    if out_dtype == torch.bfloat16 and fused_kernels.fused_for(acc) is not None and not scale.dim():
        from inkling_fp4.numerics.kernels.scale_output import scale_to_bf16  # needs triton

        return scale_to_bf16(acc, scale)  # bitwise the torch.mul below, in one vectorized pass
    out = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    return torch.mul(acc, scale, out=out)


def _output_scale(a: Operand, sa: torch.Tensor, b: Operand, sb: torch.Tensor) -> torch.Tensor:
    """``sa · sb``, the product of the two FP32 tensor decode scales (1/S_enc each): as the quantizer
    of one operand wrote it for this very partner (one FP32 product, commutative, so the same bits),
    else one multiply here."""
    for op, other in ((a, sb), (b, sa)):
        if op.output_scale is not None and op.output_scale[0] is other:
            return op.output_scale[1]
    return sa * sb


def bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Ra, C] · bᵀ (b [Rb, C]) with BF16 operands and FP32 output (an unquantized GEMM)."""
    return mm_fp32_out(a.to(torch.bfloat16), b.to(torch.bfloat16).t())
