"""Check and time the Triton glue kernels (model/glue_kernels/) against the torch.compile'd references.

    python scripts/bench_glue.py [--shape hybrid-350m|peer158m] [--calls 50] [--tiles 4096,1024,4,64]
    TRITON_INTERPRET=1 python scripts/bench_glue.py --smoke     # the script itself on CPU: checks, no timing

Why: for small models a training step is host-bound, and a compiled glue function costs 0.3-0.4 ms of
host time per call, which is why five of them are Triton kernels now. This measures, per function, at
the training shapes and dtypes (FP32 residual, BF16 activations, BF16 norm outputs, as under
``torch.autocast(bf16)``), the kernel against ``torch.compile(fn.reference)`` (what the model ran before):

  - GPU us:   forward + backward device time, median of ``triton.testing.do_bench_cudagraph`` (a
              CUDA graph: no host time inside; falls back to ``do_bench``, marked ``*``, which then
              includes the host's launch gaps); every replay builds and consumes a fresh graph;
  - host us:  time.perf_counter without synchronising, after warm-up, under autocast: ``--calls``
              forward calls, each building its own autograd graph (as training does), then one
              backward (``torch.autograd.grad``) through each of those graphs. NOTE one backward per
              graph: a compiled backward with donated buffers refuses ``retain_graph=True``;
  - checks:   forward against the compiled reference (exact for h, squared_relu; norms within
              NORM_RTOL (FP32) or one BF16 ulp on <= 1% of elements; dt_softplus within SOFTPLUS_ULPS),
              for skip_gated_rms_norm against the plain reference where the compiled one is off:
              inductor contracts y + x D into a fused multiply-add, and where the two cancel
              (s ~ 1e-6) its output moves by several BF16 ulps (9 of 67M outputs at hybrid-350m's
              shape; the kernel rounds x D, then the sum, as the plain reference does, and equals it),
              gradients against autograd through the reference in FP64 (relative norm < GRAD_RTOL);
              ``eq%`` is the share of forward outputs bit-equal to the compiled reference; ``grad err``
              the worst relative error of the compiled reference's and the kernels' gradients.

Then one line per shape: host time per training step saved, from the calls per step of the preset.
``--calls`` graphs are alive at once: 50 of hybrid-350m's [32768, 4096] BF16 MLP activations are about
13 GB. ``--tiles`` overrides TILE_FWD, TILE_BWD, PER_THREAD and CHUNK_ROWS of glue_kernels/common.py.
Exit status: 0 when every check passes, 1 on a mismatch, 2 without CUDA (or --smoke without the
interpreter).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch
import triton
import triton.testing

from inkling_fp4.model import mamba2, mlp, norm
from inkling_fp4.model.glue_kernels import common
from inkling_fp4.model.glue_kernels.gated_norm_kernels import skip_gated_rms_norm
from inkling_fp4.model.glue_kernels.norm_kernels import add_rms_norm, rms_norm
from inkling_fp4.model.glue_kernels.pointwise_kernels import dt_softplus, squared_relu
from inkling_fp4.model.presets import model_preset
from inkling_fp4.model.ssd_kernels.tuning import INTERPRET

EPS = 1e-5
SHAPES = {  # rows = B L tokens of one micro-batch (L = 2048); E = d_inner = H P; N = d_state
    "hybrid-350m": dict(rows=32768, L=2048, D=1024, E=2048, H=32, P=64, G=8, N=128, ffn=4096),
    "peer158m": dict(rows=16384, L=2048, D=768, E=1536, H=24, P=64, G=2, N=128, ffn=3072),
}
SMOKE = dict(rows=134, L=67, D=96, E=96, H=6, P=16, G=2, N=8, ffn=160)
DEVICE = "cuda"  # "cpu" with --smoke
# the tolerances of tests/test_glue_kernels.py
NORM_RTOL = 1.5e-6
SOFTPLUS_ULPS = 4
GRAD_RTOL = {torch.float32: 2e-5, torch.bfloat16: 4.5e-3}
BF, F32, F64 = torch.bfloat16, torch.float32, torch.float64


@dataclass
class Case:
    name: str
    fast: object  # the Triton function, called as fast(*leaves)
    ref: object  # the torch.compile'd reference (the plain one under --smoke)
    ref64: object  # the plain reference, called on FP64 leaves
    leaves: list  # inputs; floating ones get gradients
    douts: list  # output gradients
    rule: str  # forward check: "exact", "norm", "softplus"; add_rms_norm: "exact" for h, "norm" normed
    plain: object = None  # the uncompiled reference at the working dtypes: the forward's second check


def _cases(s: dict) -> list[Case]:
    B, L = s["rows"] // s["L"], s["L"]
    D, E, H, P, G, N, ffn = (s[k] for k in ("D", "E", "H", "P", "G", "N", "ffn"))
    dev = DEVICE
    # compiled on CUDA, as the model ran them before the kernels; plain on CPU (no inductor build there)
    fused = torch.compile if DEVICE == "cuda" else (lambda fn: fn)
    ref_rms, ref_add = fused(norm.rms_norm.reference), fused(norm.add_rms_norm.reference)
    ref_gated = fused(norm.skip_gated_rms_norm.reference)

    def rn(*shape, dtype=F32, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    def strided(base, lo, width):  # a strided leaf, as a split of a wider activation is
        return base[..., lo : lo + width].detach()

    conv_out = rn(B, L, E + 2 * G * N, dtype=BF)  # x || B || C
    zxbcdt = rn(B, L, 2 * E + 2 * G * N + H, dtype=BF)  # in_proj's output: [z, x, B, C, dt]
    x_h = strided(conv_out, 0, E).unflatten(-1, (H, P))  # [B, L, H, P]
    z = strided(zxbcdt, 0, E)  # [B, L, E]
    dt_raw = strided(zxbcdt, 2 * E + 2 * G * N, H)  # [B, L, H]
    dt_bias = torch.rand(H, device=dev) * -5 - 2
    D_skip = torch.rand(H, device=dev) * 2
    w_d, w_e = rn(D), rn(E)
    return [
        Case(
            "rms_norm",
            lambda x, w: rms_norm(x, w, EPS, BF),
            lambda x, w: ref_rms(x, w, EPS, BF),
            lambda x, w: norm.rms_norm.reference(x, w, EPS, F64),
            [rn(B, L, D, scale=4), w_d],
            [rn(B, L, D, dtype=BF)],
            "norm",
        ),
        Case(
            "add_rms_norm",
            lambda x, y, w: add_rms_norm(x, y, w, EPS, BF),
            lambda x, y, w: ref_add(x, y, w, EPS, BF),
            lambda x, y, w: norm.add_rms_norm.reference(x, y, w, EPS, F64),
            [rn(B, L, D, scale=4), rn(B, L, D, dtype=BF), w_d],
            [rn(B, L, D), rn(B, L, D, dtype=BF)],
            "norm",
        ),
        Case(
            "skip_gated_rms_norm",
            lambda y, x, d, z, w: skip_gated_rms_norm(y, x, d, z, w, G, EPS, BF),
            lambda y, x, d, z, w: ref_gated(y, x, d, z, w, G, EPS, BF),
            lambda y, x, d, z, w: norm.skip_gated_rms_norm.reference(y, x, d, z, w, G, EPS, F64),
            [rn(B, L, H, P, dtype=BF), x_h, D_skip, z, w_e],
            [rn(B, L, E, dtype=BF)],
            "norm",
            lambda y, x, d, z, w: norm.skip_gated_rms_norm.reference(y, x, d, z, w, G, EPS, BF),
        ),
        Case(
            "squared_relu",
            squared_relu,
            fused(mlp.squared_relu.reference),
            mlp.squared_relu.reference,
            [rn(B, L, ffn, dtype=BF)],
            [rn(B, L, ffn, dtype=BF)],
            "exact",
        ),
        Case(
            "dt_softplus",
            dt_softplus,
            fused(mamba2.dt_softplus.reference),
            mamba2.dt_softplus.reference,
            [dt_raw, dt_bias],
            [rn(B, L, H)],
            "softplus",
        ),
    ]


def _outs(o) -> tuple:
    return o if isinstance(o, tuple) else (o,)


def _leaves(case: Case, wide: bool = False) -> list:
    return [(t.double() if wide else t).detach().requires_grad_() for t in case.leaves]


def _grads(fn, leaves, douts):
    """The leaves' gradients through a fresh graph of fn (the graph is freed by the backward)."""
    return torch.autograd.grad(_outs(fn(*leaves)), leaves, douts)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(v.double())
    ulp = torch.ldexp(torch.ones_like(v, dtype=F64), (e - 8).clamp_min(-133))
    return torch.where(v == 0, 2.0**-133, ulp)


