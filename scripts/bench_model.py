"""Benchmark the hybrid model on CUDA: forward + backward of each layer type, and the SSD scan's share.

Why: a Mamba-2 layer is a few memory-bound pieces (conv, scan, gated norm) around two GEMMs; if the
scan or the conv is slow, the 4-bit GEMMs save nothing that matters. This measures where a layer's
time goes at the shapes of ``hybrid-350m`` (d_model 1024, Mamba 32 heads x 64, state 128, 8 groups)
at sequence 2048, under BF16 autocast as the trainer runs it.

Checks first, exit 1 on a mismatch (relative error of values and gradients, BF16 tolerance):
  - one Mamba-2 layer and one MLP layer with the fast paths (Triton SSD when it imports, Triton conv,
    torch.compile'd glue: norms, gate, D skip, dt, squared ReLU) against the reference paths (chunked
    PyTorch SSD, eager conv, eager glue), on packed documents;
  - the chunked LM head + cross-entropy (``HybridLM.loss``) against the cross-entropy of full logits;
  - generation on the GPU: prefill + decode logits against the full forward.

Then times (CUDA events, median of --iters after warm-up):
  - each block type (RMSNorm + mixer + residual): Mamba-2, attention, MLP: forward and forward + backward;
  - inside the Mamba-2 layer: the two projections, the conv, the SSD scan, the gated norm with the D
    skip, and the scan's share;
  - the whole model, forward + backward (no optimizer step), tokens/s and MFU (dense BF16 peak): with
    the chunked loss (``HybridLM.loss``) and with the cross-entropy of full FP32 logits.

Usage:
    python scripts/bench_model.py                          # hybrid-350m, batch 8, sequence 2048
    python scripts/bench_model.py --packed --compile       # documents of ~512 tokens; torch.compile blocks
    python scripts/bench_model.py --preset peer158m        # the 158M NemotronH config of the peer benchmark
    python scripts/bench_model.py --recipe nvfp4           # GEMMs under a precision recipe
    python scripts/bench_model.py --markdown BENCHMARKS.md # append the tables to BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from inkling_fp4.model.compiled import reference_glue
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import Block, HybridLM
from inkling_fp4.model.mamba2 import conv_silu_for
from inkling_fp4.model.norm import skip_gated_rms_norm
from inkling_fp4.model.packing import Packing
from inkling_fp4.model.ssd import load_triton_ssd, ssd

KINDS = {"M": "Mamba-2", "*": "attention", "-": "MLP"}
"""Hugging Face NemotronH 158M, the peer benchmark's config (126K tokens/s on the H200 at 8 x 2048)."""


