"""One rank of ``fp4train rollout`` under torchrun that records what it did, for
tests/test_rollout_distributed.py:

    torchrun --nproc_per_node 2 tests/rollout_ranks.py OUT rollout --from RUN ...

runs the command in each process and writes ``OUT/rank<r>.pt``: per RL step the prompts of this
rank's share, the first draws of its sampling generator, its own rewards and the advantages of its
rows, the completion tokens' sampler and trainer log p and entropies; per sampling (every RL step and the
final evaluation) a hash of the weights it sampled with, master and held quantized values; the
micro batches of its first optimizer step; the hash of its final weights.
"""

import hashlib
import os
import sys
from pathlib import Path

import torch

from inkling_fp4 import cli
from inkling_fp4.precision.quant_linear import QuantLinear
from inkling_fp4.rl import ranks
from inkling_fp4.train import rollout


def weights_hash(model) -> str:
    """sha256 of every parameter's bytes and every held fprop weight's block values, by name."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for m in model.modules():
        held = m.frozen_weight() if isinstance(m, QuantLinear) else None
        if held is not None and held.values is not None:
            h.update(held.values.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def record_into(record: dict) -> None:
    """Wrap the RolloutTask methods (and the gather of a step's completions) whose inputs and outputs
    the test reads."""
    task_cls = rollout.RolloutTask
    names = ("_step_prompts", "_sampling_seed", "_sampler_now", "_queue_mini_batches", "next_batches")
    real = {name: getattr(task_cls, name) for name in names}
    gather, drift, token_mean = ranks.all_completions, ranks.mismatch_figures, ranks.token_mean

    def _step_prompts(self):
        problems = real["_step_prompts"](self)
        record["prompts"].append([p.text for p in problems])
        return problems

    def _sampling_seed(self):
        seed = real["_sampling_seed"](self)
        generator = torch.Generator(device=self.trainer.model.embed.weight.device).manual_seed(seed)
        record["draws"].append(torch.rand(4, generator=generator, device=generator.device).tolist())
        return seed

    def _sampler_now(self):
        sampler = real["_sampler_now"](self)
        record["task"] = self
        record["sampled_with"].append(weights_hash(self.trainer.model))
        return sampler

    def all_completions(rewards, *args):
        record["rewards"].append(list(rewards))
        return gather(rewards, *args)

    def _queue_mini_batches(self, rows, correction):
        record["advantages"].append(rows.advantages.clone())
        return real["_queue_mini_batches"](self, rows, correction)

    def next_batches(self, micro, accum):
        batches = real["next_batches"](self, micro, accum)
        if not record["first_step"]:
            record["first_step"] = [b.state() for b in batches]
        return batches

    for fn in (_step_prompts, _sampling_seed, _sampler_now, _queue_mini_batches, next_batches):
        setattr(task_cls, fn.__name__, fn)

    def mismatch_figures(t_logp, s_logp, mask, cap, dist):
        record["mismatch"].append((t_logp[mask].clone(), s_logp[mask].clone()))  # this rank's tokens
        return drift(t_logp, s_logp, mask, cap, dist)

    def entropy_mean(x, mask, dist):
        record["entropy"].append(x[mask.bool()].clone())
        return token_mean(x, mask, dist)

    ranks.all_completions = all_completions
    ranks.mismatch_figures = mismatch_figures
    ranks.token_mean = entropy_mean


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    keys = ("prompts", "draws", "sampled_with", "rewards", "advantages", "first_step", "mismatch", "entropy")
    record = {key: [] for key in keys}
    record_into(record)
    sys.argv = ["fp4train", *argv]
    try:
        cli.main()
    except SystemExit as e:
        if e.code:
            raise
    task = record.pop("task")
    record["final"] = weights_hash(task.trainer.model)
    torch.save(record, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
