"""RMS norm, and the residual add fused with the next RMS norm, as Triton kernels behind autograd
Functions. The math of ``model/norm.py``'s rms_norm and add_rms_norm, per row of D:

    rms_norm       out = (x r) w,   r = (mean_D x^2 + eps)^-1/2,   x^ = x r,   g = dout w
                   dx = r (g - x^ mean_D(g x^)),   dw = sum_rows dout x^
    add_rms_norm   h = x + y (rounded once to h's dtype), normed = rms_norm(h); the backward is one
                   kernel: dh_total = dh + the norm's dx, returned as dx (x's dtype) and dy (y's dtype)

The forward saves r [R] (FP32). add_rms_norm normalises the h it stored, as the residual stream keeps it.

Shape letters: R rows (the flattened leading dims), D normalised width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inkling_fp4.model.glue_kernels.common import (
    amax_epilogue_kwargs,
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
from inkling_fp4.numerics.kernels.amax import zeroed_words
from inkling_fp4.numerics.kernels.fp8_epilogue import bf16_fp8_bytes, fp8_scale, running_amax
from inkling_fp4.numerics.kernels.fp8_quantize import record_amax
from inkling_fp4.numerics.kernels.nvfp4_decode_gemm import (
    quantize_rows_in_registers,
    quantize_whole_rows,
    row_halves,
    row_operand,
    row_warps,
    rows_fit_in_registers,
)
from inkling_fp4.numerics.kernels.nvfp4_rht import store_amax_pair


@triton.jit
def _norm_fwd(x_ptr, y_ptr, w_ptr, h_ptr, out_ptr, rstd_ptr, R, D, sx, sy, eps,
              ADD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
              amax_ptr, record_ptr, FP8: tl.constexpr, E5M2: tl.constexpr, HW: tl.constexpr,
              w_decode_ptr, values_ptr, out_scale_ptr, max_ptr, NVFP4_ROWS: tl.constexpr,
              NV_BLOCK_K: tl.constexpr, NV_IN_REGISTERS: tl.constexpr, pair_ptr, AMAX_PAIR: tl.constexpr,
              SIGN_BITS: tl.constexpr, NATIVE_BF16: tl.constexpr, PAIR_BLOCK_N: tl.constexpr,
              SUBTILES: tl.constexpr):  # fmt: skip
    """rms_norm of SUBTILES tiles of BLOCK_R rows: out = (h r) w, h = x, or with ADD h = x + y (also
    stored). ``FP8``: out as delayed-scaled FP8 bytes. ``NVFP4_ROWS``: also the NVFP4 block values of the
    stored BF16 out, one scale per row, from the tile held with ``NV_IN_REGISTERS``
    (``quantize_rows_in_registers``), else read back (``quantize_whole_rows``; both
    ``nvfp4_decode_gemm``): the same bits. ``AMAX_PAIR``: also the NVFP4 tensor amaxes of the stored
    out, ``max |rht(outᵀ)|`` and ``max |out|``, into ``pair_ptr`` [2] (SUBTILES · BLOCK_R a multiple of
    16, read back in feature chunks of PAIR_BLOCK_N); the tiles are the plain launch's, so the row sums
    and the output are its bits."""
    for sub in tl.static_range(SUBTILES):  # SUBTILES tiles of BLOCK_R rows, each as a plain launch's
        rows = ((tl.program_id(0) * SUBTILES + sub) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = (rows < R)[:, None] & (cols < D)[None, :]
        h = load_f32(x_ptr + rows[:, None] * sx + cols[None, :], mask)
        if ADD:
            h += load_f32(y_ptr + rows[:, None] * sy + cols[None, :], mask)
            h = round_to(h, h_ptr.dtype.element_ty)  # the norm reads h as stored
            tl.store(h_ptr + rows[:, None] * D + cols[None, :], h, mask=mask)
            h = to_f32(h)
        rstd = rsqrt(tl.div_rn(tl.sum(h * h, 1), (D * 1.0)) + eps)  # [BLOCK_R]
        w = load_f32(w_ptr + cols, cols < D)
        out = (h * rstd[:, None]) * w[None, :]
        if FP8:
            q, r = bf16_fp8_bytes(out, fp8_scale(amax_ptr, E5M2), E5M2, HW)
            tl.store(out_ptr + rows[:, None] * D + cols[None, :], q, mask=mask)
            record_amax(record_ptr, running_amax(tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32), r, mask))
        else:
            stored = round_to(out, out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * D + cols[None, :], stored, mask=mask)
            if NVFP4_ROWS:
                if NV_IN_REGISTERS:
                    # the operand is of the rows as stored; [BLOCK_R, BLOCK_D] -> halves [BLOCK_R, G, 8]
                    lo, hi = row_halves(to_f32(stored), BLOCK_R, BLOCK_D // 16)
                    quantize_rows_in_registers(lo, hi, rows, R, D, w_decode_ptr, values_ptr, out_scale_ptr,
                                               max_ptr, BLOCK_R, BLOCK_D // 16)  # fmt: skip
                else:
                    # NOTE every thread's part of the rows is stored before any thread reads the rows back
                    tl.debug_barrier()
                    quantize_whole_rows(out_ptr, D, rows, R, D, w_decode_ptr, values_ptr, out_scale_ptr,
                                        max_ptr, BLOCK_R, NV_BLOCK_K)  # fmt: skip
        tl.store(rstd_ptr + rows, rstd, mask=rows < R)
    if AMAX_PAIR:
        tl.debug_barrier()  # NOTE the rows are read back in another layout: all stores first
        rows_each: tl.constexpr = SUBTILES * BLOCK_R  # a constexpr: the amax loop unrolls over it
        store_amax_pair(out_ptr, tl.program_id(0) * rows_each, 0, D, R, D, D, pair_ptr, SIGN_BITS,
                        rows_each, PAIR_BLOCK_N, NATIVE_BF16)  # fmt: skip


@triton.jit
def _norm_bwd(h_ptr, w_ptr, rstd_ptr, dout_ptr, dh_ptr, dx_ptr, dy_ptr, dw_ptr, R, D, sh, sdo, sdh,
              HAS_DH: tl.constexpr, TWO: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr,
              BLOCK_D: tl.constexpr, amax_ptr, record_ptr, FP8: tl.constexpr, E5M2: tl.constexpr,
              HW: tl.constexpr, pair_ptr, AMAX_PAIR: tl.constexpr, SIGN_BITS: tl.constexpr,
              NATIVE_BF16: tl.constexpr, PAIR_BLOCK_N: tl.constexpr):  # fmt: skip
    """dx (plus dh when HAS_DH; also stored as dy when TWO) of this program's CHUNK rows, and their sum of
    dout h^ into its row of the dweight partial sums. ``FP8``: dy as delayed-scaled FP8 bytes.
    ``AMAX_PAIR``: also the rows' part of dy's two NVFP4 tensor amaxes into ``pair_ptr`` [2] (the
    gradient of the add's y: the output projection before it; 16 | CHUNK)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    w = load_f32(w_ptr + cols, col_ok)
    dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
    seen = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)  # FP8: max |dy| per element
    if FP8:
        scale = fp8_scale(amax_ptr, E5M2)
    for i in range(0, CHUNK, BLOCK_R):
        rows = (pid * CHUNK + i + tl.arange(0, BLOCK_R)).to(tl.int64)
        mask = (rows < R)[:, None] & col_ok[None, :]
        h = load_f32(h_ptr + rows[:, None] * sh + cols[None, :], mask)
        rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)
        dout = load_f32(dout_ptr + rows[:, None] * sdo + cols[None, :], mask)
        h_hat = h * rstd[:, None]
        dw += tl.sum(dout * h_hat, 0)
        g = dout * w[None, :]
        mean_gh = tl.div_rn(tl.sum(g * h_hat, 1), (D * 1.0))
        dx = rstd[:, None] * (g - h_hat * mean_gh[:, None])
        if HAS_DH:
            dx += load_f32(dh_ptr + rows[:, None] * sdh + cols[None, :], mask)
        tl.store(dx_ptr + rows[:, None] * D + cols[None, :], round_to(dx, dx_ptr.dtype.element_ty), mask=mask)
        if FP8:
            q, r = bf16_fp8_bytes(dx, scale, E5M2, HW)
            tl.store(dy_ptr + rows[:, None] * D + cols[None, :], q, mask=mask)
            seen = running_amax(seen, r, mask)
        elif TWO:
            tl.store(
                dy_ptr + rows[:, None] * D + cols[None, :], round_to(dx, dy_ptr.dtype.element_ty), mask=mask
            )
    tl.store(dw_ptr + pid * D + cols, dw, mask=col_ok)
    if FP8:
        record_amax(record_ptr, seen)
    if AMAX_PAIR:  # dy is dx itself where not TWO
        tl.debug_barrier()  # NOTE the rows are read back in another layout: all stores first
        store_amax_pair(dy_ptr if TWO else dx_ptr, pid * CHUNK, 0, D, R, D, D, pair_ptr, SIGN_BITS, CHUNK,
                        PAIR_BLOCK_N, NATIVE_BF16)  # fmt: skip


