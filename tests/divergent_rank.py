"""``fp4train`` under torchrun with rank 1's first weight nudged after its first optimizer step, for
tests/test_replicas.py:

    torchrun --nproc_per_node 2 tests/divergent_rank.py pretrain --run-dir RUN ...
"""

import os
import sys

import torch

from inkling_fp4 import cli
from inkling_fp4.trainer.trainer import Trainer

_step = Trainer.step


def _nudged_step(self, *args, **kwargs):
    out = _step(self, *args, **kwargs)
    if os.environ["RANK"] == "1" and self.step_count == 1:
        with torch.no_grad():
            next(self.model.parameters()).view(-1)[0] += 1e-3
    return out


if __name__ == "__main__":
    Trainer.step = _nudged_step
    sys.argv = ["fp4train", *sys.argv[1:]]
    cli.main()
