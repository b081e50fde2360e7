"""NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one FP32 scale per tensor.

Off Blackwell there is no FP4 hardware, so this code *is* the format: its codes and scale bytes must
equal what Transformer Engine / the tensor cores would produce, rounding by rounding (arXiv 2509.25149,
section 2 and appendix; DESIGN.md). Every step is an FP32 operation with one rounding:

    amax    = max |x|                                   (over the whole tensor)
    S_enc   = min(448·6 / amax, FLT_MAX)                (1 when amax == 0)
    S_dec   = 1 / S_enc                                 (FP32 reciprocal; the GEMM output scale)
    s_b     = e4m3(min(amax_b · (S_enc · (1/6)), 448))  (one RNE rounding; no lower clamp)
    enc_b   = min(1 / (fp32(s_b) · S_dec), FLT_MAX)
    code    = E2M1_RNE(clamp(x · enc_b, -6, 6))         (or stochastic rounding)
    x̂       = code · fp32(s_b) · S_dec

A block whose scaled amax underflows E4M3 gets ``s_b = 0`` and decodes to (signed) zero, never NaN.
``code · s_b`` is exact in BF16, so :meth:`NVFP4Tensor.block_values` is what an emulated GEMM
multiplies; both operands' ``S_dec`` go on the FP32 output, never into the BF16 operand.

Row mode (:func:`quantize_rows`): the recipe per row, ``amax`` and ``S_dec`` [..., 1]. 2D mode
(weights, 2-D x): one scale per 16×16 tile, stored repeated per row; a tile's amax is the same for W
and Wᵀ, so ``quantize(W, block_2d=True)`` and ``quantize(W.t(), block_2d=True)`` hold one W (fprop and
dgrad agree).

Layout: ``x: [..., N]`` -> ``codes [..., N//2]`` (even element in the low nibble), ``scales [..., N//16]``.
On CUDA :func:`quantize` and :func:`quantize_rht_t` run ``numerics/kernels/triton_nvfp4.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from types import ModuleType

import torch

from inkling_fp4.numerics import checks
from inkling_fp4.numerics.formats import (
    E2M1_MAX,
    E4M3_MAX,
    FLT_MAX,
    decode_packed,
    e2m1_encode,
    e2m1_encode_stochastic,
    e4m3_round,
    pack_nibbles,
    random_bytes,
)
from inkling_fp4.numerics.hadamard import RHT_SIZE, rht_matrix

BLOCK = 16


@dataclass
class NVFP4Tensor:
    """A quantized tensor of original shape ``shape`` ([..., N]); see the module docstring."""

    codes: torch.Tensor  # uint8 [..., N//2]
    scales: torch.Tensor  # float8_e4m3fn [..., N//16]
    amax: torch.Tensor  # float32 0-dim; [..., 1] for a row-scaled tensor (:func:`quantize_rows`)
    shape: torch.Size
    block_2d: bool = False

    @property
    def decode_scale(self) -> torch.Tensor:
        """S_dec = 1/S_enc (float32 0-dim, or [..., 1] per row): the tensor scale applied to GEMM outputs."""
        return tensor_scales(self.amax)[1]

    def block_values(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """``code · block_scale`` of shape ``shape``, without the tensor scale; exact in BF16/FP16."""
        values = decode_packed(self.codes)  # [..., N]
        scaled = values.unflatten(-1, (self.shape[-1] // BLOCK, BLOCK)) * self.scales.float()[..., None]
        return scaled.flatten(-2).reshape(self.shape).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``code · block_scale · S_dec`` computed in FP32, then cast to ``dtype``."""
        return (self.block_values(torch.float32) * self.decode_scale).to(dtype)


def tensor_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(S_enc, S_dec) in FP32 from the tensor amax: S_enc = min(448·6/amax, FLT_MAX), 1 if amax == 0."""
    amax = amax.float()
    # NOTE: ``scalar / tensor`` in torch is ``reciprocal(tensor) · scalar`` (two roundings); divide
    # tensor by tensor for the one correctly rounded quotient the format specifies.
    quotient = torch.full_like(amax, E4M3_MAX * E2M1_MAX) / amax
    s_enc = torch.where(amax == 0, 1.0, quotient.clamp(max=FLT_MAX))
    return s_enc, torch.reciprocal(s_enc)


def block_decode_scales(block_amax: torch.Tensor, s_enc: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales: e4m3(min(amax_b · (S_enc · (1/6)), 448)), one RNE rounding."""
    one_sixth = torch.full((), 1.0 / 6.0, dtype=torch.float32, device=s_enc.device)
    return e4m3_round(torch.clamp(block_amax * (s_enc * one_sixth), max=E4M3_MAX))