def _forward_ok(rule: str, got: torch.Tensor, ref: torch.Tensor) -> bool:
    if got.dtype != ref.dtype or got.shape != ref.shape:
        return False
    if rule == "exact":
        return torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.nan_to_num(), ref.nan_to_num())
    if rule == "softplus":
        ulp = torch.nextafter(ref.abs(), torch.full_like(ref, float("inf"))) - ref.abs()
        return bool(((got - ref).abs() <= SOFTPLUS_ULPS * ulp).all())
    if got.dtype == F32:
        return bool(((got - ref).abs() <= NORM_RTOL * ref.abs() + 1e-30).all())
    one_ulp = bool(((got.double() - ref.double()).abs() <= _bf16_ulp(ref)).all())
    return one_ulp and (got != ref).double().mean().item() <= 0.01


def check(case: Case) -> tuple[list[str], float, float, float]:
    """(what failed, empty when every check passes; % of forward outputs bit-equal to the compiled
    reference; worst gradient relative error of the compiled reference and of the kernels against
    FP64)."""
    douts = case.douts
    with torch.no_grad():
        fast = _outs(case.fast(*case.leaves))
        ref = _outs(case.ref(*case.leaves))
    rules = ["exact", "norm"] if case.name == "add_rms_norm" else [case.rule]
    problems = []
    for i, (rule, f, w) in enumerate(zip(rules, fast, ref, strict=True)):
        if _forward_ok(rule, f, w):
            continue
        if case.plain is not None:  # the compiled reference may contract y + x D into an FMA
            with torch.no_grad():
                if _forward_ok(rule, f, _outs(case.plain(*case.leaves))[i]):
                    continue
        problems.append(f"output {i} ({rule})")
    eq = sum((f == w).sum().item() for f, w in zip(fast, ref, strict=True)) / sum(f.numel() for f in fast)
    g_fast = _grads(case.fast, _leaves(case), douts)
    g_ref = _grads(case.ref, _leaves(case), douts)
    g64 = _grads(case.ref64, _leaves(case, wide=True), [d.double() for d in douts])
    err_fast = max(_rel(a, b) for a, b in zip(g_fast, g64, strict=True))
    err_ref = max(_rel(a, b) for a, b in zip(g_ref, g64, strict=True))
    for i, (leaf, g, gr, r) in enumerate(zip(case.leaves, g_fast, g_ref, g64, strict=True)):
        if g.dtype != leaf.dtype or g.shape != leaf.shape:
            problems.append(f"grad {i}: {g.dtype} {tuple(g.shape)}, leaf {leaf.dtype} {tuple(leaf.shape)}")
        elif _rel(g, r) >= GRAD_RTOL[g.dtype]:
            err, tol, err_c = _rel(g, r), GRAD_RTOL[g.dtype], _rel(gr, r)
            problems.append(f"grad {i} ({g.dtype}): error {err:.1e} >= {tol:.1e}, compiled {err_c:.1e}")
    return problems, 100.0 * eq, err_ref, err_fast


