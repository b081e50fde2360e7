"""Benchmark the NVFP4 Triton kernels against a device-to-device copy (CUDA).

Why: quantization runs on every GEMM operand of every layer, so the kernels must move bytes at close
to memory bandwidth. Targets on an H200, 16384x4096 BF16: the 1D round-to-nearest quantize pass at
>= 70% of the copy bandwidth, the fused RHT + columnwise + stochastic pass (the wgrad operand) at
>= 55%; a torch.compile'd naive quantizer reaches about 13%.

Before timing, every kernel is checked against the torch reference (numerics/nvfp4.py, run on the
same GPU): codes, scale bytes and amax bit for bit for round-to-nearest; for stochastic rounding the
scales, every code being one of the two reference neighbours (the reference outcome for r = 0 or
r = 255), and a z-test of the mean against the exact expectation on a slice. Any mismatch makes the
exit status 1. The input keeps each 16-token group's magnitudes within 2^12 of each other, so the
RHT sums are exact in FP32 and every summation order gives the same BF16 (see nvfp4_rht.py).

Bytes are counted honestly, as bytes read plus bytes written by the timed launches: a quantize pass
reads x (2 B/elem for BF16) and writes codes (0.5 B) and scales (1/16 B); the amax pass reads x;
"total" rows are both passes. GB/s = bytes / median time (triton.testing.do_bench, L2 flushed).

Usage:
    python scripts/bench_quant.py                  # checks, the kernel table, torch.compile baseline
    python scripts/bench_quant.py --quick          # checks, the kernel and producer tables only
    python scripts/bench_quant.py --sweep          # also every tile / warp configuration listed below
    python scripts/bench_quant.py --out bench.json # also write the results as JSON
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

try:
    import inkling_fp4  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from inkling_fp4.numerics import formats, nvfp4  # noqa: E402
from inkling_fp4.numerics.hadamard import rht_signs  # noqa: E402
from inkling_fp4.numerics.kernels import nvfp4_rht, triton_nvfp4  # noqa: E402
from inkling_fp4.numerics.kernels.amax import abs_max  # noqa: E402
from inkling_fp4.numerics.kernels.nvfp4_block_values import block_values_from_codes  # noqa: E402
from inkling_fp4.numerics.kernels.nvfp4_quantize import quantize_rows  # noqa: E402
from inkling_fp4.numerics.kernels.nvfp4_rht import (  # noqa: E402
    RowValues,
    quantize_rht_t_tiles,
    rht_t_abs_max,
    sign_bits,
)

TARGETS = {"quantize 1d rn (pass)": 0.70, "rht_t sr (pass)": 0.55}
# (block_m, block_n, num_warps) for the row quantizer; (block_n, groups, num_warps) for the RHT kernel;
# (block_m, block_n, steps, num_warps) for the amax pass; (block_n, groups, num_warps) for the RHT amax.
ROW_CONFIGS = [(8, 256, 2), (16, 256, 4), (4, 256, 1), (8, 128, 1), (8, 512, 4), (4, 512, 2), (16, 256, 2)]
RHT_CONFIGS = [(64, 2, 2), (128, 2, 4), (32, 2, 1), (64, 4, 2), (32, 4, 1), (64, 1, 2), (128, 1, 4)]
AMAX_CONFIGS = [(64, 256, 8, 8), (32, 256, 8, 8), (64, 256, 4, 8), (128, 256, 4, 8), (64, 512, 4, 8)]
RHT_AMAX_CONFIGS = [(256, 8, 4), (128, 8, 2), (256, 4, 4), (64, 8, 2), (128, 16, 4), (512, 8, 4), (512, 4, 4),
                    (1024, 4, 8), (512, 8, 8), (256, 16, 2)]  # fmt: skip
# What a training step runs (x: row values RN, RHT codes RN; dy: row values SR, RHT values SR), with
# tiles that give a thread several features (wider loads) as well as the one-feature defaults first.
TRAIN_ROW_CONFIGS = [(8, 256, 2), (16, 256, 4), (8, 512, 2), (16, 512, 4), (4, 512, 1), (32, 256, 4)]
TRAIN_RHT_CONFIGS = [(64, 2, 2), (128, 2, 2), (256, 2, 4), (256, 2, 2), (128, 1, 1), (256, 1, 2), (512, 1, 4),
                     (128, 4, 2), (256, 4, 4)]  # fmt: skip
SEED = 2**40 + 12345


def make_input(rows: int, cols: int) -> torch.Tensor:
    """BF16 Gaussian with power-of-two column scales, magnitudes clamped to [2^-6, 30]·scale."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, cols, device="cuda", generator=g)
    x = torch.sign(x) * x.abs().clamp(2.0**-6, 30.0)
    col_scale = torch.exp2(torch.randint(-8, 9, (cols,), device="cuda", generator=g).float())
    return (x * col_scale).bfloat16()


