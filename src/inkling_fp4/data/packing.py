"""Best-fit packing of variable-length examples into fixed rows, and a resumable loader over the rows.

Why pack: chat examples are short and uneven, so padding each to L wastes most of the compute. Several
whole examples share a row of L + 1 tokens, and ``doc_ids`` keeps them apart (SSM state reset,
attention masked), so the result equals training on them one by one. Best fit decreasing:
deterministic (ties keep input order), close to optimal fill.

Row layout: examples back to back, then ``<|pad|>`` up to L + 1 with its own doc id and no loss. A
target that starts another example (a seam) is never trained.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inkling_fp4.data.batch import Batch
from inkling_fp4.data.chat import EncodedChat
from inkling_fp4.errors import DataError


@dataclass
class PackedRows:
    tokens: np.ndarray  # [R, L + 1] int64
    trained: np.ndarray  # [R, L + 1] bool
    doc_ids: np.ndarray  # [R, L + 1] int32; pads have the id after the row's last example
    used: np.ndarray  # [R] int64: example tokens in each row (the rest is padding)
    examples: int
    """Examples packed."""

    @property
    def fill(self) -> float:
        """Fraction of row positions holding example tokens (not padding)."""
        return float(self.used.sum() / self.tokens.size)

    @property
    def trained_tokens(self) -> int:
        """Targets the loss is taken on in one pass over every row (the loss mask's sum)."""
        return int((self.trained[:, 1:] & (self.doc_ids[:, 1:] == self.doc_ids[:, :-1])).sum())

    def batch(self, rows: Sequence[int] | np.ndarray) -> Batch:
        rows = np.asarray(rows)
        tokens = torch.from_numpy(self.tokens[rows])
        trained = torch.from_numpy(self.trained[rows])
        doc_ids = torch.from_numpy(self.doc_ids[rows])
        same_doc = doc_ids[:, 1:] == doc_ids[:, :-1]
        return Batch(
            input_ids=tokens[:, :-1].contiguous(),
            targets=tokens[:, 1:].contiguous(),
            doc_ids=doc_ids[:, :-1].contiguous(),
            loss_mask=(trained[:, 1:] & same_doc).contiguous(),
        )


def best_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins (lists of example indices) from best-fit decreasing; every length must be <= capacity."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # (room left, bin index), sorted
    for i in order:
        slot = bisect.bisect_left(open_bins, (lengths[i], -1))
        if slot == len(open_bins):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = open_bins.pop(slot)
            bins[b].append(i)
            room -= lengths[i]
        if room > 0:
            bisect.insort(open_bins, (room, b))
    return bins


@dataclass
class Fitted:
    """Examples that fit a row, and how many were cut or dropped to get there."""

    examples: list[EncodedChat]
    truncated: int
    """Examples cut to the row length and kept (their head holds a trained token)."""
    dropped: int
    """Examples dropped for their length (overlong=drop, or a cut head without a trained token)."""


def fit(examples: Sequence[EncodedChat], row_len: int, overlong: str) -> Fitted:
    """Apply ``overlong`` (truncate | drop) to the examples longer than ``row_len`` tokens (= L + 1)."""
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"overlong must be truncate or drop, not '{overlong}'")
    kept, truncated, dropped = [], 0, 0
    for ex in examples:
        if len(ex) <= row_len:
            kept.append(ex)
        elif overlong == "truncate" and any(ex.trained[1:row_len]):
            kept.append(EncodedChat(ex.tokens[:row_len], ex.trained[:row_len]))
            truncated += 1
        else:
            dropped += 1
    return Fitted(kept, truncated, dropped)


def pack(examples: Sequence[EncodedChat], row_len: int, pad_id: int) -> PackedRows:
    """Pack examples of at most ``row_len`` tokens (= L + 1) each into rows of ``row_len``."""
    if not examples:
        raise ValueError("pack: no examples")
    longest = max(len(ex) for ex in examples)
    if longest > row_len:
        raise ValueError(f"pack: an example of {longest} tokens for rows of {row_len}; fit() them first")
    bins = best_fit([len(ex) for ex in examples], row_len)
    tokens = np.full((len(bins), row_len), pad_id, dtype=np.int64)
    trained = np.zeros((len(bins), row_len), dtype=bool)
    doc_ids = np.zeros((len(bins), row_len), dtype=np.int32)
    used = np.zeros(len(bins), dtype=np.int64)
    for r, members in enumerate(bins):
        pos = 0
        for d, i in enumerate(members):
            n = len(examples[i])
            tokens[r, pos : pos + n] = examples[i].tokens
            trained[r, pos : pos + n] = examples[i].trained
            doc_ids[r, pos : pos + n] = d
            pos += n
        doc_ids[r, pos:] = len(members)
        used[r] = pos
    return PackedRows(tokens, trained, doc_ids, used, len(examples))


class PackedLoader:
    """Rows in a seeded permutation per epoch, global row order sharded by rank; state = a counter."""

    def __init__(self, rows: PackedRows, seed: int, rank: int = 0, world_size: int = 1):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        self.rows, self.seed, self.rank, self.world_size = rows, seed, rank, world_size
        self.seq_len = rows.tokens.shape[1] - 1
        self.sample = 0
        self._epoch, self._order = -1, np.zeros(0, np.int64)

    @property
    def tokens_seen(self) -> int:
        """Row positions consumed by all ranks together (padding included): g·L."""
        return self.sample * self.seq_len

    def _row(self, g: int) -> int:
        epoch, pos = divmod(g, len(self.rows.tokens))
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows.tokens))
        return int(self._order[pos])

    def next_batch(self, batch_size: int) -> Batch:
        picks = []
        for _ in range(batch_size * self.world_size):
            if self.sample % self.world_size == self.rank:
                picks.append(self._row(self.sample))
            self.sample += 1
        return self.rows.batch(picks)

    def state_dict(self) -> dict:
        return {"sample": self.sample, "rows": len(self.rows.tokens), "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["rows"] != len(self.rows.tokens) or state["seed"] != self.seed:
            raise DataError(
                f"the checkpoint's data position is for {state['rows']} packed rows and seed "
                f"{state['seed']}, "
                f"this run has {len(self.rows.tokens)} and {self.seed}; resume with the same data and seed"
            )
        self.sample = int(state["sample"])