def gpu_us(fn, case: Case) -> tuple[float, str]:
    """Forward + backward device time in us: a CUDA graph's replay, else CUDA events (marked '*').
    Every call of ``step`` builds its own autograd graph and frees it in the backward."""
    leaves = _leaves(case)

    def step():
        _grads(fn, leaves, case.douts)

    if DEVICE == "cpu":
        return float("nan"), ""
    try:
        return triton.testing.do_bench_cudagraph(step, return_mode="median") * 1e3, ""
    except Exception as err:  # capture refused: time with events, host gaps included
        print(f"  ({case.name}: no CUDA graph: {type(err).__name__}: {str(err)[:100]})")
        torch.cuda.synchronize()
        return triton.testing.do_bench(step, return_mode="median") * 1e3, "*"


def host_us(fn, case: Case, calls: int) -> tuple[float, float]:
    """Host time per forward call and per backward call in us, under BF16 autocast, no synchronise:
    ``calls`` forward graphs kept alive, then one backward through each (no graph is run twice)."""
    leaves = _leaves(case)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    with torch.autocast(DEVICE, dtype=BF):
        for _ in range(5):
            _grads(fn, leaves, case.douts)
        sync()
        t0 = time.perf_counter()
        graphs = [fn(*leaves) for _ in range(calls)]
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        for out in graphs:
            torch.autograd.grad(_outs(out), leaves, case.douts)
        t3 = time.perf_counter()
        sync()
    del graphs
    return (t1 - t0) / calls * 1e6, (t3 - t2) / calls * 1e6


