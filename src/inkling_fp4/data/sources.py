"""Where documents come from: local files through Hugging Face ``datasets``, the hub, or the built-in corpus.

A source is one string, resolved in this order:

- ``builtin``: the offline corpus of Python standard library files (``builtin_corpus.py``);
- a path, glob, folder, or anything that looks like a path: local files of one format, read with
  ``datasets.load_dataset(<format>, data_files=[...])``;
- anything else: a hub dataset ``owner/name[:config]``, streamed (never downloaded whole).

Every source yields one string per document in a fixed order, and a fingerprint that changes with
its inputs, so token shards are rebuilt exactly when needed.
"""

from __future__ import annotations

import contextlib
import glob
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from inkling_fp4.data.builtin_corpus import BuiltinCorpus
from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.hub import hub_offline_flag, require_hub
from inkling_fp4.data.text_encoding import utf8_files
from inkling_fp4.errors import DataError

FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".md": "text",
    ".text": "text",
    ".arrow": "arrow",
}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")
_TEXT_FORMATS = ("json", "csv", "text")  # read as UTF-8 by datasets: checked first (text_encoding.py)
_ROWS_PER_READ = 1000


class DocumentSource(Protocol):
    name: str

    @property
    def n_documents(self) -> int | None: ...

    def iter_documents(self) -> Iterator[str]: ...

    def fingerprint(self) -> dict: ...

    def describe(self) -> str: ...


def file_format(path: Path) -> str | None:
    """The ``datasets`` builder for a file name, or None for an unsupported one."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return FORMATS.get(suffixes[-1]) if suffixes else None


def _looks_local(spec: str) -> bool:
    p = Path(spec).expanduser()
    return (
        p.exists()
        or any(c in spec for c in "*?[")
        or spec.startswith(("/", ".", "~"))
        or file_format(p) is not None
    )


def resolve_files(spec: str) -> list[Path]:
    """The sorted list of supported files that a path, glob or folder names."""
    p = Path(spec).expanduser()
    if p.is_dir():
        candidates = sorted(q for q in p.rglob("*") if q.is_file())
        files = [q for q in candidates if file_format(q) is not None]
        if not files:
            raise DataError(
                f"folder '{spec}' holds no supported data files; expected one of "
                f"{', '.join(sorted(FORMATS))} (optionally compressed)"
            )
        return files
    if p.is_file():
        files = [p]
    else:
        files = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not files:
            what = "no files match" if any(c in spec for c in "*?[") else "no such file or folder:"
            raise DataError(f"data source {what} '{spec}'; check the path (relative to {Path.cwd()})")
    unsupported = [q for q in files if file_format(q) is None]
    if unsupported:
        raise DataError(
            f"'{unsupported[0]}' is not a supported data file; use one of {', '.join(sorted(FORMATS))}"
        )
    return files


@dataclass
class LocalFiles:
    """Local data files of one format, read through ``datasets`` (converted to Arrow once, cached)."""

    files: list[Path]
    text_field: str
    cache_dir: Path
    sample_by: str = "document"
    max_documents: int | None = None
    max_bytes: int | None = None
    name: str = ""
    encoding_errors: str = "strict"
    _dataset: object = field(default=None, repr=False)

    @property
    def format(self) -> str:
        formats = sorted({file_format(f) for f in self.files})
        if len(formats) > 1:
            raise DataError(
                f"source '{self.name}' mixes file formats ({', '.join(formats)}); use one format per "
                "source, and blend formats with data.phases"
            )
        return formats[0]

    def dataset(self):
        """The whole table (``datasets.Dataset``), loaded once."""
        if self._dataset is None:
            import datasets

            if all(f.stat().st_size == 0 for f in self.files):
                raise DataError(
                    f"data source '{self.name}' is empty (its files hold no data); check the files"
                )
            kwargs = {"sample_by": self.sample_by} if self.format == "text" else {}
            files = self.files
            if self.format in _TEXT_FORMATS:
                files = utf8_files(files, self.encoding_errors, self.cache_dir)
            try:
                with _datasets_quiet():
                    ds = datasets.load_dataset(
                        self.format,
                        data_files=[str(f) for f in files],
                        split="train",
                        cache_dir=str(self.cache_dir / "hf_datasets"),
                        **kwargs,
                    )
            except Exception as e:  # pyarrow / json parse errors: name the files, keep the cause short
                raise DataError(
                    f"could not read '{self.name}' as {self.format} ({_first_line(e)}); "
                    "check the files' format"
                ) from None
            if len(ds) == 0:
                raise DataError(f"data source '{self.name}' is empty (0 rows); check the files")
            self._dataset = ds
        return self._dataset

    @property
    def n_documents(self) -> int:
        n = len(self.dataset())
        return n if self.max_documents is None else min(n, self.max_documents)

    def iter_rows(self) -> Iterator[dict]:
        """Whole records (for chat data): dicts of every column."""
        for i, row in enumerate(self.dataset()):
            if self.max_documents is not None and i >= self.max_documents:
                return
            yield row

    def iter_documents(self) -> Iterator[str]:
        ds = self.dataset()
        _check_text_field(self.name, self.text_field, ds.column_names)
        column = ds.select_columns([self.text_field])
        yield from _capped_texts(
            self.name,
            self.text_field,
            _column_batches(column, self.text_field),
            self.max_documents,
            self.max_bytes,
        )

    def fingerprint(self) -> dict:
        stats = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files]
        return {
            "kind": "files",
            "files": stats,
            "text_field": self.text_field,
            "sample_by": self.sample_by,
            "max_documents": self.max_documents,
            "max_bytes": self.max_bytes,
        }

    def describe(self) -> str:
        n = len(self.files)
        return f"{self.format} files '{self.name}' ({n} file{'s' * (n != 1)}, {self.n_documents} rows)"


@dataclass
class HubDataset:
    """A hub dataset streamed split 'train' (so a 10B-token dataset is never downloaded whole)."""

    repo: str
    config: str | None
    text_field: str
    cache_dir: Path
    max_documents: int | None = None
    max_bytes: int | None = None
    name: str = ""

    n_documents = None

    def _stream(self):
        import datasets

        if not hub_offline_flag():
            require_hub(f"dataset '{self.name}'", "pass local files or data.source=builtin")
        try:
            with _datasets_quiet():
                return datasets.load_dataset(
                    self.repo,
                    self.config,
                    split="train",
                    streaming=True,
                    cache_dir=str(self.cache_dir / "hf_datasets"),
                )
        except Exception as e:
            raise DataError(
                f"could not open hub dataset '{self.name}' ({_first_line(e)}); "
                "check the name (owner/name[:config]) or pass local files"
            ) from None

    def iter_rows(self) -> Iterator[dict]:
        for i, row in enumerate(self._stream()):
            if self.max_documents is not None and i >= self.max_documents:
                return
            yield row

    def iter_documents(self) -> Iterator[str]:
        stream = self._stream()
        first = next(iter(stream), None)
        if first is None:
            raise DataError(f"hub dataset '{self.name}' is empty")
        _check_text_field(self.name, self.text_field, list(first))
        rows = (row[self.text_field] for row in stream)
        yield from _capped_texts(
            self.name, self.text_field, ([t] for t in rows), self.max_documents, self.max_bytes
        )

    def fingerprint(self) -> dict:
        return {
            "kind": "hub",
            "repo": self.repo,
            "config": self.config,
            "text_field": self.text_field,
            "max_documents": self.max_documents,
            "max_bytes": self.max_bytes,
        }

    def describe(self) -> str:
        return f"hub dataset '{self.name}' (streamed)"


@contextlib.contextmanager
def _datasets_quiet():
    """Silence ``datasets``' log while it loads: the DataError made of its failure says it in one line."""
    from datasets.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _first_line(e: Exception) -> str:
    while type(e).__name__ == "DatasetGenerationError" and (e.__cause__ or e.__context__):
        e = e.__cause__ or e.__context__  # "An error occurred while generating the dataset": say which
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _check_text_field(name: str, text_field: str, columns: list[str]) -> None:
    if text_field not in columns:
        raise DataError(
            f"data source '{name}' has no field '{text_field}'; its fields are {', '.join(columns)}: "
            f"set data.text_field to the one holding the text"
        )