def norm_forward(
    x, y, weight, eps, out_dtype, h, fp8_out: FP8Scaling | None = None, nvfp4_rows=None, amax_pair=None
):
    """Launch the (add +) rms_norm forward (h: the buffer for x + y, or None) -> (normed, rstd [R]).
    ``fp8_out``: normed as FP8 bytes of the BF16 values under its delayed amax (out_dtype must be BF16).
    ``nvfp4_rows``: (w_decode [1], and the ``row_operand`` buffers) to write the NVFP4 row-scaled operand
    of normed into (out_dtype BF16). ``amax_pair``: (RHT sign bits, FP32 words [2] at zero) to reduce
    normed's two NVFP4 tensor amaxes into (``store_amax_pair``; out_dtype BF16, 16 | R)."""
    D = x.shape[-1]
    x2 = as_rows(x, D)
    y2 = x2 if y is None else as_rows(y, D)
    R = x2.shape[0]
    assert fp8_out is None or out_dtype == torch.bfloat16, "FP8 bytes are of the BF16 output"
    assert nvfp4_rows is None or (out_dtype == torch.bfloat16 and D % 16 == 0), "NVFP4 rows of BF16, 16 | D"
    out = torch.empty(x.shape, device=x.device, dtype=torch.uint8 if fp8_out is not None else out_dtype)
    rstd = torch.empty(R, device=x.device, dtype=torch.float32)
    block_d, block_r, warps = forward_tile(D)
    in_registers = nvfp4_rows is not None and rows_fit_in_registers(D)
    subtiles = 1
    if amax_pair is not None:
        assert out_dtype == torch.bfloat16 and R % 16 == 0, "the amaxes are of a BF16 output, 16 | R"
        assert fp8_out is None and nvfp4_rows is None, "the amaxes are of the BF16 output alone"
        subtiles = max(1, 16 // block_r)  # a program's rows: whole 16-token groups
    if in_registers:
        # NOTE one row a program, as the squared ReLU's rows: regrouping a several-row tile into 16-value
        # blocks shuffles it across 16 warps (7.4 us a launch at D = 768 and 64 rows, against 2.5 us
        # for the squared ReLU's 3072-wide single rows)
        block_r, warps = 1, row_warps(D)
    w_decode, values, out_scale, largest = nvfp4_rows or (out, out, out, out)
    with on_device(x):
        _norm_fwd[(max(1, cdiv(R, block_r * subtiles)),)](
            x2, y2, weight, out if h is None else h, out, rstd, R, D, x2.stride(0), y2.stride(0), eps,
            ADD=y is not None, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps, enable_fp_fusion=False,
            **fp8_epilogue_kwargs(fp8_out, out), w_decode_ptr=w_decode, values_ptr=values,
            out_scale_ptr=out_scale, max_ptr=largest, NVFP4_ROWS=nvfp4_rows is not None, NV_BLOCK_K=256,
            NV_IN_REGISTERS=in_registers, **amax_epilogue_kwargs(amax_pair, rstd, min(block_d, 32 * warps)),
            SUBTILES=subtiles,
        )  # fmt: skip
    return out, rstd


def norm_backward(h, weight, rstd, dout, dh, dx_dtype, dy_dtype, dy_into=None, dy_amaxes=None):
    """The (add +) rms_norm backward: dx, dy (dx itself when the dtypes agree) and dweight; ``dy_into``:
    where dy goes (``common.grad_buffer``). ``dy_amaxes``: (RHT sign bits, a list to append dy's two
    NVFP4 tensor amaxes to, ``[max |rht(dyᵀ)|, max |dy|]``; 16 | R)."""
    D = h.shape[-1]
    h2, dout2 = as_rows(h, D), as_rows(dout, D)
    dh2 = None if dh is None else as_rows(dh, D)
    R = h2.shape[0]
    dx = torch.empty(h.shape, device=h.device, dtype=dx_dtype)
    if dy_into is not None:
        like = torch.empty((), device=h.device, dtype=dy_dtype).expand(h.shape)
        dy_out, fp8_kw, dy = epilogue_args(grad_buffer(dy_into, like))
        two = True
    else:
        two = dy_dtype is not None and dy_dtype != dx_dtype
        dy = torch.empty(h.shape, device=h.device, dtype=dy_dtype) if two else dx
        dy_out, fp8_kw = dy, fp8_epilogue_kwargs(None, dx)
    block_d, block_r, warps, chunk = backward_tile(D)
    n_prog = max(1, cdiv(R, chunk))
    part = torch.empty(n_prog, D, device=h.device, dtype=torch.float32)  # dweight partial sums
    words = None
    if dy_amaxes is not None:
        assert dy_into is None and R % 16 == 0 and chunk % 16 == 0, "dy's amaxes: its own buffer, 16 | R"
        words = zeroed_words(2, h.device)
    amax_pair = None if words is None else (dy_amaxes[0], words)
    with on_device(h):
        _norm_bwd[(n_prog,)](
            h2, weight, rstd, dout2, dout2 if dh2 is None else dh2, dx, dy_out, part, R, D,
            h2.stride(0), dout2.stride(0), 0 if dh2 is None else dh2.stride(0),
            HAS_DH=dh2 is not None, TWO=two, CHUNK=chunk, BLOCK_R=block_r, BLOCK_D=block_d, num_warps=warps,
            enable_fp_fusion=True, **fp8_kw,
            **amax_epilogue_kwargs(amax_pair, part, min(block_d, 32 * warps)),
        )  # fmt: skip
    if words is not None:
        dy_amaxes[1].append(words)
    return dx, dy, part.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype, amax_pair=None):
        out, rstd = norm_forward(x, None, weight, eps, out_dtype, None, amax_pair=amax_pair)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, dout):
        x, weight, rstd = ctx.saved_tensors
        dx, _, dweight = norm_backward(x, weight, rstd, dout, None, x.dtype, None)
        return dx, dweight, None, None, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y, weight, eps, out_dtype, dy_into, amax_pair=None, dy_amaxes=None):
        ctx.set_materialize_grads(False)  # h is often dropped (the final norm): no zeros to add
        h = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, y.dtype))
        out, rstd = norm_forward(x, y, weight, eps, out_dtype, h, amax_pair=amax_pair)
        ctx.save_for_backward(h, weight, rstd)
        ctx.dtypes, ctx.dy_into, ctx.dy_amaxes = (x.dtype, y.dtype), dy_into, dy_amaxes
        return h, out

    @staticmethod
    def backward(ctx, dh, dnormed):
        h, weight, rstd = ctx.saved_tensors
        x_dtype, y_dtype = ctx.dtypes
        if dnormed is None:  # only h was used: its gradient passes straight through the add
            return (None,) * 8 if dh is None else (dh.to(x_dtype), dh.to(y_dtype), *(None,) * 6)
        dx, dy, dweight = norm_backward(
            h, weight, rstd, dnormed, dh, x_dtype, y_dtype, ctx.dy_into, ctx.dy_amaxes
        )
        return dx, dy, dweight, None, None, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None):
    """x: [..., D]; weight: [D] -> x / rms(x) * weight in ``out_dtype`` (default x's)."""
    check_inputs(x, weight)
    return _RMSNorm.apply(x, weight, eps, out_dtype or x.dtype)


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype, dy_into=None
):
    """x, y: [..., D] -> (h = x + y in the promoted dtype, rms_norm(h) in ``out_dtype``)."""
    check_inputs(x, y, weight)
    if x.shape != y.shape:
        raise ValueError(
            f"add_rms_norm takes x and y of one shape (no broadcasting), got {x.shape} and {y.shape}"
        )
    return _AddRMSNorm.apply(x, y, weight, eps, out_dtype, dy_into)


