"""Rollout / trainer mismatch: the sampler's log-probabilities against the trainer's forward on the
same sampled sequences, per precision and decode batch.

    python scripts/bench_mismatch.py --from runs/sft-tiny [--batches 1,64] [--problems 64]

For each precision (bf16, nvfp4 with one FP32 activation scale per tensor, nvfp4 with one per row)
the run's model samples completions of the arithmetic task's held-out prompts, decoding
``--batches`` sequences together, and the trainer's forward (all rows in one batch, as a rollout's
training step sees them) recomputes the log-probability of every sampled token. The figures are
rl/mismatch.py's: k3 KL, mean and max |d log p|, the importance ratio's range.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from inkling_fp4.config.sampler import SamplerConfig  # noqa: E402
from inkling_fp4.data.chat import encode_prompt  # noqa: E402
from inkling_fp4.infer.sampler import Sampler  # noqa: E402
from inkling_fp4.interop.load_run import load_run  # noqa: E402
from inkling_fp4.precision.autocast import autocast_for  # noqa: E402
from inkling_fp4.precision.policy import PrecisionPolicy  # noqa: E402
from inkling_fp4.rl.mismatch import mismatch_stats  # noqa: E402
from inkling_fp4.rl.rollout_batch import build_rows, token_logprobs  # noqa: E402
from inkling_fp4.rl.tasks import arithmetic  # noqa: E402

VARIANTS = {"bf16": ("bf16", "tensor"), "nvfp4-tensor": ("nvfp4", "tensor"), "nvfp4-row": ("nvfp4", "row")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="run", type=Path, required=True)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    cfg, model, tok = load_run(a.run, a.device)
    problems = arithmetic.problems("eval", a.problems, 0)
    prompts = [encode_prompt(tok, [{"role": "user", "content": q.prompt}]) for q in problems]
    print(f"{a.run} ({cfg.stage}, {model.num_params() / 1e6:.2f}M parameters), {len(prompts)} arithmetic "
          f"prompts, {a.new_tokens} new tokens, temperature 1, device {a.device}")  # fmt: skip
    head = ("precision", "decode batch", "tokens", "k3 KL", "mean abs d logp", "max abs d logp", "ratio min",
            "ratio max")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (recipe, scale) in VARIANTS.items():
        pcfg = dataclasses.replace(
            cfg.precision, recipe=recipe, activation_scale=scale, switch_to_bf16="never"
        )
        policy = PrecisionPolicy(pcfg, cfg.model.n_layers)
        policy.apply(model)
        for batch in (int(x) for x in a.batches.split(",")):
            scfg = SamplerConfig(temperature=1.0, max_new_tokens=a.new_tokens, batch_size=batch, seed=0)
            completions = Sampler(model, tok, scfg, policy, context=cfg.data.seq_len).generate(prompts)
            ids, targets, mask, s_logp = build_rows(
                prompts, [c.tokens for c in completions], [c.logprobs for c in completions], tok.pad
            )
            with torch.no_grad(), autocast_for(torch.device(a.device)):
                t_logp = token_logprobs(model(ids.to(a.device)), targets.to(a.device))[0].cpu()
            s = mismatch_stats(t_logp, s_logp, mask, cap=2.0)
            print(f"| {name} | {batch} | {int(mask.sum())} | {s['k3']:.2e} | {s['abs_mean']:.2e} | "
                  f"{s['abs_max']:.2e} | {s['ratio_min']:.4f} | {s['ratio_max']:.4f} |")  # fmt: skip


if __name__ == "__main__":
    main()
