"""Is a GPU training run bit-reproducible in deterministic mode (``train.deterministic=true``)?

Trains a hybrid preset (default hybrid-125m: Mamba-2, attention and MLP layers) for --steps steps with
the recipe's precision (hybrid-125m: NVFP4, first/last layers in BF16), built as the training loop
builds it (model on the device, PrecisionPolicy applied with the loop's stochastic-rounding seed,
AdamW, BF16 autocast, summed FP32 cross-entropy over the batch's tokens, gradient clipping), twice
from the same seed and batches with the mode on, and asserts that the per-step losses, the gradient
norms and the final weights are bitwise equal. Then, for information, the same twice with the mode
off, to show whether the mode is needed.

The batches are random tokens, alternately packed (several documents per row: the memory-efficient
attention kernel with a block-diagonal mask, the SSD kernels' document masks) and unpacked (flash
attention, ``is_causal``), so both attention backward kernels and both SSD kernel variants run.

Each trial runs in its own subprocess, the way two ``fp4train pretrain`` runs do: fresh autotune
caches, so the SSD kernels are tuned again by timing (unless the mode fixes their configs); fresh
cuBLAS handles, which read CUBLAS_WORKSPACE_CONFIG when they are made; a fresh caching allocator.
Repeating a trial inside one process would reuse the first trial's tuned configs and hide the
run-to-run differences this script looks for. Triton's on-disk autotune cache is switched off in the
children for the same reason.

Prints a table (step, loss of trial 1, loss of trial 2, equal?) per mode, whether the final weights
match, and the wall time per step with the mode on and off (steps after the first two, which compile
and tune). Exit status 1 when deterministic mode is not bitwise reproducible (or a trial fails, e.g.
a torch op without a deterministic kernel), 2 without CUDA.

Examples:
    python scripts/check_determinism.py
    python scripts/check_determinism.py --preset hybrid-350m --steps 12 --seq 4096 --batch 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TIMING_SKIP = 2
"""Untimed first steps: compilation of the fused glue and autotuning of the SSD kernels."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="hybrid-125m", help="a recipe in recipes/ (model and precision)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per trial")
    p.add_argument("--seq", type=int, default=2048, help="sequence length")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (one micro batch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trial-out", type=Path, default=None, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# one trial (child process)


def batch_for_step(step: int, args, vocab: int):
    """The step's (input_ids, targets, doc_ids or None): the same in every trial; odd steps packed."""
    g = torch.Generator().manual_seed(args.seed * 100_003 + step)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)  # [B, L + 1]
    doc_ids = None
    if step % 2 == 1:  # about 4 documents per row, boundaries anywhere
        starts = torch.rand(args.batch, args.seq, generator=g) < 4 / args.seq  # [B, L]
        doc_ids = starts.long().cumsum(-1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), doc_ids


