"""FP8 (E4M3 / E5M2) current-scaling quantizers in Triton: tensorwise, 1x128, 128x128, transposed.

Each kernel reads x once and derives the scales on the device, where torch ops would take many passes.
The results equal ``numerics/fp8.py`` (the formulas are there) bit for bit; divisions are correctly
rounded.

Modes, for a program's tile x[BLOCK_M rows, 128 cols]: ``ROWS`` 1x128 blocks along the last dim ->
data [M, N]; ``COLS`` 1x128 blocks along the tokens, written transposed -> data_t [N, M] (the wgrad
operands, with no transposed copy); ``TILE`` one scale per 128x128 tile (weights); ``TENSOR`` one scale
from an amax read through a pointer, optionally folding x's own amax into ``record`` (delayed scaling).

Block scales are in ``torch._scaled_mm``'s layout: 1x128 scales [R, C/128] outer-dim major (the
transpose view of a contiguous [C/128, R]), 128x128 scales row-major [ceil(R/128), C/128].

NOTE the FP8 byte comes from the conversion instruction on sm_89+, else from integer arithmetic on the
FP32 bits (the interpreter's downcasts truncate); both give the same byte. NaN in x gives an Inf amax,
hence an Inf ``scale_inv``, which is how the caller detects it.
"""

import functools
import os

import torch
import triton
import triton.language as tl

from inkling_fp4.numerics.kernels.common import FLT_MAX, TWO_POW_23, TWO_POW_23_BITS, bf16_round

BLOCK = 128
MODE_TENSOR, MODE_BLOCKS, MODE_TILE = 0, 1, 2
ACT_NONE, ACT_SQUARED_RELU, ACT_SQUARED_RELU_GRAD = 0, 1, 2
"""What a tensorwise quantizer applies to its input first (:func:`_prologue`)."""
# (mantissa bits, exponent bias, max) of the two formats
FORMATS = {torch.float8_e4m3fn: (3, 7, 448.0), torch.float8_e5m2: (2, 15, 57344.0)}


@triton.jit
def _scales(amax, FP8_MAX: tl.constexpr):
    """Block (or tensor) amax -> (scale, scale_inv), FP32, correctly rounded as in the reference."""
    scale = tl.minimum(tl.math.div_rn(tl.full(amax.shape, FP8_MAX, tl.float32), amax), FLT_MAX)
    scale = tl.where(amax == 0.0, 1.0, scale)
    return scale, tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), scale)


@triton.jit
def _fp8_bytes(
    x, scale, MANT: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
    SUB_FACTOR: tl.constexpr, MIN_NORMAL: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """FP32 ``x · scale`` clamped to ±FP8_MAX -> FP8 bytes (uint8), round half to even.

    ``HW``: the GPU's ``cvt.rn.satfinite``; else integer arithmetic on the bits (normal range: round the
    mantissa to MANT bits; subnormal: v = k·2^(1-BIAS-MANT) and k is the byte)."""
    v = tl.minimum(tl.abs(x * scale), FP8_MAX)
    if HW:  # x's sign on v in FP32, then the conversion: no byte arithmetic after it
        signed = (v.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -(2**31))).to(
            tl.float32, bitcast=True
        )
        if MANT == 3:
            q = signed.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            q = signed.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        bits = v.to(tl.int32, bitcast=True)
        rounded = bits + ((1 << (22 - MANT)) - 1) + ((bits >> (23 - MANT)) & 1)
        normal = (rounded >> (23 - MANT)) - ((127 - BIAS) << MANT)
        # subnormal: k = rne(v · 2^(BIAS-1+MANT)), a power-of-two product (exact), rounded by the 2^23 add
        k = (v * SUB_FACTOR + TWO_POW_23).to(tl.int32, bitcast=True) - TWO_POW_23_BITS
        byte = tl.where(v < MIN_NORMAL, k, normal)
        sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
        q = (byte | sign).to(tl.uint8)
    return q


