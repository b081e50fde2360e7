"""The Mamba-2 causal depthwise conv + SiLU as Triton kernels (forward; backward in two passes), with
document resets.

Same function as :func:`inkling_fp4.model.conv.conv_silu` (the reference, whose docstring has the math):

    a_t   = bias + sum_{s=0}^{k-1} weight[:, k-1-s] * x_{t-s} * [seg_{t-s} == seg_t]
    out_t = silu(a_t)

Why kernels: the op is purely memory-bound (k = 4 multiply-adds per element), so its cost is the bytes
moved. Forward reads x once and writes out once (2 x B L C x 2 bytes in BF16). The k shifted reads of
a tile hit L1/L2, not HBM. Nothing of size B L C is saved beyond x itself: the backward recomputes the
pre-activation a.

The backward is two passes. The first computes da = dout * silu'(a) once per position into an FP32
buffer (reads x and dout, writes 4 bytes per element); the second reads da at the k shifted positions
for dx and multiplies it with the shifted x for dweight and dbias (reads da and x, writes dx). A single
pass needs da at t..t+k-1 for every tile, so it recomputed a and silu' k times per element (k^2 shifted
loads of x, k sigmoids): on the H200 at hybrid-350m's shape (16 x 2048 x 3072, BF16) that single pass
took 1.46 ms (~410 GB/s of its 3 x B L C x 2 bytes) where the forward takes 0.18 ms (~2270 GB/s).

The input may be a strided view (the x||B||C slice of in_proj's output): only its last dim must be
contiguous, so the split of in_proj's output costs no copy.

Backward, per position t (masks as above, [t+s < L] and [seg_{t+s} == seg_t]):

    da_t       = dout_t * silu'(a_t),   silu'(a) = sig(a) (1 + a (1 - sig(a)))
    dx_t       = sum_s weight[:, k-1-s] * da_{t+s}
    dweight[:, k-1-s] = sum_{b,t} da_t * x_{t-s}        dbias = sum_{b,t} da_t

dweight and dbias are summed per (batch row, chunk of CHUNK_L positions) into an FP32 buffer, then
reduced in PyTorch: deterministic, unlike atomics. Each second-pass program walks its chunk in tiles of BL
positions, keeping the chunk's dweight and dbias sums in registers, so the buffer's size does not
depend on the tile size and the tiles can be autotuned.

Tile sizes are autotuned (model/ssd_kernels/tuning.py: the first candidate only under the interpreter
and in deterministic runs). The forward's values do not depend on the tiles (each output sums its own k
taps in a fixed order); the backward's dweight and dbias sum a chunk's rows tile by tile, so their last
bits do, which is why deterministic runs take the first candidate, as for the SSD kernels.

CUDA tensors, or any device under ``TRITON_INTERPRET=1`` (how the CPU tests run the kernels).
Shape letters: B batch, L length, C channels, k kernel width.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from inkling_fp4.model.ssd_kernels.tuning import INTERPRET, autotune, configs

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


@autotune(configs(_TILES), key=["C", "K", "HAS_SEG", "GRAD"])
@triton.jit
def _conv_silu_pointwise(
    x_ptr,
    seg_ptr,
    w_ptr,
    bias_ptr,
    dout_ptr,
    out_ptr,
    L,
    C,
    sxb,
    sxl,
    ssb,
    sdb,
    sdl,
    sob,
    sol,
    HAS_SEG: tl.constexpr,
    GRAD: tl.constexpr,
    K: tl.constexpr,
    BL: tl.constexpr,
    BC: tl.constexpr,
):
    """At the positions t of this tile: out = silu(a) (forward), or with GRAD the backward's first pass,
    out = da = dout * silu'(a) in FP32."""
    b = tl.program_id(0).to(tl.int64)  # batch offsets can pass 2^31 elements
    t = tl.program_id(1) * BL + tl.arange(0, BL)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    c_ok = c < C
    mask = (t < L)[:, None] & c_ok[None, :]
    a = _conv_pre(x_ptr, seg_ptr, w_ptr, bias_ptr, b, t, c, c_ok, L, sxb, sxl, ssb, HAS_SEG, K, BL, BC)
    sig = tl.sigmoid(a)
    if GRAD:
        dout = tl.load(dout_ptr + b * sdb + t[:, None] * sdl + c[None, :], mask=mask, other=0.0)
        out = dout.to(tl.float32) * sig * (1.0 + a * (1.0 - sig))
    else:
        out = a * sig
    tl.store(out_ptr + b * sob + t[:, None] * sol + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@autotune(configs(_TILES), key=["C", "K", "HAS_SEG"])
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
    KP: tl.constexpr,
    CHUNK: tl.constexpr,
    BL: tl.constexpr,
    BC: tl.constexpr,
):
    """Second pass: dx of this chunk's tiles and the chunk's dweight and dbias sums, from da."""
    b = tl.program_id(0).to(tl.int64)  # batch offsets can pass 2^31 elements
    chunk = tl.program_id(1)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    c_ok = c < C
    taps = tl.arange(0, KP)  # row j of dw_acc is weight column j
    dw_acc = tl.zeros((KP, BC), dtype=tl.float32)
    db_acc = tl.zeros((BC,), dtype=tl.float32)
    for i in range(0, CHUNK, BL):
        t = chunk * CHUNK + i + tl.arange(0, BL)
        t_ok = t < L
        seg_t = t  # unused without document resets
        if HAS_SEG:
            seg_t = tl.load(seg_ptr + b * ssb + t, mask=t_ok, other=-1)
        dx = tl.zeros((BL, BC), dtype=tl.float32)
        da_here = tl.zeros((BL, BC), dtype=tl.float32)
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
            w = tl.load(w_ptr + c * K + (K - 1 - s), mask=c_ok, other=0.0).to(tl.float32)
            dx += da * w[None, :]
            if s == 0:
                da_here = da
        tl.store(
            dx_ptr + b * sdxb + t[:, None] * sdxl + c[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=t_ok[:, None] & c_ok[None, :],
        )
        db_acc += tl.sum(da_here, 0)
        for s in tl.static_range(K):
            xs = _x_tap(x_ptr, seg_ptr, b, t, t_ok, seg_t, s, c, c_ok, sxb, sxl, ssb, HAS_SEG)
            part = tl.sum(da_here * xs, 0)  # [BC]
            dw_acc += tl.where(taps[:, None] == K - 1 - s, part[None, :], 0.0)
    # this chunk's partial sums: row (b, chunk) of the [B * nC, k, C] / [B * nC, C] buffers
    row = b * tl.num_programs(1) + chunk
    tl.store(db_ptr + row * C + c, db_acc, mask=c_ok)
    tl.store(
        dw_ptr + (row * K + taps[:, None]) * C + c[None, :], dw_acc, mask=(taps < K)[:, None] & c_ok[None, :]
    )


def _device(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _row_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _pointwise(x, weight, bias, seg, dout, out) -> None:
    """Launch :func:`_conv_silu_pointwise`: out = silu(a) when dout is None, else da (FP32)."""
    Bsz, L, C = x.shape
    grid = lambda meta: (Bsz, triton.cdiv(L, meta["BL"]), triton.cdiv(C, meta["BC"]))  # noqa: E731
    grad = dout is not None
    dout_arg = dout if grad else out
    with _device(x):
        _conv_silu_pointwise[grid](
            x,
            seg if seg is not None else x,
            weight,
            bias,
            dout_arg,
            out,
            L,
            C,
            x.stride(0),
            x.stride(1),
            seg.stride(0) if seg is not None else 0,
            dout_arg.stride(0),
            dout_arg.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_SEG=seg is not None,
            GRAD=grad,
            K=weight.shape[1],
        )


class _ConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, seg):
        out = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # out: [B, L, C]
        _pointwise(x, weight, bias, seg, None, out)
        ctx.save_for_backward(x, weight, bias, seg)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, bias, seg = ctx.saved_tensors
        dout = _row_contiguous(dout)
        Bsz, L, C = x.shape
        K = weight.shape[1]
        n_chunks = triton.cdiv(L, CHUNK_L)
        da = torch.empty(Bsz, L, C, device=x.device, dtype=torch.float32)  # contiguous: read as such
        _pointwise(x, weight, bias, seg, dout, da)
        dx = torch.empty(Bsz, L, C, device=x.device, dtype=x.dtype)
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
                KP=triton.next_power_of_2(K),
                CHUNK=CHUNK_L,
            )
        dweight = dw_part.sum(0).t().to(weight.dtype)  # [C, k]
        dbias = db_part.sum(0).to(bias.dtype)
        return dx, dweight.contiguous(), dbias, None


@torch.compiler.disable  # Triton launches and a hand-written backward: a graph break, not a trace
def conv_silu_triton(
    xBC: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, seg: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(causal depthwise conv(xBC)) in xBC's dtype, as :func:`~inkling_fp4.model.conv.conv_silu`.

    xBC: [B, L, C] (any strides with the last dim contiguous); weight: [C, k]; bias: [C]; seg: [B, L]
    segment ids or None. Differentiable in xBC, weight and bias. CUDA, or TRITON_INTERPRET=1.
    """
    if not (xBC.is_cuda or INTERPRET):
        raise ValueError(f"conv_silu_triton needs CUDA tensors (got {xBC.device}); use conv_silu on CPU")
    if seg is not None:
        seg = _row_contiguous(seg)
    return _ConvSiLU.apply(_row_contiguous(xBC), weight.contiguous(), bias.contiguous(), seg)
