"""Hostile data: invalid UTF-8 named by file and byte (or replaced on request), a 10 MB whitespace-free
token that trains a BPE in seconds, and Ctrl-C that stops tokenizer training at once."""

import bz2
import gzip
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from data_corpus import data_config, fresh_rng, random_texts, write_jsonl
from inkling_fp4.data.bpe_training import train_bpe_for
from inkling_fp4.data.sources import open_source
from inkling_fp4.data.text_encoding import first_invalid_utf8, utf8_files
from inkling_fp4.data.tokenizer import TRAIN_RUN_CHARS, Tokenizer, _bounded_runs
from inkling_fp4.errors import ConfigError, DataError


def _docs(tmp_path, source, **overrides):
    return list(open_source(source, data_config(tmp_path, source, **overrides)).iter_documents())


# ----------------------------------------------------------------------------------------------
# invalid UTF-8


def test_first_invalid_utf8_gives_the_exact_offset(tmp_path, monkeypatch):
    import inkling_fp4.data.text_encoding as te

    monkeypatch.setattr(te, "_CHUNK", 7)  # sequences cut by chunk ends, bad bytes at the boundaries
    good = "héllo wörld 🙂 日本".encode()
    for at in range(len(good) + 1):
        if at < len(good) and (good[at] & 0xC0) == 0x80:
            continue  # not a character boundary
        f = tmp_path / "t.txt"
        f.write_bytes(good[:at] + b"\xff" + good[at:])
        assert first_invalid_utf8(f) == (at, b"\xff"), at
    f.write_bytes(good)
    assert first_invalid_utf8(f) is None
    f.write_bytes(good + "é".encode()[:1])  # a sequence cut by the end of the file
    assert first_invalid_utf8(f)[0] == len(good)


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "csv"])
def test_invalid_utf8_names_the_file_and_byte(tmp_path, fmt):
    head = {"jsonl": b'{"text": "fine"}\n{"text": "bad ', "txt": b"fine\nbad ", "csv": b"text\nfine\nbad "}[
        fmt
    ]
    tail = {"jsonl": b' here"}\n', "txt": b" here\n", "csv": b" here\n"}[fmt]
    path = tmp_path / f"data.{fmt}"
    path.write_bytes(head + b"\xc3\x28" + tail)  # 0xC3 must be followed by a continuation byte
    with pytest.raises(DataError) as err:
        _docs(tmp_path, str(path))
    msg = str(err.value)
    assert msg == (
        f"{path}: invalid UTF-8 at byte {len(head)} (c3); fix the file, or set data.encoding_errors=replace "
        "to read bad bytes as U+FFFD"
    )
    docs = _docs(tmp_path, str(path), encoding_errors="replace")
    assert any("bad \ufffd( here" in d for d in docs) and any("fine" in d for d in docs)


def test_replace_reads_on_and_leaves_valid_files_alone(tmp_path):
    texts = random_texts(fresh_rng(), 20)
    good = write_jsonl(tmp_path / "d" / "a.jsonl", texts[:10])
    bad = tmp_path / "d" / "b.jsonl"
    lines = [json.dumps({"text": t}).encode() for t in texts[10:]]
    lines[0] = lines[0].removesuffix(b'"}') + b'\x80"}'  # a bad byte at the end of the first text
    bad.write_bytes(b"\n".join(lines) + b"\n")
    docs = _docs(tmp_path, str(tmp_path / "d"), encoding_errors="replace")
    assert docs[:10] == texts[:10] and docs[10] == texts[10] + "\ufffd" and docs[11:] == texts[11:]
    files = utf8_files([good, bad], "replace", tmp_path / "cache")
    assert files[0] == good and files[1] != bad and files[1].name == "b.jsonl"
    assert _docs(tmp_path, str(good)) == texts[:10]  # strict: a valid file reads as it is


def test_compressed_files_are_checked(tmp_path):
    for suffix, opener in ((".gz", gzip.open), (".bz2", bz2.open)):
        path = tmp_path / f"data{suffix[1:]}.jsonl{suffix}"
        with opener(path, "wb") as f:
            f.write(b'{"text": "ok"}\n{"text": "\xfe"}\n')
        with pytest.raises(DataError, match=r"invalid UTF-8 at byte 25 of its decompressed content"):
            _docs(tmp_path, str(path))
        assert _docs(tmp_path, str(path), encoding_errors="replace") == ["ok", "\ufffd"]


def test_a_fixed_file_is_checked_again(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"one \xff\n")
    with pytest.raises(DataError, match="invalid UTF-8"):
        _docs(tmp_path, str(path))
    path.write_bytes(b"one two\n")
    assert _docs(tmp_path, str(path)) == ["one two\n"]


def test_encoding_errors_is_validated(tmp_path):
    with pytest.raises((ValueError, ConfigError), match="data.encoding_errors must be strict or replace"):
        data_config(tmp_path, "builtin", encoding_errors="ignore")


# ----------------------------------------------------------------------------------------------
# a giant whitespace-free token


def test_long_runs_are_cut_for_training_only():
    stop = threading.Event()
    text = "short words " + "x" * (3 * TRAIN_RUN_CHARS + 5) + " end"
    pieces = list(_bounded_runs([text, "plain"], stop))
    assert "".join(pieces[:-1]) == text and pieces[-1] == "plain"
    assert max(len(run) for p in pieces for run in p.split()) == TRAIN_RUN_CHARS
    assert list(_bounded_runs(["a b c"], stop)) == ["a b c"]  # ordinary text passes as it is


def test_ten_megabyte_token_trains_a_tokenizer_in_seconds(tmp_path):
    path = tmp_path / "giant.txt"
    rng = fresh_rng()
    path.write_text("\n".join(random_texts(rng, 200)) + "\n" + "ab" * 5_000_000 + "a" * 1_000_000 + "\n")
    cfg = data_config(tmp_path, str(path), vocab_size=600, val_fraction=0.0)
    start = time.perf_counter()
    tok = train_bpe_for(cfg, [open_source(str(path), cfg)])
    took = time.perf_counter() - start
    assert took < 30, f"BPE training on a 10 MB token took {took:.1f}s"
    assert tok.vocab_size == 600
    start = time.perf_counter()
    ids = tok.encode("ab" * 500_000)  # encoding is unaffected by the cut, and fast enough
    assert tok.decode(ids) == "ab" * 500_000 and time.perf_counter() - start < 10


# ----------------------------------------------------------------------------------------------
# Ctrl-C


TRAINER = """
import signal, sys, time
import numpy as np
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, also under a background CI job
from inkling_fp4.data.tokenizer import Tokenizer
rng = np.random.default_rng(0)
texts = [rng.integers(97, 123, 200, dtype=np.uint8).tobytes().decode() for _ in range(60_000)]  # ~20 s
print("training", flush=True)
start = time.perf_counter()
try:
    Tokenizer.train_bpe(texts, 4096, show_progress=False)
except KeyboardInterrupt:
    print(f"interrupted {time.perf_counter() - start:.1f}", flush=True)
    sys.exit(130)
print("finished", flush=True)
"""


def test_ctrl_c_stops_tokenizer_training_within_seconds():
    proc = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "training"
        time.sleep(1.0)  # well into the Rust trainer
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        waited = time.perf_counter() - sent
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130 and out.startswith("interrupted"), out
    assert waited < 3, f"the process took {waited:.1f}s to stop after SIGINT"


def test_errors_inside_training_reach_the_caller():
    def texts():
        yield "some text"
        raise DataError("data source 'x' broke")

    with pytest.raises(DataError, match="broke"):
        Tokenizer.train_bpe(texts(), 512, show_progress=False)
