"""MXFP4 (OCP Microscaling): E2M1 elements, one E8M0 power-of-two scale per 32 elements.

The paper (arXiv 2509.25149, section 5) compares NVFP4 with MXFP4 to show what the finer E4M3 scales
and the FP32 tensor scale buy; this is that comparison's quantizer. The scale rule is the OCP MX
Specification v1.0, section 6.3:

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem      (emax_elem = 2 for E2M1: 6 = 1.5·2^2)
    X          = 2^shared_exp, shared_exp clamped to E8M0's [-127, 127]
    P_i        = E2M1_RNE(clamp(V_i / X, -6, 6))           (saturate to the max normal)

So the block amax lands in [4, 8) after scaling and values in (6, 8) saturate to 6: the rounding error
NVFP4's scale rule (amax maps to exactly 6) avoids. V_i / X is exact; there is no tensor scale, so
``block_values`` equals ``dequantize``.

Layout: ``x: [..., N]``, N % 32 == 0 -> ``codes [..., N//2]``, ``scales`` E8M0 bytes ``[..., N//32]``.
On CUDA the one-pass kernel of ``numerics/kernels/mxfp4_quantize.py`` runs; ``quantize_ref`` is the
CPU path and oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from inkling_fp4.numerics import checks, kernels
from inkling_fp4.numerics.formats import (
    E2M1_MAX,
    E8M0_NAN,
    decode_packed,
    e2m1_encode,
    e2m1_encode_stochastic,
    e8m0_from_exponent,
    e8m0_to_float,
    floor_log2,
    pack_nibbles,
    pow2_float,
    random_bytes,
)

BLOCK = 32
E2M1_EMAX = 2


@dataclass
class MXFP4Tensor:
    """An MXFP4-quantized tensor of original shape ``shape`` ([..., N])."""

    codes: torch.Tensor  # uint8 [..., N//2]
    scales: torch.Tensor  # uint8 E8M0 [..., N//32]
    shape: torch.Size

    @property
    def decode_scale(self) -> torch.Tensor:
        """MX has no tensor scale: 1.0 (float32 0-dim), kept for symmetry with NVFP4."""
        return torch.ones((), dtype=torch.float32, device=self.codes.device)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``code · 2^shared_exp`` (exact in FP32 and BF16), cast to ``dtype``."""
        n = self.shape[-1]
        values = decode_packed(self.codes).unflatten(-1, (n // BLOCK, BLOCK))  # [..., N/32, 32]
        scaled = values * e8m0_to_float(self.scales)[..., None]
        return scaled.flatten(-2).reshape(self.shape).to(dtype)

    def block_values(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Same as :meth:`dequantize` (no tensor scale to keep apart)."""
        return self.dequantize(dtype)


def quantize(
    x: torch.Tensor,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    name: str | None = None,
    check: bool = True,
) -> MXFP4Tensor:
    """MXFP4-quantize ``x: [..., N]`` in 1×32 blocks along N. On CUDA ``check=False`` skips the NaN/Inf
    check (a host sync): a non-finite block then gets the NaN scale byte and dequantizes to NaN."""
    t, _ = quantize_with_values(x, stochastic, generator, name, check, keep_codes=True, dtype=None)
    return t


def quantize_with_values(
    x: torch.Tensor,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    name: str | None = None,
    check: bool = True,
    keep_codes: bool = True,
    dtype: torch.dtype | None = torch.bfloat16,
) -> tuple[MXFP4Tensor | None, torch.Tensor | None]:
    """``(t, t.block_values(dtype))`` for the quantized x, None where not asked for (``keep_codes``,
    ``dtype``); one kernel pass for both on CUDA."""
    if not (x.is_cuda and kernels.available()):
        t = quantize_ref(x, stochastic=stochastic, generator=generator, name=name)
        return (t if keep_codes else None), (None if dtype is None else t.block_values(dtype))
    from inkling_fp4.numerics.kernels import mxfp4_quantize  # needs triton

    op = "mxfp4.quantize"
    checks.check_input(x, op=op, block=BLOCK, name=name)
    codes, scales, values = mxfp4_quantize.quantize_with_values(
        x, stochastic=stochastic, generator=generator, keep_codes=keep_codes, values_dtype=dtype
    )
    t = None if codes is None else MXFP4Tensor(codes=codes, scales=scales, shape=x.shape)
    # values are NaN exactly in the blocks with the NaN scale byte (finite blocks decode to finite values)
    if check and bool((t.scales == E8M0_NAN).any() if t is not None else values.isnan().any()):
        checks.check_finite(x, op=op, name=name)
    return t, values


def quantize_ref(
    x: torch.Tensor,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
    name: str | None = None,
) -> MXFP4Tensor:
    """The torch reference quantizer (CPU path, and the oracle for the kernel)."""
    op = "mxfp4.quantize"
    checks.check_input(x, op=op, block=BLOCK, name=name)
    shape, n = x.shape, x.shape[-1]
    xf = x.float().reshape(math.prod(shape[:-1]), n // BLOCK, BLOCK)  # x: [M, N/32, 32]
    block_amax = xf.abs().amax(-1)  # [M, N/32]
    checks.check_finite(x, op=op, name=name, amax=block_amax)

    shared_exp = (floor_log2(block_amax) - E2M1_EMAX).clamp_(-127, 127)  # [M, N/32]
    scales = e8m0_from_exponent(shared_exp)
    inverse = pow2_float(-shared_exp)  # 1/X, exact
    v = (xf * inverse[..., None]).clamp_(-E2M1_MAX, E2M1_MAX).flatten(1)  # [M, N]
    if stochastic:
        codes = e2m1_encode_stochastic(v, random_bytes(v.shape, v.device, generator))
    else:
        codes = e2m1_encode(v)
    lead = shape[:-1]
    return MXFP4Tensor(
        codes=pack_nibbles(codes).reshape(*lead, n // 2),
        scales=scales.reshape(*lead, n // BLOCK),
        shape=shape,
    )
