"""Data configuration: where text comes from, how it is tokenized and batched."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    source: str = "builtin"
    """'builtin' (offline corpus from the Python standard library), local files / globs
    (jsonl, json, parquet, csv, txt, arrow), or a hub dataset name when online."""
    text_field: str = "text"
    """Field that holds the text in structured sources."""
    tokenizer: str | None = None
    """Path to a tokenizer.json, a hub name when online, or null to train a byte-level BPE."""
    vocab_size: int = 4096
    """Vocabulary size of a tokenizer trained here."""
    seq_len: int = 128
    """Tokens per training sequence."""
    val_fraction: float = 0.01
    """Fraction of documents held out for validation."""
    cache_dir: str = "~/.cache/fp4train"
    """Where token shards and trained tokenizers are cached."""
    max_documents: int | None = None
    """Use at most this many documents of the source (quick runs)."""
    phases: list[dict] = field(default_factory=list)
    """Data phases: [{at: 0.7, source: ..., weight: ...}] switch the blend at token fractions."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError("data.seq_len must be at least 2")
        if not 0.0 <= self.val_fraction < 0.5:
            raise ValueError("data.val_fraction must be in [0, 0.5)")
