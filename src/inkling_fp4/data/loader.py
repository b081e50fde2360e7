"""The pretraining loader: deterministic, exactly resumable, sharded by rank, with data phases.

A source's train stream is cut into windows of L + 1 tokens starting every L tokens (neighbours share
one token, so every token is a target once per epoch); epoch e visits them in a seeded permutation,
all starts shifted by a seeded offset in [0, L) (0 in epoch 0) so later epochs see other boundaries.

Samples are numbered g = 0, 1, ... across all ranks; rank r takes g mod world_size == r, so the union
is the single-process stream at any world size. Sample g starts at token g·L: the phase in effect
picks the blend, and a seeded draw u(seed, g) picks the source (inverse CDF of the weights).

So the data position is a few integers (g and the per-source counts) and a resumed loader yields
exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from inkling_fp4.data.batch import Batch
from inkling_fp4.data.shards import TokenStream
from inkling_fp4.errors import DataError

_DRAWS_PER_BLOCK = 4096
_MIX_STREAM = 0x6D6978  # distinct seed words for the blend draws and the window orders
_ORDER_STREAM = 0x6F7264


class WindowSampler:
    """One source's windows of L + 1 tokens, in a seeded order, epoch after epoch."""

    def __init__(self, stream: TokenStream, seq_len: int, seed: int, source_index: int, name: str = ""):
        self.stream, self.seq_len, self.seed, self.source_index = stream, seq_len, seed, source_index
        self.name = name
        if len(stream) < seq_len + 1:
            raise DataError(
                f"data source '{name}' has {len(stream)} training tokens, fewer than one sequence of "
                f"data.seq_len + 1 = {seq_len + 1}; use more data or a shorter data.seq_len"
            )
        self._epoch_starts = [0]  # index of the first window of each epoch, extended on demand
        self._epoch, self._offset, self._order = -1, 0, np.zeros(0, np.int64)

    def _geometry(self, epoch: int) -> tuple[int, int, np.random.Generator]:
        """(start offset, number of windows, generator positioned for the permutation) of an epoch."""
        rng = np.random.default_rng([self.seed, _ORDER_STREAM, self.source_index, epoch])
        offset = int(rng.integers(self.seq_len)) if epoch > 0 else 0
        n_windows = (len(self.stream) - 1 - offset) // self.seq_len
        if n_windows < 1:  # a stream barely longer than one window: keep the start at 0
            offset, n_windows = 0, (len(self.stream) - 1) // self.seq_len
        return offset, n_windows, rng

    def window(self, k: int) -> np.ndarray:
        """The k-th window this source gives out (0-based over the whole run): [L + 1] int64."""
        while self._epoch_starts[-1] <= k:
            _, n_windows, _ = self._geometry(len(self._epoch_starts) - 1)
            self._epoch_starts.append(self._epoch_starts[-1] + n_windows)
        epoch = bisect.bisect_right(self._epoch_starts, k) - 1
        if epoch != self._epoch:
            self._offset, n_windows, rng = self._geometry(epoch)
            self._epoch, self._order = epoch, rng.permutation(n_windows)
        start = self._offset + int(self._order[k - self._epoch_starts[epoch]]) * self.seq_len
        return self.stream.slice(start, start + self.seq_len + 1)


@dataclass
class ResolvedPhase:
    """A blend in absolute terms: from token ``start`` on, source i with probability cdf[i] - cdf[i-1]."""

    start: int
    sources: list[int]
    cdf: np.ndarray


class PretrainLoader:
    """Batches of windows for one rank; see the module docstring for the order and the state."""

    def __init__(
        self,
        samplers: list[WindowSampler],
        phases: list[ResolvedPhase],
        seq_len: int,
        seed: int,
        eos_id: int,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world size {world_size}")
        assert phases and phases[0].start == 0, "the first phase starts at token 0"
        self.samplers, self.phases, self.seq_len, self.seed = samplers, phases, seq_len, seed
        self.eos_id, self.rank, self.world_size = eos_id, rank, world_size
        self.sample = 0  # next global sample index g
        self.drawn = [0] * len(samplers)  # windows given out so far, per source, over all ranks
        self._block, self._draws = -1, np.zeros(0)

    @property
    def tokens_seen(self) -> int:
        """Input tokens consumed by all ranks together (equal on every rank): g·L."""
        return self.sample * self.seq_len

    def phase_index(self, token: int) -> int:
        """Index of the phase in effect for a sample starting at ``token``."""
        starts = [p.start for p in self.phases]
        return int(np.searchsorted(starts, token, side="right")) - 1

    def _uniform(self, g: int) -> float:
        block, offset = divmod(g, _DRAWS_PER_BLOCK)
        if block != self._block:
            self._block = block
            self._draws = np.random.default_rng([self.seed, _MIX_STREAM, block]).random(_DRAWS_PER_BLOCK)
        return float(self._draws[offset])

    def source_of(self, g: int) -> int:
        """The source index of global sample g (a pure function of seed and g)."""
        phase = self.phases[self.phase_index(g * self.seq_len)]
        if len(phase.sources) == 1:
            return phase.sources[0]
        i = int(np.searchsorted(phase.cdf, self._uniform(g), side="right"))
        return phase.sources[min(i, len(phase.sources) - 1)]

    def next_windows(self, batch_size: int) -> tuple[np.ndarray, list[int]]:
        """This rank's next ``batch_size`` windows [B, L + 1] and the source index of each."""
        windows, sources = [], []
        for _ in range(batch_size * self.world_size):
            g = self.sample
            s = self.source_of(g)
            k = self.drawn[s]
            self.drawn[s] += 1
            self.sample += 1
            if g % self.world_size == self.rank:
                windows.append(self.samplers[s].window(k))
                sources.append(s)
        return np.stack(windows), sources

    def next_batch(self, batch_size: int) -> Batch:
        windows, _ = self.next_windows(batch_size)
        return Batch.from_windows(windows, self.eos_id)

    def state_dict(self) -> dict:
        return {
            "sample": self.sample,
            "drawn": list(self.drawn),
            "sources": [s.name for s in self.samplers],
            "seq_len": self.seq_len,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        names = [s.name for s in self.samplers]
        mismatch = [
            (k, state[k], v)
            for k, v in (("sources", names), ("seq_len", self.seq_len), ("seed", self.seed))
            if state[k] != v
        ]
        if mismatch:
            key, saved, now = mismatch[0]
            raise DataError(
                f"the checkpoint's data position is for {key}={saved!r} but this run has {key}={now!r}; "
                "resume with the data settings the run was started with"
            )
        self.sample = int(state["sample"])
        self.drawn = [int(n) for n in state["drawn"]]


def fixed_windows(stream: TokenStream, seq_len: int, count: int) -> np.ndarray:
    """``count`` windows [count, L + 1] spread evenly over a stream, in order (repeats when it is short)."""
    n_windows = (len(stream) - 1) // seq_len
    if n_windows < 1:
        raise DataError(
            f"the validation split has {len(stream)} tokens, fewer than one sequence of {seq_len + 1}; "
            "raise data.val_fraction, use more data or a shorter data.seq_len"
        )
    picks = np.floor((np.arange(count) + 0.5) * n_windows / count).astype(np.int64)
    return np.stack([stream.slice(int(k) * seq_len, int(k) * seq_len + seq_len + 1) for k in picks])