def _column_batches(ds, text_field: str) -> Iterator[list]:
    for start in range(0, len(ds), _ROWS_PER_READ):
        yield ds[start : start + _ROWS_PER_READ][text_field]


def _capped_texts(name, text_field, batches, max_documents, max_bytes) -> Iterator[str]:
    """Non-empty strings in order, up to the caps; a non-string value is an error naming the row."""
    count, taken, row = 0, 0, -1
    for batch in batches:
        for text in batch:
            row += 1
            if max_documents is not None and count >= max_documents:
                return
            if max_bytes is not None and taken >= max_bytes:
                return
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise DataError(
                    f"data source '{name}': field '{text_field}' of row {row} is a {type(text).__name__}, "
                    "not text; point data.text_field at a string field"
                )
            count += 1
            taken += len(text.encode("utf-8", errors="replace"))
            yield text
    if count == 0:
        raise DataError(f"data source '{name}' has no non-empty '{text_field}' values; check the data")


def open_source(spec: str, cfg: DataConfig) -> DocumentSource:
    """The document source that ``spec`` names (see the module docstring for the rules)."""
    cache_dir = Path(cfg.cache_dir).expanduser()
    caps = {"max_documents": cfg.max_documents, "max_bytes": cfg.max_bytes}
    if spec == "builtin":
        return BuiltinCorpus.open(
            site_packages=cfg.builtin_site_packages, max_file_bytes=cfg.builtin_max_file_bytes, **caps
        )
    if _looks_local(spec):
        return LocalFiles(
            resolve_files(spec),
            cfg.text_field,
            cache_dir,
            cfg.text_sample_by,
            name=spec,
            encoding_errors=cfg.encoding_errors,
            **caps,
        )
    repo, _, config = spec.partition(":")
    return HubDataset(repo, config or None, cfg.text_field, cache_dir, name=spec, **caps)
