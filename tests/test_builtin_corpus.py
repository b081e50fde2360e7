"""The built-in corpus: real standard-library text, a deterministic order, caps, and a real (capped) build."""

import sys
import sysconfig
from pathlib import Path

from data_corpus import data_config
from inkling_fp4.data.builtin_corpus import BuiltinCorpus
from inkling_fp4.data.pipeline import build_pretrain_data


def test_files_are_the_stdlib_in_sorted_order_without_tests_or_generated_files():
    corpus = BuiltinCorpus.open()
    names = [rel for _, rel, _ in corpus.files]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert len(names) > 300 and corpus.n_bytes > 3_000_000  # a real corpus, several MB
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    assert all(p.is_relative_to(stdlib) for p, _, _ in corpus.files)
    parts = {part for name in names for part in name.split("/")[:-1]}
    assert not {"test", "tests", "site-packages", "__pycache__"} & parts
    assert not any(name.startswith("_sysconfigdata") or name.startswith("encodings/cp1252") for name in names)
    assert "argparse.py" in names and "json/decoder.py" in names
    assert all(size <= 262_144 for _, _, size in corpus.files)
    assert BuiltinCorpus.open().files == corpus.files  # deterministic


def test_caps_take_a_prefix_of_the_order():
    full = BuiltinCorpus.open()
    assert BuiltinCorpus.open(max_documents=25).files == full.files[:25]
    capped = BuiltinCorpus.open(max_bytes=200_000)
    n = len(capped.files)
    assert capped.files == full.files[:n]
    assert capped.n_bytes >= 200_000 and capped.n_bytes - capped.files[-1][2] < 200_000


def test_documents_and_description():
    corpus = BuiltinCorpus.open(max_documents=5)
    docs = list(corpus.iter_documents())
    assert len(docs) == 5 and all(d.strip() for d in docs)
    assert docs[0] == corpus.files[0][0].read_text(encoding="utf-8", errors="replace")
    text = corpus.describe()
    assert "python stdlib" in text and "5 files" in text and sys.version.split()[0] in text
    assert corpus.fingerprint() == BuiltinCorpus.open(max_documents=5).fingerprint()
    assert corpus.fingerprint() != BuiltinCorpus.open(max_documents=6).fingerprint()


def test_default_pipeline_trains_a_bpe_on_the_capped_builtin_corpus(tmp_path):
    cfg = data_config(tmp_path, "builtin", max_documents=40, vocab_size=1024, seq_len=64)
    data = build_pretrain_data(cfg, tmp_path / "run", seed=0)
    shards = data.shards[0]
    assert data.tokenizer.vocab_size == 1024
    assert shards.documents("train") + shards.documents("val") == 40
    assert shards.tokens("train") > 20_000  # real text, compressed by the BPE it was trained on
    text = data.describe()
    assert "built-in corpus: python stdlib" in text and "40 files" in text and "vocab 1024" in text
    # Python source round-trips through the trained tokenizer.
    doc = BuiltinCorpus.open(max_documents=1).iter_documents().__next__()
    assert data.tokenizer.decode(data.tokenizer.encode(doc)) == doc
    batch = data.train.next_batch(2)
    assert batch.input_ids.max() < 1024
