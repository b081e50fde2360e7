"""The emulated NVFP4 GEMM's epilogue fused into the GEMM against the two passes it replaces.

    python scripts/bench_scaled_gemm.py [--tokens 32768] [--config hybrid-350m]

For each forward and dgrad GEMM shape of the model (M tokens x N outputs x K contraction, NVFP4 block
values of random tensors), the median time of: cuBLAS with a BF16 output (the floor: no scale at all),
cuBLAS with an FP32 output then ``scale_to_bf16`` (the two passes), and ``scaled_gemm`` (one kernel),
fed by pointers and by TMA (``scaled_gemm.TMA_FED``); both dgrad layouts are timed as the trainer
hands them over (Wᵀ as the view of W). Each fused output is checked against the two-pass one (within
one BF16 step, nearly all bitwise).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_model import time_ms  # noqa: E402
from inkling_fp4.model.config import ModelConfig  # noqa: E402
from inkling_fp4.numerics.nvfp4 import quantize  # noqa: E402
from inkling_fp4.precision.gemm import mm_fp32_out  # noqa: E402


def shapes(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, N, K) of every linear's forward GEMM and its dgrad (N and K swapped)."""
    d, e = cfg.d_model, cfg.mamba_heads * cfg.mamba_head_dim
    in_proj = 2 * e + 2 * cfg.n_groups * cfg.d_state + cfg.mamba_heads
    kv = 2 * cfg.n_kv_heads * (d // cfg.n_heads)
    linears = [("mamba in_proj", in_proj, d), ("mamba out_proj", d, e), ("mlp up", cfg.ffn_dim, d),
               ("mlp down", d, cfg.ffn_dim), ("attention qkv", d + kv, d),
               ("attention out", d, d)]  # fmt: skip
    out = []
    for name, n, k in linears:
        n = -(-n // 32) * 32  # the precision layer pads widths to whole blocks
        out += [(f"{name} fprop", n, k), (f"{name} dgrad", k, n)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="hybrid-350m")
    p.add_argument("--tokens", type=int, default=32768, help="M: tokens of a micro-batch (16 x 2048)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_scaled_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from inkling_fp4.numerics.kernels import scaled_gemm as sg
    from inkling_fp4.numerics.kernels.scale_output import scale_to_bf16

    def fused(a, b, s, tma):
        sg.TMA_FED = tma
        return sg.scaled_gemm(a, b, s)

    cfg = ModelConfig(preset=args.config)
    m, g = args.tokens, torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.config}, M = {m} tokens\n")
    head = [
        "GEMM", "N", "K", "cuBLAS BF16 out ms", "FP32 out + scale pass ms", "fused, pointers ms",
        "fused, TMA ms", "pointers / two passes", "TMA / two passes", "bitwise equal (pointers, TMA)",
    ]  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = [0.0] * 4
    for name, n, k in shapes(cfg):
        qa = quantize(torch.randn(m, k, device="cuda", generator=g))
        qb = quantize(torch.randn(n, k, device="cuda", generator=g) * 0.05)
        a, b = qa.block_values(), qb.block_values()
        if name.endswith("dgrad"):  # Wᵀ arrives as the view of W's [K, N] values
            b = b.t().contiguous().t()
        scale = (qa.decode_scale * qb.decode_scale).reshape(1)
        two = scale_to_bf16(mm_fp32_out(a, b.t()), scale)
        step = torch.exp2(torch.floor(torch.log2(two.float().abs().clamp_min(1e-30))) - 7)
        same = []
        for tma in (False, True):
            out = fused(a, b, scale, tma)
            if not ((out.float() - two.float()).abs() <= step).all():
                feed = "TMA" if tma else "pointers"
                print(f"{name}: the fused output ({feed}) is more than one BF16 step from the two-pass one",
                      file=sys.stderr)  # fmt: skip
                return 1
            same.append((out == two).float().mean().item())
        t = [
            time_ms(lambda a=a, b=b: torch.mm(a, b.t()), 20),
            time_ms(lambda a=a, b=b, s=scale: scale_to_bf16(mm_fp32_out(a, b.t()), s), 20),
            time_ms(lambda a=a, b=b, s=scale: fused(a, b, s, False), 20),
            time_ms(lambda a=a, b=b, s=scale: fused(a, b, s, True), 20),
        ]
        totals = [x + y for x, y in zip(totals, t, strict=True)]
        ms = " | ".join(f"{x:.3f}" for x in t)
        print(f"| {name} | {n} | {k} | {ms} | {t[2] / t[1]:.2f} | {t[3] / t[1]:.2f} | "
              f"{same[0]:.4f}, {same[1]:.4f} |")  # fmt: skip
    ms = " | ".join(f"{x:.3f}" for x in totals)
    print(f"| all | | | {ms} | {totals[2] / totals[1]:.2f} | {totals[3] / totals[1]:.2f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
