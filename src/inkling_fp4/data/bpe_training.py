"""Training the run's byte-level BPE on its own sources, cached; and the command that does it by hand.

Why train here: the default run must work offline, and a tokenizer fitted to the data (4096 tokens
for the tiny recipe) teaches a small model far more per step than a borrowed 50K vocabulary whose
embedding would dominate its parameters.

The BPE sees only training documents. Training is deterministic, so the cache key names one
tokenizer, and ``fp4train tokenizer`` on the same source gives the very one a run would train.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import tokenizers

from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.shards import file_lock, is_validation
from inkling_fp4.data.sources import DocumentSource, open_source
from inkling_fp4.data.tokenizer import SPECIAL_TOKENS, TRAIN_RUN_CHARS, Tokenizer
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.output_guard import check_output


def training_texts(sources: list[DocumentSource], val_fraction: float, max_bytes: int) -> Iterator[str]:
    """Training documents of each source in order, up to ``max_bytes / len(sources)`` bytes per source."""
    share = max_bytes // max(len(sources), 1)
    for source in sources:
        taken = 0
        for index, text in enumerate(source.iter_documents()):
            if taken >= share:
                break
            if val_fraction > 0 and is_validation(index, val_fraction):
                continue
            taken += len(text.encode("utf-8", errors="replace"))
            yield text


def bpe_cache_key(cfg: DataConfig, sources: list[DocumentSource]) -> str:
    settings = {
        "sources": [s.fingerprint() for s in sources],
        "vocab_size": cfg.vocab_size,
        "min_frequency": cfg.bpe_min_frequency,
        "train_bytes": cfg.tokenizer_train_bytes,
        "val_fraction": cfg.val_fraction,
        "special_tokens": SPECIAL_TOKENS,
        "train_run_chars": TRAIN_RUN_CHARS,
        "tokenizers": tokenizers.__version__,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def train_bpe_for(cfg: DataConfig, sources: list[DocumentSource]) -> Tokenizer:
    """The BPE for these sources and settings: from the cache, or trained now and cached."""
    cache = Path(cfg.cache_dir).expanduser() / "tokenizers"
    path = cache / f"bpe-{cfg.vocab_size}-{bpe_cache_key(cfg, sources)}.json"
    names = " + ".join(s.name for s in sources)
    with file_lock(cache / f".{path.stem}.lock"):
        if not path.is_file():
            texts = training_texts(sources, cfg.val_fraction, cfg.tokenizer_train_bytes)
            Tokenizer.train_bpe(texts, cfg.vocab_size, cfg.bpe_min_frequency).save(path)
    tok = Tokenizer.from_file(path)
    tok.origin = f"byte-level BPE trained on {names} (cached {path})"
    return tok


def not_a_trained_tokenizer(path: Path) -> str | None:
    """Why ``path`` is not a tokenizer this module trained (None: it is one)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        firsts = [(t["id"], t["content"]) for t in data["added_tokens"][: len(SPECIAL_TOKENS)]]
        ok = data["model"]["type"] == "BPE" and firsts == list(enumerate(SPECIAL_TOKENS))
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        ok = False
    return None if ok else "not a byte-level BPE tokenizer.json with fp4train's special tokens"


def tokenizer_target(out: str | Path) -> Path:
    """The file ``OUT`` names: itself when it is a .json path, else tokenizer.json in that folder."""
    out = Path(out).expanduser()
    if out.is_file() and out.suffix != ".json":
        raise UserError(
            f"OUT {out} is a file, not a .json path; pass a .json file or a folder for tokenizer.json"
        )
    return out / "tokenizer.json" if out.is_dir() or out.suffix != ".json" else out


def train_tokenizer_command(
    source: str,
    vocab_size: int,
    out: str | Path,
    text_field: str = "text",
    max_documents: int | None = None,
    cache_dir: str | None = None,
    force: bool = False,
) -> str:
    """Train a ``vocab_size``-token byte-level BPE on ``source`` into ``out``; returns the console's lines."""
    overrides = {"cache_dir": cache_dir} if cache_dir else {}
    try:
        cfg = DataConfig(
            source=source,
            vocab_size=vocab_size,
            text_field=text_field,
            max_documents=max_documents,
            **overrides,
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    target = tokenizer_target(out)
    replacing = check_output(target, "OUT", "tokenizer", kind="file", force=force,
                             not_own=not_a_trained_tokenizer, inputs=[("--source", source)])  # fmt: skip
    sources = [open_source(source, cfg)]
    tok = train_bpe_for(cfg, sources)
    target.parent.mkdir(parents=True, exist_ok=True)
    tok.save(target)
    saved = f"saved {target}: byte-level BPE, vocab {tok.vocab_size}, trained on {sources[0].describe()}"
    return f"{replacing}\n{saved}" if replacing else saved
