"""A run that never shards does not import FSDP, DTensor or distributed checkpointing (a second and a
half at every start), and a DTensor is still told apart once they are loaded."""

import subprocess
import sys

import torch

HEAVY = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint")


def test_the_stages_import_without_the_sharding_packages():
    code = ("import sys, inkling_fp4.train.pretrain, inkling_fp4.train.sft, inkling_fp4.train.rollout\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules])")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def test_a_dtensor_parameter_makes_a_model_sharded():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    from inkling_fp4.trainer.sharding import is_sharded, local_value

    model = torch.nn.Linear(4, 2)
    assert not is_sharded(model)
    assert local_value(model.weight) is model.weight
    store = torch.distributed.HashStore()
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", [0])
        weight = DTensor.from_local(model.weight.detach(), mesh, [Replicate()])
        model.weight = torch.nn.Parameter(weight)
        assert is_sharded(model)
        assert type(local_value(model.weight)) is torch.Tensor
    finally:
        torch.distributed.destroy_process_group()
