"""Token shards: a source tokenized once into memory-mapped files, with a manifest, cached by its inputs.

Layout of one cache entry ``<cache_dir>/shards/<name>-<key>/``::

    manifest.json           source, tokenizer hash, token dtype, per split: documents, tokens, shard files
    train_00000.bin ...     raw little-endian uint16 (vocab <= 65536) or uint32 token ids
    val_00000.bin ...

Each split is one stream ``<|endoftext|> doc0 <|endoftext|> doc1 ...`` cut into files of
``data.shard_tokens`` tokens (loaders see one stream). The document token *opens* each document, so
its first token is predicted from the same context as at generation time.

The cache key is (source fingerprint, tokenizer hash, settings), so a change builds a new entry
instead of reading stale tokens; entries are built under a file lock and renamed into place.

Validation split: document ``i`` is held out when ``floor((i+1)·f) > floor(i·f)`` (evenly spread,
exactly a fraction ``f``); a source too small for that gives its last document to validation.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError

FORMAT_VERSION = 1
ENCODE_BATCH_DOCS = 256
SPLITS = ("train", "val")


def is_validation(index: int, fraction: float) -> bool:
    """Whether document ``index`` of a source belongs to the held-out split."""
    return math.floor((index + 1) * fraction) > math.floor(index * fraction)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cache_key(fingerprint: dict, tokenizer_hash: str, val_fraction: float, shard_tokens: int) -> str:
    settings = {
        "format": FORMAT_VERSION,
        "source": fingerprint,
        "tokenizer": tokenizer_hash,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
    }
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


@contextmanager
def file_lock(path: Path):
    """An exclusive lock between processes (ranks) building the same cache entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class TokenStream:
    """The shard files of one split as one read-only token sequence (memory-mapped)."""

    def __init__(self, paths: list[Path], dtype: np.dtype):
        self.parts = [np.memmap(p, dtype=dtype, mode="r") for p in paths if p.stat().st_size > 0]
        self.starts = np.cumsum([0] + [len(m) for m in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def slice(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) as int64, copied out of the memory maps."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"token range [{start}, {stop}) outside a stream of {len(self)} tokens")
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        pieces, pos = [], start
        while pos < stop:
            part_start = int(self.starts[first])
            take = min(stop, int(self.starts[first + 1])) - pos
            pieces.append(self.parts[first][pos - part_start : pos - part_start + take])
            pos += take
            first += 1
        return np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, np.int64)


@dataclass
class ShardSet:
    """A loaded cache entry: the manifest and one token stream per split."""

    root: Path
    manifest: dict
    train: TokenStream
    val: TokenStream

    def tokens(self, split: str) -> int:
        return self.manifest["splits"][split]["tokens"]

    def documents(self, split: str) -> int:
        return self.manifest["splits"][split]["documents"]


class _SplitWriter:
    """Appends token ids to a split and cuts them into shard files of ``shard_tokens``."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, dtype, shard_tokens
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[dict] = []
        self.documents = 0
        self.tokens = 0

    def add_document(self, ids: np.ndarray) -> None:
        self.buffer.append(ids.astype(self.dtype))
        self.buffered += len(ids)
        self.documents += 1
        self.tokens += len(ids)
        while self.buffered >= self.shard_tokens:
            self._flush(self.shard_tokens)

    def close(self) -> dict:
        if self.buffered:
            self._flush(self.buffered)
        return {"documents": self.documents, "tokens": self.tokens, "shards": self.shards}

    def _flush(self, n: int) -> None:
        data = np.concatenate(self.buffer)
        out, rest = data[:n], data[n:]
        self.buffer, self.buffered = ([rest] if len(rest) else []), len(rest)
        name = f"{self.split}_{len(self.shards):05d}.bin"
        out.tofile(self.root / name)
        self.shards.append({"file": name, "tokens": int(len(out)), "sha256": sha256_file(self.root / name)})


def _encoded_documents(
    documents: Iterable[str], tokenizer: Tokenizer, total: int | None, label: str
) -> Iterator[np.ndarray]:
    """Each document's ids with the document token in front; encoded in parallel batches."""
    batch: list[str] = []
    eos = np.array([tokenizer.eos], dtype=np.int64)
    with tqdm(total=total, desc=f"tokenizing {label}", unit="doc", disable=None, leave=False) as bar:
        for text in documents:
            batch.append(text)
            if len(batch) == ENCODE_BATCH_DOCS:
                for ids in tokenizer.encode_batch(batch):
                    yield np.concatenate([eos, np.asarray(ids, dtype=np.int64)])
                bar.update(len(batch))
                batch = []
        for ids in tokenizer.encode_batch(batch):
            yield np.concatenate([eos, np.asarray(ids, dtype=np.int64)])
        bar.update(len(batch))


def _build(source, tokenizer: Tokenizer, root: Path, val_fraction: float, shard_tokens: int) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: _SplitWriter(root, s, dtype, shard_tokens) for s in SPLITS}
    pending = None  # the latest train document, held back in case validation would stay empty
    encoded = _encoded_documents(source.iter_documents(), tokenizer, source.n_documents, source.name)
    for index, ids in enumerate(encoded):
        if val_fraction > 0 and is_validation(index, val_fraction):
            writers["val"].add_document(ids)
            continue
        if pending is not None:
            writers["train"].add_document(pending)
        pending = ids
    if pending is not None:
        small_source = val_fraction > 0 and writers["val"].documents == 0 and writers["train"].documents > 0
        writers["val" if small_source else "train"].add_document(pending)
    splits = {s: w.close() for s, w in writers.items()}
    if splits["train"]["documents"] == 0:
        raise DataError(f"data source '{source.name}' gave no documents; check the data")
    return {
        "format": FORMAT_VERSION,
        "source": {
            "name": source.name,
            "description": source.describe(),
            "fingerprint": source.fingerprint(),
        },
        "tokenizer_hash": tokenizer.content_hash,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos,
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "splits": splits,
    }


