"""The supervised fine-tuning stage: chat examples in, loss on the answers, on the shared trainer.

A fine-tuning run starts from another run's checkpoint (``init_from``, the ``--from`` of
``fp4train sft``): its weights, model config and tokenizer. The optimizer is a fresh AdamW (the
pretraining moments describe another objective and another LR); schedule and precision are the SFT
recipe's.

Packed examples cannot see each other: a packed row's document ids restart the conv, the SSM state
and attention at every example's first token, so each example trains as if it were alone.
"""

from __future__ import annotations

from pathlib import Path

from inkling_fp4.config import RunConfig
from inkling_fp4.data.batch import Batch
from inkling_fp4.data.chat import CHAT_TEMPLATE_JINJA
from inkling_fp4.data.sft_data import SFTData, build_sft_data
from inkling_fp4.data.tokenizer import Tokenizer, check_vocab
from inkling_fp4.errors import ConfigError
from inkling_fp4.interop.load_run import base_weights, load_run_checkpoint
from inkling_fp4.runs.checkpoint import build_model
from inkling_fp4.runs.directory import TOKENIZER_FILE
from inkling_fp4.train.frame import RunResult, finish, stage_frame
from inkling_fp4.trainer.determinism import seed_everything
from inkling_fp4.trainer.trainer import Trainer, batch_geometry

DEFAULT_RECIPE = "sft-tiny"


class SFTTask:
    """Packed chat rows; the loss is the model's cross-entropy on the trained (answer) targets."""

    loss_fn = None

    def __init__(self, data: SFTData, val_batches: list[Batch] | None, pad_id: int):
        self.data, self.val_batches, self.pad_id = data, val_batches, pad_id

    def next_batches(self, micro: int, accum: int) -> list[Batch]:
        return [self.data.train.next_batch(micro) for _ in range(accum)]

    def real_tokens(self, batches: list[Batch]) -> int:
        return sum(int((b.input_ids != self.pad_id).sum()) for b in batches)

    def evaluate(self, trainer: Trainer) -> dict | None:
        return trainer.validation_loss(self.val_batches) if self.val_batches else None  # val_fraction 0

    def step_metrics(self) -> dict:
        return {}

    def state_dict(self) -> dict:
        return self.data.train.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.data.train.load_state_dict(state)


# ----------------------------------------------------------------------------------------------
# the run


def run(cfg: RunConfig, run_dir: Path, resume: bool = False, baseline: Path | None = None) -> RunResult:
    """Fine-tune ``cfg.init_from`` on ``cfg.data`` into ``run_dir`` (continuing with ``resume``)."""
    if cfg.init_from is None:
        raise ConfigError("init_from is not set: pass --from RUN (a pretrain run or checkpoint directory)")
    with stage_frame(cfg, run_dir, resume, baseline) as (dist, start):
        cfg = start.cfg
        seed_everything(cfg.train.seed)
        micro, _ = batch_geometry(cfg, dist.world_size)
        describe = []
        if start.fresh:
            base_cfg, base_model, tokenizer, ckpt = load_run_checkpoint(cfg.init_from)
            describe.append(
                f"init: weights, model and tokenizer from {ckpt.path} (step {ckpt.step} of the "
                f"{base_cfg.stage} run {ckpt.path.parent.parent.name}); optimizer: fresh AdamW; schedule: "
                f"this recipe's WSD over {cfg.train.steps} steps"
            )
            base_tensors, grown = base_weights(base_model, tokenizer)
            if grown:
                describe.append(grown)
                cfg.model.vocab_size = base_model.cfg.vocab_size
            del base_model
        else:
            tokenizer = Tokenizer.from_file(Path(run_dir) / TOKENIZER_FILE)
            base_tensors = None
        check_vocab(tokenizer, cfg.model.vocab_size)
        data = build_sft_data(cfg.data, cfg.sft, tokenizer, cfg.train.seed, dist.rank, dist.world_size)
        val = data.val_batches(cfg.eval.batches, micro) if data.has_validation else None
        task = SFTTask(data, val, tokenizer.pad)
        model = build_model(cfg.model, dist.device, base_tensors)
        trainer = Trainer(cfg, run_dir, dist, model, baseline)
        describe.append(f"data: {data.describe()}")
        return finish(trainer, task, start, tokenizer, describe, _chat_files())


def _chat_files() -> dict[str, str]:
    """The chat template beside the tokenizer, for tools that render prompts themselves."""
    return {"chat_template.jinja": CHAT_TEMPLATE_JINJA}
