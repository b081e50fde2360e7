"""Chat data for supervised fine-tuning: records -> template tokens -> packed rows -> a resumable loader.

The tokenizer is the pretrained run's (``<run_dir>/tokenizer.json``), so token ids mean what the model
learned. Records are split by index into training and validation with the same rule as pretraining
documents (``shards.is_validation``), each split packed on its own, so no conversation is in both.
Chat data is small next to pretraining data, so it is tokenized in memory on every start (no shards).
``data.source=builtin`` reads the offline docstring questions of ``builtin_chat.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from inkling_fp4.data.batch import Batch
from inkling_fp4.data.builtin_chat import BuiltinChat
from inkling_fp4.data.builtin_corpus import BuiltinCorpus
from inkling_fp4.data.chat import encode_chat, record_messages
from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.packing import PackedLoader, PackedRows, pack
from inkling_fp4.data.shards import is_validation
from inkling_fp4.data.sources import open_source
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError


@dataclass
class SFTData:
    tokenizer: Tokenizer
    train: PackedLoader
    val_rows: PackedRows | None
    source: str
    records: int
    origin: str = ""

    def val_batches(self, n: int, batch_size: int) -> list[Batch]:
        """``n`` batches of validation rows, the same every call (rows repeat when there are few)."""
        if self.val_rows is None:
            raise DataError(
                f"chat source '{self.source}' has no validation records ({self.records} in all); "
                "raise data.val_fraction or add records"
            )
        picks = np.arange(n * batch_size) % len(self.val_rows.tokens)
        return [self.val_rows.batch(picks[i * batch_size : (i + 1) * batch_size]) for i in range(n)]

    def describe(self) -> str:
        rows = self.train.rows
        return (
            f"{self.origin}: {self.records} records -> {len(rows.tokens)} packed rows of "
            f"{rows.tokens.shape[1] - 1} tokens ({rows.fill:.0%} filled, {rows.truncated} truncated, "
            f"{rows.dropped} dropped); answer tokens trained only"
        )


def build_sft_data(
    cfg: DataConfig, tokenizer: Tokenizer, seed: int, rank: int = 0, world_size: int = 1
) -> SFTData:
    """Chat records of ``cfg.source`` (files, a hub dataset, or ``builtin``: docstring questions),
    packed into rows of ``cfg.seq_len + 1``."""
    source = open_source(cfg.source, cfg)
    if isinstance(source, BuiltinCorpus):
        source = BuiltinChat(source)
    splits: dict[str, list] = {"train": [], "val": []}
    count = 0
    for index, record in enumerate(source.iter_rows()):
        encoded = encode_chat(tokenizer, record_messages(record, index))
        splits["val" if cfg.val_fraction > 0 and is_validation(index, cfg.val_fraction) else "train"].append(
            encoded
        )
        count += 1
    if not splits["train"]:
        raise DataError(f"chat source '{cfg.source}' has no training records; add records")
    row_len = cfg.seq_len + 1
    train_rows = pack(splits["train"], row_len, tokenizer.pad)
    val_rows = pack(splits["val"], row_len, tokenizer.pad) if splits["val"] else None
    loader = PackedLoader(train_rows, seed, rank, world_size)
    return SFTData(tokenizer, loader, val_rows, cfg.source, count, source.describe())