def load_shards(root: Path, verify: bool = True) -> ShardSet:
    """Open a built cache entry; a file that is missing, truncated or altered is a DataError."""
    manifest = json.loads((root / "manifest.json").read_text())
    dtype = np.dtype(manifest["dtype"])
    streams = {}
    for split in SPLITS:
        paths = []
        for shard in manifest["splits"][split]["shards"]:
            path = root / shard["file"]
            fix = f"delete the cache folder {root} and run again to rebuild it"
            if not path.is_file():
                raise DataError(f"token shard {path} is missing; {fix}")
            if path.stat().st_size != shard["tokens"] * dtype.itemsize:
                raise DataError(f"token shard {path} has the wrong size (truncated?); {fix}")
            if verify and sha256_file(path) != shard["sha256"]:
                raise DataError(f"token shard {path} is corrupt (sha256 differs from manifest.json); {fix}")
            paths.append(path)
        streams[split] = TokenStream(paths, dtype)
    return ShardSet(root, manifest, streams["train"], streams["val"])


def build_or_load_shards(
    source, tokenizer: Tokenizer, cache_dir: Path, val_fraction: float, shard_tokens: int, verify: bool = True
) -> ShardSet:
    """The source's shards for this tokenizer: loaded from the cache, or built once and cached."""
    key = cache_key(source.fingerprint(), tokenizer.content_hash, val_fraction, shard_tokens)
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in source.name)[-48:].strip("._") or "source"
    root = cache_dir / "shards" / f"{slug}-{key}"
    with file_lock(cache_dir / "shards" / f".{slug}-{key}.lock"):
        if not (root / "manifest.json").is_file():
            tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                manifest = _build(source, tokenizer, tmp, val_fraction, shard_tokens)
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
                os.replace(tmp, root)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return load_shards(root, verify=verify)
