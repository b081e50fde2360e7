"""Native FP8 GEMMs on Hopper through ``torch._scaled_mm``, and the probe that decides whether to trust
them for blockwise scaling.

``torch._scaled_mm`` infers per-tensor vs 1×128 / 128×128 scaling from the scale tensors' shapes and
strides (``F.scaled_mm`` with ``ScalingType`` exists only in newer torch). Operand a is row-major
[Ra, C], the second column-major [C, Rb]. Per-tensor scales are 0-d FP32. Blockwise (DeepSeek-style,
cuBLAS ≥ 12.9 on sm_90): a 1×128 operand's scales are [R, C/128] "outer-dim major" (stride (1, R));
``scale_b`` is the transpose of what the [Rb, C] layout would need: 128×128 → [C/128, Rb/128] whose
transpose is contiguous, 1×128 → [C/128, Rb] contiguous. All dims are padded to multiples of 16
(``OperandQuant.multiple``), as ``_scaled_mm`` requires. NOTE with torch 2.11 on an H200 the 128×128
kernel reads that layout wrongly (and rejects every other), so the probe falls back to
:data:`ROWS_1X128`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from inkling_fp4.numerics import fp8
from inkling_fp4.precision.gemm import Operand, emulated_matmul, quantize
from inkling_fp4.precision.recipes import TENSORWISE, OperandQuant


def _row_major(op: Operand) -> torch.Tensor:
    """The operand's FP8 data as a row-major [rows, contraction] tensor."""
    data = op.q.data
    if op.transposed:
        return fp8.transpose_fp8(data)
    return data.contiguous()


def _col_major_t(op: Operand) -> torch.Tensor:
    """The operand's FP8 data transposed, [contraction, rows], in column-major layout (mat2 form)."""
    data = op.q.data
    if op.transposed:  # stored [contraction, rows] (a weight's dgrad operand): its transpose, contiguous
        return fp8.transpose_fp8(data).t()
    return data.contiguous().t()


def _scale_a(op: Operand) -> torch.Tensor:
    s = op.q.scale_inv.float()
    if op.spec.block == TENSORWISE:
        return s.reshape(())
    assert op.spec.block == (1, 128) and not op.transposed, op.spec
    return s.t().contiguous().t()  # [R, C/128], stride (1, R)


def _scale_b(op: Operand, rows: int) -> torch.Tensor:
    """``scale_b`` of the logical [Rb, C] operand (``rows`` = Rb) in the layout ``_scaled_mm`` reads."""
    s = op.q.scale_inv.float()
    if op.spec.block == TENSORWISE:
        return s.reshape(())
    if op.spec.block == (128, 128):
        tiles = s.t() if op.transposed else s  # tiles of the logical [Rb, C] operand: [Rb/128, C/128]
        return TILE_SCALE_LAYOUTS[_tile_layout.get(tiles.device, "t-row-major")](tiles, rows)
    assert op.spec.block == (1, 128) and not op.transposed, op.spec
    return s.t().contiguous()  # [C/128, Rb] contiguous


