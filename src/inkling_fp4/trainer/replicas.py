"""Whether every data-parallel rank holds the same weights, checked before each checkpoint.

Under DDP each rank applies the same all-reduced gradient to its own copy, so the copies stay equal
bit for bit only while nothing in the update depends on the rank. A rank that drifts (a rank-local
branch, a non-deterministic kernel in the optimizer) trains a model nobody saved, and the checkpoint
(rank 0's) hides it. As Megatron-LM's weight-hash check, each rank reduces every parameter to two
integer checksums of its bits; a MAX and a MIN all-reduce tell whether all ranks agree. Sharded
(FSDP) parameters are not replicas and are not checked.
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4 import distributed as D
from inkling_fp4.errors import UserError

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDivergence(UserError):
    """The ranks' weights differ: the run stops before writing a checkpoint of one rank's copy."""

    exit_code = 1  # nothing is wrong with the command: resume from the last checkpoint


def checksums(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """(parameter names, [n, 2] int64: each parameter's sum and sum of squares of its bits as integers,
    wrapping). Any one changed bit changes the sum."""
    names, rows = [], []
    for name, p in model.named_parameters():
        bits = p.detach().contiguous().view(-1).view(_INT_OF_SIZE[p.element_size()]).to(torch.int64)
        names.append(name)
        rows.append(torch.stack([bits.sum(), (bits * bits).sum()]))
    return names, torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.int64)


def check_replicas(model: nn.Module, dist: D.DistInfo, step: int) -> None:
    """Raise :class:`ReplicaDivergence` naming the first parameter whose bits differ between ranks."""
    if not dist.active:
        return
    names, sums = checksums(model)
    high, low = sums.clone(), sums.clone()
    D.all_reduce_max(high, dist)
    D.all_reduce_min(low, dist)
    differ = (high != low).any(1).nonzero().flatten().tolist()
    if differ:
        raise ReplicaDivergence(
            f"step {step}: the {dist.world_size} ranks hold different weights ({len(differ)} of "
            f"{len(names)} parameters, first {names[differ[0]]}); nothing was saved at this step: "
            "resume from the last checkpoint (--resume), and report it, the update depends on the rank"
        )
