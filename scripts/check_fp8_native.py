"""Check native FP8 GEMMs (torch._scaled_mm) against exact emulation, case by case, on CUDA.

Why: a wrong scale layout for blockwise ``_scaled_mm`` does not always raise; it can silently scale
blocks by the wrong factor. Inputs here are randn times 2^(row factor + column factor), so every
block of every blocking has a very different scale and a wrong layout shows as an error of the
order of the output itself. Hopper FP8 tensor cores accumulate with reduced precision (about 14
bits between promotions, DeepSeek-V3 report 3.3.2), so a correct layout is within
``FP8_ACCUM_TOL · Σ|a_i·b_i|`` of the emulation (plus the BF16 rounding of a BF16 output).

For each case (tensorwise / blockwise x fprop / dgrad / wgrad x FP32 / BF16 output) it prints the
error of the layout the code uses (in units of that bound: <= 1 passes), and for blockwise cases
also the alternative scale layouts (contiguous vs outer-dim-major 1x128 scales, transposed 128x128
scales, padded vs unpadded 128x128 row stride), each as a ratio, "rejected" (torch raised) or
"shape" (not a valid shape here). Exits 1 if any layout the code uses does not match.

Usage: python scripts/check_fp8_native.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from inkling_fp4.precision import gemm, native_fp8  # noqa: E402
from test_gemm import FP8_CASES, block_varied, fp8_gemm_operands, fp8_layout_error  # noqa: E402


def b_rows(b: gemm.Operand) -> int:
    """Rows of the logical [Rb, C] second operand."""
    return b.q.data.shape[1] if b.transposed else b.q.data.shape[0]


def _alternatives(a: gemm.Operand, b: gemm.Operand) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Plausible (scale_a, scale_b) layouts for a blockwise pair, by name; 'code' is what gemm uses."""
    sa_logical = a.q.scale_inv.float()  # [Ra, C/128]
    out = {}
    sa_alts = {"a outer-major": sa_logical.t().contiguous().t(), "a row-major": sa_logical.contiguous()}
    s = b.q.scale_inv.float()
    if b.spec.block == (128, 128):
        tiles = (s.t() if b.transposed else s).contiguous()  # [Rb/128, C/128]
        c = tiles.shape[1]
        padded = torch.zeros(tiles.shape[0], -(-c // 4) * 4, device=s.device)
        padded[:, :c] = tiles
        sb_alts = {
            "b [C/128,Rb/128] T-row-major": tiles.t(),
            "b [C/128,Rb/128] contiguous": tiles.t().contiguous(),
            "b [C/128,Rb/128] T-row-major padded4": padded[:, :c].t(),
            "b [Rb/128,C/128] contiguous": tiles,
            # each row with its tile's scale, read as a 1x128 operand (native_fp8.ROWS_1X128)
            "b rows-1x128 [C/128,Rb] contiguous": tiles.repeat_interleave(128, dim=0)[: b_rows(b)]
            .t()
            .contiguous(),
        }
    else:
        sb_alts = {"b [C/128,Rb] contiguous": s.t().contiguous(), "b [C/128,Rb] T": s.contiguous().t()}
    for na, sa in sa_alts.items():
        for nb, sb in sb_alts.items():
            out[f"{na} + {nb}"] = (sa, sb)
    return out


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        print("check_fp8_native.py needs a CUDA device with FP8 tensor cores (sm_89+)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, bound: error <= 1 x (2^-10 Σ|ab|)")
    from inkling_fp4.precision.backends import native_fp8_blockwise_out_dtypes

    dtypes = native_fp8_blockwise_out_dtypes(torch.device("cuda"))  # the probe picks the layout "code" uses
    dev = torch.device("cuda", torch.cuda.current_device())
    layout, api = native_fp8._tile_layout.get(dev), native_fp8._blockwise_api.get(dev)
    print(f"probe: blockwise out dtypes {sorted(str(d) for d in dtypes)} via {api}, 128x128 scale_b {layout}")
    x, w, dy = block_varied(256, 384), block_varied(256, 384), block_varied(256, 256)
    failures = []
    for scaling, gemm_name, out_dtype in FP8_CASES:
        label = f"{scaling:>10} {gemm_name:>5} {str(out_dtype).split('.')[-1]:>8}"
        a, b = fp8_gemm_operands(scaling, gemm_name, x, w, dy)
        layouts = {"code": None}
        if scaling != "tensorwise":
            layouts.update(_alternatives(a, b))
        for name, scales in layouts.items():
            try:
                if scales is None:
                    native = native_fp8.native_fp8_matmul(a, b, out_dtype)
                else:
                    mat1, mat2 = native_fp8._row_major(a), native_fp8._col_major_t(b)
                    native = torch._scaled_mm(mat1, mat2, scales[0], scales[1], out_dtype=out_dtype)
                torch.cuda.synchronize()
                err = fp8_layout_error(native, a, b)
                verdict = f"{err:10.3g} {'MATCH' if err <= 1.0 else 'mismatch'}"
            except (RuntimeError, ValueError, TypeError, NotImplementedError) as e:
                err = float("inf")
                verdict = f"{'rejected':>10} {str(e).splitlines()[0][:90]}"
            print(f"{label}  {name:<62} {verdict}")
            fallback = scaling == "blockwise" and out_dtype == torch.float32 and err == float("inf")
            if name == "code" and fallback:
                print(
                    f"{label}  (no FP32-output blockwise GEMM here: gemm_backend.matmul rounds a BF16 output)"
                )
            elif name == "code" and not err <= 1.0:
                failures.append(label)
    if failures:
        print("FAIL: the layout the code uses does not match emulation for: " + "; ".join(failures))
        return 1
    print("OK: every case matches emulation with the layout the code uses")
    return 0


if __name__ == "__main__":
    sys.exit(main())