def norm_amax_pair(x, y, weight, eps: float, sign_bits: int | None, dy_amaxes=None):
    """The training pre-norm of a BF16 output that also reduces its two NVFP4 tensor amaxes (the wgrad's
    RHT by ``sign_bits``; None: not these): x [..., D] (y or None; tokens a multiple of 16) -> (h = x + y
    or None, normed [..., D] BF16, FP32 [2] ``[max |rht(normedᵀ)|, max |normed|]`` or None, as
    ``rht_t_abs_max`` gives them for the 2-D normed). Differentiable as :func:`rms_norm` /
    :func:`add_rms_norm`; ``dy_amaxes``: (sign bits, list) for y's gradient (:func:`norm_backward`)."""
    pair = None if sign_bits is None else zeroed_words(2, x.device)
    amax_pair = None if pair is None else (sign_bits, pair)
    if y is None:
        assert dy_amaxes is None, "a norm without the add has no y"
        check_inputs(x, weight)
        return None, _RMSNorm.apply(x, weight, eps, torch.bfloat16, amax_pair), pair
    check_inputs(x, y, weight)
    h, normed = _AddRMSNorm.apply(x, y, weight, eps, torch.bfloat16, None, amax_pair, dy_amaxes)
    return h, normed, pair


@torch.no_grad()
def norm_nvfp4_rows(x, y, weight, eps: float, w_decode: torch.Tensor):
    """No-grad (add +) rms_norm to BF16 that also writes the normed rows' NVFP4 operand, one scale per row
    (the decode step's pre-norm): x [R, D] (y [R, D] or None) -> (h = x + y or None, normed [R, D] BF16,
    values [R, D] BF16, out_scale [R] (``w_decode`` folded in), the largest row amax [1])."""
    check_inputs(*(t for t in (x, y, weight) if t is not None))
    R, D = x.reshape(-1, x.shape[-1]).shape
    h_dtype = None if y is None else torch.promote_types(x.dtype, y.dtype)
    h = None if y is None else torch.empty(x.shape, device=x.device, dtype=h_dtype)  # contiguous rows
    values, out_scale, largest = row_operand(R, D, x.device)
    rows = (w_decode, values, out_scale, largest)
    normed, _ = norm_forward(x, y, weight, eps, torch.bfloat16, h, nvfp4_rows=rows)
    return h, normed, values, out_scale, largest
