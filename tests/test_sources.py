"""Sources: every local file format, globs and folders, the hub path offline, and the clear errors."""

import csv
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_corpus import data_config, fresh_rng, random_texts, write_jsonl
from inkling_fp4.data.sources import HubDataset, LocalFiles, file_format, open_source
from inkling_fp4.errors import DataError


def _docs(tmp_path, source, **overrides):
    return list(open_source(source, data_config(tmp_path, source, **overrides)).iter_documents())


@pytest.fixture
def texts():
    rng = fresh_rng()
    return random_texts(rng, 25)


def test_jsonl(tmp_path, texts):
    path = write_jsonl(tmp_path / "d.jsonl", texts, extra={"id": 1})
    assert _docs(tmp_path, str(path)) == texts


def test_json_array(tmp_path, texts):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"body": t, "n": i} for i, t in enumerate(texts)]))
    assert _docs(tmp_path, str(path), text_field="body") == texts


def test_parquet(tmp_path, texts):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": texts, "score": list(range(len(texts)))}), path)
    assert _docs(tmp_path, str(path)) == texts


def test_csv(tmp_path, texts):
    path = tmp_path / "d.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["title", "content"])
        writer.writerows([[f"t{i}", t] for i, t in enumerate(texts)])
    expected = [t.replace("\r\n", "\n").replace("\r", "\n") for t in texts]  # csv's newline translation
    got = [
        t.replace("\r\n", "\n").replace("\r", "\n") for t in _docs(tmp_path, str(path), text_field="content")
    ]
    assert got == expected


def test_arrow(tmp_path, texts):
    path = tmp_path / "d.arrow"
    table = pa.table({"text": texts})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    assert _docs(tmp_path, str(path)) == texts


def test_txt_one_document_per_file_and_per_line(tmp_path, texts):
    clean = [" ".join(t.split()) or "x" for t in texts]  # no line breaks inside a document
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, t in enumerate(clean[:5]):
        (folder / f"{i:02d}.txt").write_text(t, encoding="utf-8")
    assert [d.strip("\n") for d in _docs(tmp_path, str(folder))] == clean[:5]
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(clean) + "\n", encoding="utf-8")
    assert _docs(tmp_path, str(lines), text_sample_by="line") == clean


def test_glob_and_folder_read_files_in_sorted_order(tmp_path, texts):
    for name, part in (("b.jsonl", texts[10:]), ("a.jsonl", texts[:10])):
        write_jsonl(tmp_path / "set" / name, part)
    assert _docs(tmp_path, str(tmp_path / "set" / "*.jsonl")) == texts
    assert _docs(tmp_path, str(tmp_path / "set")) == texts


def test_caps_keep_the_order(tmp_path, texts):
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    assert _docs(tmp_path, str(path), max_documents=7) == texts[:7]
    capped = _docs(tmp_path, str(path), max_bytes=len(texts[0].encode()) + 1)
    assert capped == texts[:2]


def test_fingerprint_follows_the_files(tmp_path, texts):
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    cfg = data_config(tmp_path, str(path))
    before = open_source(str(path), cfg).fingerprint()
    assert open_source(str(path), cfg).fingerprint() == before
    write_jsonl(path, texts[:-1])
    os.utime(path, ns=(1, 1))
    assert open_source(str(path), cfg).fingerprint() != before


def test_missing_path(tmp_path):
    with pytest.raises(DataError, match="no such file or folder: .*missing.jsonl"):
        open_source(str(tmp_path / "missing.jsonl"), data_config(tmp_path, "x"))
    with pytest.raises(DataError, match="no files match"):
        open_source(str(tmp_path / "*.parquet"), data_config(tmp_path, "x"))


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="empty"):
        _docs(tmp_path, str(tmp_path / "empty.jsonl"))
    write_jsonl(tmp_path / "blank.jsonl", ["", ""])
    with pytest.raises(DataError, match="no non-empty 'text' values"):
        _docs(tmp_path, str(tmp_path / "blank.jsonl"))


def test_missing_text_field_lists_the_fields(tmp_path, texts):
    path = write_jsonl(tmp_path / "d.jsonl", texts, field="content", extra={"url": "u"})
    with pytest.raises(DataError, match=r"no field 'text'; its fields are content, url.*data.text_field"):
        _docs(tmp_path, str(path))


def test_non_text_field_names_the_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "ok", "n": 1}\n{"text": "fine", "n": 2}\n')
    with pytest.raises(DataError, match="row 0 is a int"):
        _docs(tmp_path, str(path), text_field="n")


def test_unsupported_and_mixed_formats(tmp_path, texts):
    (tmp_path / "notes.xyz").write_text("hello")
    with pytest.raises(DataError, match="not a supported data file"):
        open_source(str(tmp_path / "notes.xyz"), data_config(tmp_path, "x"))
    write_jsonl(tmp_path / "mix" / "a.jsonl", texts)
    (tmp_path / "mix" / "b.txt").write_text("plain")
    with pytest.raises(DataError, match="mixes file formats"):
        _docs(tmp_path, str(tmp_path / "mix"))


def test_compressed_and_classification():
    from pathlib import Path

    assert file_format(Path("a/b.jsonl.gz")) == "json"
    assert file_format(Path("x.PARQUET")) == "parquet"
    assert file_format(Path("x.bin")) is None


def test_source_kinds(tmp_path, texts):
    path = write_jsonl(tmp_path / "d.jsonl", texts)
    assert isinstance(open_source(str(path), data_config(tmp_path, "x")), LocalFiles)
    hub = open_source("someone/some-dataset:sub", data_config(tmp_path, "x"))
    assert isinstance(hub, HubDataset) and hub.repo == "someone/some-dataset" and hub.config == "sub"


def test_hub_dataset_offline_is_a_quick_clear_error(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr("inkling_fp4.data.hub._endpoint_reachable", lambda: False)
    with pytest.raises(DataError, match="cannot be reached.*local files"):
        _docs(tmp_path, "no-such-owner-fp4train/no-such-dataset")
