"""Several processes, one run: torchrun environment, process group, DDP, rank-0 duties.

``torchrun --nproc_per_node N -m inkling_fp4 pretrain ...`` starts N copies of the same command;
torchrun sets RANK / WORLD_SIZE / LOCAL_RANK and this module turns them into a process group (NCCL
on GPUs, gloo on CPU), a device per process and a DistributedDataParallel model, which averages
gradients across ranks during backward. Each rank reads its own shard of the data; rank 0 alone
logs and writes checkpoints (DDP keeps every replica identical, so its copy is the model), after
gathering the per-rank pieces of state (data positions, RNG states) that differ between ranks.
A single process (no torchrun) needs none of this and gets plain no-ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from inkling_fp4.errors import UserError


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False
    """This call started the process group, so its ``shutdown`` ends it. A caller that starts the
    group first (several runs in one process) keeps it across runs: NOTE a process group destroyed
    and started again under torchrun can meet the previous one's stale rendezvous keys and fail."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world_size > 1


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """auto | cpu | cuda | cuda:N; auto and cuda pick cuda:LOCAL_RANK (0 without torchrun)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"train.device={name} but CUDA is not available here; use train.device=cpu")
    if name == "cuda":
        return torch.device("cuda", local_rank)
    try:
        return torch.device(name)
    except RuntimeError:
        raise UserError(f"train.device='{name}' is not a device; use auto, cpu, cuda or cuda:N") from None


def init_distributed(device_name: str) -> DistInfo:
    """Read torchrun's environment; start the process group when WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(device_name, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    starts = world > 1 and not dist.is_initialized()
    if starts:
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world, local, device, owns_group=starts)


def wrap_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """DDP across ranks (gradients averaged in backward); the model itself on one process."""
    if not info.active:
        return model
    ids = [info.device.index] if info.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def all_reduce_sum(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.active:
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x


def all_reduce_max(x: torch.Tensor, info: DistInfo) -> None:
    """In place: every rank's ``x`` becomes the elementwise max over the ranks."""
    if info.active:
        dist.all_reduce(x, op=dist.ReduceOp.MAX)


def all_reduce_min(x: torch.Tensor, info: DistInfo) -> None:
    """In place: every rank's ``x`` becomes the elementwise min over the ranks."""
    if info.active:
        dist.all_reduce(x, op=dist.ReduceOp.MIN)


def all_gather_rows(x: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """Every rank's ``x`` (the same shape on each), concatenated along dim 0 in rank order."""
    if not info.active:
        return x
    parts = [torch.empty_like(x) for _ in range(info.world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True on every rank when ``flag`` is True on at least one (e.g. an interrupt seen by one rank)."""
    if not info.active:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not info.active:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(info: DistInfo) -> None:
    if info.active:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """End the process group if ``info``'s call started it (see ``DistInfo.owns_group``)."""
    if info.owns_group and dist.is_initialized():
        dist.destroy_process_group()