@triton.jit
def _magnitude(x):
    """|x| with NaN as Inf, so that a NaN makes its block's amax (and scale_inv) Inf."""
    magnitude = tl.abs(x)
    return tl.where(magnitude == magnitude, magnitude, float("inf"))


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def record_amax(record_ptr, seen):
    """Fold a program's running max |x| (NaN as Inf) into the delayed-scaling amax word; only a program
    that would raise the word does the atomic (thousands share it)."""
    m = tl.reduce(tl.reduce(seen, 1, _max_nan), 0, _max_nan)
    m = tl.where(m == m, m, float("inf"))
    if m > tl.load(record_ptr):
        tl.atomic_max(record_ptr, m)


@triton.jit
def _transposed_bytes(
    x, scale, scale_t, MANT: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
    SUB_FACTOR: tl.constexpr, MIN_NORMAL: tl.constexpr, HW_T: tl.constexpr,
):  # fmt: skip
    """Bytes of x · scale transposed, [CHUNK, BLOCK_M] from x [BLOCK_M, CHUNK].

    NOTE on an H200 (Triton 3.6) the instruction's bytes put through a transpose are wrong at some tiles,
    and the instruction on xᵀ is right for BF16 x only: hence ``HW_T`` for BF16 input alone (GPU-tested)."""
    if HW_T:
        return _fp8_bytes(tl.trans(x), scale_t, MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, True)
    else:
        return tl.trans(_fp8_bytes(x, scale, MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, False))


@triton.jit
def _blocks_with_cols(
    x_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, M, N, NP, stride_xm, rows,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr, SUB_FACTOR: tl.constexpr, MIN_NORMAL: tl.constexpr, HW: tl.constexpr,
    HW_T: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """1x128 blocks along the tokens (written transposed), and along the rows too if ``ROWS``, for the tile
    x[rows (BLOCK_M = 128), 128 columns], CHUNK columns at a time.

    Chunks because the whole FP32 tile spills registers. Row blocks need whole rows, so a first sweep does
    the columns and the row amaxes, and a second re-reads the chunks (from L2) for the rows."""
    row_amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    in_rows = rows < M
    for c0 in tl.static_range(0, 128, CHUNK):
        cols = tl.program_id(1) * 128 + c0 + tl.arange(0, CHUNK)
        x = tl.load(
            x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
            mask=in_rows[:, None] & (cols < N)[None, :], other=0.0,
        ).to(tl.float32)  # x: [BLOCK_M, CHUNK]; columns N..NP-1 read as 0  # fmt: skip
        magnitude = _magnitude(x)
        if ROWS:
            row_amax = tl.maximum(row_amax, tl.max(magnitude, axis=1))
        scale, scale_inv = _scales(tl.max(magnitude, axis=0), FP8_MAX)  # [CHUNK], one per column
        q_t = _transposed_bytes(
            x, scale[None, :], scale[:, None], MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW_T
        )  # qᵀ: [CHUNK, BLOCK_M]  # fmt: skip
        t_ptrs = data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :]
        tl.store(t_ptrs, q_t, mask=(cols < NP)[:, None] & in_rows[None, :])
        # scale_inv of data_t [NP, M/128], outer-dim major: element (c, b) at b·NP + c
        tl.store(scale_t_ptr + tl.program_id(0) * NP + cols, scale_inv, mask=cols < NP)
    if ROWS:
        scale, scale_inv = _scales(row_amax, FP8_MAX)  # [BLOCK_M]
        # scale_inv [M, NP/128], outer-dim major: element (r, b) at b·M + r
        tl.store(scale_ptr + tl.program_id(1) * M + rows, scale_inv, mask=in_rows)
        for c0 in tl.static_range(0, 128, CHUNK):
            cols = tl.program_id(1) * 128 + c0 + tl.arange(0, CHUNK)
            if CHUNK < 128:  # else x is the whole tile, loaded by the first sweep
                x = tl.load(
                    x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                    mask=in_rows[:, None] & (cols < N)[None, :], other=0.0,
                ).to(tl.float32)  # fmt: skip
            q = _fp8_bytes(x, scale[:, None], MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW)
            tl.store(
                data_ptr + rows.to(tl.int64)[:, None] * NP + cols[None, :], q,
                mask=in_rows[:, None] & (cols < NP)[None, :],
            )  # fmt: skip


