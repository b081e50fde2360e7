"""Mamba-2's output, the D skip and the gated group RMS norm, as Triton kernels behind an autograd
Function. The math of ``model/norm.py``'s skip_gated_rms_norm, per row and group of GW = E/G channels
(channel c = h P + p):

    s  = y + x D_h          (rounded like the reference: x D_h, then the sum, each to the skip dtype)
    u  = s silu(z),   r = (mean_GW u^2 + eps)^-1/2,   u^ = u r,   out = u^ w
    backward, g = dout w:
    du = r (g - u^ mean_GW(g u^));   ds = du silu(z);   dz = du s silu'(z)
    dy = ds;   dx = ds D_h;   dD_h = sum_{rows, p} ds x;   dw = sum_rows dout u^

The backward recomputes s and u from y, x, z (which it reads anyway), so the forward saves only
r [R, G]. One program handles one group of BLOCK_R rows.

Shape letters: R rows, E d_inner (= H P), G groups, GW = E/G, H heads, P head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.model.glue_kernels.common import (
    TL_DTYPES,
    amax_epilogue_kwargs,
    amax_pair_kwargs,
    as_rows,
    backward_tile,
    cdiv,
    check_inputs,
    epilogue_args,
    forward_tile,
    fp8_epilogue_kwargs,
    grad_buffer,
    load_f32,
    on_device,
    round_to,
    rsqrt,
    to_f32,
)
from inkling_fp4.model.grad_slab import FP8Scaling
from inkling_fp4.model.ssd_kernels.tuning import INTERPRET
from inkling_fp4.numerics.kernels.amax import zeroed_words
from inkling_fp4.numerics.kernels.fp8_epilogue import bf16_fp8_bytes, fp8_scale, running_amax
from inkling_fp4.numerics.kernels.fp8_quantize import record_amax
from inkling_fp4.numerics.kernels.nvfp4_rht import store_amax_pair

# The backward's tile: 8 elements per thread (a group row of 256 is then one warp's, so its sums stay in
# the warp) and 128 rows per program; faster than the shared defaults on an H200.
BWD_PER_THREAD = 8
BWD_CHUNK_ROWS = 128
# The backward's FP8 variant is capped at the BF16 variant's 128 registers a thread (sm_90): uncapped,
# the epilogue takes it past 128, fewer programs fit an SM and it runs slower than the BF16 variant.
BWD_FP8_REGS = 128


def _skip_gate_math(y_ptr, x_ptr, d, z_ptr, rows, cols, mask, sy, sx, sz, S_DTYPE: tl.constexpr):
    """s = y + x D_h (rounded op by op as the reference), z and x in FP32. d: D_h per column, loaded once
    per program (a load inside the backward's loop would go through shared memory every iteration)."""
    y = load_f32(y_ptr + rows[:, None] * sy + cols[None, :], mask)
    x = load_f32(x_ptr + rows[:, None] * sx + cols[None, :], mask)
    s = to_f32(round_to(y + to_f32(round_to(x * d[None, :], S_DTYPE)), S_DTYPE))
    z = load_f32(z_ptr + rows[:, None] * sz + cols[None, :], mask)
    return s, z, x


# a plain function under the interpreter, which re-patches triton.language on every jit call
_skip_gate = _skip_gate_math if INTERPRET else triton.jit(_skip_gate_math)


@triton.jit
def _gated_fwd(y_ptr, x_ptr, D_ptr, z_ptr, w_ptr, out_ptr, rstd_ptr, R, E, GW, sy, sx, sz, eps,
               P: tl.constexpr, S_DTYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
               amax_ptr, record_ptr, FP8: tl.constexpr, E5M2: tl.constexpr, HW: tl.constexpr, pair_ptr,
               AMAX_PAIR: tl.constexpr, SIGN_BITS: tl.constexpr, NATIVE_BF16: tl.constexpr,
               PAIR_BLOCK_N: tl.constexpr, SUBTILES: tl.constexpr):  # fmt: skip
    """Group program_id(1) of SUBTILES tiles of BLOCK_R rows: out = (u r) w. ``FP8``: out as
    delayed-scaled FP8 bytes. ``AMAX_PAIR``: also the stored tile's part of out's two NVFP4 tensor amaxes,
    ``max |rht(outᵀ)|`` and ``max |out|``, into ``pair_ptr`` [2] (SUBTILES · BLOCK_R a multiple of 16;
    ``nvfp4_rht.store_amax_pair``); the tiles are the plain launch's, so the row sums and the output are
    its bits."""
    grp = tl.program_id(1)
    for sub in tl.static_range(SUBTILES):  # SUBTILES tiles of BLOCK_R rows, each as a plain launch's
        rows = ((tl.program_id(0) * SUBTILES + sub) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        lane = tl.arange(0, BLOCK_C)
        cols = grp * GW + lane
        mask = (rows < R)[:, None] & (lane < GW)[None, :]
        d = load_f32(D_ptr + cols // P, lane < GW)  # D_h of channel h P + p
        s, z, x = _skip_gate(y_ptr, x_ptr, d, z_ptr, rows, cols, mask, sy, sx, sz, S_DTYPE)
        u = s * (z * tl.sigmoid(z))
        rstd = rsqrt(tl.div_rn(tl.sum(u * u, 1), (GW * 1.0)) + eps)  # [BLOCK_R]
        w = load_f32(w_ptr + cols, lane < GW)
        out = (u * rstd[:, None]) * w[None, :]
        if FP8:
            q, r = bf16_fp8_bytes(out, fp8_scale(amax_ptr, E5M2), E5M2, HW)
            tl.store(out_ptr + rows[:, None] * E + cols[None, :], q, mask=mask)
            record_amax(record_ptr, running_amax(tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32), r, mask))
        else:
            tl.store(
                out_ptr + rows[:, None] * E + cols[None, :],
                round_to(out, out_ptr.dtype.element_ty),
                mask=mask,
            )
        tl.store(rstd_ptr + rows * tl.num_programs(1) + grp, rstd, mask=rows < R)
    if AMAX_PAIR:
        tl.debug_barrier()  # NOTE the tile is read back in another layout: all stores first
        rows_each: tl.constexpr = SUBTILES * BLOCK_R  # a constexpr: the amax loop unrolls over it
        store_amax_pair(out_ptr, tl.program_id(0) * rows_each, grp * GW, grp * GW + GW, R, E, E, pair_ptr,
                        SIGN_BITS, rows_each, PAIR_BLOCK_N, NATIVE_BF16)  # fmt: skip


@triton.jit
def _gated_bwd(y_ptr, x_ptr, D_ptr, z_ptr, w_ptr, rstd_ptr, dout_ptr, dy_ptr, dx_ptr, dz_ptr, part_ptr,
               R, E, GW, sy, sx, sz, sdo, sdz, P: tl.constexpr, S_DTYPE: tl.constexpr, CHUNK: tl.constexpr,
               BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, amax_ptr, record_ptr, FP8: tl.constexpr,
               E5M2: tl.constexpr, HW: tl.constexpr, pair_ptr, AMAX_PAIR: tl.constexpr,
               SIGN_BITS: tl.constexpr, NATIVE_BF16: tl.constexpr, PAIR_BLOCK_N: tl.constexpr):  # fmt: skip
    """dy, dx, dz of group program_id(1) over CHUNK rows; the sums of dout u^ and ds x go to row
    program_id(0) of the partial sums [programs, 2, E]. ``FP8``: dz as delayed-scaled FP8 bytes."""
    pid = tl.program_id(0)
    grp = tl.program_id(1)
    lane = tl.arange(0, BLOCK_C)
    cols = grp * GW + lane
    col_ok = lane < GW
    w = load_f32(w_ptr + cols, col_ok)
    d = load_f32(D_ptr + cols // P, col_ok)  # D_h of channel h P + p
    # per-element partial sums, reduced over the rows once after the loop: a reduction across the
    # tile's rows per iteration would cross warps (shared memory and barriers every iteration)
    dw = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    dd = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    seen = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)  # FP8: max |dz| per element
    if FP8:
        scale = fp8_scale(amax_ptr, E5M2)
    for i in range(0, CHUNK, BLOCK_R):
        rows = (pid * CHUNK + i + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (rows < R)[:, None] & col_ok[None, :]
        s, z, x = _skip_gate(y_ptr, x_ptr, d, z_ptr, rows, cols, mask, sy, sx, sz, S_DTYPE)
        rstd = tl.load(rstd_ptr + rows * tl.num_programs(1) + grp, mask=rows < R, other=0.0)
        dout = load_f32(dout_ptr + rows[:, None] * sdo + cols[None, :], mask)
        sig = tl.sigmoid(z)
        silu = z * sig
        u_hat = (s * silu) * rstd[:, None]
        dw += dout * u_hat
        g = dout * w[None, :]
        mean_gu = tl.div_rn(tl.sum(g * u_hat, 1), (GW * 1.0))
        du = rstd[:, None] * (g - u_hat * mean_gu[:, None])
        ds = du * silu
        dz = du * s * (sig * (1.0 + z * (1.0 - sig)))
        dd += ds * x
        out_at = rows[:, None] * E + cols[None, :]
        tl.store(dy_ptr + out_at, round_to(ds, dy_ptr.dtype.element_ty), mask=mask)
        tl.store(dx_ptr + out_at, round_to(ds * d[None, :], dx_ptr.dtype.element_ty), mask=mask)
        if FP8:
            q, r = bf16_fp8_bytes(dz, scale, E5M2, HW)
            tl.store(dz_ptr + rows[:, None] * sdz + cols[None, :], q, mask=mask)
            seen = running_amax(seen, r, mask)
        else:
            tl.store(
                dz_ptr + rows[:, None] * sdz + cols[None, :], round_to(dz, dz_ptr.dtype.element_ty), mask=mask
            )
    tl.store(part_ptr + (pid * 2) * E + cols, tl.sum(dw, 0), mask=col_ok)
    tl.store(part_ptr + (pid * 2 + 1) * E + cols, tl.sum(dd, 0), mask=col_ok)
    if FP8:
        record_amax(record_ptr, seen)
    if AMAX_PAIR:  # dz's part of its slab's NVFP4 amaxes (common.amax_pair_kwargs)
        tl.debug_barrier()  # NOTE the rows are read back in another layout: all stores first
        store_amax_pair(dz_ptr, pid * CHUNK, grp * GW, grp * GW + GW, R, E, sdz, pair_ptr, SIGN_BITS, CHUNK,
                        PAIR_BLOCK_N, NATIVE_BF16)  # fmt: skip


def gated_forward(
    y,
    x,
    D,
    z,
    weight,
    n_groups: int,
    eps: float,
    out_dtype,
    fp8_out: FP8Scaling | None = None,
    amax_pair=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [..., E], rstd [R, G]); ``fp8_out``: out as FP8 bytes of the BF16 values (out_dtype BF16).
    ``amax_pair``: (RHT sign bits, FP32 words [2] at zero) to reduce out's two NVFP4 tensor amaxes into
    (out_dtype BF16, 16 | R)."""
    H, P = y.shape[-2:]
    E = H * P
    s_dtype = skip_dtype(y, x, D)
    y2, x2, z2 = as_rows(y, E), as_rows(x, E), as_rows(z, E)
    R, GW = y2.shape[0], E // n_groups
    assert fp8_out is None or out_dtype == torch.bfloat16, "FP8 bytes are of the BF16 output"
    out_dtype = torch.uint8 if fp8_out is not None else out_dtype or s_dtype
    out = torch.empty(z.shape, device=z.device, dtype=out_dtype)
    fp8_kw = fp8_epilogue_kwargs(fp8_out, out)
    rstd = torch.empty(R, n_groups, device=z.device, dtype=torch.float32)
    block_c, block_r, warps = forward_tile(GW)
    subtiles = 1
    if amax_pair is not None:
        assert out_dtype == torch.bfloat16 and R % 16 == 0, "the amaxes are of a BF16 output, 16 | R"
        subtiles = max(1, 16 // block_r)  # a program's rows: whole 16-token groups
    with on_device(z):
        _gated_fwd[(max(1, cdiv(R, block_r * subtiles)), n_groups)](
            y2, x2, D, z2, weight, out, rstd, R, E, GW, y2.stride(0), x2.stride(0), z2.stride(0), eps,
            P=P, S_DTYPE=TL_DTYPES[s_dtype], BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
            enable_fp_fusion=False, **fp8_kw,
            **amax_epilogue_kwargs(amax_pair, rstd, min(block_c, 32 * warps)),
            SUBTILES=subtiles,
        )  # fmt: skip
    return out, rstd


def gated_backward(y, x, D, z, weight, rstd, dout, dz_into=None):
    """(dy, dx, dD, dz, dweight) for dout [..., E]; ``dz_into`` as for :func:`skip_gated_rms_norm`."""
    H, P = y.shape[-2:]
    E = H * P
    y2, x2, z2, dout2 = as_rows(y, E), as_rows(x, E), as_rows(z, E), as_rows(dout, E)
    R, G = rstd.shape
    dy = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    dx = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    # [..., E]; a column block of in_proj's gradient in the mixer (BF16 values or FP8 bytes)
    dz_target = grad_buffer(dz_into, z)
    dz_out, fp8_kw, dz = epilogue_args(dz_target)
    dz2 = dz_out.view(-1, E)
    block_c, block_r, warps, chunk = backward_tile(E // G, BWD_PER_THREAD, BWD_CHUNK_ROWS)
    n_prog = max(1, cdiv(R, chunk))
    # at the tuned elements per thread only: a wider group (more per thread) keeps ptxas's own count
    tuned = block_r * block_c <= BWD_PER_THREAD * 32 * warps
    cap = dict(maxnreg=BWD_FP8_REGS) if fp8_kw["FP8"] and tuned else {}
    pair_kw = amax_pair_kwargs(dz_target, chunk, rstd, min(block_c, 32 * warps))  # NVFP4: dz's amaxes
    part = torch.empty(n_prog, 2, E, device=z.device, dtype=torch.float32)  # dweight, dD partial sums
    with on_device(z):
        _gated_bwd[(n_prog, G)](
            y2, x2, D, z2, weight, rstd, dout2, dy, dx, dz2, part, R, E, E // G,
            y2.stride(0), x2.stride(0), z2.stride(0), dout2.stride(0), dz2.stride(0),
            P=P, S_DTYPE=TL_DTYPES[skip_dtype(y, x, D)], CHUNK=chunk, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=warps, enable_fp_fusion=True, **fp8_kw, **pair_kw, **cap,
        )  # fmt: skip
    sums = part.sum(0)  # [2, E]
    dD = sums[1].view(H, P).sum(1).to(D.dtype)  # [H]
    return dy, dx, dD, dz, sums[0].to(weight.dtype)


def skip_dtype(y: torch.Tensor, x: torch.Tensor, D: torch.Tensor) -> torch.dtype:
    """The dtype of the skip sum y + x D (the promoted dtype of the three)."""
    return torch.promote_types(torch.promote_types(y.dtype, x.dtype), D.dtype)


class _SkipGatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, x, D, z, weight, n_groups, eps, out_dtype, dz_into, amax_pair=None):
        out, rstd = gated_forward(y, x, D, z, weight, n_groups, eps, out_dtype, amax_pair=amax_pair)
        ctx.save_for_backward(y, x, D, z, weight, rstd)
        ctx.dz_into = dz_into
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = gated_backward(*ctx.saved_tensors, dout, ctx.dz_into)
        return *grads, None, None, None, None, None


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
    """Mamba-2's output ``gated_rms_norm(y + D x, z)``: y, x [..., H, P] (x may have strided rows), D [H],
    z [..., H P], weight [H P] -> [..., H P]. ``dz_into``: None, or a function returning the tensor the
    backward writes dz into (``model/grad_slab.py``)."""
    _check(y, x, D, z, weight, n_groups)
    return _SkipGatedRMSNorm.apply(y, x, D, z, weight, n_groups, eps, out_dtype, dz_into)


def _check(y, x, D, z, weight, n_groups: int) -> None:
    check_inputs(y, x, D, z, weight)
    H, P = y.shape[-2:]
    if x.shape != y.shape or z.shape != y.shape[:-2] + (H * P,) or D.shape != (H,) or (H * P) % n_groups:
        raise ValueError(
            "skip_gated_rms_norm takes y, x [..., H, P], D [H], z [..., H*P] with H*P divisible by "
            f"n_groups; got y {tuple(y.shape)}, x {tuple(x.shape)}, D {tuple(D.shape)}, z {tuple(z.shape)}, "
            f"n_groups {n_groups}"
        )


def skip_gated_norm_amax_pair(y, x, D, z, weight, n_groups: int, eps: float, sign_bits: int, dz_into=None):
    """:func:`skip_gated_rms_norm` to BF16 (tokens a multiple of 16) that also reduces its output's two
    NVFP4 tensor amaxes (out_proj's x; the wgrad's RHT by ``sign_bits``) -> (out [..., E], FP32 [2]
    ``[max |rht(outᵀ)|, max |out|]``, as ``rht_t_abs_max`` gives them for the 2-D out)."""
    _check(y, x, D, z, weight, n_groups)
    pair = zeroed_words(2, z.device)
    out = _SkipGatedRMSNorm.apply(
        y, x, D, z, weight, n_groups, eps, torch.bfloat16, dz_into, (sign_bits, pair)
    )
    return out, pair
