"""Check and time the Mamba-2 causal conv + SiLU (model/conv_triton.py) on a GPU.

    python scripts/bench_conv.py [--shape B,L,C,W] [--out FILE.json]
    TRITON_INTERPRET=1 python scripts/bench_conv.py --smoke      # the script itself, on CPU

Why: the op is memory-bound, so its floor is the bytes it must move (forward: read x, write out;
backward: read x and dout, write dx), and a training step's profile showed it far above that floor.
This script says how far: per pass, the median time (triton.testing.do_bench), the effective
bandwidth over those bytes (the backward's floor: read x and dout, write dx; the FP32 da buffer
between its two passes is extra traffic), the autotuner's choice, the first candidate alone (what
deterministic runs use), and torch.compile's fusion of the reference for comparison.

Default shape: hybrid-350m's conv at batch 16 x 2048 (C = x||B||C = 2048 + 2 x 4 x 128 = 3072
channels, a view into in_proj's output of width W = 5152), BF16, with document resets.

Correctness first: values and gradients (x, weight, bias) against the FP32 reference ``conv_silu``,
relative error ||a - ref|| / ||ref|| below 1e-2 (BF16 outputs). Exit status: 0 when every check
passes, 1 on a mismatch, 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.testing

from inkling_fp4.model.conv import conv_silu, fused_conv_silu
from inkling_fp4.model.conv_triton import _conv_silu_bwd, _conv_silu_pointwise, conv_silu_triton
from inkling_fp4.model.packing import segment_ids
from inkling_fp4.model.ssd_kernels import tuning

TOLERANCE = 1e-2
DEVICE = "cuda"  # "cpu" with --smoke (TRITON_INTERPRET=1): the script's own check, no timing


def _bench(fn) -> float:
    if DEVICE == "cpu":
        fn()
        return float("nan")
    return triton.testing.do_bench(fn)


def _inputs(B: int, L: int, C: int, W: int, k: int = 4):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    base = torch.randn(B, L, W, device=DEVICE, generator=g).to(torch.bfloat16)
    w = torch.randn(C, k, device=DEVICE, generator=g) * 0.5
    bias = torch.randn(C, device=DEVICE, generator=g)
    doc = torch.zeros(B, L, dtype=torch.long, device=DEVICE)
    for cut in (L // 3, L // 2, (3 * L) // 4):
        doc[:, cut:] += 1
    dy = torch.randn(B, L, C, device=DEVICE, generator=g).to(torch.bfloat16)
    return base, w, bias, segment_ids(doc), dy


def _grads(fn, base, C, w, bias, seg, dy):
    base, w, bias = (t.detach().clone().requires_grad_() for t in (base, w, bias))
    y = fn(base[..., :C], w, bias, seg)
    y.backward(dy)
    return [y.detach(), base.grad[..., :C], w.grad, bias.grad]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def _time(fn, base, C, w, bias, seg, dy) -> tuple[float, float]:
    """(forward ms, backward ms): medians of do_bench; the backward gives dx, dweight and dbias."""
    x = base[..., :C].detach().requires_grad_()  # a strided leaf, as in_proj's output slice is
    wr, br = w.clone().requires_grad_(), bias.clone().requires_grad_()
    with torch.no_grad():
        fwd = _bench(lambda: fn(x, wr, br, seg))
    y = fn(x, wr, br, seg)
    bwd = _bench(lambda: torch.autograd.grad(y, (x, wr, br), dy, retain_graph=True))
    return fwd, bwd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="16,2048,3072,5152", help="B,L,C,W (W: the row width x is a view of)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        args.shape = "1,300,24,40"
    elif not torch.cuda.is_available():
        print("bench_conv.py needs a CUDA GPU", file=sys.stderr)
        return 2
    B, L, C, W = (int(v) for v in args.shape.split(","))
    torch._functorch.config.donated_buffer = False  # the compiled backward runs again on one graph
    base, w, bias, seg, dy = _inputs(B, L, C, W)

    ref = _grads(conv_silu, base.float(), C, w, bias, seg, dy.float())
    got = _grads(conv_silu_triton, base, C, w, bias, seg, dy)
    errors = {n: _rel(a, r) for n, a, r in zip(("out", "dx", "dweight", "dbias"), got, ref, strict=True)}
    ok = all(e < TOLERANCE for e in errors.values())
    print(f"shape B={B} L={L} C={C} (view of width {W}), BF16, document resets")
    print("relative error vs FP32 reference: " + ", ".join(f"{n} {e:.1e}" for n, e in errors.items()))

    elem = B * L * C * 2  # bytes of one [B, L, C] BF16 tensor
    rows, chosen = {}, {}
    for name, fn, fixed in (
        ("triton, autotuned", conv_silu_triton, False),
        ("triton, first config", conv_silu_triton, True),
        ("torch.compile reference", fused_conv_silu(), False),
    ):
        tuning.set_fixed_configs(fixed)
        fwd, bwd = _time(fn, base, C, w, bias, seg, dy)
        if name == "triton, autotuned":
            kernels = {"forward / da": _conv_silu_pointwise, "dx, dw": _conv_silu_bwd}
            # the autotuner's choice per key (the forward and da passes are two keys of one kernel)
            chosen = {f"{k} {key}": str(cfg) for k, v in kernels.items() for key, cfg in v.cache.items()}
        rows[name] = {
            "fwd_ms": fwd,
            "bwd_ms": bwd,
            "fwd_gbs": 2 * elem / fwd / 1e6,
            "bwd_gbs": 3 * elem / bwd / 1e6,
        }
    tuning.set_fixed_configs(False)
    print(f"{'':<26}{'fwd ms':>8}{'GB/s':>7}{'bwd ms':>8}{'GB/s':>7}")
    for name, r in rows.items():
        print(f"{name:<26}{r['fwd_ms']:8.3f}{r['fwd_gbs']:7.0f}{r['bwd_ms']:8.3f}{r['bwd_gbs']:7.0f}")
    print("autotuned: " + "; ".join(f"{k}: {v}" for k, v in chosen.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"shape": [B, L, C, W], "errors": errors, "timing": rows, "chosen": chosen}, f, indent=2
            )
    if not ok:
        print(f"MISMATCH: a relative error is above {TOLERANCE}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
