"""Chat records of local jsonl, json and csv files, read as they are written.

Why not ``datasets``: it infers one type per column, so a CSV column of numbers becomes int, and a
JSON field holding "0" in one record and 7 in another is cast and reported at the wrong record. Chat
data is small, so these files are read here: csv cells stay strings as written; JSON lines (or one
array of objects) keep their JSON types, so a number where text belongs is reported at its record.
Parquet, arrow and .zst stay with ``datasets`` (``sources.py``).
"""

from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from inkling_fp4.data.config import DataConfig
from inkling_fp4.data.sources import DocumentSource, LocalFiles, open_source
from inkling_fp4.data.text_encoding import checkable, open_text, utf8_files
from inkling_fp4.errors import DataError

_FORMATS = ("json", "csv")
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}  # fmt: skip


@dataclass
class RecordFiles:
    """Local json / csv files of one format, read record by record (see the module docstring)."""

    files: list[Path]
    format: str
    name: str
    cache_dir: Path
    encoding_errors: str = "strict"
    max_documents: int | None = None
    records: int | None = None
    """Records read by the last complete pass (None before one)."""

    def iter_rows(self) -> Iterator[dict]:
        n = 0
        for record in self._records():
            if self.max_documents is not None and n >= self.max_documents:
                break
            yield record
            n += 1
        if n == 0:
            raise DataError(f"data source '{self.name}' is empty (0 records); check the files")
        self.records = n

    def _records(self) -> Iterator[dict]:
        read = self._csv if self.format == "csv" else self._json
        index = 0
        text_paths = utf8_files(self.files, self.encoding_errors, self.cache_dir)  # cleaned copies, if asked
        for path, text_path in zip(self.files, text_paths, strict=True):
            for record in read(path, text_path, index):
                yield record
                index += 1

    def describe(self) -> str:
        n, rows = len(self.files), "" if self.records is None else f", {self.records} rows"
        return f"{self.format} files '{self.name}' ({n} file{'s' * (n != 1)}{rows})"

    def _where(self, index: int, path: Path, line: int | None) -> str:
        at = "from 0" if line is None else f"from 0, line {line}"
        if len(self.files) > 1:  # the file, when the source's name does not say it
            at += f" of {path}" if line is not None else f", {path}"
        return f"could not read '{self.name}' as {self.format}: record {index} ({at})"

    def _json(self, path: Path, text_path: Path, index: int) -> Iterator[dict]:
        with open_text(text_path) as f:
            text = f.read()
        if text.lstrip().startswith("["):  # one array of records
            try:
                values = json.loads(text)
            except json.JSONDecodeError:
                values = None  # JSON lines whose first value is an array: reported line by line
            if isinstance(values, list):
                for value in values:
                    yield self._object(value, index, path, None)
                    index += 1
                return
        # NOTE: split at "\n" only: a JSON string may hold U+2028, which str.splitlines() breaks at
        for line, raw in enumerate(text.split("\n"), 1):
            if not raw.strip():
                continue
            try:
                value = json.loads(raw)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{self._where(index, path, line)} is not JSON ({e.msg}); check the files' format"
                ) from None
            yield self._object(value, index, path, line)
            index += 1

    def _object(self, value, index: int, path: Path, line: int | None) -> dict:
        if not isinstance(value, dict):
            kind = _JSON_KINDS.get(type(value), type(value).__name__)
            raise DataError(
                f"{self._where(index, path, line)} is {kind}, not an object of fields; check the files' "
                "format"
            )
        return value

    def _csv(self, path: Path, text_path: Path, index: int) -> Iterator[dict]:
        # NOTE: the csv module refuses a field over 128 KiB by default; a long completion is no error
        csv.field_size_limit(max(csv.field_size_limit(), min(sys.maxsize, 2**31 - 1)))
        with open_text(text_path) as f:
            rows = csv.reader(f)
            try:
                header = next(rows, None)
                for row in rows:
                    if not row:  # a blank line
                        continue
                    if len(row) != len(header):
                        raise DataError(
                            f"{self._where(index, path, rows.line_num)} has {len(row)} fields where the "
                            f"header has {len(header)}; quote the fields that hold commas"
                        )
                    yield dict(zip(header, row, strict=True))
                    index += 1
            except csv.Error as e:
                raise DataError(
                    f"{self._where(index, path, rows.line_num)}: {e}; check the files' format"
                ) from None


def open_records(spec: str, cfg: DataConfig) -> RecordFiles | DocumentSource:
    """The chat records that ``spec`` names: local json / csv read here, else ``sources.py``'s source."""
    source = open_source(spec, cfg)
    if not isinstance(source, LocalFiles) or source.format not in _FORMATS:
        return source
    if not all(checkable(f) for f in source.files):
        return source
    return RecordFiles(source.files, source.format, spec, source.cache_dir, cfg.encoding_errors,
                       cfg.max_documents)  # fmt: skip
