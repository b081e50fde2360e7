"""Data configuration: where text comes from, how it is tokenized, cached and batched.

A source is one string (``builtin``, a local path / glob / folder, or a hub dataset name), so a recipe
line and an override read the same. Data phases change the blend of sources at fractions of the run's
tokens, as the NVFP4 paper switches its pretraining mixture at 70% and 90% of the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inkling_fp4.data.text_encoding import ENCODING_ERRORS


@dataclass
class DataPhase:
    """One blend of sources, used from token fraction ``at`` until the next phase starts."""

    at: float
    """Fraction of the run's tokens at which this blend starts (0 <= at < 1)."""
    sources: list[str]
    """Sources of the blend, each written as ``data.source`` takes it."""
    weights: list[float] | None = None
    """Sampling weight of each source (normalised to sum to 1); null = equal weights."""

    def __post_init__(self):
        if not 0.0 <= self.at < 1.0:
            raise ValueError(f"data.phases: at={self.at} must be a token fraction in [0, 1)")
        if not self.sources:
            raise ValueError(f"data.phases: the phase at {self.at} lists no sources")
        if self.weights is not None:
            if len(self.weights) != len(self.sources):
                raise ValueError(
                    f"data.phases: the phase at {self.at} has {len(self.sources)} sources but "
                    f"{len(self.weights)} weights; give one weight per source"
                )
            if any(not w > 0 for w in self.weights):
                raise ValueError(f"data.phases: weights of the phase at {self.at} must all be > 0")

    def normalized_weights(self) -> list[float]:
        weights = self.weights or [1.0] * len(self.sources)
        total = sum(weights)
        return [w / total for w in weights]


@dataclass
class DataConfig:
    source: str = "builtin"
    """'builtin' (the offline stdlib corpus), local files / globs / folders, or a hub dataset name."""
    text_field: str = "text"
    """Field that holds the text in structured sources."""
    text_sample_by: str = "document"
    """How .txt files become documents: document (one per file), paragraph or line."""
    encoding_errors: str = "strict"
    """Invalid UTF-8 in local text / json / csv files: strict (an error naming file and offset) or
    replace (bad bytes read as U+FFFD)."""
    tokenizer: str | None = None
    """A tokenizer.json (or its folder), a hub name, or null: train a byte-level BPE on the sources."""
    vocab_size: int = 4096
    """Vocabulary size of a tokenizer trained here (special tokens included)."""
    bpe_min_frequency: int = 2
    """A byte pair must occur this often to be merged when training the BPE."""
    tokenizer_train_bytes: int = 100_000_000
    """At most this many bytes of text train the BPE (split evenly over the sources)."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.01
    """Fraction of documents held out for validation (at least one when a source has two or more)."""
    cache_dir: str = "~/.cache/fp4train"
    """Where token shards, trained tokenizers and converted datasets are cached."""
    max_documents: int | None = None
    """Use at most this many documents of each source (the first ones, in the source's order)."""
    max_bytes: int | None = None
    """Stop reading a source once this many bytes of text were taken (null = no cap)."""
    builtin_site_packages: bool = False
    """The built-in corpus also takes the installed site-packages (large: minutes to tokenize)."""
    builtin_max_file_bytes: int = 262_144
    """The built-in corpus skips files larger than this (generated tables, not prose or code)."""
    shard_tokens: int = 16_777_216
    """Tokens per shard file."""
    verify_checksums: bool = True
    """Check each shard's sha256 against the manifest when loading it."""
    phases: list[DataPhase] = field(default_factory=list)
    """[{at: 0.7, sources: [...], weights: [...]}, ...]: blends switched at token fractions of the run;
    before the first phase the run reads ``source`` alone."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError("data.seq_len must be at least 2")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ValueError("data.val_fraction must be in [0, 0.5)")
        if self.text_sample_by not in ("document", "paragraph", "line"):
            raise ValueError("data.text_sample_by must be document, paragraph or line")
        if self.encoding_errors not in ENCODING_ERRORS:
            raise ValueError(f"data.encoding_errors must be strict or replace, not '{self.encoding_errors}'")
        if self.vocab_size < 512:
            raise ValueError("data.vocab_size must be at least 512 (256 bytes, special tokens and merges)")
        if self.bpe_min_frequency < 1:
            raise ValueError("data.bpe_min_frequency must be >= 1")
        if self.tokenizer_train_bytes < 1:
            raise ValueError("data.tokenizer_train_bytes must be >= 1")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError("data.max_documents must be >= 1 or null")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError("data.max_bytes must be >= 1 or null")
        if self.builtin_max_file_bytes < 1:
            raise ValueError("data.builtin_max_file_bytes must be >= 1")
        if self.shard_tokens < 1024:
            raise ValueError("data.shard_tokens must be at least 1024")
        ats = [p.at for p in self.phases]
        if any(b <= a for a, b in zip(ats, ats[1:], strict=False)):
            raise ValueError(f"data.phases must be in increasing order of 'at', got {ats}")

    def all_sources(self) -> list[str]:
        """Every distinct source the run reads, the base source first."""
        names = [self.source] if not self.phases or self.phases[0].at > 0 else []
        for phase in self.phases:
            names += phase.sources
        return list(dict.fromkeys(names))
