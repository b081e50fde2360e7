"""Benchmark the blockwise FP8 quantizer (``numerics/kernels/fp8_quantize.py``) on a CUDA GPU.

Why: in the fp8 recipe's training step the quantizer, not the FP8 GEMMs, decides whether FP8 pays: at
hybrid-350m it took 42 ms of a 243 ms step (198 launches, about 1 TB/s over the bytes it moves, a
third of an H200's bandwidth), while the FP8 GEMMs saved 13 ms over BF16. This times the three
layouts the layer uses, at the layer's shapes, against a device-to-device copy of the same bytes.

Before timing, each result is checked bit for bit against the torch reference (``numerics/fp8.py``)
on the zero-padded input: codes and scale_inv. A mismatch makes the exit status 1.

Bytes are what the launch reads and writes: x (2 B per element, BF16), codes (1 B per element per
layout), scales (4 B per 128 elements per layout). GB/s = bytes / median time (do_bench).

Usage:
    python scripts/bench_quant_fp8.py                      # tokens 32768, widths 1024, 4096, 6176
    python scripts/bench_quant_fp8.py --tokens 16384 --widths 768,3072
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from inkling_fp4.numerics import fp8


def _layouts(x: torch.Tensor):
    """name -> (run, reference, bytes written per element), for x [M, N] BF16."""
    padded = F.pad(x, (0, -x.shape[1] % 128))
    return {
        "pair (x, xT)": (
            lambda: fp8.quantize_blockwise_pair(x, check=False, pad=True),
            lambda: (fp8.quantize_blockwise_ref(padded, (1, 128)), fp8.quantize_blockwise_t_ref(padded)),
            2,
        ),
        "rows (x)": (
            lambda: (fp8.quantize_blockwise(x, check=False, pad=True),),
            lambda: (fp8.quantize_blockwise_ref(padded, (1, 128)),),
            1,
        ),
        "tokens (xT)": (
            lambda: (fp8.quantize_blockwise_t(x, check=False),),
            lambda: (fp8.quantize_blockwise_t_ref(x),),
            1,
        ),
    }


def _mismatch(got, want) -> str:
    for g, w in zip(got, want, strict=True):
        if g.data.shape != w.data.shape:
            return f"shape {tuple(g.data.shape)} vs {tuple(w.data.shape)}"
        if not torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)):
            return "codes differ"
        if not torch.equal(g.scale_inv.contiguous(), w.scale_inv.contiguous()):
            return "scales differ"
    return ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--widths", default="1024,4096,6176", help="comma-separated N (6176: a Mamba in_proj)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant_fp8.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    torch.manual_seed(0)
    failures = 0
    print(f"{torch.cuda.get_device_name()}, BF16 input, {args.tokens} tokens")
    print(f"{'width':>6} {'layout':<14} {'ms':>8} {'GB/s':>8} {'copy GB/s':>10}  check")
    for n in (int(w) for w in args.widths.split(",")):
        x = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        x *= torch.exp2(torch.randint(-8, 9, (args.tokens, 1), device="cuda").float()).to(x.dtype)
        copy_ms = do_bench(lambda x=x: x.clone())
        copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
        for name, (run, reference, layouts) in _layouts(x).items():
            problem = _mismatch(run(), reference())
            failures += bool(problem)
            ms = do_bench(run)
            moved = x.numel() * (x.element_size() + layouts * (1 + 4 / 128))
            print(f"{n:>6} {name:<14} {ms:8.3f} {moved / ms / 1e6:8.0f} {copy_gbs:10.0f}  {problem or 'ok'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
