"""Benchmark the FP8 quantizers (``numerics/kernels/fp8_quantize.py``, ``kernels/amax.py``) on a CUDA GPU.

Why: in the fp8 recipe's training step the quantizer, not the FP8 GEMMs, decides whether FP8 pays: at
hybrid-350m it took 42 ms of a 243 ms step (198 launches, about 1 TB/s over the bytes it moves, a
third of an H200's bandwidth), while the FP8 GEMMs saved 13 ms over BF16. This times the three
layouts the layer uses, at the layer's shapes, against a device-to-device copy of the same bytes, and
the tensorwise pair (amax pass + one pass writing both layouts) with its amax pass alone, the pair
under delayed scaling (one pass: the scale from a given amax, x's own amax recorded), and the MLP's
fused squared ReLU pairs (relu(x)² and its gradient quantized as they are computed, x as h).

Before timing, each result is checked bit for bit against the torch reference (``numerics/fp8.py``)
on the zero-padded input: codes and scale_inv. A mismatch makes the exit status 1.

Bytes are what the launch reads and writes: x (2 B per element, BF16), codes (1 B per element per
layout), scales (4 B per 128 elements per layout). GB/s = bytes / median time (do_bench).

``--integer`` makes the bytes with integer arithmetic instead of the GPU's conversion instruction
(the two give the same bytes; the flag measures what the instruction is worth).

Usage:
    python scripts/bench_quant_fp8.py                      # tokens 32768, widths 1024, 4096, 6176
    python scripts/bench_quant_fp8.py --tokens 16384 --widths 768,3072
    python scripts/bench_quant_fp8.py --integer
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from inkling_fp4.numerics import fp8
from inkling_fp4.numerics.kernels import amax as amax_kernel
from inkling_fp4.numerics.kernels import fp8_quantize


def _same(got, want) -> str:
    """'' when the FP8 results (tuples of FP8Tensor / FP8BlockTensor) are equal bit for bit."""
    for g, w in zip(got, want, strict=True):
        if g.data.shape != w.data.shape:
            return f"shape {tuple(g.data.shape)} vs {tuple(w.data.shape)}"
        if not torch.equal(g.data.view(torch.uint8), w.data.view(torch.uint8)):
            return "codes differ"
        if not torch.equal(g.scale_inv.contiguous().reshape(-1), w.scale_inv.contiguous().reshape(-1)):
            return "scales differ"
    return ""


def _layouts(x: torch.Tensor):
    """name -> (run, check -> '' or the problem, bytes moved), for x [M, N] BF16.

    Bytes: x read (2 B per element) per pass over it, codes (1 B per element per layout), block scales
    (4 B per 128 elements per layout)."""
    padded = F.pad(x, (0, -x.shape[1] % 128))
    n, blocked = x.numel(), 1 + 4 / 128
    tensorwise = fp8.quantize_tensorwise_ref(x)
    tensor_pair_ref = (tensorwise, fp8.FP8Tensor(tensorwise.data.t(), tensorwise.scale_inv))
    amax = x.abs().amax().float()
    pair_ref = (fp8.quantize_blockwise_ref(padded, (1, 128)), fp8.quantize_blockwise_t_ref(padded))
    rows_ref = fp8.quantize_blockwise_ref(padded, (1, 128))
    tokens_ref = fp8.quantize_blockwise_t_ref(x)

    def pair():
        return fp8.quantize_blockwise_pair(x, check=False, pad=True)

    def rows():
        return fp8.quantize_blockwise(x, check=False, pad=True)

    def tokens():
        return fp8.quantize_blockwise_t(x, check=False)

    def tensor_pair():
        return fp8.quantize_tensorwise_pair(x, check=False)

    def tensor_amax():
        return amax_kernel.abs_max(x)

    history_amax = amax.reshape(1) / 2  # delayed scaling: an earlier amax, half of x's (some saturate)
    delayed_ref = fp8.quantize_tensorwise_ref(x, amax=history_amax)
    delayed_pair_ref = (delayed_ref, fp8.FP8Tensor(delayed_ref.data.t(), delayed_ref.scale_inv))
    record = torch.full((1,), -1.0, device=x.device)

    def tensor_delayed():
        return fp8.quantize_tensorwise_pair(x, check=False, amax=history_amax, record=record)

    def delayed_check():
        record.fill_(-1.0)
        problem = _same(tensor_delayed(), delayed_pair_ref)
        return problem or ("" if torch.equal(record.reshape(()), amax) else "recorded amax differs")

    # the MLP's fused squared ReLU: x as h, and a second tensor as the upstream gradient
    dout = x.roll(1, 0)
    relu_refs = []
    for d in (None, dout):
        r = fp8.quantize_tensorwise_ref(fp8.squared_relu_ref(x, d), amax=history_amax)
        relu_refs.append((r, fp8.FP8Tensor(r.data.t(), r.scale_inv)))

    def squared_relu(d=None):
        return fp8.quantize_squared_relu_pair(x, d, check=False, amax=history_amax, record=record)

    def squared_relu_grad():
        return squared_relu(dout)

    return {
        "pair (x, xT)": (pair, lambda: _same(pair(), pair_ref), n * (2 + 2 * blocked)),
        "rows (x)": (rows, lambda: _same((rows(),), (rows_ref,)), n * (2 + blocked)),
        "tokens (xT)": (tokens, lambda: _same((tokens(),), (tokens_ref,)), n * (2 + blocked)),
        "tensor pair": (
            tensor_pair,
            lambda: _same(tensor_pair(), tensor_pair_ref),
            n * (2 + 2 + 2),  # x read by the amax pass and by the codes pass; two layouts written
        ),
        "tensor pair delayed": (tensor_delayed, delayed_check, n * (2 + 2)),  # one read; x's amax recorded
        "squared ReLU pair": (squared_relu, lambda: _same(squared_relu(), relu_refs[0]), n * (2 + 2)),
        "squared ReLU grad pair": (
            squared_relu_grad,
            lambda: _same(squared_relu_grad(), relu_refs[1]),
            n * (2 + 2 + 2),  # h and the upstream gradient read
        ),
        "tensor amax": (
            tensor_amax,
            lambda: "" if torch.equal(tensor_amax().reshape(()), amax) else "amax differs",
            n * 2,
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--widths", default="1024,4096,6176", help="comma-separated N (6176: a Mamba in_proj)")
    ap.add_argument(
        "--integer", action="store_true", help="integer bytes instead of the conversion instruction"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant_fp8.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    if args.integer:
        fp8_quantize.conversion_instruction = lambda device: False
    torch.manual_seed(0)
    failures = 0
    how = "integer arithmetic" if args.integer else "conversion instruction"
    print(f"{torch.cuda.get_device_name()}, BF16 input, {args.tokens} tokens, FP8 bytes by {how}")
    print(f"{'width':>6} {'layout':<14} {'ms':>8} {'GB/s':>8} {'copy GB/s':>10}  check")
    for n in (int(w) for w in args.widths.split(",")):
        x = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        x *= torch.exp2(torch.randint(-8, 9, (args.tokens, 1), device="cuda").float()).to(x.dtype)
        copy_ms = do_bench(lambda x=x: x.clone())
        copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
        for name, (run, check, moved) in _layouts(x).items():
            problem = check()
            failures += bool(problem)
            ms = do_bench(run)
            print(f"{n:>6} {name:<14} {ms:8.3f} {moved / ms / 1e6:8.0f} {copy_gbs:10.0f}  {problem or 'ok'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
