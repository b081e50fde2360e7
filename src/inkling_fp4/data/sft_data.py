"""Chat data for supervised fine-tuning: records -> template tokens -> packed rows -> a resumable loader.

Every record is validated first (``chat.parse_record``), so a bad one is a one-line DataError before
anything is tokenized. Records are split by index (``shards.is_validation``; a small source holds out
its last record) and each split packed on its own, so no conversation is in both. Chat data is small,
so it is tokenized in memory at every start (no shards). The tokenizer is the pretrained run's, so
token ids mean what the model learned.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from inkling_fp4.data.batch import Batch
from inkling_fp4.data.builtin_tasks import BuiltinTasks
from inkling_fp4.data.chat import Chat, EncodedChat, assemble, parse_record
from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.packing import PackedLoader, PackedRows, fit, pack
from inkling_fp4.data.record_files import open_records
from inkling_fp4.data.sft_config import SFTConfig
from inkling_fp4.data.shards import is_validation
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError

_ENCODE_CHATS = 1024  # conversations per encode_batch call (the tokenizer's threads share a call)


@dataclass
class SFTData:
    tokenizer: Tokenizer
    train: PackedLoader
    val_rows: PackedRows | None
    """Packed validation rows; None when no example is held out."""
    stats: dict
    """Counts of the build for the log (``truncated`` / ``dropped_long`` over both splits)."""
    source: str
    origin: str
    loss_on: str

    @property
    def has_validation(self) -> bool:
        return self.val_rows is not None

    @property
    def trained_tokens(self) -> int:
        """Trained targets per pass over the training rows."""
        return self.stats["trained_tokens"]

    def val_batches(self, n: int, batch_size: int) -> list[Batch]:
        """``n`` batches of validation rows, the same every call (rows repeat when there are few)."""
        if self.val_rows is None:
            raise DataError(
                f"chat source '{self.source}' has no validation examples ({self.stats['records']} records "
                "in all); raise sft.val_fraction or add records"
            )
        picks = np.arange(n * batch_size) % len(self.val_rows.tokens)
        return [self.val_rows.batch(picks[i * batch_size : (i + 1) * batch_size]) for i in range(n)]

    def describe(self) -> str:
        s, L = self.stats, self.train.seq_len
        return (
            f"{self.origin}: {s['records']} records ({s['skipped_empty']} skipped for an empty answer) -> "
            f"{s['examples']} training examples in {s['rows']} packed rows of {L} tokens "
            f"({s['fill']:.0%} filled), {s['val_examples']} held out; {s['truncated']} truncated, "
            f"{s['dropped_long']} dropped as longer than {L + 1} tokens; loss on {self.loss_on}: "
            f"{s['trained_tokens']} trained tokens per epoch"
        )


def _rows(source, name: str) -> Iterator[tuple[int, dict]]:
    """(index, record) in the source's order; undecodable text is a DataError naming the record."""
    rows, index = iter(source.iter_rows()), 0
    while True:
        try:
            record = next(rows)
        except StopIteration:
            return
        except UnicodeDecodeError as e:
            raise DataError(
                f"chat source '{name}', record {index}: text is not valid UTF-8 ({e.reason}); "
                "re-encode the file as UTF-8, or set data.encoding_errors=replace"
            ) from None
        yield index, record
        index += 1


def _encode(tokenizer: Tokenizer, chats: list[Chat], loss_on: str) -> list[EncodedChat]:
    out = []
    for start in range(0, len(chats), _ENCODE_CHATS):
        part = chats[start : start + _ENCODE_CHATS]
        ids = tokenizer.encode_batch([m["content"] for chat in part for m in chat.messages])
        pos = 0
        for chat in part:
            n = len(chat.messages)
            out.append(assemble(tokenizer, chat, ids[pos : pos + n], loss_on))
            pos += n
    return out


def _open(cfg: DataConfig, sft: SFTConfig, seed: int):
    if cfg.source == "builtin":
        return BuiltinTasks(
            sft.builtin_examples,
            seed,
            levels=sft.builtin_levels,
            failed_attempts=tuple(sft.countdown_failed_attempts),
        )
    return open_records(cfg.source, cfg)


def build_sft_data(
    cfg: DataConfig, sft: SFTConfig, tokenizer: Tokenizer, seed: int, rank: int = 0, world_size: int = 1
) -> SFTData:
    """Chat records of ``cfg.source`` (files, a hub dataset, or ``builtin``: worked task examples),
    validated, masked by ``sft.loss_on`` and packed into rows of ``cfg.seq_len + 1`` tokens."""
    source = _open(cfg, sft, seed)
    splits: dict[str, list[Chat]] = {"train": [], "val": []}
    records = skipped = 0
    for index, record in _rows(source, cfg.source):
        chat = parse_record(record, f"chat record {index} (from 0) of '{cfg.source}'")
        records += 1
        if chat.empty_answer:
            skipped += 1
            continue
        held_out = sft.val_fraction > 0 and is_validation(index, sft.val_fraction)
        splits["val" if held_out else "train"].append(chat)
    if sft.val_fraction > 0 and not splits["val"] and len(splits["train"]) >= 2:
        splits["val"].append(splits["train"].pop())  # a small source: hold out its last record
    if not splits["train"]:
        raise DataError(
            f"chat source '{cfg.source}' has no training records ({records} read, {skipped} with an "
            "empty answer); add records"
        )
    row_len = cfg.seq_len + 1
    train = fit(_encode(tokenizer, splits["train"], sft.loss_on), row_len, sft.overlong)
    val = fit(_encode(tokenizer, splits["val"], sft.loss_on), row_len, sft.overlong)
    if not train.examples:
        hint = "" if sft.overlong == "truncate" else ", or set sft.overlong=truncate"
        raise DataError(
            f"no training example of '{cfg.source}' fits data.seq_len + 1 = {row_len} tokens with a trained "
            f"token ({train.dropped} dropped for length); raise data.seq_len{hint}"
        )
    train_rows = pack(train.examples, row_len, tokenizer.pad)
    val_rows = pack(val.examples, row_len, tokenizer.pad) if val.examples else None
    stats = {
        "records": records,
        "skipped_empty": skipped,
        "train_records": len(splits["train"]),
        "val_records": len(splits["val"]),
        "examples": train_rows.examples,
        "val_examples": 0 if val_rows is None else val_rows.examples,
        "truncated": train.truncated + val.truncated,
        "dropped_long": train.dropped + val.dropped,
        "rows": len(train_rows.tokens),
        "val_rows": 0 if val_rows is None else len(val_rows.tokens),
        "fill": train_rows.fill,
        "tokens": int(train_rows.used.sum()),
        "trained_tokens": train_rows.trained_tokens,
    }
    loader = PackedLoader(train_rows, seed, rank, world_size)
    return SFTData(tokenizer, loader, val_rows, stats, cfg.source, source.describe(), sft.loss_on)
