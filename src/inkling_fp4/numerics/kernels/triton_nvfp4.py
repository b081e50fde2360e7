"""NVFP4 on CUDA through Triton: the formats of ``numerics/nvfp4.py``, at memory bandwidth.

Round-to-nearest gives the reference's codes and scale bytes bit for bit; stochastic rounding draws
from a Philox stream seeded from the caller's torch generator (same distribution, other draws).

Every quantizer is two launches, an amax pass and the quantize pass, which derives S_enc on the device
and also writes ``1/S_enc``: an emulated step is bound by launches, so the host issues nothing else.
Finiteness is the caller's check on the returned ``amax`` (+Inf for NaN/Inf), which ``fake_quantize*``
do themselves unless ``check_finite=False``. ``fake_quantize*`` write BF16 block values
``code · block_scale`` (what an emulated GEMM consumes), ``1/S_enc`` apart.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch

from inkling_fp4.numerics import checks, nvfp4
from inkling_fp4.numerics.hadamard import RHT_SIZE, rht_signs
from inkling_fp4.numerics.kernels.amax import abs_max
from inkling_fp4.numerics.kernels.nvfp4_block_values import block_values_from_codes
from inkling_fp4.numerics.kernels.nvfp4_quantize import quantize_rows
from inkling_fp4.numerics.kernels.nvfp4_rht import RowValues, quantize_rht_t_tiles, rht_t_abs_max, sign_bits
from inkling_fp4.numerics.kernels.seeds import draw_seed

BLOCK = 16


@dataclass
class NVFP4BlockValues:
    """An emulated-GEMM operand: ``values · decode_scale`` is the dequantized tensor."""

    values: torch.Tensor  # [..., N] BF16: code · block scale, exact
    decode_scale: torch.Tensor  # FP32 0-dim: 1/S_enc (written by the kernel), applied to the GEMM output
    amax: torch.Tensor  # FP32 0-dim
    quantized: nvfp4.NVFP4Tensor | None  # codes + scales from the same pass, when asked for
    output_scale: torch.Tensor | None = None  # FP32 0-dim: decode_scale · scale_with, when asked for


_FIXED_SIGN_BITS = sign_bits(rht_signs("fixed"))
# id(signs) -> (weak reference, version, bit mask): reading a device tensor's signs syncs, so a
# sign tensor that is passed again unchanged is read once.
_sign_cache: dict[int, tuple[weakref.ref, int, int]] = {}


def _sign_bits(signs: torch.Tensor | None) -> int:
    if signs is None:
        return _FIXED_SIGN_BITS
    if tuple(signs.shape) != (RHT_SIZE,):
        raise ValueError(f"quantize_rht_t: signs must have shape ({RHT_SIZE},), got {tuple(signs.shape)}")
    cached = _sign_cache.get(id(signs))
    if cached is not None and cached[0]() is signs and cached[1] == signs._version:
        return cached[2]
    bits = sign_bits(signs)
    if len(_sign_cache) > 64:
        _sign_cache.clear()
    _sign_cache[id(signs)] = (weakref.ref(signs), signs._version, bits)
    return bits


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as [M, N] with unit last-dim stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _decode_buffer(write: bool, partner: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """FP32 [1] for the decode scale, [2] for it and its product with ``partner``; None: not written."""
    if not write:
        return None
    return torch.empty(1 if partner is None else 2, dtype=torch.float32, device=device)


def _decode_scales(
    decode: torch.Tensor | None, partner: torch.Tensor | None, launched: bool, amax: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(decode scale, its product with ``partner``) as 0-dim tensors; for an empty tensor the reference's."""
    if decode is None:
        return None, None
    if not launched:
        decode = nvfp4.tensor_scales(amax.reshape(()))[1].reshape(1)
        if partner is not None:
            decode = torch.cat([decode, decode * partner.reshape(1)])
    return decode[0], None if partner is None else decode[1]


