"""AdamW with weight decay on matrices only, and its state as named tensors for checkpoints.

The paper trains with Adam (beta 0.9 / 0.95) and weight decay 0.1. Everything the optimizer touches
is FP32 whatever the GEMM precision: that is what lets 4-bit forward passes train at all.

Decay follows Megatron's rule (as the Nemotron-H runs): every parameter of two or more dimensions
decays, embedding and LM head included; 1-D parameters and those marked ``_no_weight_decay = True``
(the Mamba convention for A_log and D) do not.
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4.config.trainer import OptimConfig


def decays(param: nn.Parameter) -> bool:
    return param.ndim >= 2 and not getattr(param, "_no_weight_decay", False)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters in two groups (decay / no decay)."""
    params = [p for p in model.parameters() if p.requires_grad]
    bad = [p.dtype for p in params if p.dtype != torch.float32]
    if bad:
        raise TypeError(f"master weights must be FP32, found {sorted(set(map(str, bad)))}")
    groups = [
        {"params": [p for p in params if decays(p)], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if not decays(p)], "weight_decay": 0.0},
    ]
    # the fused CUDA kernel for plain tensors; torch's default (foreach) for CPU and sharded DTensors
    fused = bool(params) and params[0].is_cuda and type(params[0].data) is torch.Tensor
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True if fused else None
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """Per-parameter state as ``{"<param name>.<key>": tensor}`` (exp_avg, exp_avg_sq, step)."""
    names = _param_names(model)
    out = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                t = value if torch.is_tensor(value) else torch.tensor(value)
                out[f"{names[id(p)]}.{key}"] = t.detach().cpu().contiguous()
    return out


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer, model: nn.Module, tensors: dict[str, torch.Tensor]
) -> None:
    """Inverse of :func:`optimizer_tensors`; every parameter's state must be present or absent whole."""
    names = _param_names(model)
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for full, t in tensors.items():
        name, key = full.rsplit(".", 1)
        by_param.setdefault(name, {})[key] = t
    unknown = set(by_param) - set(names.values())
    if unknown:
        raise KeyError(f"optimizer state for unknown parameters: {sorted(unknown)[:5]}")
    for group in optimizer.param_groups:
        # NOTE: AdamW keeps `step` as an FP32 0-dim tensor on the CPU unless fused or capturable.
        step_on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = by_param.get(names[id(p)])
            if state is None:
                continue
            optimizer.state[p] = {
                key: t.clone() if key == "step" and not step_on_device else t.to(p.device, copy=True)
                for key, t in state.items()
            }