@triton.jit
def _prologue(x, dout_ptr, offsets, mask, ACT: tl.constexpr, HW: tl.constexpr):
    """The FP32 tensor to quantize from BF16 x: x (``ACT_NONE``), relu(x)² (``ACT_SQUARED_RELU``) or
    2·dout·x where x > 0 (``ACT_SQUARED_RELU_GRAD``); the last two rounded to BF16 exactly as
    ``model/glue_kernels/pointwise_kernels.py`` writes them."""
    h = x.to(tl.float32)
    if ACT == 0:
        return h
    if ACT == 1:
        r = tl.where(h < 0.0, 0.0, h)  # NOTE not tl.maximum: it drops NaN, relu keeps it
        v = r * r  # exact in FP32 for BF16 h
    else:
        dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        v = tl.where(h <= 0.0, 0.0, (dout * h) * 2.0)
    return bf16_round(v, HW)


@triton.jit
def _tensor_scaled(
    x_ptr, dout_ptr, amax_ptr, record_ptr, data_ptr, scale_ptr, data_t_ptr, M, N, stride_xm, rows,
    ROWS: tl.constexpr, COLS: tl.constexpr, RECORD: tl.constexpr, ACT: tl.constexpr, MANT: tl.constexpr,
    BIAS: tl.constexpr, FP8_MAX: tl.constexpr, SUB_FACTOR: tl.constexpr, MIN_NORMAL: tl.constexpr,
    HW: tl.constexpr, HW_T: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One scale for the whole tensor: x[rows, 128 columns] -> its bytes (``ROWS``) and/or the same bytes
    transposed (``COLS``). ``RECORD``: fold max|x| into ``record_ptr``. ``ACT``: quantize :func:`_prologue`
    of x, so the producer's BF16 output never goes through memory."""
    scale, scale_inv = _scales(tl.load(amax_ptr), FP8_MAX)
    in_rows = rows < M
    for c0 in tl.static_range(0, 128, CHUNK):
        cols = tl.program_id(1) * 128 + c0 + tl.arange(0, CHUNK)
        mask = in_rows[:, None] & (cols < N)[None, :]
        offsets = rows.to(tl.int64)[:, None] * stride_xm + cols[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        x = _prologue(x, dout_ptr, offsets, mask, ACT, HW)
        if RECORD:
            if c0 == 0:
                seen = tl.abs(x)
            else:
                seen = _max_nan(seen, tl.abs(x))
        if ROWS:  # q: [BLOCK_M, CHUNK]
            q = _fp8_bytes(x, scale, MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW)
            tl.store(data_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], q, mask=mask)
        if COLS:  # qᵀ: [CHUNK, BLOCK_M]
            if ROWS and not HW:  # the rows' integer bytes, transposed (HW_T implies HW)
                q_t = tl.trans(q)
            else:
                q_t = _transposed_bytes(x, scale, scale, MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW_T)
            t_ptrs = data_t_ptr + cols.to(tl.int64)[:, None] * M + rows[None, :]
            tl.store(t_ptrs, q_t, mask=tl.trans(mask))
    if RECORD:  # magnitudes are >= 0 and the word starts at 0 or -1 (AmaxHistory's "nothing yet")
        record_amax(record_ptr, seen)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_ptr, scale_inv)


# 64 or 128 columns at 4 or 8 warps were the fastest on an H200; the bits do not depend on the choice.
CANDIDATES = ((4, 64), (8, 64), (4, 128), (8, 128))
"""(warps, CHUNK) pairs the GPU autotuner picks from; every pair writes the same bits."""
_CONFIGS = (
    [triton.Config({"CHUNK": 32}, num_warps=8)]
    if os.environ.get("TRITON_INTERPRET") == "1"
    else [triton.Config({"CHUNK": c}, num_warps=w) for w, c in CANDIDATES]
)


