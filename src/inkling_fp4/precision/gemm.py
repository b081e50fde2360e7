"""The GEMMs of a quantized linear layer, emulated exactly on any device.

Every GEMM is "NT": ``out [Ra, Rb] = a [Ra, C] · bᵀ``, both operands blocked along the contraction C,
the only way a tensor core can apply block scales. An :class:`Operand`'s ``transposed`` flag lets a
16×16-tiled W [N, K] serve as fprop's W and dgrad's Wᵀ [K, N] without a second quantization.

Why emulated NVFP4 / MXFP4 is exact: an E2M1 element times its E4M3 (or E8M0) block scale has at most
6 significant bits, so ``block_values()`` is exact in BF16. These are multiplied with FP32
accumulation and the FP32 tensor decode scales (or a row-scaled x's [M, 1] column) multiply the
output, as the Blackwell epilogue does; only the accumulation order differs. NOTE the tensor scale is
never folded into the BF16 operand (that would round it). FP8 is dequantized to FP32 (exact) and
multiplied in IEEE FP32 (TF32 would round the operands). Native FP8: :mod:`.native_fp8`.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from inkling_fp4.numerics import fp8
from inkling_fp4.precision import finite_guard, fused_kernels
from inkling_fp4.precision.operand import Operand, pad_to
from inkling_fp4.precision.quantizers import foldable_partner, fused_operand, quantize
from inkling_fp4.precision.recipes import TENSORWISE, OperandQuant

__all__ = ["Operand", "pad_to", "quantize"]  # re-exported: the GEMMs' callers take operands from here


def nvfp4_amax_pair_specs(row_spec: OperandQuant | None, token_spec: OperandQuant | None) -> bool:
    """Whether a tensor quantized as ``row_spec`` (NVFP4 1x16 along C under one tensor scale) and as
    ``token_spec`` (NVFP4 after the RHT, along M) takes both tensor amaxes from one read."""
    return (
        row_spec is not None and token_spec is not None
        and row_spec.format == "nvfp4" and token_spec.format == "nvfp4"
        and row_spec.block != (16, 16) and not row_spec.rht and token_spec.rht and not row_spec.row_scaled
    )  # fmt: skip


def shared_nvfp4_amaxes(
    t: torch.Tensor,
    row_spec: OperandQuant | None,
    token_spec: OperandQuant | None,
    signs: tuple[float, ...] | None,
    given: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Both NVFP4 tensor amaxes of t [M, C] from one read: ``max |t|`` for ``row_spec`` (1x16 along C)
    and ``max |rht(tᵀ)|`` for ``token_spec`` (RHT, 1x16 along M), as ``amax=`` for :func:`quantize`.
    ``given``: the words [2] ``[max |rht(tᵀ)|, max |t|]`` that t's producer reduced
    (:data:`PRODUCER_NVFP4_AMAXES`), taken instead of the read. (None, None) where the fused kernels do
    not run or the specs are not that pair."""
    fused = fused_kernels.fused_for(t) if nvfp4_amax_pair_specs(row_spec, token_spec) else None
    if fused is None:
        return None, None
    if given is not None:
        return given[1], given[0]
    return fused.abs_max_pair(pad_to(t, 16, 1), fused_kernels.signs_on(signs, t.device))


PRODUCER_NVFP4_AMAXES = False
"""Whether the kernels that write a linear's x or dy (the pre-norm, the squared ReLU, the gated norm, the
writers of in_proj's gradient slab: ``model/fused_nvfp4_train.py``) reduce its two NVFP4 tensor amaxes as
they write it, so the linear skips its amax pass over it (the same words). Off: the graphed hybrid-350m
step took 238.5 ms with them against 225.8 without (H100, ``bench_pretrain.py --producer-amaxes on``)."""


SAVED_WGRAD_VALUES = True
"""Whether a linear keeps x's wgrad operand Q(RHT(xᵀ)) for the backward as BF16 block values (2 bytes an
element) rather than codes and scale bytes (0.56), where the fused kernels run: the backward then skips
the pass that decodes them, for 1.44 more bytes an element of saved activations. The hybrid-350m NVFP4
step: 235.6 ms against 239.3 ms, peak memory 35.4 GiB against 30.5 (H100, 2026-12-07,
``bench_pretrain.py --saved-x values|codes``)."""


def saves_wgrad_values(x: torch.Tensor) -> bool:
    """Whether x's wgrad operand is saved as values (:data:`SAVED_WGRAD_VALUES`): only where the fused
    kernels run, the decode pass it skips being theirs; elsewhere codes keep the memory small."""
    return SAVED_WGRAD_VALUES and fused_kernels.fused_for(x) is not None


FUSED_NVFP4_PAIR = False
"""Whether a tensor's two NVFP4 operands (x: fprop rows and the saved wgrad Q(RHT(xᵀ)); dy: dgrad rows and
wgrad Q(RHT(dyᵀ))) come from one pass over it where :func:`nvfp4_operand_pair` applies, or each from its
own pass (the same bits). Off: slower on an H100, in the step (258.7 against 240.1 ms, hybrid-350m) and
alone (BENCHMARKS.md)."""


