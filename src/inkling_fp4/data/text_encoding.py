"""Invalid UTF-8 in local text files, found before ``datasets`` reads them: the file and the byte.

Why: ``datasets`` reads json, csv and text through pyarrow, which stops at the first bad byte with an
error naming neither the file nor the byte. So each text file is streamed once through an incremental
UTF-8 decoder: under ``data.encoding_errors=strict`` a bad file is a :class:`DataError` naming file
and offset; under ``replace`` a cleaned copy (U+FFFD) in the cache is read instead (the fingerprint
stays the file's). A clean file is remembered by a marker keyed on path, size and mtime. Compressed
files (.gz, .bz2, .xz) are checked decompressed; .zst cannot be (no standard-library codec).
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import hashlib
import io
import json
import lzma
import os
from pathlib import Path

from inkling_fp4.errors import DataError

ENCODING_ERRORS = ("strict", "replace")
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_CHUNK = 1 << 22


def checkable(path: Path) -> bool:
    """Whether ``path`` can be streamed here (plain, or compressed with a standard-library codec)."""
    suffix = path.suffix.lower()
    return suffix in _OPENERS or suffix not in (".zst", ".zstd")


def _open_bytes(path: Path):
    return _OPENERS.get(path.suffix.lower(), open)(path, "rb")


def open_text(path: Path) -> io.TextIOWrapper:
    """``path``, decompressed as its suffix says, as UTF-8 text: a byte-order mark dropped, line ends
    as written (what the csv module needs)."""
    return io.TextIOWrapper(_open_bytes(path), encoding="utf-8-sig", newline="")


def first_invalid_utf8(path: Path) -> tuple[int, bytes] | None:
    """(offset, the bad bytes) of the first invalid UTF-8 in ``path`` (decompressed), or None."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    fed = 0
    with _open_bytes(path) as f:
        while True:
            chunk = f.read(_CHUNK)
            pending = len(decoder.getstate()[0])  # a sequence cut by the previous chunk's end
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:  # e.start counts from the pending bytes
                return fed - pending + e.start, e.object[e.start : e.end]
            if not chunk:
                return None
            fed += len(chunk)


def _key(path: Path) -> str:
    st = path.stat()
    stamp = json.dumps([str(path.resolve()), st.st_size, st.st_mtime_ns])
    return hashlib.sha256(stamp.encode()).hexdigest()[:16]


def _write_replaced(src: Path, dst: Path) -> None:
    """``src`` decoded with bad bytes as U+FFFD, written as UTF-8 to ``dst`` (atomically)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    with _open_bytes(src) as f, open(tmp, "w", encoding="utf-8", newline="") as out:
        while chunk := f.read(_CHUNK):
            out.write(decoder.decode(chunk))
        out.write(decoder.decode(b"", final=True))
    os.replace(tmp, dst)


def utf8_files(files: list[Path], errors: str, cache_dir: Path) -> list[Path]:
    """The files ``datasets`` should read for ``files`` under ``errors`` (see the module docstring)."""
    if errors not in ENCODING_ERRORS:
        raise AssertionError(f"encoding_errors {errors!r} is validated in DataConfig")
    root = cache_dir / "utf8"
    out = []
    for path in files:
        if not checkable(path):
            out.append(path)
            continue
        key = _key(path)
        compressed = path.suffix.lower() in _OPENERS
        clean = root / key / (path.stem if compressed else path.name)  # a.jsonl.gz -> a.jsonl
        if (root / f"{key}.ok").is_file():
            out.append(path)
            continue
        if errors == "replace" and clean.is_file():
            out.append(clean)
            continue
        try:
            bad = first_invalid_utf8(path)
        except (OSError, EOFError, lzma.LZMAError) as e:  # a corrupt archive: datasets will say so too
            raise DataError(f"cannot read {path} ({e}); check the file") from None
        if bad is None:
            root.mkdir(parents=True, exist_ok=True)
            (root / f"{key}.ok").touch()
            out.append(path)
        elif errors == "strict":
            offset, raw = bad
            where = f"byte {offset}" + (" of its decompressed content" if compressed else "")
            raise DataError(
                f"{path}: invalid UTF-8 at {where} ({raw.hex(' ')}); fix the file, or set "
                "data.encoding_errors=replace to read bad bytes as U+FFFD"
            )
        else:
            _write_replaced(path, clean)
            out.append(clean)
    return out
