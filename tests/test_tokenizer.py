"""Tokenizer: BPE training, save/load round trip, special tokens, hashes, vocabulary checks, clear errors."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from data_corpus import fresh_rng, random_text, random_texts, write_jsonl
from inkling_fp4.data.bpe_training import train_tokenizer_command
from inkling_fp4.data.tokenizer import SPECIAL_TOKENS, Tokenizer, check_vocab
from inkling_fp4.errors import DataError


@pytest.fixture(scope="module")
def corpus():
    rng = fresh_rng()
    return rng, random_texts(rng, 300)


@pytest.fixture(scope="module")
def tok(corpus):
    return Tokenizer.train_bpe(corpus[1], vocab_size=512, show_progress=False)


def test_trained_vocabulary_and_special_ids(tok):
    assert tok.vocab_size == 512  # special tokens count inside the requested size
    ids = [tok.hf.token_to_id(t) for t in SPECIAL_TOKENS]
    assert len(set(ids)) == len(SPECIAL_TOKENS) and all(0 <= i < 512 for i in ids)
    assert tok.bos == tok.eos == tok.hf.token_to_id("<|endoftext|>")
    assert tok.pad == tok.hf.token_to_id("<|pad|>") and tok.end == tok.hf.token_to_id("<|end|>")
    assert set(tok.role_ids) == {"system", "user", "assistant"}
    assert tok.added_specials == []


def test_round_trip_any_text(tok, corpus):
    rng = corpus[0]
    texts = random_texts(rng, 50) + [
        "",
        " ",
        "\x00\x01",
        "🙂" * 7,
        "a\r\nb\tc",
        "日本語のテキスト",
        "x" * 3000,
    ]
    for text in texts:
        ids = tok.encode(text)
        assert tok.decode(ids) == text, f"seed {rng.seed_value}: {text!r}"
        assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_literal_special_strings_stay_text(tok):
    # A document quoting the separator must not forge a document boundary or a chat role.
    text = "before <|endoftext|> middle <|assistant|> <|pad|> after"
    ids = tok.encode(text)
    special = {tok.eos, tok.pad, tok.end, *tok.role_ids.values()}
    assert not special & set(ids)
    assert tok.decode(ids) == text


def test_save_load_round_trip(tok, corpus, tmp_path):
    path = tmp_path / "tokenizer.json"
    tok.save(path)
    loaded = Tokenizer.from_file(path)
    assert loaded.content_hash == tok.content_hash
    assert loaded.vocab_size == tok.vocab_size and loaded.eos == tok.eos and loaded.role_ids == tok.role_ids
    for text in corpus[1][:50] + ["<|endoftext|> literal"]:
        assert loaded.encode(text) == tok.encode(text)
    assert Tokenizer.from_file(tmp_path).content_hash == tok.content_hash  # a folder holding tokenizer.json
    assert Tokenizer.load(str(path)).content_hash == tok.content_hash


def test_training_is_deterministic_and_hash_tracks_content(corpus):
    a = Tokenizer.train_bpe(corpus[1], vocab_size=600, show_progress=False)
    b = Tokenizer.train_bpe(corpus[1], vocab_size=600, show_progress=False)
    assert a.content_hash == b.content_hash
    c = Tokenizer.train_bpe(corpus[1], vocab_size=601, show_progress=False)
    assert c.content_hash != a.content_hash


def test_foreign_tokenizer_gets_missing_special_tokens(tmp_path, corpus):
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(
        corpus[1],
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["</s>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf.save(str(tmp_path / "foreign.json"))
    size = hf.get_vocab_size()
    tok = Tokenizer.from_file(tmp_path / "foreign.json")
    assert tok.eos == hf.token_to_id("</s>")  # its own end-of-text token is reused
    assert tok.added_specials == [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"]
    assert tok.vocab_size == size + len(SPECIAL_TOKENS) - 1
    assert tok.pad >= size and all(i >= size for i in tok.role_ids.values())
    text = random_text(corpus[0])
    assert tok.decode(tok.encode(text)) == text


def test_check_vocab(tok):
    check_vocab(tok, 512)
    check_vocab(tok, 4096)
    with pytest.raises(DataError, match=r"512 tokens but model.vocab_size is 500.*model.vocab_size=512"):
        check_vocab(tok, 500)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        Tokenizer.from_file(tmp_path / "nope.json")
    with pytest.raises(DataError, match="not found"):
        Tokenizer.load(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "nonsense"}))
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(bad)
    with pytest.raises(DataError, match="at least 262"):
        Tokenizer.train_bpe(["abc"], vocab_size=100)


def test_hub_name_offline_is_a_quick_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="offline.*tokenizer.json"):
        Tokenizer.load("no-such-owner-fp4train/no-such-tokenizer")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("inkling_fp4.data.hub._endpoint_reachable", lambda: False)
    with pytest.raises(DataError, match="cannot be reached"):
        Tokenizer.load("no-such-owner-fp4train/no-such-tokenizer")


def test_train_tokenizer_command(tmp_path, corpus):
    src = write_jsonl(tmp_path / "docs.jsonl", corpus[1])
    line = train_tokenizer_command(str(src), 520, tmp_path / "out", cache_dir=str(tmp_path / "cache"))
    saved = tmp_path / "out" / "tokenizer.json"
    assert str(saved) in line and "vocab 520" in line
    tok = Tokenizer.from_file(saved)
    assert tok.vocab_size == 520
    assert tok.decode(tok.encode(corpus[1][0])) == corpus[1][0]
    # The same source and size again: the cached tokenizer, identical.
    train_tokenizer_command(str(src), 520, tmp_path / "again.json", cache_dir=str(tmp_path / "cache"))
    assert Tokenizer.from_file(tmp_path / "again.json").content_hash == tok.content_hash
