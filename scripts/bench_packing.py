"""Step time of packed SFT rows against pretraining windows, same model, shapes and precision.

    python scripts/bench_packing.py [--preset hybrid-125m] [--batch 32] [--seq 2048] [--recipe nvfp4]

One process, one model, one trainer: blocks of ``--block`` optimizer steps on pretraining windows of
the built-in corpus and on packed rows of the built-in SFT tasks, alternated ``--rounds`` times, each
step timed between device synchronisations. So the two kinds of batch meet the same GPU clocks, host
and allocator state, and what differs is only the data: documents per row (a few in a pretraining
window, dozens in a packed row), the loss mask, the padding. SFT's tokens/s counts real tokens
(padding excluded), pretraining's every token. Prints the median step time and tokens/s of each.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inkling_fp4 import distributed as D  # noqa: E402
from inkling_fp4.config import load_config  # noqa: E402
from inkling_fp4.data.pipeline import build_pretrain_data  # noqa: E402
from inkling_fp4.data.sft_data import build_sft_data  # noqa: E402
from inkling_fp4.model.hybrid import HybridLM  # noqa: E402
from inkling_fp4.train.pretrain import PretrainTask  # noqa: E402
from inkling_fp4.train.sft import SFTTask  # noqa: E402
from inkling_fp4.trainer.determinism import seed_everything  # noqa: E402
from inkling_fp4.trainer.trainer import Trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="hybrid-125m")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--recipe", default="nvfp4")
    p.add_argument("--block", type=int, default=8, help="steps per block")
    p.add_argument("--rounds", type=int, default=4, help="blocks of each kind")
    p.add_argument("--examples", type=int, default=40_000)
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_packing"))
    a = p.parse_args()
    cfg = load_config("hybrid-125m", [
        f"model.preset={a.preset}", f"model.vocab_size={a.vocab}", f"data.vocab_size={a.vocab}",
        "data.builtin_site_packages=false", f"data.seq_len={a.seq}", f"train.batch_size={a.batch}",
        f"train.micro_batch_size={a.batch}", f"precision.recipe={a.recipe}", "precision.switch_to_bf16=never",
        "train.warmup_steps=1", "train.steps=100000", "log.progress=false", "monitor.enabled=false",
        f"sft.builtin_examples={a.examples}",
    ])  # fmt: skip
    seed_everything(0)
    dist = D.init_distributed(cfg.train.device)
    pre = build_pretrain_data(cfg.data, None, 0, total_tokens=10**9)
    sft = build_sft_data(cfg.data, cfg.sft, pre.tokenizer, 0)
    tasks = {"pretrain": PretrainTask(pre, []), "sft": SFTTask(sft, None, pre.tokenizer.pad)}
    with torch.device(dist.device):
        model = HybridLM(cfg.model)
    a.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, a.out, dist, model)
    trainer.build()
    trainer.open_log([], [f"pretrain: {pre.describe()}", f"sft: {sft.describe()}"])
    trainer.graph_on(0, first=True)
    sync = torch.cuda.synchronize if dist.device.type == "cuda" else (lambda: None)
    times: dict[str, list[tuple[float, int]]] = {k: [] for k in tasks}
    for r in range(a.rounds + 1):  # round 0 warms up (compilation, autotuning) and is not counted
        for name, task in tasks.items():
            for _ in range(a.block):
                batches = task.next_batches(trainer.micro, trainer.accum)
                sync()
                t0 = time.perf_counter()
                result = trainer.step(batches, None, task.real_tokens(batches))
                sync()
                if r:
                    times[name].append((time.perf_counter() - t0, result.real_tokens))
    trainer.close()
    print(
        f"\n{a.preset} (vocab {a.vocab}), {a.recipe}, {a.batch} x {a.seq}, {a.rounds} x {a.block} steps each"
    )
    print("| batches | median step ms | median tokens/s | docs per row |")
    print("|---|---:|---:|---:|")
    rates = {}
    for name, task in tasks.items():
        ms = statistics.median(t for t, _ in times[name]) * 1e3
        rates[name] = statistics.median(n / t for t, n in times[name])
        b = task.next_batches(1, 1)[0]
        docs = float((b.doc_ids[:, 1:] != b.doc_ids[:, :-1]).sum(1).float().mean() + 1)
        print(f"| {name} | {ms:.1f} | {rates[name]:,.0f} | {docs:.1f} |")
    print(f"\nsft / pretrain tokens/s: {rates['sft'] / rates['pretrain']:.3f}")


if __name__ == "__main__":
    main()
