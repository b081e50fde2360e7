"""Benchmark one decode step's GEMMs: BF16 cuBLAS against the NVFP4 fprop, unfused and fused.

Why: a decode step multiplies M = batch rows by every weight once, so each GEMM is microseconds of
work, and NVFP4's emulated fprop adds its activation quantization and output scaling around cuBLAS
(five launches per layer). ``precision/decode_fprop.py`` does it in two (three under tensor scaling),
with a Triton GEMM whose epilogue scales, or cuBLAS and the scale kernel. This times each variant per
layer shape inside a CUDA graph (as the decode step runs: no host launch overhead counted, only the
GPU's time per kernel and the gaps between them), sums a step's worth of layers, tries the Triton
GEMM's tile choices, and checks every variant's output against the unfused reference.

Usage:
    python scripts/bench_decode_gemm.py --preset peer158m --batches 1,16,64,256
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

from inkling_fp4.model.config import ModelConfig
from inkling_fp4.numerics.kernels import nvfp4_decode_gemm as kernels
from inkling_fp4.precision import decode_fprop, gemm
from inkling_fp4.precision.graph_capture import quantized_graph
from inkling_fp4.precision.linear_gemms import _fprop
from inkling_fp4.precision.recipes import nvfp4_recipe

TILES = [(16, 32, 256, 4), (16, 64, 256, 4), (32, 32, 256, 4), (64, 32, 256, 4), (64, 64, 128, 4),
         (16, 32, 128, 4), (16, 64, 128, 4), (64, 32, 128, 8)]  # fmt: skip
"""(BLOCK_M, BLOCK_N, BLOCK_K, warps) of the scaled GEMM, tried per layer shape."""


def layer_shapes(cfg: ModelConfig) -> dict[tuple[int, int], int]:
    """(K, N) of each linear layer of a decode step -> how many of them the step has."""
    from inkling_fp4.model.hybrid import HybridLM
    from inkling_fp4.precision.quant_linear import QuantLinear

    with torch.device("meta"):
        model = HybridLM(cfg)
    shapes: dict[tuple[int, int], int] = {}
    for m in model.modules():
        if isinstance(m, QuantLinear):
            shapes[(m.in_features, m.out_features)] = shapes.get((m.in_features, m.out_features), 0) + 1
    head = (model.lm_head.in_features, model.lm_head.out_features)
    shapes[head] = shapes.get(head, 0) + 1
    return shapes


def ints(text: str) -> list[int]:
    """A comma-separated list of integers (argparse names a bad one)."""
    return [int(v) for v in text.split(",") if v]


def graph_us(fn, reps: int = 50) -> float:
    """Microseconds per call of ``fn`` replayed ``reps`` times inside one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with quantized_graph(g, torch.device("cuda")):  # as the decode graph captures quantized GEMMs
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)


def variant(x, wq, n, spec, backend):
    """The decode fprop with the GEMM ``backend`` (triton | cublas)."""
    try:
        decode_fprop.GEMM = backend
        return decode_fprop.decode_fprop(x, wq, spec, n, "bench")
    finally:
        decode_fprop.GEMM = "auto"  # the default, for whatever runs next


def time_layer(m: int, k: int, n: int, failures: list[str]) -> tuple[dict, dict]:
    """(us per call of each variant, us per call of the row-scaled GEMM per tile choice)."""
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda")
    w16 = w.to(torch.bfloat16)
    times = {"bf16": graph_us(functools.partial(F.linear, x, w16))}
    per_tile = {}
    for scale in ("tensor", "row"):
        recipe = nvfp4_recipe(activation_scale=scale)
        wq = gemm.quantize(w, recipe.fprop.b, codes=False, values=True)
        ref = _fprop(x, w, recipe, "ref", torch.bfloat16, wq=wq)[0].float()
        times[f"unfused {scale}"] = graph_us(
            functools.partial(_fprop, x, w, recipe, "u", torch.bfloat16, wq=wq)
        )
        for backend in ("triton", "cublas"):
            run = functools.partial(variant, x, wq, n, recipe.fprop.a, backend)
            err = ((run().float() - ref).abs() / (ref.abs() + 1e-3)).max().item()
            if err > 2**-6:
                failures.append(f"M={m} K={k} N={n} {scale} {backend}: rel err {err:.2e}")
            times[f"{scale} {backend}"] = graph_us(run)
        if scale == "row":
            xv, out_scale, _ = kernels.quantize_rows_whole(x, wq.decode_scale)
            for tiles in TILES:
                per_tile[tiles] = graph_us(
                    functools.partial(kernels.scaled_gemm, xv, wq.values[:n], out_scale, tiles=tiles)
                )
    return times, per_tile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="peer158m")
    parser.add_argument(
        "--batches", type=ints, default=ints("1,16,64,256"), help="comma-separated batch sizes"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_gemm.py needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    shapes = layer_shapes(ModelConfig(preset=args.preset))
    print(f"{torch.cuda.get_device_name()}, {args.preset}: (K, N) x count {shapes}")
    failures: list[str] = []
    for m in args.batches:
        totals: dict[str, float] = {}
        tile_totals: dict[tuple, float] = {}
        for (k, n), count in shapes.items():
            times, per_tile = time_layer(m, k, n, failures)
            print(
                f"  M={m:4d} K={k:5d} N={n:6d} x{count:2d}: "
                + ", ".join(f"{a} {b:.1f}us" for a, b in times.items())
            )
            for key, t in times.items():
                totals[key] = totals.get(key, 0.0) + t * count
            for tiles, t in per_tile.items():
                tile_totals[tiles] = tile_totals.get(tiles, 0.0) + t * count
        ratios = ", ".join(
            f"{key} / bf16 {totals[key] / totals['bf16']:.2f}x" for key in totals if key != "bf16"
        )
        print(
            f"M={m}: per step (us): " + ", ".join(f"{a} {b:.0f}" for a, b in totals.items()) + f"; {ratios}"
        )
        ranked = sorted(tile_totals.items(), key=lambda kv: kv[1])[:4]
        print(
            "  row-scaled GEMM alone, step total per tile choice (us): "
            + "; ".join(f"{t}: {v:.0f}" for t, v in ranked)
        )
    if failures:
        print("MISMATCH: " + "; ".join(failures[:10]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
