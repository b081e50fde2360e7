"""The Mamba-2 causal depthwise conv + SiLU as Triton kernels, with document resets; the reference is
``model/conv.py``'s :func:`conv_silu`:

    a_t   = bias + sum_{s=0}^{k-1} weight[:, k-1-s] * x_{t-s} * [seg_{t-s} == seg_t]
    out_t = silu(a_t)

Backward, per position t (masks as above, [t+s < L] and [seg_{t+s} == seg_t]):

    da_t       = dout_t * silu'(a_t),   silu'(a) = sig(a) (1 + a (1 - sig(a)))
    dx_t       = sum_s weight[:, k-1-s] * da_{t+s}
    dweight[:, k-1-s] = sum_{b,t} da_{t+s} * x_t        dbias = sum_{b,t} da_t

The backward recomputes a and runs in two passes: the first writes da per position in FP32, the second
reads it at the k shifted positions (one pass would recompute a and silu' k times). dweight and dbias
are summed per (batch row, CHUNK_L positions) into an FP32 buffer reduced in PyTorch, deterministic;
their last bits depend on the autotuned tile, so deterministic runs take the first candidate.

Shape letters: B batch, L length, C channels, k kernel width.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from inkling_fp4.model.glue_kernels.common import amax_pair_kwargs, epilogue_args, grad_buffer, round_to
from inkling_fp4.model.ssd_kernels.tuning import INTERPRET, autotune, configs
from inkling_fp4.numerics.kernels.fp8_epilogue import bf16_fp8_bytes, fp8_scale, running_amax
from inkling_fp4.numerics.kernels.fp8_quantize import record_amax
from inkling_fp4.numerics.kernels.nvfp4_rht import store_amax_pair

CHUNK_L = 256  # positions per backward program (one row of the dweight / dbias partial sums)

# (BL positions, BC channels) tiles and warps; the first is the interpreter's and deterministic runs'.
# Every BL divides CHUNK_L.
_TILES = [
    ({"BL": 32, "BC": 128}, 4),
    ({"BL": 16, "BC": 256}, 4),
    ({"BL": 64, "BC": 64}, 4),
    ({"BL": 32, "BC": 64}, 2),
    ({"BL": 64, "BC": 128}, 8),
    ({"BL": 128, "BC": 64}, 8),
    ({"BL": 16, "BC": 128}, 2),
]


# The backward's second pass keeps k + 1 sums per tile element in registers, hence smaller tiles; the
# first is the fastest on an H200 at hybrid-350m's shape.
_BWD_TILES = [
    ({"BL": 8, "BC": 64}, 2),
    ({"BL": 8, "BC": 128}, 4),
    ({"BL": 16, "BC": 64}, 4),
    ({"BL": 4, "BC": 64}, 2),
    ({"BL": 8, "BC": 32}, 1),
    ({"BL": 16, "BC": 64}, 2),
    ({"BL": 8, "BC": 256}, 8),
    ({"BL": 4, "BC": 256}, 4),
]


@triton.jit
def _x_tap(x_ptr, seg_ptr, b, t, t_ok, seg_t, s, c, c_ok, sxb, sxl, ssb, HAS_SEG: tl.constexpr):
    """x_{t-s} at positions t [BL] and channels c [BC] in FP32: 0 before position 0, past a document
    boundary (seg_{t-s} != seg_t) and where t is masked off."""
    ts = t - s
    ok = t_ok & (ts >= 0)
    if HAS_SEG:
        seg_s = tl.load(seg_ptr + b * ssb + ts, mask=ok, other=-2)
        ok = ok & (seg_s == seg_t)
    xs = tl.load(
        x_ptr + b * sxb + ts[:, None] * sxl + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0
    )
    return xs.to(tl.float32)


@triton.jit
def _conv_pre(
    x_ptr,
    seg_ptr,
    w_ptr,
    bias_ptr,
    b,
    t,
    c,
    c_ok,
    L,
    sxb,
    sxl,
    ssb,
    HAS_SEG: tl.constexpr,
    K: tl.constexpr,
    BL: tl.constexpr,
    BC: tl.constexpr,
):
    """Pre-activation a at positions t [BL] (any, masked to 0 <= t < L) and channels c [BC], FP32."""
    t_ok = (t >= 0) & (t < L)
    acc = tl.zeros((BL, BC), dtype=tl.float32) + tl.load(bias_ptr + c, mask=c_ok, other=0.0)[None, :].to(
        tl.float32
    )
    seg_t = t  # unused without document resets
    if HAS_SEG:
        seg_t = tl.load(seg_ptr + b * ssb + t, mask=t_ok, other=-1)
    for s in tl.static_range(K):
        xs = _x_tap(x_ptr, seg_ptr, b, t, t_ok, seg_t, s, c, c_ok, sxb, sxl, ssb, HAS_SEG)
        w = tl.load(w_ptr + c * K + (K - 1 - s), mask=c_ok, other=0.0).to(tl.float32)
        acc += xs * w[None, :]
    return acc


@autotune(configs(_TILES), key=["C", "K", "HAS_SEG", "GRAD", "BLOCKS"])
@triton.jit
def _conv_silu_pointwise(
    x_ptr,
    seg_ptr,
    w_ptr,
    bias_ptr,
    dout_ptr,
    dout1_ptr,
    dout2_ptr,
    out_ptr,
    L,
    C,
    C1,
    C2,
    sxb,
    sxl,
    ssb,
    sdb,
    sdl,
    sdb1,
    sdl1,
    sdb2,
    sdl2,
    sob,
    sol,
    HAS_SEG: tl.constexpr,
    GRAD: tl.constexpr,
    BLOCKS: tl.constexpr,
    K: tl.constexpr,
    BL: tl.constexpr,
    BC: tl.constexpr,
):
    """out = silu(a), or with GRAD the backward's first pass, da = dout * silu'(a) in FP32; with
    BLOCKS = 3, dout comes as three column-block tensors (channels [0, C1), [C1, C2), [C2, C))."""
    b = tl.program_id(0).to(tl.int64)  # batch offsets can pass 2^31 elements
    t = tl.program_id(1) * BL + tl.arange(0, BL)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    c_ok = c < C
    mask = (t < L)[:, None] & c_ok[None, :]
    a = _conv_pre(x_ptr, seg_ptr, w_ptr, bias_ptr, b, t, c, c_ok, L, sxb, sxl, ssb, HAS_SEG, K, BL, BC)
    sig = tl.sigmoid(a)
    if GRAD:
        if BLOCKS == 3:
            in0 = c < C1
            in2 = c >= C2
            in1 = ~in0 & ~in2
            dout = tl.load(
                dout_ptr + b * sdb + t[:, None] * sdl + c[None, :], mask=mask & in0[None, :], other=0.0
            ).to(tl.float32)
            at1 = dout1_ptr + b * sdb1 + t[:, None] * sdl1 + (c - C1)[None, :]
            dout += tl.load(at1, mask=mask & in1[None, :], other=0.0).to(tl.float32)
            at2 = dout2_ptr + b * sdb2 + t[:, None] * sdl2 + (c - C2)[None, :]
            dout += tl.load(at2, mask=mask & in2[None, :], other=0.0).to(tl.float32)
        else:
            dout = tl.load(dout_ptr + b * sdb + t[:, None] * sdl + c[None, :], mask=mask, other=0.0)
        out = dout.to(tl.float32) * sig * (1.0 + a * (1.0 - sig))
    else:
        out = a * sig
    tl.store(out_ptr + b * sob + t[:, None] * sol + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _tap_weight(w_ptr, c, c_ok, K: tl.constexpr, s: tl.constexpr):
    """weight[:, k-1-s] at channels c in FP32 (zeros for s >= k)."""
    if s < K:
        return tl.load(w_ptr + c * K + (K - 1 - s), mask=c_ok, other=0.0).to(tl.float32)
    return tl.zeros(c.shape, dtype=tl.float32)


@autotune(configs(_BWD_TILES), key=["C", "K", "HAS_SEG"])
@triton.jit
def _conv_silu_bwd(
    x_ptr,
    seg_ptr,
    w_ptr,
    da_ptr,
    dx_ptr,
    dw_ptr,
    db_ptr,
    L,
    C,
    sxb,
    sxl,
    ssb,
    sdxb,
    sdxl,
    HAS_SEG: tl.constexpr,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    BL: tl.constexpr,
    BC: tl.constexpr,
    amax_ptr,
    record_ptr,
    FP8: tl.constexpr,
    E5M2: tl.constexpr,
    HW: tl.constexpr,
    pair_ptr,
    AMAX_PAIR: tl.constexpr,
    SIGN_BITS: tl.constexpr,
    NATIVE_BF16: tl.constexpr,
):
    """Second pass: dx of this chunk's tiles and the chunk's dweight and dbias sums, from da (k <= 4).
    ``FP8``: dx as delayed-scaled FP8 bytes (``numerics/kernels/fp8_epilogue.py``). ``AMAX_PAIR``: also
    the chunk's part of dx's slab's two NVFP4 amaxes (``common.amax_pair_kwargs``; 16 | L).

    The owner of input position t visits each tap once (da_{t+s} feeds dx_t and dweight), so x is read
    once, unshifted. The sums are reduced over the positions once, after the loop: a reduction per tile
    would cross warps every iteration."""
    b = tl.program_id(0).to(tl.int64)  # batch offsets can pass 2^31 elements
    chunk = tl.program_id(1)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    c_ok = c < C
    w0 = _tap_weight(w_ptr, c, c_ok, K, 0)[None, :]
    w1 = _tap_weight(w_ptr, c, c_ok, K, 1)[None, :]
    w2 = _tap_weight(w_ptr, c, c_ok, K, 2)[None, :]
    w3 = _tap_weight(w_ptr, c, c_ok, K, 3)[None, :]
    dw0 = tl.zeros((BL, BC), dtype=tl.float32)  # dw_s: the sums of weight column k-1-s
    dw1 = tl.zeros((BL, BC), dtype=tl.float32)
    dw2 = tl.zeros((BL, BC), dtype=tl.float32)
    dw3 = tl.zeros((BL, BC), dtype=tl.float32)
    db = tl.zeros((BL, BC), dtype=tl.float32)
    seen = tl.zeros((BL, BC), dtype=tl.float32)  # FP8: max |dx| per element
    if FP8:
        scale = fp8_scale(amax_ptr, E5M2)
    for i in range(0, CHUNK, BL):
        t = chunk * CHUNK + i + tl.arange(0, BL)
        t_ok = t < L
        seg_t = t  # unused without document resets
        if HAS_SEG:
            seg_t = tl.load(seg_ptr + b * ssb + t, mask=t_ok, other=-1)
        tile = t_ok[:, None] & c_ok[None, :]
        x_t = tl.load(x_ptr + b * sxb + t[:, None] * sxl + c[None, :], mask=tile, other=0.0).to(tl.float32)
        dx = tl.zeros((BL, BC), dtype=tl.float32)
        for s in tl.static_range(K):
            ts = t + s  # the output position that tap s of position t feeds
            ok = t_ok & (ts < L)
            if HAS_SEG:
                seg_s = tl.load(seg_ptr + b * ssb + ts, mask=ok, other=-2)
                ok = ok & (seg_s == seg_t)
            # da at t + s (0 where the tap is masked), written by the first pass
            da = tl.load(
                da_ptr + (b * L + ts[:, None]) * C + c[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0
            )
            if s == 0:
                dx += da * w0
                dw0 += da * x_t
                db += da
            elif s == 1:
                dx += da * w1
                dw1 += da * x_t
            elif s == 2:
                dx += da * w2
                dw2 += da * x_t
            else:
                dx += da * w3
                dw3 += da * x_t
        dx_at = dx_ptr + b * sdxb + t[:, None] * sdxl + c[None, :]
        if FP8:
            q, r = bf16_fp8_bytes(dx, scale, E5M2, HW)
            tl.store(dx_at, q, mask=tile)
            seen = running_amax(seen, r, tile)
        else:
            tl.store(dx_at, round_to(dx, dx_ptr.dtype.element_ty), mask=tile)  # as the FP8 form rounds
    # this chunk's partial sums: row (b, chunk) of the [B * nC, k, C] / [B * nC, C] buffers
    row = b * tl.num_programs(1) + chunk
    tl.store(db_ptr + row * C + c, tl.sum(db, 0), mask=c_ok)
    tl.store(dw_ptr + (row * K + K - 1) * C + c, tl.sum(dw0, 0), mask=c_ok)
    if K > 1:
        tl.store(dw_ptr + (row * K + K - 2) * C + c, tl.sum(dw1, 0), mask=c_ok)
    if K > 2:
        tl.store(dw_ptr + (row * K + K - 3) * C + c, tl.sum(dw2, 0), mask=c_ok)
    if K > 3:
        tl.store(dw_ptr + (row * K + K - 4) * C + c, tl.sum(dw3, 0), mask=c_ok)
    if FP8:
        record_amax(record_ptr, seen)
    if AMAX_PAIR:
        tl.debug_barrier()  # NOTE the rows are read back in another layout: all stores first
        first_c = tl.program_id(2) * BC
        store_amax_pair(dx_ptr + b * sdxb, chunk * CHUNK, first_c, first_c + BC, L, C, sdxl, pair_ptr,
                        SIGN_BITS, CHUNK, BC, NATIVE_BF16)  # fmt: skip


def _device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _row_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pointwise(x, weight, bias, seg, douts, out) -> None:
    Bsz, L, C = x.shape
    grid = lambda meta: (Bsz, triton.cdiv(L, meta["BL"]), triton.cdiv(C, meta["BC"]))  # noqa: E731
    grad = douts is not None
    d = list(douts) if grad else [out]
    bounds = [0]  # the blocks' first channels (conv_silu_triton checked that they cover C)
    for t in d:
        bounds.append(bounds[-1] + t.shape[-1])
    d3 = d if len(d) == 3 else d * 3  # unused pointers and strides when whole
    with _device(x):
        _conv_silu_pointwise[grid](
            x,
            seg if seg is not None else x,
            weight,
            bias,
            d3[0],
            d3[1],
            d3[2],
            out,
            L,
            C,
            bounds[1],
            bounds[2] if len(d) == 3 else C,
            x.stride(0),
            x.stride(1),
            seg.stride(0) if seg is not None else 0,
            d3[0].stride(0),
            d3[0].stride(1),
            d3[1].stride(0),
            d3[1].stride(1),
            d3[2].stride(0),
            d3[2].stride(1),
            out.stride(0),
            out.stride(1),
            HAS_SEG=seg is not None,
            GRAD=grad,
            BLOCKS=len(d),
            K=weight.shape[1],
        )


class _ConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seg, blocks, dx_into):
        ctx.dx_into = dx_into
        out = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # out: [B, L, C]
        _pointwise(x, weight, bias, seg, None, out)
        ctx.save_for_backward(x, weight, bias, seg)
        return out if blocks is None else tuple(out.split(blocks, -1))

    @staticmethod
    def backward(ctx, *douts):
        x, weight, bias, seg = ctx.saved_tensors
        Bsz, L, C = x.shape
        douts = [_row_contiguous(d.reshape(Bsz, L, d.shape[-1])) for d in douts]
        K = weight.shape[1]
        n_chunks = triton.cdiv(L, CHUNK_L)
        da = torch.empty(Bsz, L, C, device=x.device, dtype=torch.float32)  # contiguous: read as such
        _pointwise(x, weight, bias, seg, douts, da)
        # [B, L, C]; a column block of in_proj's gradient in the mixer (BF16 values or FP8 bytes)
        target = grad_buffer(ctx.dx_into, x)
        dx, fp8_kw, dx_grad = epilogue_args(target)
        # NVFP4: dx's amaxes, where 16-token groups stay inside a sequence
        pair_kw = amax_pair_kwargs(target, CHUNK_L if L % 16 == 0 else 1, x)
        dw_part = torch.empty(Bsz * n_chunks, K, C, device=x.device, dtype=torch.float32)
        db_part = torch.empty(Bsz * n_chunks, C, device=x.device, dtype=torch.float32)
        with _device(x):
            _conv_silu_bwd[lambda meta: (Bsz, n_chunks, triton.cdiv(C, meta["BC"]))](
                x,
                seg if seg is not None else x,
                weight,
                da,
                dx,
                dw_part,
                db_part,
                L,
                C,
                x.stride(0),
                x.stride(1),
                seg.stride(0) if seg is not None else 0,
                dx.stride(0),
                dx.stride(1),
                HAS_SEG=seg is not None,
                K=K,
                CHUNK=CHUNK_L,
                **fp8_kw,
                **pair_kw,
            )
        dweight = dw_part.sum(0).t().to(weight.dtype)  # [C, k]
        dbias = db_part.sum(0).to(bias.dtype)
        return dx_grad, dweight.contiguous(), dbias, None, None, None


@torch.compiler.disable  # Triton launches and a hand-written backward: a graph break, not a trace
def conv_silu_triton(
    xBC: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    seg: torch.Tensor | None = None,
    blocks: list[int] | None = None,
    dx_into=None,
):
    """silu(causal depthwise conv(xBC)) in xBC's dtype, as ``model/conv.py``'s :func:`conv_silu`: xBC
    [B, L, C] (last dim contiguous), weight [C, k] (k <= 4), bias [C], seg [B, L] or None. blocks: 1 or 3
    column widths to split the output into (the mixer's x, B and C), whose gradients are read in place;
    dx_into: where the backward writes dxBC (``model/grad_slab.py``)."""
    if not (xBC.is_cuda or INTERPRET):
        raise ValueError(f"conv_silu_triton needs CUDA tensors (got {xBC.device}); use conv_silu on CPU")
    if weight.shape[1] > 4:
        raise ValueError(
            f"conv_silu_triton takes conv kernel widths up to 4, got {weight.shape[1]}; "
            "use model.conv_impl=compiled for wider kernels"
        )
    if blocks is not None and (len(blocks) not in (1, 3) or sum(blocks) != xBC.shape[-1]):
        raise ValueError(f"blocks must be 1 or 3 widths summing to {xBC.shape[-1]}, got {blocks}")
    if seg is not None:
        seg = _row_contiguous(seg)
    blocks = None if blocks is None else list(blocks)
    return _ConvSiLU.apply(_row_contiguous(xBC), weight.contiguous(), bias.contiguous(), seg, blocks, dx_into)