@triton.autotune(
    configs=_CONFIGS, key=["N", "BLOCK_M", "MODE", "ROWS", "COLS", "RECORD", "ACT", "HW", "HW_T"]
)
@triton.jit
def _quantize_fp8_kernel(
    x_ptr, dout_ptr, amax_ptr, record_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, M, N, NP,
    stride_xm, BLOCK_M: tl.constexpr, MODE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    RECORD: tl.constexpr, ACT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr,
    SUB_FACTOR: tl.constexpr, MIN_NORMAL: tl.constexpr, HW: tl.constexpr, HW_T: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    if MODE == 0:
        _tensor_scaled(
            x_ptr, dout_ptr, amax_ptr, record_ptr, data_ptr, scale_ptr, data_t_ptr, M, N, stride_xm, rows,
            ROWS, COLS, RECORD, ACT, MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW, HW_T, CHUNK,
        )  # fmt: skip
    elif MODE == 1 and COLS:  # the wgrad operands (and their fprop / dgrad partners): in column chunks
        _blocks_with_cols(
            x_ptr, data_ptr, scale_ptr, data_t_ptr, scale_t_ptr, M, N, NP, stride_xm, rows,
            BLOCK_M, ROWS, MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW, HW_T, CHUNK,
        )  # fmt: skip
    else:
        cols = tl.program_id(1) * 128 + tl.arange(0, 128)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        # x: [BLOCK_M, 128]; columns N..NP-1 (the zero padding) load as 0 and are stored as 0 codes
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        out_mask = (rows < M)[:, None] & (cols < NP)[None, :]
        x = x.to(tl.float32)
        magnitude = _magnitude(x)
        if MODE == 1:
            if ROWS:
                scale, scale_inv = _scales(tl.max(magnitude, axis=1), FP8_MAX)  # [BLOCK_M]
                q = _fp8_bytes(x, scale[:, None], MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW)
                tl.store(data_ptr + rows.to(tl.int64)[:, None] * NP + cols[None, :], q, mask=out_mask)
                # scale_inv [M, N/128], outer-dim major: element (r, b) at b·M + r
                tl.store(scale_ptr + tl.program_id(1) * M + rows, scale_inv, mask=rows < M)
        else:
            scale, scale_inv = _scales(tl.max(tl.max(magnitude, axis=1), axis=0), FP8_MAX)
            q = _fp8_bytes(x, scale, MANT, BIAS, FP8_MAX, SUB_FACTOR, MIN_NORMAL, HW)
            tl.store(data_ptr + rows.to(tl.int64)[:, None] * NP + cols[None, :], q, mask=out_mask)
            tl.store(scale_ptr + tl.program_id(0) * tl.cdiv(N, 128) + tl.program_id(1), scale_inv)


def _default_block_m(mode: int, cols: bool) -> int:
    """Tokens per program: 128 for blocks along the tokens or 128x128 tiles; 64 (the fastest) for a
    tensorwise x/xᵀ pair; 32 for rows alone."""
    if mode == MODE_TILE or (cols and mode != MODE_TENSOR):
        return 128
    return 64 if cols else 32


@functools.cache
def conversion_instruction(device: torch.device) -> bool:
    """Whether ``device`` has the FP8 conversion instruction (CUDA sm_89+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    mode: int,
    rows: bool = True,
    cols: bool = False,
    amax: torch.Tensor | None = None,
    record: torch.Tensor | None = None,
    act: int = ACT_NONE,
    dout: torch.Tensor | None = None,
    pad_to_block: bool = False,
    block_m: int | None = None,
    hardware_cast: bool | None = None,
    transposed_cast: bool | None = None,
    config: tuple[int, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize x [M, N] (unit last-dim stride) -> the outputs asked for: ``data`` [M, NP] and
    ``scale_inv``, ``data_t`` [NP, M] and ``scale_inv_t``.

    NP = N, or with ``pad_to_block`` (blocked modes) ceil(N/128)·128: the outputs of x zero-padded, with no
    padded copy. Otherwise N must be a multiple of 128 where blocks run along N; ``cols`` in a blocked mode
    needs M % 128 == 0. ``MODE_TENSOR`` needs ``amax`` (FP32 [1]). ``hardware_cast`` / ``transposed_cast``
    force the conversion instruction (True) or integer bytes (False). ``act`` (``MODE_TENSOR``, BF16 x):
    quantize relu(x)², or its gradient for ``dout``. ``config``: (warps, CHUNK) instead of autotuning.
    """
    mant, bias, fp8_max = FORMATS[dtype]
    m, n = x.shape
    if record is not None and mode != MODE_TENSOR:
        raise ValueError("quantize_fp8: record applies to MODE_TENSOR (block scales record nothing)")
    if act != ACT_NONE and (mode != MODE_TENSOR or x.dtype != torch.bfloat16):
        raise ValueError("quantize_fp8: act applies to MODE_TENSOR of a bfloat16 x")
    if (dout is not None) != (act == ACT_SQUARED_RELU_GRAD) or (
        dout is not None and (dout.shape != x.shape or dout.stride() != x.stride() or dout.dtype != x.dtype)
    ):
        raise ValueError("quantize_fp8: ACT_SQUARED_RELU_GRAD takes a dout laid out as x, other acts none")
    if pad_to_block and mode == MODE_TENSOR:
        raise ValueError("quantize_fp8: pad_to_block applies to the blocked modes; tensorwise takes any N")
    np_ = triton.cdiv(n, BLOCK) * BLOCK if pad_to_block else n
    blocks_along_n = mode == MODE_TILE or (mode == MODE_BLOCKS and rows)
    if (blocks_along_n and np_ % BLOCK) or x.stride(1) != 1 or (cols and mode != MODE_TENSOR and m % BLOCK):
        raise ValueError(f"quantize_fp8: x of shape {tuple(x.shape)} does not fit 128-element blocks")
    if block_m is None:
        block_m = _default_block_m(mode, cols)
    dev = x.device
    out = {}
    data = data_t = scale = scale_t = None
    if mode == MODE_TENSOR:
        scale = torch.empty((), dtype=torch.float32, device=dev)
        out["scale_inv"] = scale
    if rows or mode == MODE_TILE:
        data = torch.empty(m, np_, dtype=torch.uint8, device=dev)
        out["data"] = data.view(dtype)
        if mode == MODE_BLOCKS:
            scale = torch.empty(np_ // BLOCK, m, dtype=torch.float32, device=dev)
            out["scale_inv"] = scale.t()  # [M, NP/128], stride (1, M)
        elif mode == MODE_TILE:
            scale = torch.empty(triton.cdiv(m, BLOCK), np_ // BLOCK, dtype=torch.float32, device=dev)
            out["scale_inv"] = scale
    if cols:
        data_t = torch.empty(np_, m, dtype=torch.uint8, device=dev)
        out["data_t"] = data_t.view(dtype)
        if mode == MODE_BLOCKS:
            scale_t = torch.empty(m // BLOCK, np_, dtype=torch.float32, device=dev)
            out["scale_inv_t"] = scale_t.t()  # [NP, M/128], stride (1, NP)
    if m == 0:
        if scale is not None and mode == MODE_TENSOR:
            scale.fill_(1.0)
        return out
    dummy = x
    hw = conversion_instruction(x.device) if hardware_cast is None else hardware_cast
    hw_t = hw and (x.dtype == torch.bfloat16 if transposed_cast is None else transposed_cast)
    grid = (triton.cdiv(m, block_m), triton.cdiv(np_, BLOCK))
    kernel, launch = _quantize_fp8_kernel, {}
    if config is not None:
        kernel, launch = _quantize_fp8_kernel.fn, dict(num_warps=config[0], CHUNK=config[1])
    kernel[grid](
        x, dummy if dout is None else dout, dummy if amax is None else amax,
        dummy if record is None else record,
        dummy if data is None else data, dummy if scale is None else scale,
        dummy if data_t is None else data_t, dummy if scale_t is None else scale_t,
        m, n, np_, x.stride(0),
        BLOCK_M=block_m, MODE=mode, ROWS=rows, COLS=cols, RECORD=record is not None, ACT=act,
        MANT=mant, BIAS=bias, FP8_MAX=fp8_max, SUB_FACTOR=2.0 ** (bias - 1 + mant),
        MIN_NORMAL=2.0 ** (1 - bias), HW=hw, HW_T=hw_t,
        **launch,
    )  # fmt: skip
    return out