def _tile_scales_t(tiles: torch.Tensor) -> torch.Tensor:
    """128×128 scales [Rb/128, C/128] -> ``scale_b`` [C/128, Rb/128] whose transpose is row-major.

    NOTE torch's ScaledBlas.cpp wants a row stride of ceil(C/128) in older releases and
    round_up(ceil(C/128), 4) in newer ones ("16-byte aligned strides"); the padded one is used where
    this torch accepts it.
    """
    rb, c = tiles.shape
    padded = -(-c // 4) * 4
    if padded == c or rb <= 1 or not _tile_scale_rows_padded(tiles.device):
        return tiles.contiguous().t()
    buf = tiles.new_zeros(rb, padded)
    buf[:, :c] = tiles
    return buf[:, :c].t()


ROWS_1X128 = "rows-1x128"
"""The 128×128 weight as a 1×128 operand: every row of a tile carries the tile's scale.

The same numbers as the 128×128 GEMM, through the 1×128 × 1×128 kernel the wgrad uses: the probe's
last resort where the 128×128 path disagrees with emulation."""

TILE_SCALE_LAYOUTS = {  # (tiles [Rb/128, C/128], Rb) -> scale_b
    "t-row-major": lambda tiles, rows: _tile_scales_t(tiles),  # [C/128, Rb/128], transpose row-major
    "row-major": lambda tiles, rows: tiles.t().contiguous(),  # [C/128, Rb/128] row-major
    "tiles-row-major": lambda tiles, rows: tiles.contiguous(),  # [Rb/128, C/128] row-major
    "tiles-col-major": lambda tiles, rows: tiles.t().contiguous().t(),  # [Rb/128, C/128] column-major
    # each row takes its tile's scale: [Rb, C/128] -> the 1x128 scale_b [C/128, Rb] contiguous
    ROWS_1X128: lambda tiles, rows: tiles.repeat_interleave(128, dim=0)[:rows].t().contiguous(),
}
"""Candidate layouts of a 128×128 ``scale_b``. NOTE an accepted layout can still be read transposed
(wrong results, no error), so the probe picks the first one that matches emulation."""

_tile_layout: dict[torch.device, str] = {}
_blockwise_api: dict[torch.device, str] = {}
"""Per device, the op the probe found to agree for blockwise GEMMs: "_scaled_mm" or "scaled_mm"."""


def _blockwise_apis() -> tuple[str, ...]:
    """The blockwise FP8 GEMM ops of this torch, in the order the probe tries them."""
    explicit = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
    return ("_scaled_mm", "scaled_mm") if explicit else ("_scaled_mm",)


@functools.lru_cache(maxsize=8)
def _tile_scale_rows_padded(device: torch.device) -> bool:
    """Whether this torch wants 128×128 scale rows padded to 4 entries (probed once per device)."""
    if device.type != "cuda":
        return False
    a = torch.zeros(16, 384, device=device).to(torch.float8_e4m3fn)
    b = torch.zeros(256, 384, device=device).to(torch.float8_e4m3fn)
    scale_a = torch.ones(3, 16, device=device).t()  # [16, 3], outer-dim major
    padded = torch.ones(2, 4, device=device)[:, :3].t()  # [3, 2], row stride 4 in the transpose
    try:
        torch._scaled_mm(a, b.t(), scale_a, padded, out_dtype=torch.bfloat16)
        return True
    except RuntimeError:
        return False


def native_fp8_matmul(a: Operand, b: Operand, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [Ra, Rb] = a · bᵀ on FP8 tensor cores.

    NOTE for blockwise operands the probe (:func:`probe_native_fp8_blockwise`) decides between
    ``torch._scaled_mm`` and ``F.scaled_mm``, and whether the native result is used at all.
    """
    mat1 = _row_major(a)  # [Ra, C] row-major
    mat2 = _col_major_t(b)  # [C, Rb] column-major
    scale_b = _scale_b(b, mat2.shape[1])
    blockwise = a.spec.block != TENSORWISE
    if blockwise and _blockwise_api.get(mat2.device) == "scaled_mm":
        recipe = {(1, 128): F.ScalingType.BlockWise1x128, (128, 128): F.ScalingType.BlockWise128x128}
        block_b = b.spec.block
        if block_b == (128, 128) and _tile_layout.get(mat2.device) == ROWS_1X128:
            block_b = (1, 128)
        return F.scaled_mm(
            mat1, mat2, _scale_a(a), recipe[a.spec.block], scale_b, recipe[block_b],
            output_dtype=out_dtype,
        )  # fmt: skip
    return torch._scaled_mm(mat1, mat2, _scale_a(a), scale_b, out_dtype=out_dtype)


def probe_native_fp8_blockwise(device: torch.device) -> frozenset:
    """The output dtypes (of BF16, FP32) for which the fp8 recipe's three blockwise GEMMs run natively
    on ``device`` and agree with emulation. The shapes have several tiles each way, none square, so a
    scale read in the wrong layout cannot agree by accident."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 512, device=device, generator=g) * torch.rand(256, 512, device=device, generator=g)
    w = torch.randn(384, 512, device=device, generator=g) * 8 ** torch.rand(
        384, 1, device=device, generator=g
    )
    dy = torch.randn(256, 384, device=device, generator=g)
    act, tile = OperandQuant("e4m3", (1, 128)), OperandQuant("e4m3", (128, 128))
    wq = quantize(w, tile)
    tiled = [
        (quantize(x, act), wq),  # fprop: [256, 512] x [384, 512]ᵀ
        (quantize(dy, act), dataclasses.replace(wq, transposed=True)),  # dgrad: W read transposed
    ]
    wgrad = [(quantize(dy, act, transpose=True), quantize(x, act, transpose=True))]

    def agrees(pairs, out_dtype) -> bool:
        try:
            for a, b in pairs:
                got = native_fp8_matmul(a, b, out_dtype).float()
                want = emulated_matmul(a, b)
                if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
                    return False
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return True
        except (RuntimeError, NotImplementedError, ValueError, TypeError):
            return False

    for api in _blockwise_apis():
        _blockwise_api[device] = api
        supported, found = set(), None
        for out_dtype in (torch.bfloat16, torch.float32):
            if not agrees(wgrad, out_dtype):
                continue
            for layout in [found] if found else list(TILE_SCALE_LAYOUTS):
                _tile_layout[device] = layout
                if agrees(tiled, out_dtype):
                    supported.add(out_dtype)
                    found = layout
                    break
        if supported:
            _tile_layout[device] = found
            return frozenset(supported)
    _blockwise_api.pop(device, None)
    _tile_layout.pop(device, None)
    return frozenset()