class Report:
    """Collects checks and timings; prints as it goes."""

    def __init__(self, copy_gbps: float):
        self.copy_gbps = copy_gbps
        self.rows: list[dict] = []
        self.checks: list[dict] = []

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        print(f"  {'ok  ' if ok else 'FAIL'} {name} {detail}")

    def time(self, name: str, fn, nbytes: int, config: str = "", rep: int = 100) -> float:
        ms = do_bench(fn, warmup=25, rep=rep, return_mode="median")
        gbps = nbytes / ms / 1e6
        row = {"kernel": name, "config": config, "ms": ms, "bytes": nbytes, "gbps": gbps,
               "pct_copy": 100 * gbps / self.copy_gbps}  # fmt: skip
        self.rows.append(row)
        target = TARGETS.get(name)
        flag = "" if target is None else f" (target {100 * target:.0f}%)"
        print(f"  {name:<34} {config:<18} {ms:8.4f} ms {gbps:8.0f} GB/s {row['pct_copy']:6.1f}%{flag}")
        return ms


def _same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    a = a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a
    b = b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b
    bad = int((a != b).sum())
    return bad == 0, "" if bad == 0 else f"{bad} differ"


def check_exact(report: Report, name: str, got: nvfp4.NVFP4Tensor, ref: nvfp4.NVFP4Tensor) -> None:
    for field in ("codes", "scales", "amax"):
        ok, detail = _same(getattr(got, field), getattr(ref, field))
        report.check(f"{name}: {field}", ok, detail)