def nvfp4_operand_pair(
    t: torch.Tensor,
    row_spec: OperandQuant | None,
    token_spec: OperandQuant | None,
    signs: tuple[float, ...] | None,
    amax: torch.Tensor | None,
    amax_t: torch.Tensor | None,
    name: str = "",
    *,
    keep_codes_t: bool = True,
    generator: torch.Generator | None = None,
    scale_with: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[Operand, Operand] | None:
    """t [M, C]'s operand along its rows (1x16 along C, BF16 values) and Q(RHT(tᵀ)) (its codes with
    ``keep_codes_t``, to save; else its values) from one read of t: the bits :func:`quantize` gives each,
    stochastic rounding's draws included. Both amaxes from :func:`shared_nvfp4_amaxes`; ``scale_with``:
    each operand's GEMM partner's decode scale. None without whole blocks (no padding)."""
    if not FUSED_NVFP4_PAIR or amax is None or amax_t is None or t.shape[0] % 16 or t.shape[1] % 16:
        return None
    scale_with = tuple(foldable_partner(s) for s in scale_with)
    rows, tokens = fused_kernels.fused_for(t).fake_quantize_pair(
        t, amax, amax_t, fused_kernels.signs_on(signs, t.device),
        stochastic=(row_spec.stochastic, token_spec.stochastic), generator=generator,
        keep_codes_t=keep_codes_t, scale_with=scale_with, name=name or None,
        check_finite=finite_guard.eager(),
    )  # fmt: skip
    return (
        fused_operand(rows, row_spec, name, scale_with[0]),
        fused_operand(tokens, token_spec, name, scale_with[1]),
    )


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
    """Both FP8 operands of t [M, C] from one read, the bits :func:`quantize` gives separately: t in
    1×128 blocks along C (fprop x, dgrad dy) and tᵀ in 1×128 blocks along M (wgrad xᵀ, dyᵀ), or for
    tensorwise specs t and tᵀ under one scale (no transposed copy of FP8 bytes). None unless the specs
    are such a pair (same FP8 format and block, no RHT; 1×128 also needs M % 128 == 0).

    A width C not a multiple of 128 (a Mamba in_proj's 6176) is zero-padded to Cp by the quantizer:
    rows [M, Cp], tokens [Cp, M] (its zero rows give wgrad rows that ``matmul(..., size=...)`` crops).
    ``amax`` / ``record``: delayed scaling. ``squared_relu``: the pair of relu(t)² (with ``dout``: of
    its gradient) instead of t. No finiteness check on CUDA: NaN/Inf shows as an Inf scale_inv.
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
    """out [Ra, Rb] = a · bᵀ, exactly as a block-scaled tensor core computes it; ``size`` crops padding."""
    av, sa = _values(a)  # av: [Ra, C]
    bv, sb = _values(b)  # bv: [Rb, C]
    if out_dtype == torch.bfloat16 and sa is not None and sb.numel() == 1 and _fused_epilogue(av, bv):
        from inkling_fp4.numerics.kernels.scaled_gemm import scaled_gemm  # needs triton

        # the FP32 product stays in registers: bitwise the path below but for the accumulation order
        return scaled_gemm(av, bv, _output_scale(a, sa, b, sb).reshape(-1), size)
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


FUSED_EPILOGUE = True
"""Whether NVFP4 GEMMs with a BF16 output on CUDA scale and round in the GEMM's own kernel
(``numerics/kernels/scaled_gemm.py``) rather than in a second pass over an FP32 product; a benchmark
switches it off to time the two."""


FUSED_MAX_K = 8192
"""The longest contraction the fused kernel takes. Fed by pointers it lost to cuBLAS plus the FP32 pass
beyond K 1024 (``scripts/bench_scaled_gemm.py``, H100, 2026-12-05). Fed by TMA (``scaled_gemm.TMA_FED``)
with x kept as values, fusing every GEMM of hybrid-350m (K up to 6176) gave a 226.8 ms NVFP4 step
(226.2 in a second run), where TMA alone at K <= 1024 gave 233.2 and values alone 235.6 (H100,
2026-12-07, ``bench_pretrain.py --fused-max-k``). Operands TMA cannot load (strides off 16 bytes) take
the pointer-fed kernel at any K up to this."""


def _fused_epilogue(av: torch.Tensor, bv: torch.Tensor) -> bool:
    return (
        FUSED_EPILOGUE
        and av.shape[1] <= FUSED_MAX_K
        and av.is_cuda
        and av.dtype == bv.dtype == torch.bfloat16
        and fused_kernels.fused_for(av) is not None
    )


def _output_scale(a: Operand, sa: torch.Tensor, b: Operand, sb: torch.Tensor) -> torch.Tensor:
    """``sa · sb`` (1/S_enc each): as one operand's quantizer wrote it for this partner (the same bits),
    else multiplied here."""
    for op, other in ((a, sb), (b, sa)):
        if op.output_scale is not None and op.output_scale[0] is other:
            return op.output_scale[1]
    return sa * sb


def bf16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [Ra, C] · bᵀ (b [Rb, C]) with BF16 operands and FP32 output (an unquantized GEMM)."""
    return mm_fp32_out(a.to(torch.bfloat16), b.to(torch.bfloat16).t())
