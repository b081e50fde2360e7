"""From a data config to what the trainer consumes: a tokenizer, a train loader, validation batches.

Validation reads the held-out documents of the run's first source only, the same whatever the seed
or blend, so validation losses of runs that differ in precision compare directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inkling_fp4.data.batch import Batch
from inkling_fp4.data.bpe_training import train_bpe_for
from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.loader import PretrainLoader, ResolvedPhase, WindowSampler, fixed_windows
from inkling_fp4.data.shards import ShardSet, build_or_load_shards
from inkling_fp4.data.sources import DocumentSource, open_source
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError


@dataclass
class PretrainData:
    tokenizer: Tokenizer
    train: PretrainLoader
    sources: list[DocumentSource]
    shards: list[ShardSet]
    """One per source, in the order of ``sources``."""
    seq_len: int
    rank: int = 0
    world_size: int = 1

    def val_batches(self, n: int, batch_size: int, rank_shard: bool = False) -> list[Batch]:
        """``n`` batches spread evenly over the validation split, the same every call.

        Every rank gets the same batches; with ``rank_shard`` rank r gets rows r, r + W, ... of W times
        as many windows (average the losses over ranks then).
        """
        ranks = self.world_size if rank_shard else 1
        windows = fixed_windows(self.shards[0].val, self.seq_len, n * batch_size * ranks)
        if rank_shard:
            windows = windows[self.rank :: self.world_size]
        eos = self.tokenizer.eos
        return [Batch.from_windows(windows[i * batch_size : (i + 1) * batch_size], eos) for i in range(n)]

    def describe(self) -> str:
        lines = []
        for source, shards in zip(self.sources, self.shards, strict=True):
            lines.append(
                f"{source.describe()}, {_count(shards.tokens('train') + shards.tokens('val'))} tokens "
                f"(train {_count(shards.tokens('train'))}, val {_count(shards.tokens('val'))} in "
                f"{shards.documents('val')} documents; vocab {self.tokenizer.vocab_size})"
            )
        if len(self.train.phases) > 1 or len(self.sources) > 1:
            for phase in self.train.phases:
                blend = ", ".join(
                    f"{self.sources[s].name} {w:.0%}"
                    for s, w in zip(phase.sources, np.diff(np.concatenate([[0.0], phase.cdf])), strict=True)
                )
                lines.append(f"phase from token {_count(phase.start)}: {blend}")
        lines.append(self.tokenizer.describe())
        return "\n".join(lines)


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def resolve_tokenizer(cfg: DataConfig, sources: list[DocumentSource], run_dir: Path | None) -> Tokenizer:
    """The run's tokenizer: a resumed run keeps its own ``tokenizer.json``, else the configured one or a
    BPE trained on the sources. Reads only (the stage saves it once every check has passed)."""
    saved = run_dir / "tokenizer.json" if run_dir is not None else None
    if saved is None:
        return Tokenizer.load(cfg.tokenizer) if cfg.tokenizer is not None else train_bpe_for(cfg, sources)
    if cfg.tokenizer is None and saved.is_file():
        tok = Tokenizer.from_file(saved)
        if tok.vocab_size != cfg.vocab_size:
            raise DataError(
                f"{saved} has {tok.vocab_size} tokens but data.vocab_size is {cfg.vocab_size}; use a new "
                "run directory for another tokenizer, or set data.vocab_size to match"
            )
        return tok
    tok = Tokenizer.load(cfg.tokenizer) if cfg.tokenizer is not None else train_bpe_for(cfg, sources)
    if saved.is_file() and Tokenizer.from_file(saved).content_hash != tok.content_hash:
        raise DataError(
            f"{saved} holds another tokenizer than data.tokenizer={cfg.tokenizer}; use a new run directory"
        )
    return tok


def resolve_phases(cfg: DataConfig, names: list[str], total_tokens: int | None) -> list[ResolvedPhase]:
    """The config's phases with absolute start tokens and source indices into ``names``."""
    phases = []
    if not cfg.phases or cfg.phases[0].at > 0:
        phases.append(ResolvedPhase(0, [names.index(cfg.source)], np.ones(1)))
    for phase in cfg.phases:
        if phase.at > 0 and total_tokens is None:
            raise DataError("data.phases switch at fractions of the run's tokens; pass total_tokens")
        start = 0 if phase.at == 0 else math.ceil(phase.at * total_tokens)
        cdf = np.cumsum(phase.normalized_weights())
        phases.append(ResolvedPhase(start, [names.index(s) for s in phase.sources], cdf))
    return phases


def build_pretrain_data(
    cfg: DataConfig,
    run_dir: Path | None,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    total_tokens: int | None = None,
) -> PretrainData:
    """Everything the pretraining loop reads: sources, tokenizer, shards (cached) and this rank's loader."""
    cache_dir = Path(cfg.cache_dir).expanduser()
    names = cfg.all_sources()
    sources = [open_source(name, cfg) for name in names]
    tokenizer = resolve_tokenizer(cfg, sources, Path(run_dir) if run_dir is not None else None)
    shards = [
        build_or_load_shards(
            s, tokenizer, cache_dir, cfg.val_fraction, cfg.shard_tokens, cfg.verify_checksums
        )
        for s in sources
    ]
    samplers = [
        WindowSampler(sh.train, cfg.seq_len, seed, i, name)
        for i, (sh, name) in enumerate(zip(shards, names, strict=True))
    ]
    phases = resolve_phases(cfg, names, total_tokens)
    loader = PretrainLoader(samplers, phases, cfg.seq_len, seed, tokenizer.eos, rank, world_size)
    return PretrainData(tokenizer, loader, sources, shards, cfg.seq_len, rank, world_size)
