"""SFT on one GPU end to end: pretrain hybrid-125m, fine-tune it under the FP8 baseline and NVFP4
(``compare-baseline --stage sft``), and compare SFT's throughput with pretraining's at the same shapes.

    python scripts/bench_sft.py --out runs/sft-bench [--pretrain-steps 200] [--sft-steps 150]

Throughput is each run's median ``tokens_per_s`` over the steps it trained in its own precision
(before the BF16 switch), skipping the first ``--skip`` logged steps (compilation, autotuning).
SFT's tokens are its real tokens (padding excluded), pretraining's every token: equal numbers mean
packing keeps the GPU as busy as pretraining does. Prints a table; docs/SFT.md records the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHARED = ["data.builtin_site_packages=false", "log.progress=false"]


def fp4train(*args: str) -> None:
    cmd = [sys.executable, "-m", "inkling_fp4", *args]
    print("$ fp4train " + " ".join(args), flush=True)
    t0 = time.time()
    subprocess.run(cmd, check=True)
    print(f"  ({time.time() - t0:.0f} s)", flush=True)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def throughput(run_dir: Path, recipe: str, skip: int) -> tuple[float, int]:
    steps = [r for r in rows(run_dir) if "tokens_per_s" in r and r.get("precision") == recipe]
    values = [r["tokens_per_s"] for r in steps[skip:]]
    return statistics.median(values), len(values)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/sft-bench"))
    p.add_argument("--pretrain-steps", type=int, default=200)
    p.add_argument("--sft-steps", type=int, default=150)
    p.add_argument("--examples", type=int, default=100_000, help="sft.builtin_examples")
    p.add_argument("--skip", type=int, default=3, help="logged rows skipped before the median")
    a = p.parse_args()
    pre, cmp = a.out / "pretrain", a.out / "sft-compare"
    n = a.pretrain_steps
    if not (pre / "checkpoints" / f"step_{n}" / "state.json").is_file():
        fp4train(
            "pretrain", "--recipe", "hybrid-125m", "--run-dir", str(pre), *SHARED, f"train.steps={n}",
            "train.warmup_steps=20", "data.vocab_size=8192", "model.vocab_size=8192",
            f"train.checkpoint_every={n}", f"eval.every={n // 4}", "eval.batches=4",
        )  # fmt: skip
    m = a.sft_steps
    fp4train(
        "compare-baseline", "--stage", "sft", "--recipe", "sft-hybrid-125m", "--from", str(pre),
        "--run-dir", str(cmp), "log.progress=false", f"train.steps={m}", f"train.checkpoint_every={m}",
        f"sft.builtin_examples={a.examples}", f"eval.every={max(m // 6, 1)}", "train.warmup_steps=15",
    )  # fmt: skip
    pre_tok, pre_n = throughput(pre, "nvfp4", a.skip)
    sft_tok, sft_n = throughput(cmp / "nvfp4", "nvfp4", a.skip)
    fp8_tok, fp8_n = throughput(cmp / "fp8", "fp8", a.skip)
    print("\n| run | median tokens/s | logged steps |")
    print("|---|---:|---:|")
    print(f"| pretrain nvfp4 | {pre_tok:,.0f} | {pre_n} |")
    print(f"| sft nvfp4 (real tokens) | {sft_tok:,.0f} | {sft_n} |")
    print(f"| sft fp8 (real tokens) | {fp8_tok:,.0f} | {fp8_n} |")
    print(f"\nsft / pretrain (nvfp4): {sft_tok / pre_tok:.3f}")
    print((cmp / "report" / "report.md").read_text())


if __name__ == "__main__":
    main()