def run_trial(args) -> None:
    """Train and save {losses, grad_norms, step_s, weights, precision} to args.trial_out."""
    if args.deterministic:  # first: before any GEMM on the GPU
        from inkling_fp4.trainer.determinism import enable_determinism

        enable_determinism()
    from inkling_fp4.config import load_config
    from inkling_fp4.model.hybrid import HybridLM
    from inkling_fp4.precision import finite_guard
    from inkling_fp4.precision.policy import PrecisionPolicy
    from inkling_fp4.trainer.optimizer import build_optimizer, set_lr

    cfg = load_config(args.preset, [f"train.seed={args.seed}"])
    device = torch.device("cuda")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = HybridLM(cfg.model)
    policy = PrecisionPolicy(cfg.precision, cfg.model.n_layers)
    policy.set_generator_seed(args.seed * 1009)  # as the loop seeds rank 0's stochastic rounding
    policy.apply(model)
    optimizer = build_optimizer(model, cfg.optim)
    losses, grad_norms, step_s = [], [], []
    for step in range(1, args.steps + 1):
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        set_lr(optimizer, cfg.optim.lr * step / args.steps)  # a warmup: every step moves the weights
        batch = batch_for_step(step, args, cfg.model.vocab_size)
        ids, targets, doc_ids = (t if t is None else t.to(device) for t in batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_sum = model(ids, doc_ids=doc_ids, targets=targets)  # summed FP32 cross-entropy
        (loss_sum / targets.numel()).backward()
        finite_guard.raise_if_non_finite()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append((loss_sum / targets.numel()).item())
        grad_norms.append(grad_norm.item())
        torch.cuda.synchronize(device)
        step_s.append(time.perf_counter() - t0)
    weights = {name: p.detach().cpu() for name, p in model.named_parameters()}
    result = {"losses": losses, "grad_norms": grad_norms, "step_s": step_s, "weights": weights}
    torch.save(result | {"precision": policy.describe(model)}, args.trial_out)


# ----------------------------------------------------------------------------------------------
# the comparison (parent process)


def trial(args, deterministic: bool, index: int, workdir: Path) -> dict | str:
    """Run one trial in a subprocess; its results, or the tail of its output when it failed."""
    out = workdir / f"{'on' if deterministic else 'off'}_{index}.pt"
    cmd = [sys.executable, __file__, "--trial-out", str(out), "--preset", args.preset]
    cmd += ["--steps", str(args.steps), "--seq", str(args.seq), "--batch", str(args.batch)]
    cmd += ["--seed", str(args.seed)] + (["--deterministic"] if deterministic else [])
    env = dict(os.environ, TRITON_CACHE_AUTOTUNING="0")
    if not deterministic:
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)  # the mode off as a plain run has it
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        return (proc.stdout + proc.stderr)[-4000:]
    return torch.load(out, weights_only=True)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (torch.equal alone takes -0.0 for 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def compare(a: dict, b: dict) -> dict:
    names = list(a["weights"])
    differing = [n for n in names if not same_bits(a["weights"][n], b["weights"][n])]
    max_diff = max(
        ((a["weights"][n].float() - b["weights"][n].float()).abs().max().item() for n in differing),
        default=0.0,
    )
    return {
        "losses_equal": a["losses"] == b["losses"],
        "grad_norms_equal": a["grad_norms"] == b["grad_norms"],
        "weights_equal": not differing,
        "tensors": len(names),
        "differing": len(differing),
        "max_weight_diff": max_diff,
    }


def step_ms(*trials: dict) -> float:
    times = [s for t in trials for s in (t["step_s"][TIMING_SKIP:] or t["step_s"])]
    return 1e3 * sum(times) / len(times)


def print_table(label: str, a: dict, b: dict, verdict: dict) -> None:
    print(f"\n{label}")
    head = f"{'step':>5} {'loss trial 1':>16} {'loss trial 2':>16}  equal?"
    print(f"{head}  {'grad norm 1':>13} {'grad norm 2':>13}")
    rows = zip(a["losses"], b["losses"], a["grad_norms"], b["grad_norms"], strict=True)
    for i, (x, y, g1, g2) in enumerate(rows):
        same = "yes" if x == y and g1 == g2 else "NO"
        print(f"{i + 1:>5} {x:>16.10f} {y:>16.10f}  {same:>6}  {g1:>13.7g} {g2:>13.7g}")
    w = "bitwise equal" if verdict["weights_equal"] else "DIFFER"
    print(
        f"final weights: {w} ({verdict['tensors'] - verdict['differing']}/{verdict['tensors']} tensors "
        f"identical, max |diff| {verdict['max_weight_diff']:.3g})"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.trial_out is not None:
        run_trial(args)
        return 0
    if not torch.cuda.is_available():
        print("check_determinism.py needs a CUDA GPU", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="check_determinism_"))
    results = {}
    for deterministic in (True, False):
        for index in (1, 2):
            t0 = time.perf_counter()
            results[deterministic, index] = trial(args, deterministic, index, workdir)
            state = "ok" if isinstance(results[deterministic, index], dict) else "FAILED"
            mode = "on" if deterministic else "off"
            print(
                f"trial {index}, deterministic {mode}: {state} ({time.perf_counter() - t0:.0f} s)", flush=True
            )
    failed = {k: v for k, v in results.items() if isinstance(v, str)}
    for (deterministic, index), text in failed.items():
        print(f"\ntrial {index} with deterministic mode {'on' if deterministic else 'off'} failed:\n{text}")
    if (True, 1) in failed or (True, 2) in failed:
        print("\nFAIL deterministic mode did not run")
        return 1

    on_a, on_b = results[True, 1], results[True, 2]
    gpu = torch.cuda.get_device_name(0)
    print(
        f"\n{args.preset} on {gpu}: {args.steps} steps of {args.batch} x {args.seq} tokens, "
        f"seed {args.seed}, torch {torch.__version__}\nprecision: {on_a['precision']}"
    )
    on = compare(on_a, on_b)
    print_table("deterministic mode ON (train.deterministic=true)", on_a, on_b, on)
    off = None
    if not failed:
        off_a, off_b = results[False, 1], results[False, 2]
        off = compare(off_a, off_b)
        print_table("deterministic mode OFF (for information)", off_a, off_b, off)

    print("\nwall time per step (after the first two):")
    print(f"  on  {step_ms(on_a, on_b):8.1f} ms")
    if off is not None:
        ratio = step_ms(on_a, on_b) / step_ms(results[False, 1], results[False, 2])
        print(f"  off {step_ms(results[False, 1], results[False, 2]):8.1f} ms   (on / off = {ratio:.2f}x)")
        differs = not (off["losses_equal"] and off["grad_norms_equal"] and off["weights_equal"])
        print(f"mode off: two runs {'differ' if differs else 'were identical this time'}")
    ok = on["losses_equal"] and on["grad_norms_equal"] and on["weights_equal"]
    print("PASS deterministic mode is bitwise reproducible" if ok else "FAIL deterministic mode differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