def calls_per_step(preset: str) -> dict[str, int]:
    """How often a training step calls each function forward (and once more backward)."""
    pattern = model_preset(preset)["pattern"]
    n_m, n_mlp = pattern.count("M"), pattern.count("-")
    # the first block's norm is a plain rms_norm; every other block and the final norm add first
    return dict(
        rms_norm=1, add_rms_norm=len(pattern), skip_gated_rms_norm=n_m, squared_relu=n_mlp, dt_softplus=n_m
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), action="append")
    parser.add_argument("--calls", type=int, default=50, help="forward graphs (and backwards) timed")
    parser.add_argument("--tiles", help="TILE_FWD,TILE_BWD,PER_THREAD,CHUNK_ROWS")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        if not INTERPRET:
            print("--smoke runs under TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        DEVICE, args.calls, shapes = "cpu", 2, {"hybrid-350m": SMOKE}
    elif not torch.cuda.is_available():
        print("bench_glue.py needs a CUDA device", file=sys.stderr)
        return 2
    else:
        shapes = {k: SHAPES[k] for k in args.shape or list(SHAPES)}
    if args.tiles:
        tiles = [int(v) for v in args.tiles.split(",")]
        common.TILE_FWD, common.TILE_BWD, common.PER_THREAD, common.CHUNK_ROWS = tiles
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU, Triton interpreter"
    print(f"torch {torch.__version__}, triton {triton.__version__}, {device}")
    print(
        f"tiles: fwd {common.TILE_FWD}, bwd {common.TILE_BWD}, {common.PER_THREAD}/thread, "
        f"chunk {common.CHUNK_ROWS}; {args.calls} calls"
    )
    failed = []
    head = f"{'fn':<20} {'GPU us ref/tri':>16} {'host fwd ref/tri':>17} {'host bwd ref/tri':>17}"
    head += f" {'eq%':>6} {'grad err ref/tri':>18}  ok"
    for shape, dims in shapes.items():
        torch._dynamo.reset()  # compile the references for this shape alone (static shapes, as in training)
        torch.manual_seed(0)
        print(f"\n{shape}: {dims}\n{head}")
        saved_us = 0.0
        counts = calls_per_step(shape)
        for case in _cases(dims):
            problems, eq, err_ref, err_fast = check(case)
            ok = not problems
            g_ref, m_ref = gpu_us(case.ref, case)
            g_fast, m_fast = gpu_us(case.fast, case)
            hf_ref, hb_ref = host_us(case.ref, case, args.calls)
            hf_fast, hb_fast = host_us(case.fast, case, args.calls)
            saved_us += counts[case.name] * (hf_ref + hb_ref - hf_fast - hb_fast)
            gpu = f"{g_ref:.0f}{m_ref}/{g_fast:.0f}{m_fast}"
            host_f, host_b = f"{hf_ref:.0f}/{hf_fast:.0f}", f"{hb_ref:.0f}/{hb_fast:.0f}"
            line = f"{case.name:<20} {gpu:>16} {host_f:>17} {host_b:>17} {eq:6.2f}"
            line += f" {f'{err_ref:.1e}/{err_fast:.1e}':>18}  {'ok' if ok else 'MISMATCH'}"
            print(line)
            if not ok:
                failed.append(f"{shape} {case.name} ({'; '.join(problems)})")
        n_calls = sum(counts.values())
        print(f"{shape}: {n_calls} calls per step (+ backward): host time saved {saved_us / 1e3:.2f} ms/step")
    if failed:
        print("MISMATCH: " + ", ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
