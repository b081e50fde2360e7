"""Check and time the Triton SSD scan (ssd_triton) on a GPU against the chunked reference (ssd_reference).

    python scripts/bench_ssd.py [--shapes main|all] [--chunks 64,128] [--no-compiled-ref] [--out FILE.json]

Four sections, each printed as a table as soon as it is done (and written to --out after every section,
so a run cut short still leaves its results):

1. correctness: values and gradients (x, dt, A, B, C, initial state) against ssd_reference in FP64, as
   relative errors ||a - ref|| / ||ref||; the column ``ref32`` is the error of the reference itself run
   on the same inputs in FP32 math (with outputs in the input dtype), the floor BF16 outputs allow.
2. timing: forward and forward + backward (median ms, triton.testing.do_bench), and the first call
   (compile + autotune, seconds) separately. Target shape b=8, l=2048, h=32 x p=64, n=128, g=8, BF16:
   forward <= 1.1 ms, forward + backward <= 5 ms.
3. per kernel at the target shape, and the autotuner's choices.
4. torch.compile'd ssd_reference at the target shape (the baseline to beat).

Exit status: 0 when every check passes and no kernel fails; 1 on a mismatch or a kernel failure
(timings that miss the targets are reported, not failed); 2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass

import torch

DEVICE = "cuda"  # "cpu" with --smoke
TARGET_SHAPE = (8, 2048, 32, 64, 8, 128)  # b, l, h, p, g, n
TARGET_FWD_MS, TARGET_FWD_BWD_MS = 1.1, 5.0
EXTRA_SHAPES = [
    (4, 4096, 16, 64, 1, 128),  # long sequence, one group for all heads
    (16, 1024, 24, 64, 8, 64),  # small state, 3 heads per group
    (2, 2000, 40, 64, 8, 128),  # length not a multiple of the chunk, 5 heads per group
    (4, 2048, 16, 128, 4, 128),  # head dim 128
]
SMOKE_SHAPES = [(2, 40, 4, 16, 2, 32), (1, 24, 2, 16, 1, 16)]  # --smoke: the interpreter on CPU
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}  # dA gets 3x: a sum over all positions
NAMES = ("x", "dt", "A", "B", "C", "initial_state")


@dataclass
class Inputs:
    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    initial_state: torch.Tensor | None
    doc_ids: torch.Tensor | None

    def leaves(self, dtype=None):
        out = {}
        for k in NAMES:
            t = getattr(self, k)
            if t is not None:
                t = t.detach().to(dtype) if dtype is not None else t.detach().clone()
                out[k] = t.requires_grad_()
        return out


def make_inputs(shape, dtype, docs, init, seed=0):
    b, l, h, p, g, n = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(b, l, h, p, device=DEVICE, generator=gen).to(dtype)
    dt = torch.exp(torch.empty(b, l, h, device=DEVICE).uniform_(-6.9, -0.7, generator=gen))  # [1e-3, 0.5]
    A = -torch.exp(torch.empty(h, device=DEVICE).uniform_(-2.3, 1.4, generator=gen))  # [-4, -0.1]
    B = torch.randn(b, l, g, n, device=DEVICE, generator=gen).to(dtype)
    C = torch.randn(b, l, g, n, device=DEVICE, generator=gen).to(dtype)
    state = torch.randn(b, h, p, n, device=DEVICE, generator=gen) if init else None
    doc_ids = None
    if docs:  # packed documents of mean length ~300, with a boundary on a chunk edge
        starts = torch.rand(b, l, device=DEVICE, generator=gen) < 1 / 300
        starts[:, min(128, l - 1)] = True
        doc_ids = starts.int().cumsum(1).int()
    return Inputs(x, dt, A, B, C, state, doc_ids)


def rel(a, ref):
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def run_with_grads(fn, inp: Inputs, chunk, dy, dfinal, dtype=None):
    leaves = inp.leaves(dtype)
    y, final = fn(
        leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk,
        initial_state=leaves.get("initial_state"), doc_ids=inp.doc_ids,
    )  # fmt: skip
    grads = torch.autograd.grad([y, final], list(leaves.values()), [dy.to(y.dtype), dfinal.to(final.dtype)])
    return {"y": y, "final": final, **{"d" + k: g for k, g in zip(leaves, grads, strict=True)}}


def check_case(shape, dtype, chunk, docs, init):
    from inkling_fp4.model.ssd import ssd_reference
    from inkling_fp4.model.ssd_triton import ssd_triton

    inp = make_inputs(shape, dtype, docs, init)
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    dy = torch.randn(inp.x.shape, device=DEVICE, generator=gen)
    b, _, h, p, _, n = shape
    dfinal = torch.randn(b, h, p, n, device=DEVICE, generator=gen)
    got = run_with_grads(ssd_triton, inp, chunk, dy, dfinal)
    ref64 = run_with_grads(ssd_reference, inp, chunk, dy, dfinal, dtype=torch.float64)
    ref32 = run_with_grads(ssd_reference, inp, chunk, dy, dfinal)
    errors = {k: rel(got[k], ref64[k]) for k in ref64}
    floor = {k: rel(ref32[k], ref64[k]) for k in ref64}
    tol = TOLERANCE[dtype]
    ok = all(e <= (3 * tol if k == "dA" else tol) for k, e in errors.items())
    del got, ref64, ref32
    return errors, floor, ok


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench(fn, rep=200):
    if DEVICE != "cuda":  # --smoke: one interpreted call, wall clock
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def time_case(shape, dtype, chunk, docs, fn=None):
    from inkling_fp4.model.ssd_triton import ssd_triton

    fn = fn or ssd_triton
    inp = make_inputs(shape, dtype, docs, init=False)
    leaves = inp.leaves()
    args = [leaves[k] for k in ("x", "dt", "A", "B", "C")]
    dy = torch.randn_like(inp.x)

    def forward():
        with torch.no_grad():
            fn(*args, chunk, doc_ids=inp.doc_ids)

    def forward_backward():
        y, _ = fn(*args, chunk, doc_ids=inp.doc_ids)
        torch.autograd.grad(y, args, dy)

    sync()
    t0 = time.perf_counter()
    forward_backward()
    sync()
    first = time.perf_counter() - t0
    return first, bench(forward), bench(forward_backward)


def time_kernels(shape, chunk):
    """Each kernel alone, on the buffers of one forward and backward at `shape` (BF16)."""
    from inkling_fp4.model.ssd_kernels import (
        chunk_cumsum,
        chunk_scan,
        chunk_states,
        scan_grads_bc,
        scan_grads_x,
        state_grads,
    )

    inp = make_inputs(shape, torch.bfloat16, docs=False, init=False)
    x, dt, A, B, C = inp.x, inp.dt, inp.A, inp.B, inp.C
    dy = torch.randn_like(x)
    dt_t, G = chunk_cumsum.chunk_cumsum(dt, A, chunk)
    states, _ = chunk_states.chunk_states(x, dt_t, G, B, None, None, chunk)
    dstates, _ = state_grads.state_grads(dy, G, C, None, None, chunk)
    calls = {
        "chunk_cumsum": lambda: chunk_cumsum.chunk_cumsum(dt, A, chunk),
        "chunk_states": lambda: chunk_states.chunk_states(x, dt_t, G, B, None, None, chunk),
        "chunk_scan": lambda: chunk_scan.chunk_scan(x, dt_t, G, B, C, states, None, chunk),
        "state_grads": lambda: state_grads.state_grads(dy, G, C, None, None, chunk),
        "scan_grads_x": lambda: scan_grads_x.scan_grads_x(
            x, dt_t, G, A, B, C, dy, states, dstates, None, chunk
        ),
        "scan_grads_bc": lambda: scan_grads_bc.scan_grads_bc(
            x, dt_t, G, B, C, dy, states, dstates, None, chunk
        ),
    }
    times = {}
    for name, call in calls.items():
        try:
            times[name] = bench(call, rep=100)
        except Exception as exc:  # noqa: BLE001 - one kernel failing should not hide the others
            print(f"  {name} FAILED: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            times[name] = float("nan")
    kernels = {
        "chunk_states": chunk_states._chunk_states_kernel,
        "chunk_scan": chunk_scan._chunk_scan_kernel,
        "state_grads": state_grads._state_grads_kernel,
        "scan_grads_x": scan_grads_x._scan_grads_x_kernel,
        "scan_grads_bc": scan_grads_bc._scan_grads_bc_kernel,
    }
    choices = {name: [str(c) for c in k.cache.values()] for name, k in kernels.items()}
    return times, choices


def shape_str(shape):
    b, l, h, p, g, n = shape
    return f"b{b} l{l} h{h}x{p} g{g} n{n}"


def fail(results, section, label, exc):
    first = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    print(f"  FAILED {label}: {first}", flush=True)
    traceback.print_exc(limit=6, file=sys.stderr)
    results["failures"].append({"section": section, "case": label, "error": first})
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def section_correctness(results, shapes, chunks):
    target = shapes[0]
    print(
        "\n1. correctness vs ssd_reference in FP64 (relative errors; ref32: the reference's own FP32 error)"
    )
    bf16, fp32 = torch.bfloat16, torch.float32
    cases = [(target, bf16, c, False, True) for c in chunks]
    cases += [(target, bf16, chunks[0], True, True), (target, fp32, chunks[0], True, True)]
    cases += [(s, bf16, chunks[0], True, True) for s in shapes[1:]]
    print(f"  {'shape':<26}{'dtype':<9}{'Q':>4}{'docs':>6}  {'worst':>8}  {'ok':<4} errors (ref32)")
    for shape, dtype, chunk, docs, init in cases:
        label = f"{shape_str(shape)} {str(dtype)[6:]} Q{chunk} docs={docs}"
        try:
            errors, floor, ok = check_case(shape, dtype, chunk, docs, init)
        except Exception as exc:  # noqa: BLE001 - reported and counted as a failure
            fail(results, "correctness", label, exc)
            continue
        detail = " ".join(f"{k} {e:.1e} ({floor[k]:.0e})" for k, e in errors.items())
        verdict = "ok" if ok else "BAD"
        worst = max(errors.values())
        row = (
            f"{shape_str(shape):<26}{str(dtype)[6:]:<9}{chunk:>4}{str(docs):>6}  {worst:>8.2e}  {verdict:<4}"
        )
        print(f"  {row} {detail}", flush=True)
        results["correctness"].append(
            dict(shape=shape, dtype=str(dtype), chunk=chunk, docs=docs, errors=errors, ref32=floor, ok=ok)
        )
        if not ok:
            results["failures"].append({"section": "correctness", "case": label, "error": "mismatch"})


def section_timing(results, shapes, chunks):
    target = shapes[0]
    print("\n2. timing, BF16 (median ms; first call = compile + autotune, s)")
    print(f"  {'shape':<26}{'Q':>4}{'docs':>6}{'first s':>9}{'fwd ms':>9}{'fwd+bwd':>9}")
    for shape in shapes:
        for chunk in chunks:
            for docs in [False, True] if shape == target else [False]:
                label = f"{shape_str(shape)} Q{chunk} docs={docs}"
                try:
                    first, fwd, fwd_bwd = time_case(shape, torch.bfloat16, chunk, docs)
                except Exception as exc:  # noqa: BLE001
                    fail(results, "timing", label, exc)
                    continue
                mark = ""
                if shape == TARGET_SHAPE:
                    met = fwd <= TARGET_FWD_MS and fwd_bwd <= TARGET_FWD_BWD_MS
                    mark = "  target " + ("met" if met else "MISSED")
                row = f"{shape_str(shape):<26}{chunk:>4}{str(docs):>6}{first:>9.1f}{fwd:>9.3f}{fwd_bwd:>9.3f}"
                print(f"  {row}{mark}", flush=True)
                results["timing"].append(
                    dict(
                        shape=shape,
                        chunk=chunk,
                        docs=docs,
                        first_call_s=first,
                        fwd_ms=fwd,
                        fwd_bwd_ms=fwd_bwd,
                    )
                )


def section_kernels(results, target, chunks):
    print(f"\n3. per kernel at {shape_str(target)}, BF16 (median ms) and autotune choices")
    for chunk in chunks:
        try:
            times, choices = time_kernels(target, chunk)
        except Exception as exc:  # noqa: BLE001
            fail(results, "kernels", f"Q{chunk}", exc)
            continue
        row = "  ".join(f"{k} {v:.3f}" for k, v in times.items())
        print(f"  Q={chunk}: {row}  sum {sum(times.values()):.3f}", flush=True)
        results["kernels"][chunk] = {"ms": times, "configs": choices}
        for name, ms in times.items():
            if ms != ms:  # NaN: that kernel failed
                results["failures"].append(
                    {"section": "kernels", "case": f"{name} Q{chunk}", "error": "failed"}
                )
        for name, picked in choices.items():
            if picked:  # empty when a kernel has one config (the interpreter)
                print(f"    {name}: {'; '.join(picked)}")


def section_compiled_reference(results, target, chunks):
    print(f"\n4. torch.compile(ssd_reference) at {shape_str(target)}, BF16 inputs (FP32 math)")
    from inkling_fp4.model.ssd import ssd_reference

    compiled = torch.compile(ssd_reference, dynamic=False)
    for chunk in chunks:
        try:
            first, fwd, fwd_bwd = time_case(target, torch.bfloat16, chunk, False, fn=compiled)
        except Exception as exc:  # noqa: BLE001 - the baseline failing does not fail the kernel
            print(f"  Q={chunk}: compiled reference failed: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        print(f"  Q={chunk}: compile {first:.1f} s, fwd {fwd:.3f} ms, fwd+bwd {fwd_bwd:.3f} ms", flush=True)
        results["compiled_reference"][chunk] = dict(compile_s=first, fwd_ms=fwd, fwd_bwd_ms=fwd_bwd)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", choices=["main", "all"], default="all")
    parser.add_argument("--chunks", default="64,128", help="chunk sizes to check and time")
    parser.add_argument("--no-compiled-ref", action="store_true", help="skip torch.compile(ssd_reference)")
    parser.add_argument("--out", default=None, help="write all results to this JSON file")
    parser.add_argument(
        "--smoke", action="store_true", help="check this script on CPU: interpreter, tiny shapes"
    )
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported
        DEVICE = "cpu"
        shapes, chunks = SMOKE_SHAPES[: 1 if args.shapes == "main" else 2], [16, 32]
    elif not torch.cuda.is_available():
        print("bench_ssd.py needs a CUDA GPU (or --smoke to check the script on CPU)", file=sys.stderr)
        return 2
    else:
        chunks = [int(c) for c in args.chunks.split(",")]
        shapes = [TARGET_SHAPE] + (EXTRA_SHAPES if args.shapes == "all" else [])
    import triton

    results = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (Triton interpreter)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "correctness": [],
        "timing": [],
        "kernels": {},
        "compiled_reference": {},
        "failures": [],
    }
    print(f"{results['device']}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    sections = [
        lambda: section_correctness(results, shapes, chunks),
        lambda: section_timing(results, shapes, chunks),
        lambda: section_kernels(results, shapes[0], chunks),
    ]
    if not (args.no_compiled_ref or args.smoke):
        sections.append(lambda: section_compiled_reference(results, shapes[0], chunks))
    for section in sections:
        section()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    n_fail = len(results["failures"])
    print(
        "\nALL OK"
        if not n_fail
        else f"\n{n_fail} FAILURE(S): " + "; ".join(f["case"] for f in results["failures"])
    )
    return 1 if n_fail else 0


if __name__ == "__main__":
    sys.exit(main())
