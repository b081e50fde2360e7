"""Input scales for the NVFP4 exports: the amax of each quantized linear's input over a few batches.

Serving engines quantize activations with a static global scale from the checkpoint, where the
training forward takes each batch's own amax. So the export runs a few validation batches through
the run's recipe and records max |x| per linear layer: input_scale = amax / (6·448) (ModelOpt),
input_global_scale = 6·448 / amax (compressed-tensors).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from inkling_fp4.config import RunConfig
from inkling_fp4.data.pipeline import build_pretrain_data
from inkling_fp4.data.sft_data import build_sft_data
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision.policy import PrecisionPolicy
from inkling_fp4.precision.quant_linear import QuantLinear


@dataclass
class ExportConfig:
    """Options of ``fp4train export`` (``export.<field>=value`` on its command line)."""

    calibration_batches: int = 4
    """Validation batches of the run's data whose activation amaxes give the NVFP4 input scales."""
    calibration_batch_size: int = 4
    """Sequences per calibration batch (of the run's data.seq_len)."""

    def __post_init__(self):
        if self.calibration_batches < 1 or self.calibration_batch_size < 1:
            raise ValueError("export.calibration_batches and calibration_batch_size must be >= 1")


@torch.no_grad()
def input_amaxes(
    model: HybridLM, policy: PrecisionPolicy, batches: Iterable[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """{QuantLinear.full_name: amax of its input (FP32 0-dim)} over ``batches`` ([B, L] token ids),
    with the policy's recipe applied to ``model`` (left applied)."""
    policy.apply(model)
    model.eval()
    amax: dict[str, torch.Tensor] = {}
    hooks = []

    def record(module: QuantLinear, args):
        x = args[0].detach().abs().amax().float().cpu()
        name = module.full_name
        amax[name] = torch.maximum(amax[name], x) if name in amax else x

    for m in model.modules():
        if isinstance(m, QuantLinear) and m.recipe is not None:
            hooks.append(m.register_forward_pre_hook(record))
    try:
        for ids in batches:
            model(ids.to(model.embed.weight.device))
    finally:
        for h in hooks:
            h.remove()
    return amax


def calibration_batches(
    cfg: RunConfig, tokenizer: Tokenizer, export: ExportConfig, run_dir: Path | None
) -> list[torch.Tensor]:
    """[B, L] token batches of the run's validation data (windows, or packed chat rows for sft)."""
    n, b = export.calibration_batches, export.calibration_batch_size
    if cfg.stage == "sft":
        data = build_sft_data(cfg.data, cfg.sft, tokenizer, cfg.train.seed)
        return [batch.input_ids for batch in data.val_batches(n, b)]
    data = build_pretrain_data(cfg.data, run_dir, cfg.train.seed)
    return [batch.input_ids for batch in data.val_batches(n, b)]
