"""The pretraining stage: token shards in, every token trained, on the shared trainer.

The model is built in place on its device: a 12B model never passes through host memory. Under
torchrun every rank runs this function (DDP replicas or FSDP2 shards, ``train.parallel``) and reads
its own share of every global batch, so the loss curve does not depend on the number of GPUs.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from inkling_fp4 import distributed as D
from inkling_fp4.config import RunConfig
from inkling_fp4.data.batch import Batch
from inkling_fp4.data.chat import CHAT_TEMPLATE_JINJA
from inkling_fp4.data.pipeline import PretrainData, build_pretrain_data
from inkling_fp4.data.tokenizer import check_vocab
from inkling_fp4.interop.load_run import base_weights, load_run_checkpoint
from inkling_fp4.runs.checkpoint import build_model
from inkling_fp4.runs.lineage import CHAT_TEMPLATE_FILE, trained_on_chat
from inkling_fp4.train.frame import RunResult, finish, stage_frame
from inkling_fp4.trainer.determinism import seed_everything
from inkling_fp4.trainer.trainer import Trainer, batch_geometry


class PretrainTask:
    """Windows of the token stream; the loss is the model's cross-entropy on every target."""

    loss_fn = None

    def __init__(self, data: PretrainData, val_batches: list[Batch]):
        self.data, self.val_batches = data, val_batches

    def next_batches(self, micro: int, accum: int) -> list[Batch]:
        return [self.data.train.next_batch(micro) for _ in range(accum)]

    def real_tokens(self, batches: list[Batch]) -> int:
        return sum(b.input_ids.numel() for b in batches)  # windows of real text: no padding

    def evaluate(self, trainer: Trainer) -> dict:
        return trainer.validation_loss(self.val_batches)

    def step_metrics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return self.data.train.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data.train.load_state_dict(state)


def run(cfg: RunConfig, run_dir: Path, resume: bool = False, baseline: Path | None = None) -> RunResult:
    """Pretrain ``cfg`` into ``run_dir`` (continuing its latest good checkpoint with ``resume``)."""
    with stage_frame(cfg, run_dir, resume, baseline) as (dist, start):
        cfg = start.cfg
        seed_everything(cfg.train.seed)
        micro, _ = batch_geometry(cfg, dist.world_size)
        tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
        base_model = ckpt = None
        # continued pretraining: the base model is read (and checked) before any shard is written
        if start.fresh and cfg.init_from is not None:
            _, base_model, _, ckpt = load_run_checkpoint(cfg.init_from)
        # rank 0 first: it trains the tokenizer and writes the token shards; the others then read them
        for building in (True, False):
            if dist.is_main == building:
                data = build_pretrain_data(
                    cfg.data, None if start.fresh else run_dir, cfg.train.seed, rank=dist.rank,
                    world_size=dist.world_size, total_tokens=cfg.train.steps * tokens_per_step,
                )  # fmt: skip
            D.barrier(dist)
        describe, base_tensors, chat_files = [f"data: {data.describe()}"], None, None
        if base_model is not None:  # continued pretraining: another run's weights
            describe.insert(0, f"init: weights and model from {ckpt.path} (step {ckpt.step}); optimizer: "
                               "fresh AdamW; schedule: this recipe's WSD")  # fmt: skip
            if trained_on_chat(ckpt.path):  # the weights keep what they learnt of the template
                chat_files = {CHAT_TEMPLATE_FILE: CHAT_TEMPLATE_JINJA}
            base_tensors, grown = base_weights(base_model, data.tokenizer)
            if grown:
                describe.append(grown)
                cfg.model.vocab_size = base_model.cfg.vocab_size
            del base_model
        check_vocab(data.tokenizer, cfg.model.vocab_size)
        # each rank evaluates its share of eval.batches x micro x ranks windows: with the default micro
        # batch (batch_size / ranks) the validation set is the same whatever the number of processes
        task = PretrainTask(data, data.val_batches(cfg.eval.batches, micro, rank_shard=True))
        with initial_weights_rng(cfg.train.init_seed, dist.device):
            model = build_model(cfg.model, dist.device, base_tensors)
        trainer = Trainer(cfg, run_dir, dist, model, baseline)
        return finish(trainer, task, start, data.tokenizer, describe, chat_files)


@contextlib.contextmanager
def initial_weights_rng(init_seed: int | None, device: torch.device):
    """Draw the initial weights from ``init_seed`` when it is set. The global generators (CPU and this
    device) then continue from where they were before the build; the data order and the stochastic
    rounding draw from their own generators, seeded from ``train.seed``, so they do not change."""
    if init_seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(init_seed)
        yield
