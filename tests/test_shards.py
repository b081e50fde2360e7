"""Token shards: exact contents, identical across runs, cache reuse and invalidation, checksums."""

import json
import math

import numpy as np
import pytest

import inkling_fp4.data.shards as shards_mod
from data_corpus import data_config, fresh_rng, random_texts, write_jsonl
from inkling_fp4.data.shards import TokenStream, build_or_load_shards, is_validation, load_shards, token_dtype
from inkling_fp4.data.sources import open_source
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError


@pytest.fixture(scope="module")
def corpus():
    rng = fresh_rng()
    texts = random_texts(rng, 120, max_words=40)
    return texts, Tokenizer.train_bpe(texts, vocab_size=512, show_progress=False)


def _build(tmp_path, texts, tok, cache="cache", **overrides):
    src = tmp_path / "d.jsonl"
    if not src.exists():
        write_jsonl(src, texts)
    settings = {"val_fraction": 0.1, "shard_tokens": 1024} | overrides
    cfg = data_config(tmp_path, str(src), **settings)
    source = open_source(str(src), cfg)
    return build_or_load_shards(source, tok, tmp_path / cache, cfg.val_fraction, cfg.shard_tokens)


def test_streams_hold_exactly_the_documents(tmp_path, corpus):
    texts, tok = corpus
    shards = _build(tmp_path, texts, tok)
    val_idx = [i for i in range(len(texts)) if is_validation(i, 0.1)]
    assert len(val_idx) == 12  # exactly the fraction, evenly spread
    expected = {"train": [], "val": []}
    for i, t in enumerate(texts):
        expected["val" if i in val_idx else "train"] += [tok.eos, *tok.encode(t)]
    for split in ("train", "val"):
        stream = getattr(shards, split)
        got = stream.slice(0, len(stream))
        assert got.tolist() == expected[split]
        assert shards.tokens(split) == len(expected[split])
    assert shards.documents("val") == 12 and shards.documents("train") == 108
    assert len(shards.manifest["splits"]["train"]["shards"]) > 1  # the stream spans several files
    assert shards.manifest["dtype"] == "uint16" and shards.manifest["tokenizer_hash"] == tok.content_hash


def test_identical_across_two_runs(tmp_path, corpus):
    texts, _ = corpus
    # Two independent runs: each trains its own tokenizer and writes its own cache.
    a = _build(tmp_path, texts, Tokenizer.train_bpe(texts, 512, show_progress=False), cache="cache_a")
    b = _build(tmp_path, texts, Tokenizer.train_bpe(texts, 512, show_progress=False), cache="cache_b")
    files_a = sorted(p.name for p in a.root.iterdir())
    assert files_a == sorted(p.name for p in b.root.iterdir())
    assert a.root.name == b.root.name  # same cache key
    for name in files_a:
        assert (a.root / name).read_bytes() == (b.root / name).read_bytes(), name


def test_cache_is_reused_and_invalidated(tmp_path, corpus, monkeypatch):
    texts, tok = corpus
    first = _build(tmp_path, texts, tok)
    real_build = shards_mod._build

    def must_not_build(*args, **kwargs):
        raise AssertionError("rebuilt although nothing changed")

    monkeypatch.setattr(shards_mod, "_build", must_not_build)
    again = _build(tmp_path, texts, tok)
    assert again.root == first.root
    monkeypatch.setattr(shards_mod, "_build", real_build)
    changed = _build(tmp_path, texts, tok, val_fraction=0.2)  # other settings: another entry
    assert changed.root != first.root and changed.documents("val") == 24
    write_jsonl(tmp_path / "d.jsonl", texts[:-3])  # edited input: another entry
    edited = _build(tmp_path, texts, tok)
    assert edited.root != first.root
    assert edited.documents("train") + edited.documents("val") == len(texts) - 3


def test_corrupt_shard_is_named(tmp_path, corpus):
    texts, tok = corpus
    shards = _build(tmp_path, texts, tok)
    victim = shards.root / shards.manifest["splits"]["train"]["shards"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{victim.name} is corrupt.*delete the cache folder"):
        _build(tmp_path, texts, tok)
    victim.write_bytes(bytes(data[:-2]))
    with pytest.raises(DataError, match="wrong size"):
        load_shards(shards.root)
    victim.unlink()
    with pytest.raises(DataError, match="missing"):
        load_shards(shards.root)


def test_small_source_still_has_validation(tmp_path, corpus):
    texts, tok = corpus
    shards = _build(tmp_path, texts[:3], tok, val_fraction=0.01)
    assert shards.documents("val") == 1 and shards.documents("train") == 2
    val = shards.val.slice(0, len(shards.val)).tolist()
    assert val == [tok.eos, *tok.encode(texts[2])]  # the last document is held out
    none = _build(tmp_path, texts[:3], tok, cache="c2", val_fraction=0.0)
    assert none.documents("val") == 0 and none.documents("train") == 3


def test_validation_rule_is_an_exact_fraction():
    rng = fresh_rng()
    for _ in range(20):
        n, f = rng.randint(1, 5000), rng.uniform(0.0, 0.49)
        assert sum(is_validation(i, f) for i in range(n)) == math.floor(n * f)  # telescoping sum


def test_token_stream_across_files(tmp_path):
    rng = np.random.default_rng()
    parts = [rng.integers(0, 2**32 - 1, size=n, dtype=np.uint32) for n in (5, 1, 17, 3)]
    paths = []
    for i, p in enumerate(parts):
        p.tofile(tmp_path / f"s{i}.bin")
        paths.append(tmp_path / f"s{i}.bin")
    stream = TokenStream(paths, np.dtype(np.uint32))
    whole = np.concatenate(parts).astype(np.int64)
    assert len(stream) == len(whole)
    for _ in range(50):
        a = int(rng.integers(0, len(whole)))
        b = int(rng.integers(a, len(whole) + 1))
        assert np.array_equal(stream.slice(a, b), whole[a:b])
    with pytest.raises(IndexError):
        stream.slice(0, len(whole) + 1)
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_manifest_is_plain_json(tmp_path, corpus):
    texts, tok = corpus
    shards = _build(tmp_path, texts, tok)
    manifest = json.loads((shards.root / "manifest.json").read_text())
    assert manifest["source"]["fingerprint"]["kind"] == "files"
    for split in ("train", "val"):
        info = manifest["splits"][split]
        assert sum(s["tokens"] for s in info["shards"]) == info["tokens"]
        assert all(len(s["sha256"]) == 64 for s in info["shards"])