def _run_rows(
    x: torch.Tensor, block_2d: bool, stochastic: bool, generator: torch.Generator | None,
    write_codes: bool, values_dtype: torch.dtype | None, amax: torch.Tensor | None = None,
    write_decode: bool = False, partner: torch.Tensor | None = None,
) -> tuple[nvfp4.NVFP4Tensor | None, torch.Tensor | None, torch.Tensor, tuple]:  # fmt: skip
    """(packed tensor, block values, amax, (decode scale, product with ``partner``)), None if not asked."""
    x2 = _rows_view(x)
    m, n = x2.shape
    codes = torch.empty((m, n // 2), dtype=torch.uint8, device=x.device) if write_codes else None
    scales = torch.empty((m, n // BLOCK), dtype=torch.float8_e4m3fn, device=x.device) if write_codes else None
    values = torch.empty((m, n), dtype=values_dtype, device=x.device) if values_dtype else None
    decode = _decode_buffer(write_decode, partner, x.device)
    if m == 0:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    else:
        amax = abs_max(x2) if amax is None else amax.reshape(1)
        seed = draw_seed(generator) if stochastic else None
        quantize_rows(
            x2, amax, block_2d=block_2d, seed=seed, codes=codes,
            scales=scales.view(torch.uint8) if write_codes else None, values=values, decode=decode,
            partner=partner,
        )  # fmt: skip
    lead = x.shape[:-1]
    quantized = None
    if write_codes:
        quantized = nvfp4.NVFP4Tensor(
            codes=codes.reshape(*lead, n // 2),
            scales=scales.reshape(*lead, n // BLOCK),
            amax=amax.reshape(()),
            shape=x.shape,
            block_2d=block_2d,
        )
    values = None if values is None else values.reshape(x.shape)
    return quantized, values, amax.reshape(()), _decode_scales(decode, partner, m * n > 0, amax)


def _run_rht_t(
    x: torch.Tensor, signs: torch.Tensor | None, stochastic: bool, generator: torch.Generator | None,
    write_codes: bool, values_dtype: torch.dtype | None, amax: torch.Tensor | None = None,
    write_decode: bool = False, partner: torch.Tensor | None = None,
) -> tuple[nvfp4.NVFP4Tensor | None, torch.Tensor | None, torch.Tensor, tuple]:  # fmt: skip
    """:func:`_run_rows` for rht(x.t())."""
    m, n = x.shape
    codes = torch.empty((n, m // 2), dtype=torch.uint8, device=x.device) if write_codes else None
    scales = torch.empty((n, m // BLOCK), dtype=torch.float8_e4m3fn, device=x.device) if write_codes else None
    values = torch.empty((n, m), dtype=values_dtype, device=x.device) if values_dtype else None
    decode = _decode_buffer(write_decode, partner, x.device)
    if m == 0 or n == 0:
        amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    else:
        bits = _sign_bits(signs)
        amax = rht_t_abs_max(x, bits) if amax is None else amax.reshape(1)
        seed = draw_seed(generator) if stochastic else None
        quantize_rht_t_tiles(
            x, bits, amax, seed=seed, codes=codes,
            scales=scales.view(torch.uint8) if write_codes else None, values=values, decode=decode,
            partner=partner,
        )  # fmt: skip
    quantized = None
    if write_codes:
        quantized = nvfp4.NVFP4Tensor(
            codes=codes, scales=scales, amax=amax.reshape(()), shape=torch.Size((n, m)), block_2d=False
        )
    return quantized, values, amax.reshape(()), _decode_scales(decode, partner, m * n > 0, amax)


def quantize(
    x: torch.Tensor,
    block_2d: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> nvfp4.NVFP4Tensor:
    """NVFP4-quantize x [..., N] (N % 16 == 0; 2-D in ``block_2d`` mode) along its last dim."""
    quantized, _, _, _ = _run_rows(x, block_2d, stochastic, generator, write_codes=True, values_dtype=None)
    return quantized


def quantize_rht_t(
    x: torch.Tensor,
    signs: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> nvfp4.NVFP4Tensor:
    """The wgrad operand ``quantize(rht(x.t(), signs))`` for x [M, N] (M % 16 == 0) -> shape [N, M]."""
    quantized, _, _, _ = _run_rht_t(x, signs, stochastic, generator, write_codes=True, values_dtype=None)
    return quantized


@functools.lru_cache(maxsize=16)
def rht_sign_bits(signs: tuple[float, ...] | None) -> int:
    """The RHT sign mask the kernels take for a recipe's ``rht_signs`` (None: the fixed signs)."""
    return _FIXED_SIGN_BITS if signs is None else sign_bits(torch.tensor(signs))


def abs_max_pair(x: torch.Tensor, signs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``max |x|``, ``max |rht(x.t(), signs)|``) for x [M, N] from one read of x, as FP32 0-dim tensors:
    the ``amax=`` of :func:`fake_quantize` and :func:`fake_quantize_rht_t` for that x."""
    m, n = x.shape
    if m == 0 or n == 0:
        zero = torch.zeros((), dtype=torch.float32, device=x.device)
        return zero, zero.clone()
    pair = rht_t_abs_max(x, _sign_bits(signs), with_x_amax=True)  # [rht amax, x amax]
    return pair[1], pair[0]


def fake_quantize(
    x: torch.Tensor,
    block_2d: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    keep_codes: bool = False,
    dtype: torch.dtype | None = torch.bfloat16,
    name: str | None = None,
    amax: torch.Tensor | None = None,
    check_finite: bool = True,
    scale_with: torch.Tensor | None = None,
) -> NVFP4BlockValues:
    """Block values of ``quantize(x, ...)`` in one pass: ``values`` = ``quantize(x).block_values(dtype)``
    (none for ``dtype=None``); ``keep_codes`` also returns the packed tensor. ``amax``: ``max |x|`` when
    known, saving the amax pass. ``scale_with``: the other GEMM operand's decode scale; ``output_scale``
    is then their product, from the same pass."""
    op = "nvfp4.fake_quantize"
    checks.check_input(x, op=op, block=BLOCK, name=name, ndim=2 if block_2d else None)
    quantized, values, amax, (decode, product) = _run_rows(
        x, block_2d, stochastic, generator, keep_codes, dtype, amax, write_decode=True, partner=scale_with
    )
    if check_finite:
        checks.check_finite(x, op=op, name=name, amax=amax)
    return NVFP4BlockValues(values, decode, amax, quantized, product)


def fake_quantize_row_scaled(
    x: torch.Tensor,
    keep_codes: bool = False,
    dtype: torch.dtype | None = torch.bfloat16,
    name: str | None = None,
    check_finite: bool = True,
) -> NVFP4BlockValues:
    """Block values of ``nvfp4.quantize_rows(x)``; ``decode_scale`` and ``amax`` are [..., 1]."""
    op = "nvfp4.fake_quantize_row_scaled"
    checks.check_input(x, op=op, block=BLOCK, name=name)
    x2 = _rows_view(x)
    m, n = x2.shape
    amax = x2.abs().amax(-1).float() if m * n else x2.new_zeros(m, dtype=torch.float32)  # [M], exact
    codes = torch.empty((m, n // 2), dtype=torch.uint8, device=x.device) if keep_codes else None
    scales = torch.empty((m, n // BLOCK), dtype=torch.float8_e4m3fn, device=x.device) if keep_codes else None
    values = torch.empty((m, n), dtype=dtype, device=x.device) if dtype else None
    if m * n:
        quantize_rows(
            x2, amax, block_2d=False, seed=None, codes=codes,
            scales=scales.view(torch.uint8) if keep_codes else None, values=values, row_scaled=True,
        )  # fmt: skip
    if check_finite:
        checks.check_finite(x, op=op, name=name, amax=amax)
    lead = x.shape[:-1]
    amax = amax.reshape(*lead, 1)
    decode = nvfp4.tensor_scales(amax)[1]  # the reference's 1/S_enc per row, bit for bit
    quantized = None
    if keep_codes:
        codes, scales = codes.reshape(*lead, n // 2), scales.reshape(*lead, n // BLOCK)
        quantized = nvfp4.NVFP4Tensor(codes=codes, scales=scales, amax=amax, shape=x.shape)
    values = None if values is None else values.reshape(x.shape)
    return NVFP4BlockValues(values, decode, amax, quantized)


def fake_quantize_rht_t(
    x: torch.Tensor,
    signs: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    keep_codes: bool = False,
    dtype: torch.dtype | None = torch.bfloat16,
    name: str | None = None,
    amax: torch.Tensor | None = None,
    check_finite: bool = True,
    scale_with: torch.Tensor | None = None,
) -> NVFP4BlockValues:
    """Block values [N, M] of ``quantize_rht_t(x, ...)`` for x [M, N], as :func:`fake_quantize`; ``amax``
    is ``max |rht(x.t())|``."""
    op = "nvfp4.fake_quantize_rht_t"
    checks.check_dtype(x, op=op, name=name)
    checks.check_block_shape(x, op=op, block=1, name=name, ndim=2)
    checks.check_rows(x, op=op, block=BLOCK, what="the token dim, blocked after the transpose", name=name)
    quantized, values, amax, (decode, product) = _run_rht_t(
        x, signs, stochastic, generator, keep_codes, dtype, amax, write_decode=True, partner=scale_with
    )
    if check_finite:
        checks.check_finite(x, op=op, name=name, amax=amax)
    return NVFP4BlockValues(values, decode, amax, quantized, product)


def fake_quantize_pair(
    x: torch.Tensor,
    amax: torch.Tensor,
    amax_t: torch.Tensor,
    signs: torch.Tensor | None = None,
    *,
    stochastic: tuple[bool, bool] = (False, False),
    generator: torch.Generator | None = None,
    keep_codes_t: bool = True,
    scale_with: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    name: str | None = None,
    check_finite: bool = True,
) -> tuple[NVFP4BlockValues, NVFP4BlockValues]:
    """x [M, N]'s two operands from one read of x, given both amaxes (:func:`abs_max_pair`): the BF16
    values of :func:`fake_quantize` and :func:`fake_quantize_rht_t` with its codes (``keep_codes_t``:
    a forward's x, the rows for the fprop and xᵀ saved for the wgrad) or its values (a backward's dy, for
    the dgrad and the wgrad). ``stochastic`` and ``scale_with`` are (rows, RHT); the seeds are drawn in that
    order, as the two calls draw them: the same bits."""
    op = "nvfp4.fake_quantize_pair"
    checks.check_dtype(x, op=op, name=name)
    checks.check_block_shape(x, op=op, block=BLOCK, name=name, ndim=2)
    checks.check_rows(x, op=op, block=BLOCK, what="the token dim, blocked after the transpose", name=name)
    m, n = x.shape
    if m == 0 or n == 0:
        rows = fake_quantize(x, stochastic=stochastic[0], generator=generator, name=name, amax=amax,
                             check_finite=check_finite, scale_with=scale_with[0])  # fmt: skip
        tokens = fake_quantize_rht_t(
            x, signs, stochastic[1], generator, keep_codes=keep_codes_t,
            dtype=None if keep_codes_t else torch.bfloat16, name=name, amax=amax_t, check_finite=check_finite,
            scale_with=scale_with[1],
        )  # fmt: skip
        return rows, tokens
    row_seed = draw_seed(generator) if stochastic[0] else None
    seed_t = draw_seed(generator) if stochastic[1] else None
    codes = torch.empty((n, m // 2), dtype=torch.uint8, device=x.device) if keep_codes_t else None
    scales = (
        torch.empty((n, m // BLOCK), dtype=torch.float8_e4m3fn, device=x.device) if keep_codes_t else None
    )
    values_t = None if keep_codes_t else torch.empty((n, m), dtype=torch.bfloat16, device=x.device)
    values = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    decode = _decode_buffer(True, scale_with[0], x.device)
    decode_t = _decode_buffer(True, scale_with[1], x.device)
    rows = RowValues(values, amax.reshape(1), decode, row_seed, scale_with[0])
    quantize_rht_t_tiles(
        x, _sign_bits(signs), amax_t.reshape(1), seed=seed_t, codes=codes,
        scales=scales.view(torch.uint8) if keep_codes_t else None, values=values_t, decode=decode_t,
        partner=scale_with[1], rows=rows,
    )  # fmt: skip
    if check_finite:
        checks.check_finite(x, op=op, name=name, amax=amax.reshape(()))
    amax, amax_t = amax.reshape(()), amax_t.reshape(())
    quantized_t = None
    if keep_codes_t:
        quantized_t = nvfp4.NVFP4Tensor(codes=codes, scales=scales, amax=amax_t, shape=torch.Size((n, m)))
    row_scales = _decode_scales(decode, scale_with[0], True, amax)
    t_scales = _decode_scales(decode_t, scale_with[1], True, amax_t)
    return (
        NVFP4BlockValues(values, row_scales[0], amax, None, row_scales[1]),
        NVFP4BlockValues(values_t, t_scales[0], amax_t, quantized_t, t_scales[1]),
    )


def block_values(t: nvfp4.NVFP4Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``t.block_values(dtype)`` from the packed codes and scales, in one read of them."""
    n = t.shape[-1]
    codes = t.codes.reshape(-1, n // 2).contiguous()
    scales = t.scales.reshape(-1, n // BLOCK).contiguous().view(torch.uint8)
    values = torch.empty((codes.shape[0], n), dtype=dtype, device=codes.device)
    if codes.shape[0]:
        block_values_from_codes(codes, scales, values)
    return values.reshape(t.shape)