def time_ms(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def packed_doc_ids(batch: int, seq: int, doc_len: int, device) -> torch.Tensor:
    """[batch, seq] int32 documents of random lengths around doc_len."""
    g = torch.Generator().manual_seed(0)
    docs = torch.zeros(batch, seq, dtype=torch.int32)
    for row in range(batch):
        t, d = 0, 0
        while t < seq:
            n = int(torch.randint(doc_len // 2, doc_len * 3 // 2 + 1, (1,), generator=g))
            docs[row, t : t + n] = d
            t, d = t + n, d + 1
    return docs.to(device)


def check_fast_paths(cfg: ModelConfig, device) -> list[str]:
    """Mamba-2 and MLP layers, fast vs reference paths, values and gradients. Returns failure messages."""
    failures = []
    for kind in "M-":
        torch.manual_seed(0)
        block = Block(kind, cfg, 0).to(device)
        x = torch.randn(2, 1024, cfg.d_model, device=device)
        packing = Packing.from_doc_ids(packed_doc_ids(2, 1024, 300, device))
        dy = torch.randn_like(x)
        results = {}
        for impl in ("fast", "reference"):
            if kind == "M":
                block.mixer.ssd_impl = "auto" if impl == "fast" else "reference"
                block.mixer.conv_impl = "auto" if impl == "fast" else "reference"
            block.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            with (
                torch.autocast("cuda", dtype=torch.bfloat16),
                reference_glue() if impl == "reference" else nullcontext(),
            ):
                y = block(xi, packing)
            y.backward(dy)
            results[impl] = [("output", y), ("dx", xi.grad)] + [
                (n, p.grad) for n, p in block.named_parameters()
            ]
        for (name, fast), (_, ref) in zip(results["fast"], results["reference"], strict=True):
            err = rel_err(fast, ref)
            ok = err < 2e-2
            print(f"  check {KINDS[kind]} {name:<24s} rel err {err:.2e} {'ok' if ok else 'MISMATCH'}")
            if not ok:
                failures.append(f"{KINDS[kind]} {name}: rel err {err:.2e}")
    return failures


def check_chunked_loss(device) -> list[str]:
    """HybridLM.loss (chunked head + CE) against the CE of full logits, value and gradients."""
    torch.manual_seed(0)
    cfg = ModelConfig(pattern="M*-", d_model=256, ffn_dim=1024, mamba_heads=8, mamba_head_dim=64, d_state=64)
    model = HybridLM(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (2, 1000), device=device)
    targets = torch.randint(0, cfg.vocab_size, (2, 1000), device=device)
    mask = torch.rand(2, 1000, device=device) > 0.1
    out = {}
    for impl in ("chunked", "full"):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if impl == "chunked":
                loss = model.loss(ids, targets, loss_mask=mask, chunk_tokens=512)
            else:
                ce = F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten(), reduction="none")
                loss = (ce * mask.flatten()).sum()
        loss.backward()
        out[impl] = [("loss", loss.detach())] + [(n, p.grad) for n, p in model.named_parameters()]
    worst_name, worst = max(
        ((n, rel_err(a, b)) for (n, a), (_, b) in zip(out["chunked"], out["full"], strict=True)),
        key=lambda t: t[1],
    )
    ok = worst < 2e-2
    print(f"  check chunked loss (worst: {worst_name}) rel err {worst:.2e} {'ok' if ok else 'MISMATCH'}")
    return [] if ok else [f"chunked loss {worst_name}: rel err {worst:.2e}"]


def check_generation(device) -> list[str]:
    torch.manual_seed(0)
    cfg = ModelConfig(
        pattern="M*-M-", d_model=256, ffn_dim=1024, mamba_heads=8, mamba_head_dim=64, d_state=64
    )
    model = HybridLM(cfg).to(device)
    ids = torch.randint(0, cfg.vocab_size, (3, 96), device=device)
    lengths = torch.tensor([40, 64, 17], device=device)
    rows = torch.arange(3, device=device)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        full = model(ids).float()
        cache = model.allocate_cache(3, 96)
        errs = [rel_err(model.prefill(ids[:, :64], lengths, cache), full[rows, lengths - 1])]
        for s in range(24):
            errs.append(rel_err(model.decode_step(ids[rows, lengths + s], cache), full[rows, lengths + s]))
    worst = max(errs)
    ok = worst < 3e-2
    print(f"  check generation (prefill + 24 decode steps) rel err {worst:.2e} {'ok' if ok else 'MISMATCH'}")
    return [] if ok else [f"generation: rel err {worst:.2e}"]


def fwd_bwd(fn, *inputs):
    """A closure running fn(*inputs) forward and backward (random output gradient), grads dropped."""
    out = fn(*inputs)
    dy = torch.randn_like(out[0] if isinstance(out, tuple) else out)

    def run():
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
        y = fn(*inputs)
        (y[0] if isinstance(y, tuple) else y).backward(dy)

    return run


def bench_blocks(cfg, args, device, packing) -> list[tuple[str, float, float, float]]:
    rows = []
    x = torch.randn(args.batch, args.seq, cfg.d_model, device=device, requires_grad=True)
    for kind in "M*-":
        block = Block(kind, cfg, 1).to(device)
        if args.policy is not None:
            args.policy.apply(block)
        run_block = torch.compile(block) if args.compile else block

        def fwd(run_block=run_block):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return run_block(x, packing)

        torch.cuda.reset_peak_memory_stats()
        t_f = time_ms(lambda fwd=fwd: fwd(), args.iters)
        t_fb = time_ms(fwd_bwd(fwd), args.iters)
        mem = torch.cuda.max_memory_allocated() / 2**30
        rows.append((f"{KINDS[kind]} block", t_f, t_fb, mem))
    return rows


def bench_mamba_parts(cfg, args, device, packing) -> list[tuple[str, float, float, float]]:
    B, L = args.batch, args.seq
    H, P, G, N = cfg.mamba_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.d_state
    mixer = Block("M", cfg, 1).to(device).mixer
    if args.policy is not None:
        args.policy.apply(mixer)
    bf = dict(device=device, dtype=torch.bfloat16)
    u = torch.randn(B, L, cfg.d_model, **bf, requires_grad=True)
    h = torch.randn(B, L, cfg.d_inner, **bf, requires_grad=True)
    xbc = torch.randn(B, L, mixer.conv_dim, **bf, requires_grad=True)
    x = torch.randn(B, L, H, P, **bf, requires_grad=True)
    dt = (torch.rand(B, L, H, device=device) * 0.1).requires_grad_()
    A = (-torch.rand(H, device=device) * 8 - 1).requires_grad_()
    Bm = torch.randn(B, L, G, N, **bf, requires_grad=True)
    Cm = torch.randn(B, L, G, N, **bf, requires_grad=True)
    seg = None if packing is None else packing.seg
    conv = conv_silu_for(mixer.conv_impl, xbc, mixer.conv_weight.shape[1])
    y = torch.randn(B, L, H, P, **bf, requires_grad=True)
    z = torch.randn(B, L, cfg.d_inner, **bf, requires_grad=True)

    def proj(u, h):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return mixer.in_proj(u).sum() + mixer.out_proj(h).sum()

    def scan(x, dt, A, Bm, Cm):
        return ssd(x, dt, A, Bm, Cm, cfg.chunk_size, doc_ids=seg, impl=cfg.ssd_impl)[0]

    def conv_fn(xbc):
        return conv(xbc, mixer.conv_weight, mixer.conv_bias, seg, [xbc.shape[-1]])[0]

    def gated_norm(y, x, z):
        return skip_gated_rms_norm(y, x, mixer.D, z, mixer.norm.weight, G, mixer.norm.eps)

    rows = []
    for name, fn, inputs in (
        ("Mamba-2: in_proj + out_proj", proj, (u, h)),
        ("Mamba-2: conv + SiLU", conv_fn, (xbc,)),
        ("Mamba-2: SSD scan", scan, (x, dt, A, Bm, Cm)),
        ("Mamba-2: D skip + gated norm", gated_norm, (y, x, z)),
    ):
        torch.cuda.reset_peak_memory_stats()
        t_f = time_ms(lambda fn=fn, inputs=inputs: fn(*inputs), args.iters)
        t_fb = time_ms(fwd_bwd(fn, *inputs), args.iters)
        rows.append((name, t_f, t_fb, torch.cuda.max_memory_allocated() / 2**30))
    return rows


def bench_model(cfg, args, device, doc_ids, chunked: bool):
    """Whole model forward + backward (no optimizer step), loss by ``HybridLM.loss`` (chunked head +
    CE) or by the cross-entropy of full FP32 logits."""
    model = HybridLM(cfg).to(device)
    if args.policy is not None:
        args.policy.apply(model)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    if args.compile:
        loss_fn = torch.compile(model.loss) if chunked else torch.compile(model)
    else:
        loss_fn = model.loss if chunked else model

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunked:
                loss = loss_fn(ids, ids, doc_ids)
            else:
                loss = F.cross_entropy(loss_fn(ids, doc_ids=doc_ids).flatten(0, 1).float(), ids.flatten())
        loss.backward()
        model.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    ms = time_ms(step, max(3, args.iters // 2))
    tokens_per_s = args.batch * args.seq / (ms / 1e3)
    mfu = model.flops_per_token(args.seq) * tokens_per_s / 989e12
    return ms, tokens_per_s, mfu, torch.cuda.max_memory_allocated() / 2**30, model.num_params()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="hybrid-350m", help="a model preset, or peer158m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--packed", action="store_true", help="packed documents (doc_ids), ~--doc-len each")
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--compile", action="store_true", help="torch.compile each block / the model")
    parser.add_argument(
        "--recipe", default="bf16", help="precision recipe of the GEMMs (bf16, fp8, nvfp4, ...)"
    )
    parser.add_argument("--skip-model", action="store_true", help="skip the whole-model step")
    parser.add_argument("--markdown", default=None, help="append the results as Markdown to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_model.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    cfg = ModelConfig(preset=args.preset)
    args.policy = None
    if args.recipe != "bf16":
        from inkling_fp4.precision.config import PrecisionConfig
        from inkling_fp4.precision.policy import PrecisionPolicy

        pcfg = PrecisionConfig(recipe=args.recipe, bf16_first_layers=0, bf16_last_layers=0)
        args.policy = PrecisionPolicy(pcfg, cfg.n_layers)

    name = torch.cuda.get_device_name(device)
    kernel = "triton" if load_triton_ssd() else "reference only"
    print(f"{name}, torch {torch.__version__}, SSD kernel: {kernel}")
    print("checks:")
    failures = check_fast_paths(cfg, device) + check_chunked_loss(device) + check_generation(device)

    doc_ids = packed_doc_ids(args.batch, args.seq, args.doc_len, device) if args.packed else None
    packing = Packing.from_doc_ids(doc_ids)
    rows = bench_blocks(cfg, args, device, packing) + bench_mamba_parts(cfg, args, device, packing)
    mamba_fb = rows[0][2]
    scan_fb = next(r for r in rows if "SSD" in r[0])[2]
    setup = (
        f"{args.preset}, batch {args.batch} x {args.seq} tokens, recipe {args.recipe}, "
        f"{'packed ~' + str(args.doc_len) + '-token documents' if args.packed else 'one document per row'}, "
        f"{'torch.compile' if args.compile else 'eager'}"
    )
    lines = [
        f"### bench_model.py: {setup}",
        "",
        f"{name}, torch {torch.__version__}, {datetime.date.today()}",
        "",
        "| piece | forward ms | forward + backward ms | peak GiB |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {n} | {f:.3f} | {fb:.3f} | {m:.1f} |" for n, f, fb, m in rows]
    lines += [
        "",
        f"SSD scan share of the Mamba-2 layer (forward + backward): {100 * scan_fb / mamba_fb:.0f}%",
    ]
    if not args.skip_model:
        for chunked in (True, False):
            ms, tps, mfu, mem, n_params = bench_model(cfg, args, device, doc_ids, chunked)
            loss = "chunked head + CE (HybridLM.loss)" if chunked else "CE of full FP32 logits"
            lines += [
                f"Whole model ({n_params / 1e6:.0f}M parameters) forward + backward, {loss}: {ms:.1f} ms, "
                f"{tps:,.0f} tokens/s, MFU {100 * mfu:.1f}% of 989 TFLOP/s, peak {mem:.1f} GiB",
            ]
            torch.cuda.empty_cache()
    print("\n".join(lines))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + "\n".join(lines) + "\n")
    if failures:
        print("MISMATCH: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
