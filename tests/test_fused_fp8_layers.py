"""fuse_fp8 (model/fused_fp8/layers.py): the model and every layer get their fused FP8 class and keep
their parameters, state dict and outputs; converting twice changes nothing; the trainer converts
under delayed FP8 scaling only. (That a converted model trains bit for bit as the plain one, with
the fused paths taken, is tests/fused_fp8.py's check in each fused path's tests.)"""

from __future__ import annotations

import pytest
import torch

from inkling_fp4.config import load_config
from inkling_fp4.distributed import DistInfo
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.fused_fp8 import layers as F
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.trainer.trainer import Trainer

CFG = ModelConfig(pattern="M*-M", vocab_size=64, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64,
                  mamba_heads=4, mamba_head_dim=16, n_groups=1, d_state=8, chunk_size=8)  # fmt: skip


def test_every_layer_converted_with_its_state_and_outputs():
    torch.manual_seed(0)
    model = HybridLM(CFG)
    ids = torch.randint(0, 64, (2, 12))
    plain_out, state = model(ids), {k: v.clone() for k, v in model.state_dict().items()}
    params = [id(p) for p in model.parameters()]
    assert F.fuse_fp8(model) is model
    kinds = {type(m) for m in model.modules()}
    assert not kinds & set(F.FUSED) and set(F.FUSED.values()) <= kinds
    assert [id(p) for p in model.parameters()] == params
    assert (
        all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        and state.keys() == model.state_dict().keys()
    )
    assert torch.equal(model(ids), plain_out)  # off the fused paths' conditions (CPU, FP32): the plain math
    F.fuse_fp8(model)
    assert {type(m) for m in model.modules()} == kinds


@pytest.mark.parametrize("scaling, fused", [("delayed", True), ("current", False)])
def test_the_trainer_converts_under_delayed_fp8_only(tmp_path, scaling, fused):
    cfg = load_config("tiny", ["precision.recipe=fp8-tensorwise", f"precision.fp8_scaling={scaling}",
                               "train.device=cpu"])  # fmt: skip
    model = HybridLM(cfg.model)
    Trainer(cfg, tmp_path, DistInfo(), model)
    assert isinstance(model, F.FusedFP8HybridLM) is fused
    assert all(isinstance(b, F.FusedFP8Block) is fused for b in model.layers)
