"""The fused-epilogue NVFP4 GEMM of ``scaled_gemm.py`` fed by the tensor memory accelerator (Hopper+).

The same product and epilogue, out = bf16((a · bᵀ) · s), but each operand tile arrives by one TMA copy
(zeros past the edges, so no masks and no wrapped rows) and the kernel is persistent: one program per
SM walks the output tiles, so one tile's epilogue overlaps the next one's loads. At K <= 1024 the
epilogue is a large share of the GEMM, which is where the pointer-fed kernel trailed cuBLAS.
a [M, K] must be K-contiguous; b either [N, K] K-contiguous or the transposed view of a [K, N] tensor
(how dgrad's Wᵀ arrives). Row strides must be 16-byte multiples, as TMA needs.
"""

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from inkling_fp4.numerics.kernels.scale_output import scaled_bf16


def _set_block_shapes(nargs):
    """Autotune's pre-hook: the descriptors' tile shapes follow the config being tried."""
    bm, bn, bk = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [bm, bk]
    nargs["b_desc"].block_shape = [bk, bn] if nargs["B_KN"] else [bn, bk]


def _config(bm, bn, bk, warps, stages, ws=False):
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "WARP_SPECIALIZE": ws},
        num_warps=warps, num_stages=stages, pre_hook=_set_block_shapes,
    )  # fmt: skip


CONFIGS = [
    _config(128, 256, 64, 8, 3),
    _config(256, 128, 64, 8, 3),
    _config(128, 128, 64, 8, 4),
    _config(128, 128, 64, 4, 4),
    _config(128, 256, 64, 8, 3, ws=True),
    _config(128, 128, 64, 4, 4, ws=True),
]
"""Tilings tried once per GEMM shape (wgmma's 64-row multiples), with and without warp specialization."""
INTERPRETER_TILE = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "WARP_SPECIALIZE": False}


@triton.jit
def _widened(t, NATIVE_BF16: tl.constexpr):
    """BF16 tile as the dot takes it: itself on a GPU, widened on its bits under the interpreter (whose
    dot misreads BF16; exact)."""
    if NATIVE_BF16:
        return t
    bits = t.to(tl.int16, bitcast=True).to(tl.int32)
    return ((bits & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _scaled_gemm_tma_kernel(
    a_desc, b_desc, scale_ptr, out_ptr, M, N, K, stride_om, M_BUCKET, ROW_SCALE: tl.constexpr,
    NATIVE_BF16: tl.constexpr, B_KN: tl.constexpr, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, GROUP_M: tl.constexpr = 8,
):  # fmt: skip
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * tiles_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(
        tl.program_id(0), tiles_m * tiles_n, NUM_SMS, flatten=True, warp_specialize=WARP_SPECIALIZE
    ):
        # tiles walk GROUP_M row tiles down a column before moving right: b's tiles stay in L2
        first_m = (tile // in_group) * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (tile % in_group) % rows_in_group
        tile_n = (tile % in_group) // rows_in_group
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([tile_m * BLOCK_M, ki * BLOCK_K])  # [BM, BK]
            if B_KN:
                b = b_desc.load([ki * BLOCK_K, tile_n * BLOCK_N])  # [BK, BN]
            else:
                b = b_desc.load([tile_n * BLOCK_N, ki * BLOCK_K]).T  # [BN, BK] -> [BK, BN]
            if NATIVE_BF16:
                acc = tl.dot(a, b, acc)  # FP32 accumulation of exact BF16 products
            else:
                acc = tl.dot(_widened(a, NATIVE_BF16), _widened(b, NATIVE_BF16), acc, input_precision="ieee")
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = scaled_bf16(acc, scale_ptr, rows, M, ROW_SCALE, NATIVE_BF16)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :], out, mask=mask)


_tuned = triton.autotune(configs=CONFIGS, key=["M_BUCKET", "N", "K", "ROW_SCALE", "B_KN"])(
    _scaled_gemm_tma_kernel
)


def fits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether TMA can feed these operands: a K-contiguous, b K- or N-contiguous, 16-byte row strides."""
    if a.stride(1) != 1 or (b.stride(1) != 1 and b.stride(0) != 1):
        return False
    b_row = b.stride(0) if b.stride(1) == 1 else b.stride(1)
    rows = ((a.stride(0), a.data_ptr()), (b_row, b.data_ptr()))
    return all((stride * 2) % 16 == 0 and ptr % 16 == 0 for stride, ptr in rows)


@functools.lru_cache(maxsize=8)
def _sm_count(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def scaled_gemm_tma(a, b, scale, out, m: int, n: int, bucket: int, row_scale: bool, native: bool) -> None:
    """Writes bf16((a [M, K] · b [N, K]ᵀ) · scale) into out [m, n]; the caller checked :func:`fits`."""
    b_kn = b.stride(1) != 1  # b is the view of a [K, N] tensor
    k = a.shape[1]
    a_desc = TensorDescriptor(a, [a.shape[0], k], [a.stride(0), 1], [1, 1])
    if b_kn:
        b_desc = TensorDescriptor(b.t(), [k, b.shape[0]], [b.stride(1), 1], [1, 1])
    else:
        b_desc = TensorDescriptor(b, [b.shape[0], k], [b.stride(0), 1], [1, 1])
    args = (a_desc, b_desc, scale, out, m, n, k, out.stride(0), bucket)
    if a.is_cuda:
        sms = _sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device())
        grid = lambda meta: (  # noqa: E731
            min(sms, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),
        )
        _tuned[grid](*args, ROW_SCALE=row_scale, NATIVE_BF16=native, B_KN=b_kn, NUM_SMS=sms)
        return
    t = INTERPRETER_TILE  # the interpreter: one small tiling, three programs walking the tiles
    a_desc.block_shape = [t["BLOCK_M"], t["BLOCK_K"]]
    b_desc.block_shape = [t["BLOCK_K"], t["BLOCK_N"]] if b_kn else [t["BLOCK_N"], t["BLOCK_K"]]
    _scaled_gemm_tma_kernel[(3,)](*args, ROW_SCALE=row_scale, NATIVE_BF16=native, B_KN=b_kn, NUM_SMS=3, **t)