def block_encode_scales(scales: torch.Tensor, s_dec: torch.Tensor) -> torch.Tensor:
    """FP32 element multipliers: min(1 / (fp32(s_b) · S_dec), FLT_MAX); FLT_MAX for a 0 scale."""
    return torch.reciprocal(scales.float() * s_dec).clamp_(max=FLT_MAX)


def _tile_amax(magnitude: torch.Tensor) -> torch.Tensor:
    """|x| [M, N/16, 16] -> amax per 16×16 tile [ceil(M/16), N/16]; a partial last tile is zero-padded."""
    pad = -magnitude.shape[0] % BLOCK
    if pad:
        magnitude = torch.cat([magnitude, magnitude.new_zeros(pad, *magnitude.shape[1:])])
    return magnitude.unflatten(0, (magnitude.shape[0] // BLOCK, BLOCK)).amax(dim=(1, 3))


def quantize_ref(
    x: torch.Tensor,
    block_2d: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    name: str | None = None,
) -> NVFP4Tensor:
    """The torch reference quantizer (CPU path, and the oracle for the kernels)."""
    op = "nvfp4.quantize"
    checks.check_input(x, op=op, block=BLOCK, name=name, ndim=2 if block_2d else None)
    shape, n = x.shape, x.shape[-1]
    xf = x.float().reshape(math.prod(shape[:-1]), n // BLOCK, BLOCK)  # x: [M, N/16, 16]
    magnitude = xf.abs()
    # block_amax: [M, N/16], or per tile [ceil(M/16), N/16] in 2D mode
    block_amax = _tile_amax(magnitude) if block_2d else magnitude.amax(-1)
    amax = block_amax.amax() if block_amax.numel() else xf.new_zeros(())
    checks.check_finite(x, op=op, name=name, amax=amax)

    s_enc, s_dec = tensor_scales(amax)
    scales = block_decode_scales(block_amax, s_enc)
    if block_2d:
        scales = scales.repeat_interleave(BLOCK, dim=0)[: xf.shape[0]]  # [M, N/16]
    encode = block_encode_scales(scales, s_dec)  # [M, N/16]
    v = (xf * encode[..., None]).clamp_(-E2M1_MAX, E2M1_MAX).flatten(1)  # [M, N]
    if stochastic:
        codes = e2m1_encode_stochastic(v, random_bytes(v.shape, v.device, generator))
    else:
        codes = e2m1_encode(v)
    lead = shape[:-1]
    return NVFP4Tensor(
        codes=pack_nibbles(codes).reshape(*lead, n // 2),
        scales=scales.reshape(*lead, n // BLOCK),
        amax=amax,
        shape=shape,
        block_2d=block_2d,
    )


def quantize_rows(x: torch.Tensor, name: str | None = None, check: bool = True) -> NVFP4Tensor:
    """Row-scaled NVFP4 (round to nearest): each row of ``x: [..., N]`` quantized as :func:`quantize_ref`
    would quantize it alone. A token's output then does not depend on the batch it is in. ``check``:
    raise on NaN/Inf now (a host sync), else the caller checks the amax."""
    op = "nvfp4.quantize_rows"
    checks.check_input(x, op=op, block=BLOCK, name=name)
    shape, n = x.shape, x.shape[-1]
    xf = x.float().reshape(math.prod(shape[:-1]), n // BLOCK, BLOCK)  # x: [M, N/16, 16]
    block_amax = xf.abs().amax(-1)  # [M, N/16]
    amax = block_amax.amax(-1, keepdim=True) if block_amax.numel() else xf.new_zeros(xf.shape[0], 1)  # [M, 1]
    if check:
        checks.check_finite(x, op=op, name=name, amax=amax)
    s_enc, s_dec = tensor_scales(amax)  # [M, 1] each
    scales = block_decode_scales(block_amax, s_enc)  # [M, N/16]
    encode = block_encode_scales(scales, s_dec)  # [M, N/16]
    v = (xf * encode[..., None]).clamp_(-E2M1_MAX, E2M1_MAX).flatten(1)  # [M, N]
    lead = shape[:-1]
    return NVFP4Tensor(
        codes=pack_nibbles(e2m1_encode(v)).reshape(*lead, n // 2),
        scales=scales.reshape(*lead, n // BLOCK),
        amax=amax.reshape(*lead, 1),
        shape=shape,
    )


@functools.lru_cache(maxsize=16)
def _rht_matrix_on(signs: tuple[float, ...] | None, device: torch.device) -> torch.Tensor:
    return rht_matrix(None if signs is None else torch.tensor(signs)).to(device)


def rht(x: torch.Tensor, signs: torch.Tensor | None = None, name: str | None = None) -> torch.Tensor:
    """16-point RHT along the last dim: ``x_blocks @ (diag(signs)·H16/4)`` in FP32, rounded once to
    BF16 (also for FP32 input). ``signs``: float [16] of ±1, default the fixed wgrad vector."""
    checks.check_input(x, op="nvfp4.rht", block=RHT_SIZE, name=name)
    key = None if signs is None else tuple(float(s) for s in signs.tolist())
    r = _rht_matrix_on(key, x.device)  # [16, 16]
    blocks = x.float().reshape(-1, RHT_SIZE)  # [M·N/16, 16]
    precision = torch.get_float32_matmul_precision()
    if x.dtype != torch.float32 or precision == "highest":
        out = blocks @ r  # [M·N/16, 16]
    else:
        # NOTE: a reduced FP32 matmul precision (TF32) would round FP32 inputs to 10 mantissa bits
        # (BF16/FP16 inputs fit exactly), so FP32 inputs take the IEEE matmul.
        torch.set_float32_matmul_precision("highest")
        try:
            out = blocks @ r  # [M·N/16, 16]
        finally:
            torch.set_float32_matmul_precision(precision)
    return out.to(torch.bfloat16).reshape(x.shape)


def _check_rht_t_input(x: torch.Tensor, *, op: str, name: str | None) -> None:
    """x: [M, N] with M (the token dim, blocked after the transpose) a multiple of 16."""
    checks.check_dtype(x, op=op, name=name)
    checks.check_block_shape(x, op=op, block=1, name=name, ndim=2)
    checks.check_rows(x, op=op, block=BLOCK, what="the token dim, blocked after the transpose", name=name)


def quantize_rht_t_ref(
    x: torch.Tensor,
    signs: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    name: str | None = None,
) -> NVFP4Tensor:
    """The wgrad operand: ``quantize(rht(x.t()))`` for x: [M, N] -> NVFP4Tensor of shape [N, M]
    (blocks of 16 along the token dim M)."""
    op = "nvfp4.quantize_rht_t"
    _check_rht_t_input(x, op=op, name=name)
    checks.check_finite(x, op=op, name=name)
    xt = rht(x.t().contiguous(), signs, name=name)  # [N, M] bf16
    return quantize_ref(xt, stochastic=stochastic, generator=generator, name=name)


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType | None:
    """The Triton kernel module, or None when Triton or the kernel module is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    module = "inkling_fp4.numerics.kernels.triton_nvfp4"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name in ("triton", module, "inkling_fp4.numerics.kernels"):
            return None
        raise


def quantize(
    x: torch.Tensor,
    block_2d: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    name: str | None = None,
) -> NVFP4Tensor:
    """NVFP4-quantize ``x: [..., N]`` (blocks along N); Triton on CUDA, the torch reference elsewhere."""
    kernels = _kernels() if x.is_cuda else None
    if kernels is None:
        return quantize_ref(x, block_2d=block_2d, stochastic=stochastic, generator=generator, name=name)
    op = "nvfp4.quantize"
    checks.check_input(x, op=op, block=BLOCK, name=name, ndim=2 if block_2d else None)
    t = kernels.quantize(x, block_2d=block_2d, stochastic=stochastic, generator=generator)
    checks.check_finite(x, op=op, name=name, amax=t.amax)
    return t


def quantize_rht_t(
    x: torch.Tensor,
    signs: torch.Tensor | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    name: str | None = None,
) -> NVFP4Tensor:
    """``quantize(rht(x.t(), signs), stochastic=...)`` for x: [M, N]; fused on CUDA."""
    kernels = _kernels() if x.is_cuda else None
    if kernels is None:
        return quantize_rht_t_ref(x, signs=signs, stochastic=stochastic, generator=generator, name=name)
    op = "nvfp4.quantize_rht_t"
    _check_rht_t_input(x, op=op, name=name)
    t = kernels.quantize_rht_t(x, signs=signs, stochastic=stochastic, generator=generator)
    checks.check_finite(x, op=op, name=name, amax=t.amax)
    return t
