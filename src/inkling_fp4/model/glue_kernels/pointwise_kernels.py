"""The two elementwise glue functions without a reduction, as Triton kernels behind autograd Functions
(and the decode step's squared ReLU that also writes down_proj's NVFP4 rows, no autograd):

    squared_relu   out = r r,  r = relu(h);          dh = 2 dout h where h > 0, else 0
    dt_softplus    v = dt + bias;  out = v if v > 20 else log1p(exp(v)) (FP32);
                   dv = dout e / (e + 1), e = exp(v) (dout above the threshold);  ddt_bias = sum_rows dv

squared_relu is exact both ways: a BF16 (or FP16) product is exact in FP32, and ``2 dout h`` is the
reference's ``dout r + dout r`` for normal numbers.

Shape letters: R rows (B L tokens), H heads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.model.glue_kernels.common import (
    amax_epilogue_kwargs,
    amax_pair_kwargs,
    as_rows,
    cdiv,
    check_inputs,
    epilogue_args,
    exp,
    forward_tile,
    fp8_epilogue_kwargs,
    grad_buffer,
    load_f32,
    log1p,
    on_device,
    round_to,
    to_f32,
)
from inkling_fp4.numerics.kernels.amax import zeroed_words
from inkling_fp4.numerics.kernels.fp8_epilogue import bf16_fp8_bytes, fp8_scale, running_amax
from inkling_fp4.numerics.kernels.fp8_quantize import record_amax
from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import (
    load_row_halves,
    quantize_rows_in_registers,
    quantize_whole_rows,
    row_block_mask,
    row_blocks,
    row_half_offsets,
    row_operand,
    row_warps,
    rows_fit_in_registers,
)
from inkling_fp4.numerics.kernels.nvfp4_rht import native_bf16, store_amax_pair

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)  # F.softplus's default: above it softplus(v) = v
SQUARED_RELU_BLOCK = 4096  # elements per program of the flat squared ReLU
SQUARED_RELU_WARPS = 8


@triton.jit
def _squared_relu(h_ptr, dout_ptr, out_ptr, n, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """out = relu(h)^2, or with GRAD out = dh = 2 dout h where h > 0 (else 0); flat, in h's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    h = load_f32(h_ptr + offs, mask)
    r = tl.where(h < 0.0, 0.0, h)  # NOTE not tl.maximum: it drops NaN, relu keeps it
    if GRAD:
        dout = load_f32(dout_ptr + offs, mask)
        out = tl.where(h <= 0.0, 0.0, (dout * h) * 2.0)  # the reference's dout r + dout r, rounded once
    else:
        out = r * r  # exact in FP32 for BF16/FP16 h: rounded once, as the reference's product
    tl.store(out_ptr + offs, round_to(out, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dt_softplus(dt_ptr, bias_ptr, dout_ptr, out_ptr, part_ptr, R, H, sdt, sdo, sout,
                 GRAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, amax_ptr, record_ptr,
                 FP8: tl.constexpr, E5M2: tl.constexpr, HW: tl.constexpr, pair_ptr, AMAX_PAIR: tl.constexpr,
                 SIGN_BITS: tl.constexpr, NATIVE_BF16: tl.constexpr, PAIR_BLOCK_N: tl.constexpr):  # fmt: skip
    """out = softplus(dt + bias) in FP32, or with GRAD out = d dt and this tile's sum of it into row
    program_id(0) of the dt_bias partial sums. ``FP8`` (with GRAD): d dt as delayed-scaled FP8 bytes.
    ``AMAX_PAIR`` (with GRAD): also the tile's part of d dt's slab's two NVFP4 amaxes
    (``common.amax_pair_kwargs``)."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < R)[:, None] & (cols < H)[None, :]
    v = load_f32(dt_ptr + rows[:, None] * sdt + cols[None, :], mask)
    v += load_f32(bias_ptr + cols, cols < H)[None, :]
    e = exp(v)
    if GRAD:
        dout = load_f32(dout_ptr + rows[:, None] * sdo + cols[None, :], mask)
        dv = tl.where(v > SOFTPLUS_THRESHOLD, dout, tl.div_rn(dout * e, e + 1.0))
        dv = tl.where(mask, dv, 0.0)
        if FP8:
            q, r = bf16_fp8_bytes(dv, fp8_scale(amax_ptr, E5M2), E5M2, HW)
            tl.store(out_ptr + rows[:, None] * sout + cols[None, :], q, mask=mask)
            record_amax(record_ptr, running_amax(tl.zeros_like(r), r, mask))
        else:
            tl.store(
                out_ptr + rows[:, None] * sout + cols[None, :], round_to(dv, out_ptr.dtype.element_ty),
                mask=mask,
            )  # fmt: skip
            if AMAX_PAIR:
                tl.debug_barrier()  # NOTE the rows are read back in another layout: all stores first
                store_amax_pair(out_ptr, pid * BLOCK_R, 0, H, R, H, sout, pair_ptr, SIGN_BITS, BLOCK_R,
                                PAIR_BLOCK_N, NATIVE_BF16)  # fmt: skip
        tl.store(part_ptr + pid * H + cols, tl.sum(dv, 0), mask=cols < H)
    else:
        out = tl.where(v > SOFTPLUS_THRESHOLD, v, log1p(e))
        tl.store(out_ptr + rows[:, None] * sout + cols[None, :], out, mask=mask)


def _squared_relu_pass(h: torch.Tensor, dout: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty_like(h)
    with on_device(h):
        _squared_relu[(max(1, cdiv(h.numel(), SQUARED_RELU_BLOCK)),)](
            h, h if dout is None else dout, out, h.numel(), GRAD=dout is not None, BLOCK=SQUARED_RELU_BLOCK,
            num_warps=SQUARED_RELU_WARPS, enable_fp_fusion=dout is not None,
        )  # fmt: skip
    return out


@triton.jit
def _squared_relu_amax_pair(h_ptr, dout_ptr, out_ptr, pair_ptr, R, F, GRAD: tl.constexpr,
                            SIGN_BITS: tl.constexpr, BLOCK_F: tl.constexpr, NATIVE_BF16: tl.constexpr,
                            PAIR_BLOCK_N: tl.constexpr):  # fmt: skip
    """:func:`_squared_relu` (or with GRAD its gradient) of a 16-token group of h [R, F], BLOCK_F features
    at a time, then from the stored rows their part of the two NVFP4 tensor amaxes
    (``nvfp4_rht.store_amax_pair``). One program per group: two atomics per 16 rows."""
    rows = (tl.program_id(0) * 16 + tl.arange(0, 16)).to(tl.int64)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = (rows < R)[:, None] & (cols < F)[None, :]
        offs = rows[:, None] * F + cols[None, :]
        h = load_f32(h_ptr + offs, mask)
        if GRAD:
            out = tl.where(h <= 0.0, 0.0, (load_f32(dout_ptr + offs, mask) * h) * 2.0)
        else:
            r = tl.where(h < 0.0, 0.0, h)  # NOTE not tl.maximum: it drops NaN, relu keeps it
            out = r * r
        tl.store(out_ptr + offs, round_to(out, out_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()  # NOTE the rows are read back in another layout: all stores first
    store_amax_pair(out_ptr, tl.program_id(0) * 16, 0, F, R, F, F, pair_ptr, SIGN_BITS, 16, PAIR_BLOCK_N,
                    NATIVE_BF16)  # fmt: skip


SQUARED_RELU_PAIR_TILE = (512, 4)
"""(features a step, warps) of a :func:`_squared_relu_amax_pair` program."""


def _squared_relu_amax_pass(h: torch.Tensor, dout: torch.Tensor | None, sign_bits: int):
    """(:func:`_squared_relu_pass`'s output, its two NVFP4 tensor amaxes [2])."""
    F = h.shape[-1]
    R = h.numel() // F
    assert h.dtype == torch.bfloat16 and R % 16 == 0, "the amaxes are of a BF16 output, 16 | tokens"
    pair = zeroed_words(2, h.device)
    out = torch.empty_like(h)
    block_f, warps = SQUARED_RELU_PAIR_TILE
    with on_device(h):
        _squared_relu_amax_pair[(R // 16,)](
            h, h if dout is None else dout, out, pair, R, F, GRAD=dout is not None, SIGN_BITS=sign_bits,
            BLOCK_F=block_f, NATIVE_BF16=native_bf16(), PAIR_BLOCK_N=32 * warps, num_warps=warps,
            enable_fp_fusion=dout is not None,
        )  # fmt: skip
    return out, pair


class _SquaredReLU(torch.autograd.Function):
    """``amax_pair``: (sign bits, a list to append the output's two NVFP4 amaxes to); ``grad_pair``: the
    same for the input's gradient, in the backward."""

    @staticmethod
    def forward(ctx, h, amax_pair=None, grad_pair=None):
        h = h.contiguous()
        ctx.save_for_backward(h)
        ctx.grad_pair = grad_pair
        if amax_pair is None:
            return _squared_relu_pass(h, None)
        out, words = _squared_relu_amax_pass(h, None, amax_pair[0])
        amax_pair[1].append(words)
        return out

    @staticmethod
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        if ctx.grad_pair is None:
            return _squared_relu_pass(h, dout.contiguous()), None, None
        dh, words = _squared_relu_amax_pass(h, dout.contiguous(), ctx.grad_pair[0])
        ctx.grad_pair[1].append(words)
        return dh, None, None


class _DtSoftplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt_raw, dt_bias, ddt_into):
        ctx.ddt_into = ddt_into
        H = dt_raw.shape[-1]
        dt2 = as_rows(dt_raw, H)
        R = dt2.shape[0]
        out = torch.empty(dt_raw.shape, device=dt_raw.device, dtype=torch.float32)
        block_h, block_r, warps = forward_tile(H)
        with on_device(dt_raw):
            _dt_softplus[(max(1, cdiv(R, block_r)),)](
                dt2, dt_bias, dt2, out, out, R, H, dt2.stride(0), 0, H,
                GRAD=False, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps, enable_fp_fusion=False,
                **fp8_epilogue_kwargs(None, out), **amax_epilogue_kwargs(None, out, block_h),
            )  # fmt: skip
        ctx.save_for_backward(dt_raw, dt_bias)
        return out

    @staticmethod
    def backward(ctx, dout):
        dt_raw, dt_bias = ctx.saved_tensors
        H = dt_raw.shape[-1]
        dt2, dout2 = as_rows(dt_raw, H), as_rows(dout, H)
        R = dt2.shape[0]
        block_h, block_r, warps = forward_tile(H)  # one tile of rows per program, as the forward
        n_prog = max(1, cdiv(R, block_r))
        # [..., H]; a column block of in_proj's gradient in the mixer (BF16 values or FP8 bytes)
        target = grad_buffer(ctx.ddt_into, dt_raw)
        ddt_out, fp8_kw, ddt = epilogue_args(target)
        ddt2 = ddt_out.view(-1, H)
        pair_kw = amax_pair_kwargs(target, block_r, ddt2, min(block_h, 32 * warps))  # NVFP4: d dt's amaxes
        part = torch.empty(n_prog, H, device=dt_raw.device, dtype=torch.float32)  # dt_bias partial sums
        with on_device(dt_raw):
            _dt_softplus[(n_prog,)](
                dt2, dt_bias, dout2, ddt2, part, R, H, dt2.stride(0), dout2.stride(0), ddt2.stride(0),
                GRAD=True, BLOCK_R=block_r, BLOCK_H=block_h, num_warps=warps, enable_fp_fusion=True,
                **fp8_kw, **pair_kw,
            )  # fmt: skip
        return ddt, part.sum(0).to(dt_bias.dtype), None


def squared_relu(h: torch.Tensor) -> torch.Tensor:
    """relu(h)^2 elementwise in h's dtype (any shape; a non-contiguous h is copied)."""
    check_inputs(h)
    return _SquaredReLU.apply(h)


def squared_relu_amax_pair(
    h: torch.Tensor, sign_bits: int | None, grad_sign_bits: int | None = None, grad_words: list | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """relu(h)^2 of a BF16 h [..., F] (tokens a multiple of 16), differentiable as :func:`squared_relu`,
    and with ``sign_bits`` its two NVFP4 tensor amaxes from the producing pass: FP32 [2]
    ``[max |rht(outᵀ)|, max |out|]``, as ``rht_t_abs_max`` gives them for the 2-D out (the wgrad's RHT).
    With ``grad_sign_bits`` the backward appends the same words of h's gradient to ``grad_words``."""
    check_inputs(h)
    words: list = []
    amax_pair = None if sign_bits is None else (sign_bits, words)
    grad_pair = None if grad_sign_bits is None else (grad_sign_bits, grad_words)
    out = _SquaredReLU.apply(h, amax_pair, grad_pair)
    return out, (words[0] if words else None)


def dt_softplus(dt_raw: torch.Tensor, dt_bias: torch.Tensor, ddt_into=None) -> torch.Tensor:
    """dt_raw: [..., H] (a strided view is fine); dt_bias: [H] -> softplus(dt_raw + dt_bias) in FP32.
    ``ddt_into``: None, or a function returning where the backward writes d dt_raw (``grad_slab.py``)."""
    check_inputs(dt_raw, dt_bias)
    return _DtSoftplus.apply(dt_raw, dt_bias, ddt_into)


@triton.jit
def _squared_relu_rows(h_ptr, out_ptr, R, F, w_decode_ptr, values_ptr, out_scale_ptr, max_ptr,
                       BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, NV_BLOCK_K: tl.constexpr,
                       IN_REGISTERS: tl.constexpr, G: tl.constexpr):  # fmt: skip
    """relu(h)^2 of BLOCK_R whole rows of h [R, F] (as :func:`_squared_relu`), then the NVFP4 operand of
    the stored rows with one scale per row. ``IN_REGISTERS``: the rows in one load, as the halves of their
    G 16-value blocks, quantized where they are held (``nvfp4_decode_gemm.quantize_rows_in_registers``);
    else BLOCK_F columns at a time, read back by ``quantize_whole_rows``. The same bits either way."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    if IN_REGISTERS:
        lo, hi = load_row_halves(h_ptr, F, rows, R, F, BLOCK_R, G)  # [BLOCK_R, G, 8] each
        # NOTE not tl.maximum: it drops NaN, relu keeps it
        lo = tl.where(lo < 0.0, 0.0, lo)
        hi = tl.where(hi < 0.0, 0.0, hi)
        out_lo = round_to(lo * lo, out_ptr.dtype.element_ty)
        out_hi = round_to(hi * hi, out_ptr.dtype.element_ty)
        ptrs = out_ptr + row_half_offsets(rows, F, G)
        mask = row_block_mask(rows, R, F, G)[:, :, None]
        tl.store(ptrs, out_lo, mask=mask)
        tl.store(ptrs + 8, out_hi, mask=mask)
        # the operand is of the rows as stored
        quantize_rows_in_registers(to_f32(out_lo), to_f32(out_hi), rows, R, F, w_decode_ptr, values_ptr,
                                   out_scale_ptr, max_ptr, BLOCK_R, G)  # fmt: skip
    else:
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F)
            mask = (rows < R)[:, None] & (cols < F)[None, :]
            h = load_f32(h_ptr + rows[:, None] * F + cols[None, :], mask)
            r = tl.where(h < 0.0, 0.0, h)  # NOTE not tl.maximum: it drops NaN, relu keeps it
            tl.store(
                out_ptr + rows[:, None] * F + cols[None, :], round_to(r * r, out_ptr.dtype.element_ty),
                mask=mask,
            )  # fmt: skip
        # NOTE every thread's part of the rows is stored before any thread reads the rows back
        tl.debug_barrier()
        quantize_whole_rows(out_ptr, F, rows, R, F, w_decode_ptr, values_ptr, out_scale_ptr, max_ptr, BLOCK_R,
                            NV_BLOCK_K)  # fmt: skip


@torch.no_grad()
def squared_relu_nvfp4_rows(h: torch.Tensor, w_decode: torch.Tensor):
    """relu(h)^2 of h [R, F] BF16 (16 | F) and its NVFP4 operand, one scale per row (the decode step's
    input of down_proj) -> (out [R, F] BF16, values [R, F] BF16, out_scale [R] (``w_decode`` folded in),
    the largest row amax [1]). One program a row: a decode batch is a few dozen rows."""
    check_inputs(h)
    h = h.contiguous()
    R, F = h.shape
    out = torch.empty_like(h)
    values, out_scale, largest = row_operand(R, F, h.device)
    in_registers = rows_fit_in_registers(F)
    with on_device(h):
        _squared_relu_rows[(max(1, R),)](
            h, out, R, F, w_decode, values, out_scale, largest, BLOCK_R=1, BLOCK_F=1024, NV_BLOCK_K=256,
            IN_REGISTERS=in_registers, G=row_blocks(F) if in_registers else 1,
            num_warps=row_warps(F) if in_registers else 4,
        )  # fmt: skip
    return out, values, out_scale, largest
