"""Small random corpora for the data tests: fresh text each run, with the awkward cases mixed in."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from inkling_fp4.data.config import DataConfig

_SYLLABLES = [
    "ka",
    "lo",
    "mi",
    "sun",
    "tra",
    "vel",
    "qu",
    "ix",
    "ø",
    "é",
    "ß",
    "日本",
    "🙂",
    "ζ",
    "def",
    "self",
]
_AWKWARD = ["\t", "\n", "  ", "\r\n", "\x00", "<|endoftext|>", "<|assistant|>", "\u200b", "'''", "{}", "\\n"]


def fresh_rng() -> random.Random:
    """A generator seeded from the OS; the seed is in its repr-friendly attribute for failure messages."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    rng.seed_value = seed
    return rng


def random_text(rng: random.Random, min_words: int = 3, max_words: int = 60) -> str:
    words = []
    for _ in range(rng.randint(min_words, max_words)):
        if rng.random() < 0.05:
            words.append(rng.choice(_AWKWARD))
        else:
            words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    return " ".join(words)


def random_texts(rng: random.Random, n: int, **kwargs) -> list[str]:
    return [random_text(rng, **kwargs) for _ in range(n)]


def write_jsonl(path: Path, texts: list[str], field: str = "text", extra: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({field: t, **(extra or {})}) + "\n")
    return path


def data_config(tmp_path: Path, source: str, **overrides) -> DataConfig:
    """A DataConfig whose caches live under tmp_path (never the user's cache)."""
    settings = {"source": source, "cache_dir": str(tmp_path / "cache"), "vocab_size": 512, "seq_len": 16}
    settings.update(overrides)
    return DataConfig(**settings)
