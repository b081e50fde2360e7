"""Fully sharded data parallel (FSDP2, ``fully_shard``): for models whose replicas do not fit one GPU.

DDP keeps FP32 weights, gradients and both Adam moments on every GPU: 16 bytes per parameter, more
than an H200 holds for the 12B model. FSDP2 shards them and all-gathers one block's weights just
before it runs, so each GPU holds 16 / N bytes per parameter plus one block at a time.

Every block is one FSDP unit, the root another. Weights are gathered in FP32, so QuantLinear quantizes
the same master weights as under DDP. Checkpoints stay in the replicated format (full tensors by
name), so a run may resume with DDP, FSDP or another number of GPUs.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from inkling_fp4.distributed import DistInfo

# torch.distributed's FSDP, DTensor and checkpoint packages take about 1.5 s to import, paid by every
# run that never shards; so they are imported where a sharded run needs them.


def _dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor; none exists unless torch.distributed.tensor was imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def shard_model(model: nn.Module, info: DistInfo) -> nn.Module:
    """Shard ``model`` in place across all ranks: one FSDP unit per block of ``model.layers``, then
    the root. Call before the optimizer is built (it must see the sharded parameters)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_sharded(model: nn.Module) -> bool:
    module = sys.modules.get("torch.distributed.tensor")  # never imported: nothing is a DTensor
    return module is not None and any(isinstance(p, module.DTensor) for p in model.parameters())


def local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (e.g. the grad norm clip_grad_norm_ returns); other tensors as they are."""
    return t.full_tensor() if _dtensor(t) else t


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model tensors, optimizer tensors) gathered to full tensors on the CPU of rank 0 (empty elsewhere),
    named as :func:`~inkling_fp4.runs.checkpoint.model_tensors` and
    :func:`~inkling_fp4.trainer.optimizer.optimizer_tensors` name them. A collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    params = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, optimizer, options=full)
    opt = {
        f"{name}.{key}": (value if torch.is_tensor(value) else torch.tensor(value)).contiguous()
        for name, state in osd.get("state", {}).items()
        for key, value in state.items()
    }
    return params, opt


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, params: dict, opt: dict) -> None:
    """Inverse of :func:`full_state`: every rank passes the full tensors and keeps its own shard.
    NOTE each tensor is scattered by a collective, so every rank walks them in one order (by name)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    params = dict(sorted(params.items()))
    set_model_state_dict(model, params, options=StateDictOptions(full_state_dict=True, strict=True))
    names = {id(p): name for name, p in model.named_parameters()}
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": [names[id(p)] for p in g["params"]]}
        for g in optimizer.param_groups
    ]
    state: dict[str, dict[str, torch.Tensor]] = {}
    for full, t in sorted(opt.items()):
        name, key = full.rsplit(".", 1)
        state.setdefault(name, {})[key] = t
    full = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=full)