def check_stochastic(report: Report, name: str, got: nvfp4.NVFP4Tensor, y: torch.Tensor) -> None:
    """``got`` = stochastic quantization of y (the transformed operand for the RHT path)."""
    nearest = nvfp4.quantize_ref(y)
    report.check(f"{name}: scales = RN scales", *_same(got.scales, nearest.scales))
    _, s_dec = nvfp4.tensor_scales(nearest.amax)
    encode = nvfp4.block_encode_scales(nearest.scales.float(), s_dec)
    v = (y.float().unflatten(-1, (-1, 16)) * encode[..., None]).clamp(-6, 6).flatten(-2)
    codes = formats.unpack_nibbles(got.codes)
    low = formats.e2m1_encode_stochastic(v, torch.zeros_like(v))
    high = formats.e2m1_encode_stochastic(v, torch.full_like(v, 255.0))
    outside = int(((codes != low) & (codes != high)).sum())
    report.check(f"{name}: codes are neighbours", outside == 0, f"{outside} outside" if outside else "")
    rows = max(1, 2**18 // v.shape[-1])  # exact expectation over the 256 values of r, on a slice
    part = v[:rows]
    r = torch.arange(256, device=v.device, dtype=torch.float32).reshape(256, 1, 1).expand(256, *part.shape)
    outcomes = formats.e2m1_decode(formats.e2m1_encode_stochastic(part.expand(256, *part.shape), r)).double()
    drawn = formats.e2m1_decode(codes[:rows]).double()
    z = float((drawn - outcomes.mean(0)).sum() / outcomes.var(0, correction=0).sum().sqrt())
    report.check(f"{name}: unbiased", abs(z) < 5, f"z = {z:.2f}")


def run_checks(report: Report, x: torch.Tensor) -> None:
    print("checks against the torch reference (same GPU):")
    ref = nvfp4.quantize_ref(x)
    x_amax, rht_amax = triton_nvfp4.abs_max_pair(x)
    report.check("abs_max_pair: amax of x", *_same(x_amax, ref.amax))
    report.check("abs_max_pair: amax of rht(x.t())", *_same(rht_amax, nvfp4.quantize_rht_t_ref(x).amax))
    check_exact(report, "quantize 1d rn", triton_nvfp4.quantize(x), ref)
    check_exact(
        report, "quantize 2d rn", triton_nvfp4.quantize(x, block_2d=True), nvfp4.quantize_ref(x, True)
    )
    fused = triton_nvfp4.fake_quantize(x, keep_codes=True)
    report.check("fake_quantize: values", *_same(fused.values, ref.block_values(torch.bfloat16)))
    check_exact(report, "fake_quantize: codes", fused.quantized, ref)
    report.check("block_values from codes", *_same(triton_nvfp4.block_values(ref), ref.block_values()))
    gen = torch.Generator().manual_seed(0)
    check_stochastic(report, "quantize 1d sr", triton_nvfp4.quantize(x, stochastic=True, generator=gen), x)
    rht_ref = nvfp4.quantize_rht_t_ref(x)
    check_exact(report, "rht_t rn", triton_nvfp4.quantize_rht_t(x), rht_ref)
    check_exact(report, "rht_t rn, random signs", triton_nvfp4.quantize_rht_t(x, rht_signs("random", 3)),
                nvfp4.quantize_rht_t_ref(x, rht_signs("random", 3)))  # fmt: skip
    fused = triton_nvfp4.fake_quantize_rht_t(x, keep_codes=True)
    report.check("fake_quantize_rht_t: values", *_same(fused.values, rht_ref.block_values()))
    rows, tokens = triton_nvfp4.fake_quantize_pair(x, x_amax, rht_amax)
    report.check("fake_quantize_pair: row values", *_same(rows.values, ref.block_values(torch.bfloat16)))
    check_exact(report, "fake_quantize_pair: rht", tokens.quantized, rht_ref)
    y = nvfp4.rht(x.t().contiguous())
    check_stochastic(report, "rht_t sr", triton_nvfp4.quantize_rht_t(x, stochastic=True, generator=gen), y)


def bench_kernels(report: Report, x: torch.Tensor, rep: int) -> None:
    m, n = x.shape
    read = 2 * m * n  # x, or BF16 block values
    packed = m * n // 2 + m * n // 16  # codes + scale bytes
    codes = torch.empty(m, n // 2, dtype=torch.uint8, device="cuda")
    scales = torch.empty(m, n // 16, dtype=torch.uint8, device="cuda")
    t_codes = torch.empty(n, m // 2, dtype=torch.uint8, device="cuda")
    t_scales = torch.empty(n, m // 16, dtype=torch.uint8, device="cuda")
    values = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    t_values = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
    amax = abs_max(x)
    bits = sign_bits(rht_signs("fixed"))
    rht_amax = rht_t_abs_max(x, bits)
    packed_out = dict(codes=codes, scales=scales, values=None)
    t_packed_out = dict(codes=t_codes, scales=t_scales, values=None)

    def rows(seed=None, block_2d=False, given_amax=None, **out):
        return lambda: quantize_rows(x, amax if given_amax is None else given_amax(), block_2d=block_2d,
                                     seed=seed, **out)  # fmt: skip

    def rht(seed=None, **out):
        return lambda: quantize_rht_t_tiles(x, bits, rht_amax, seed=seed, **out)

    pair_amax = rht_t_abs_max(x, bits, with_x_amax=True)
    row_decode, t_decode = torch.empty(1, device="cuda"), torch.empty(1, device="cuda")

    def two_passes():  # what a linear's forward ran for x before the pair pass
        quantize_rows(x, pair_amax[1:], block_2d=False, seed=None, codes=None, scales=None, values=values,
                      decode=row_decode)  # fmt: skip
        quantize_rht_t_tiles(x, bits, pair_amax[:1], seed=None, codes=t_codes, scales=t_scales, values=None,
                             decode=t_decode)  # fmt: skip

    def pair():
        quantize_rht_t_tiles(x, bits, pair_amax[:1], seed=None, codes=t_codes, scales=t_scales, values=None,
                             decode=t_decode, rows=RowValues(values, pair_amax[1:], row_decode))  # fmt: skip

    def torch_amax():
        return torch.linalg.vector_norm(x, float("inf")).float().reshape(1)

    def wide(fn):  # the RHT kernel loading a token group as one tile (nvfp4_rht.WIDE_LOADS)
        def run():
            nvfp4_rht.WIDE_LOADS = True
            try:
                return fn()
            finally:
                nvfp4_rht.WIDE_LOADS = False

        return run

    for name, fn, out in (
        ("rht_t amax + x amax", lambda: rht_t_abs_max(x, bits, with_x_amax=True), None),
        ("rht_t sr codes", rht(seed=SEED, **t_packed_out), (t_codes, t_scales)),
        ("rht_t sr values", rht(seed=SEED, codes=None, scales=None, values=t_values), (t_values,)),
    ):
        row_loads = [t.clone() for t in out] if out else [fn().clone()]
        got = wide(fn)()
        got = [t.clone() for t in out] if out else [got]
        ok = all(torch.equal(a, b) for a, b in zip(row_loads, got, strict=True))
        report.check(f"{name}: wide loads = row loads", ok)

    table = [
        ("amax (triton)", lambda: abs_max(x), read),
        ("amax (torch x.abs().amax())", lambda: x.abs().amax(), 3 * read),
        ("amax (torch vector_norm inf)", lambda: torch.linalg.vector_norm(x, float("inf")), read),
        ("quantize 1d rn (pass)", rows(**packed_out), read + packed),
        ("quantize 1d sr (pass)", rows(seed=SEED, **packed_out), read + packed),
        ("quantize 2d rn (pass)", rows(block_2d=True, **packed_out), read + packed),
        ("quantize 1d rn (total)", lambda: triton_nvfp4.quantize(x), 2 * read + packed),
        ("torch amax + quantize pass", rows(given_amax=torch_amax, **packed_out), 2 * read + packed),
        ("values 1d rn (pass)", rows(codes=None, scales=None, values=values), 2 * read),
        ("values+codes 1d rn (pass)", rows(codes=codes, scales=scales, values=values), 2 * read + packed),
        ("block values from codes", lambda: block_values_from_codes(codes, scales, values), packed + read),
        ("rht_t amax", lambda: rht_t_abs_max(x, bits), read),
        ("rht_t amax + x amax (one read)", lambda: rht_t_abs_max(x, bits, with_x_amax=True), read),
        ("rht_t rn (pass)", rht(**t_packed_out), read + packed),
        ("rht_t sr (pass)", rht(seed=SEED, **t_packed_out), read + packed),
        ("rht_t sr (total)", lambda: triton_nvfp4.quantize_rht_t(x, stochastic=True), 2 * read + packed),
        ("rht_t sr values+codes (pass)", rht(seed=SEED, codes=t_codes, scales=t_scales, values=t_values),
         2 * read + packed),
        ("rht_t sr values (pass)", rht(seed=SEED, codes=None, scales=None, values=t_values), 2 * read),
        ("rht_t amax + x amax, wide loads", wide(lambda: rht_t_abs_max(x, bits, with_x_amax=True)), read),
        ("rht_t rn (pass), wide loads", wide(rht(**t_packed_out)), read + packed),
        ("rht_t sr (pass), wide loads", wide(rht(seed=SEED, **t_packed_out)), read + packed),
        ("rht_t sr values (pass), wide loads", wide(rht(seed=SEED, codes=None, scales=None, values=t_values)),
         2 * read),
        ("x: row values + rht codes (2 passes)", two_passes, 3 * read + packed),
        ("x: row values + rht codes (1 pass)", pair, 2 * read + packed),
    ]  # fmt: skip
    print("kernels:")
    for name, fn, nbytes in table:
        report.time(name, fn, nbytes, rep=rep)


def bench_producers(report: Report, x: torch.Tensor, rep: int) -> None:
    """The training producers that also reduce their output's two NVFP4 tensor amaxes (the pre-norm, the
    squared ReLU; ``model/fused_nvfp4_train.py``) against the producer followed by the linear's own amax
    pass; their words checked against that pass first."""
    from inkling_fp4.model.glue_kernels import norm_kernels, pointwise_kernels
    from inkling_fp4.numerics.kernels.amax import zeroed_words

    m, n = x.shape
    read = 2 * m * n
    bits = sign_bits(rht_signs("fixed"))
    w = torch.rand(n, device=x.device) + 0.5

    def norm(pair: bool):  # -> (out, its words or None)
        words = zeroed_words(2, x.device) if pair else None
        amax_pair = (bits, words) if pair else None
        return norm_kernels.norm_forward(x, None, w, 1e-5, torch.bfloat16, None, amax_pair=amax_pair)[
            0
        ], words

    def squared_relu(pair: bool):
        if pair:
            return pointwise_kernels._squared_relu_amax_pass(x, None, bits)
        return pointwise_kernels._squared_relu_pass(x, None), None

    def with_amax_pass(produce):
        return rht_t_abs_max(produce(False)[0], bits, with_x_amax=True)

    producers = (("norm", norm), ("squared relu", squared_relu))
    for name, produce in producers:
        out, words = produce(True)
        report.check(f"{name} + amaxes: words", *_same(words, rht_t_abs_max(out, bits, with_x_amax=True)))
        if name == "squared relu":  # the norm's 16-row tile may round its row sums apart from the plain one's
            report.check(f"{name} + amaxes: output", *_same(out, produce(False)[0]))
    print("producers (x in, its BF16 output out; the amaxes by a pass after it, or from the same pass):")
    for name, produce in producers:
        report.time(f"{name} (pass)", lambda p=produce: p(False), 2 * read, rep=rep)
        report.time(f"{name} + amax pass (2 passes)", lambda p=produce: with_amax_pass(p), 3 * read, rep=rep)
        report.time(f"{name} + amaxes (1 pass)", lambda p=produce: p(True), 2 * read, rep=rep)


def naive_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference math, written plainly (for torch.compile): packed codes and scales."""
    xf = x.float().reshape(x.shape[0], -1, 16)
    magnitude = xf.abs()
    s_enc, s_dec = nvfp4.tensor_scales(magnitude.amax())
    scales = nvfp4.block_decode_scales(magnitude.amax(-1), s_enc)
    encode = nvfp4.block_encode_scales(scales, s_dec)
    v = (xf * encode[..., None]).clamp(-6.0, 6.0).flatten(1)
    return formats.pack_nibbles(formats.e2m1_encode(v)), scales


def bench_compiled(report: Report, x: torch.Tensor, rep: int) -> None:
    m, n = x.shape
    try:
        compiled = torch.compile(naive_quantize)
        codes, scales = compiled(x)
        ref = nvfp4.quantize_ref(x)
        report.check("torch.compile naive: codes", *_same(codes, ref.codes))
        nbytes = 2 * 2 * m * n + m * n // 2 + m * n // 16  # reads x twice (amax, then quantize)
        report.time("torch.compile naive quantize", lambda: compiled(x), nbytes, rep=rep)
    except Exception as e:  # the baseline is informative only; its failure is not the kernels'
        print(f"  torch.compile baseline failed: {type(e).__name__}: {e}")


def sweep(report: Report, x: torch.Tensor, rep: int) -> None:
    """Each configuration: checked (codes equal the default configuration's), then timed."""
    m, n = x.shape
    read, out = 2 * m * n, m * n // 2 + m * n // 16
    amax = abs_max(x)
    bits = sign_bits(rht_signs("fixed"))
    rht_amax = rht_t_abs_max(x, bits)
    want = triton_nvfp4.quantize(x)
    want_t = triton_nvfp4.quantize_rht_t(x)
    print("sweep:")
    for bm, bn, w in ROW_CONFIGS:
        codes = torch.empty_like(want.codes)
        scales = torch.empty_like(want.scales).view(torch.uint8)
        kw = dict(
            block_2d=False, codes=codes, scales=scales, values=None, block_m=bm, block_n=bn, num_warps=w
        )
        quantize_rows(x, amax, seed=None, **kw)
        cfg = f"m{bm} n{bn} w{w}"
        report.check(f"quantize 1d rn {cfg}", *_same(codes, want.codes))
        report.time(
            "quantize 1d rn (pass)", lambda kw=kw: quantize_rows(x, amax, seed=None, **kw), read + out, cfg
        )
        report.time(
            "quantize 1d sr (pass)", lambda kw=kw: quantize_rows(x, amax, seed=SEED, **kw), read + out, cfg
        )
    for bn, groups, w in RHT_CONFIGS:
        codes = torch.empty_like(want_t.codes)
        scales = torch.empty_like(want_t.scales).view(torch.uint8)
        kw = dict(codes=codes, scales=scales, values=None, block_n=bn, groups=groups, num_warps=w)
        quantize_rht_t_tiles(x, bits, rht_amax, seed=None, **kw)
        cfg = f"n{bn} g{groups} w{w}"
        report.check(f"rht_t rn {cfg}", *_same(codes, want_t.codes))
        report.time("rht_t sr (pass)", lambda kw=kw: quantize_rht_t_tiles(x, bits, rht_amax, seed=SEED, **kw),
                    read + out, cfg)  # fmt: skip
    train_sweep(report, x, amax, bits, rht_amax)
    for bm, bn, steps, w in AMAX_CONFIGS:
        kw = dict(block_m=bm, block_n=bn, steps=steps, num_warps=w)
        cfg = f"m{bm} n{bn} s{steps} w{w}"
        report.check(f"amax {cfg}", *_same(abs_max(x, **kw), amax))
        report.time("amax (triton)", lambda kw=kw: abs_max(x, **kw), read, cfg)
    for bn, groups, w in RHT_AMAX_CONFIGS:
        kw = dict(block_n=bn, groups=groups, num_warps=w)
        cfg = f"n{bn} g{groups} w{w}"
        report.check(f"rht_t amax {cfg}", *_same(rht_t_abs_max(x, bits, **kw), rht_amax))
        report.time("rht_t amax", lambda kw=kw: rht_t_abs_max(x, bits, **kw), read, cfg)
        kw["with_x_amax"] = True
        report.check(f"rht_t amax + x amax {cfg}", *_same(rht_t_abs_max(x, bits, **kw)[1:], amax))
        report.time("rht_t amax + x amax (one read)", lambda kw=kw: rht_t_abs_max(x, bits, **kw), read, cfg)


def train_sweep(report: Report, x: torch.Tensor, amax, bits: int, rht_amax) -> None:
    """The passes of a training step (BF16 block values of x and dy along rows; x's RHT codes, dy's RHT
    values stochastic) under each tile, each checked against the first (default) tile's bits."""
    m, n = x.shape
    read, out = 2 * m * n, m * n // 2 + m * n // 16
    want: dict[str, torch.Tensor] = {}

    def run(name: str, cfg: str, launch, result: torch.Tensor, nbytes: int) -> None:
        launch()
        report.check(f"{name} {cfg}", *_same(result, want.setdefault(name, result)))
        report.time(name, launch, nbytes, cfg)

    for bm, bn, w in TRAIN_ROW_CONFIGS:
        tile = dict(block_2d=False, codes=None, scales=None, block_m=bm, block_n=bn, num_warps=w)
        for seed, name in ((None, "train rows values rn"), (SEED, "train rows values sr")):
            values = torch.empty_like(x)
            launch = functools.partial(quantize_rows, x, amax, seed=seed, values=values, **tile)
            run(name, f"m{bm} n{bn} w{w}", launch, values, 2 * read)
    for bn, groups, w in TRAIN_RHT_CONFIGS:
        tile = dict(block_n=bn, groups=groups, num_warps=w)
        codes = torch.empty(n, m // 2, dtype=torch.uint8, device=x.device)
        scales = torch.empty(n, m // 16, dtype=torch.uint8, device=x.device)
        values = torch.empty(n, m, dtype=torch.bfloat16, device=x.device)
        rn = functools.partial(quantize_rht_t_tiles, x, bits, rht_amax, seed=None, codes=codes, scales=scales,
                               values=None, **tile)  # fmt: skip
        sr = functools.partial(quantize_rht_t_tiles, x, bits, rht_amax, seed=SEED, codes=None, scales=None,
                               values=values, **tile)  # fmt: skip
        run("train rht codes rn", f"n{bn} g{groups} w{w}", rn, codes, read + out)
        run("train rht values sr", f"n{bn} g{groups} w{w}", sr, values, 2 * read)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="checks and the kernel table only")
    parser.add_argument("--sweep", action="store_true", help="also time every tile / warp configuration")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_quant: needs a CUDA device")
        return 2
    rep = 50 if args.quick else 100
    x = make_input(args.rows, args.cols)
    copy_out = torch.empty_like(x)
    copy_ms = do_bench(lambda: copy_out.copy_(x), warmup=25, rep=rep, return_mode="median")
    copy_gbps = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, triton {triton.__version__}, x {tuple(x.shape)} bf16")
    print(f"device-to-device copy: {copy_ms:.4f} ms, {copy_gbps:.0f} GB/s (read + write)")
    report = Report(copy_gbps)
    run_checks(report, x)
    bench_kernels(report, x, rep)
    bench_producers(report, x, rep)
    if not args.quick:
        bench_compiled(report, x, rep)
    if args.sweep:
        sweep(report, x, rep)
    failed = [c["check"] for c in report.checks if not c["ok"]]
    for name_, target in TARGETS.items():
        best = max((r["pct_copy"] for r in report.rows if r["kernel"] == name_), default=0.0)
        print(f"target {name_}: best {best:.1f}% of copy (target {100 * target:.0f}%)")
    if args.out:
        result = {"device": name, "torch": torch.__version__, "triton": triton.__version__,
                  "shape": list(x.shape), "copy_ms": copy_ms, "copy_gbps": copy_gbps,
                  "rows": report.rows, "checks": report.checks}  # fmt: skip
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    if failed:
        print(f"MISMATCH in {len(failed)} check(s): {', '.join(failed[:8])}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
