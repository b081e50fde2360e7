"""build_sft_data: record formats, the held-out split, empty answers, overlong examples, refusals."""

import csv
import gzip
import json

import numpy as np
import pytest
import torch

from data_corpus import data_config, fresh_rng, random_text, random_texts
from inkling_fp4.data.chat import encode_chat, parse_record
from inkling_fp4.data.sft_config import SFTConfig
from inkling_fp4.data.sft_data import build_sft_data
from inkling_fp4.data.shards import is_validation
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError, UserError
from test_chat import adversarial_text, answer_text, conversation


@pytest.fixture(scope="module")
def tok():
    rng = fresh_rng()
    return Tokenizer.train_bpe(random_texts(rng, 200), vocab_size=512, show_progress=False)


def write_records(path, records):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return str(path)


def examples_of(rows):
    """Each packed example of ``rows`` as (tokens, trained) lists (the padding left out)."""
    out = []
    for r in range(len(rows.tokens)):
        n = rows.used[r]
        tokens, trained, ids = rows.tokens[r, :n], rows.trained[r, :n], rows.doc_ids[r, :n]
        out += [(tokens[ids == d].tolist(), trained[ids == d].tolist()) for d in np.unique(ids)]
    return out


def mixed_records(rng, n):
    """messages records and string prompt / completion records (one table: nulls in the other columns)."""
    records = []
    for i in range(n):
        if i % 3:
            records.append({"messages": conversation(rng), "id": i})
        else:
            rec = {"prompt": adversarial_text(rng), "completion": answer_text(rng), "id": i}
            if rng.random() < 0.5:
                rec["system"] = random_text(rng, 1, 5)
            records.append(rec)
    return records


@pytest.mark.parametrize("loss_on", ["assistant", "completion", "all"])
def test_every_record_is_packed_once_in_its_split(tok, tmp_path, loss_on):
    rng = fresh_rng()
    records = mixed_records(rng, rng.randint(30, 60))
    path = write_records(tmp_path / "chat.jsonl", records)
    sft = SFTConfig(loss_on=loss_on, val_fraction=0.2)
    cfg = data_config(tmp_path, path, seq_len=512, val_fraction=0.0)  # data.val_fraction is not SFT's
    data = build_sft_data(cfg, sft, tok, seed=rng.randint(0, 1000))
    expected = {"train": [], "val": []}
    for i, r in enumerate(records):
        enc = encode_chat(tok, parse_record(r), loss_on)
        expected["val" if is_validation(i, 0.2) else "train"].append((enc.tokens, enc.trained))
    assert sorted(examples_of(data.train.rows)) == sorted(expected["train"]), rng.seed_value
    assert sorted(examples_of(data.val_rows)) == sorted(expected["val"]), rng.seed_value
    s = data.stats
    assert s["records"] == len(records) and s["skipped_empty"] == s["truncated"] == s["dropped_long"] == 0
    assert (s["train_records"], s["val_records"]) == (len(expected["train"]), len(expected["val"]))
    assert (s["examples"], s["val_examples"]) == (len(expected["train"]), len(expected["val"]))
    assert s["rows"] == len(data.train.rows.tokens) and s["val_rows"] == len(data.val_rows.tokens)
    assert s["tokens"] == sum(len(t) for t, _ in expected["train"])
    assert data.trained_tokens == s["trained_tokens"] == sum(sum(m[1:]) for _, m in expected["train"])
    assert 0 < s["fill"] <= 1
    text = data.describe()
    assert "\n" not in text and f"{len(records)} records" in text and f"loss on {loss_on}" in text
    batch = data.train.next_batch(2)
    assert batch.input_ids.shape == (2, 512) and batch.loss_mask.any()
    v = data.val_batches(2, 3)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(v, data.val_batches(2, 3), strict=True))
    # nothing else written: the datasets cache and the UTF-8 check's markers
    allowed = {tmp_path / "cache" / "hf_datasets", tmp_path / "cache" / "utf8"}
    assert set((tmp_path / "cache").iterdir()) <= allowed


def test_conversational_prompt_completion_file(tok, tmp_path):
    rng = fresh_rng()
    records = []
    for _ in range(12):
        messages = conversation(rng)
        cut = max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
        records.append({"prompt": messages[:cut], "completion": messages[cut:]})
    path = write_records(tmp_path / "pc.jsonl", records)
    data = build_sft_data(data_config(tmp_path, path, seq_len=512), SFTConfig(loss_on="completion"), tok, 0)
    got = sorted(examples_of(data.train.rows) + examples_of(data.val_rows))
    trained = [tok.decode([t for t, k in zip(*ex, strict=True) if k]) for ex in got]
    answers = ["".join(m["content"] + "<|end|>" for m in r["completion"]) for r in records]
    assert sorted(trained) == sorted(answers)
    assert data.stats["val_records"] == 1  # a small source still holds one record out


def test_empty_answers_are_skipped_and_counted(tok, tmp_path):
    rng = fresh_rng()
    records = mixed_records(rng, 20)
    blanks = sorted(rng.sample(range(20), 4))
    for i in blanks:
        if "messages" in records[i]:
            next(m for m in records[i]["messages"] if m["role"] == "assistant")["content"] = " \n"
        else:
            records[i]["completion"] = ""
    path = write_records(tmp_path / "chat.jsonl", records)
    data = build_sft_data(data_config(tmp_path, path, seq_len=512), SFTConfig(val_fraction=0.0), tok, 0)
    assert data.stats["skipped_empty"] == 4 and data.stats["examples"] == 16 and not data.has_validation
    assert "4 skipped for an empty answer" in data.describe()
    with pytest.raises(DataError, match="no validation examples.*sft.val_fraction"):
        data.val_batches(1, 1)
    only_blank = write_records(tmp_path / "blank.jsonl", [{"prompt": "q", "completion": " "}] * 3)
    with pytest.raises(DataError, match="no training records .*3 with an empty answer"):
        build_sft_data(data_config(tmp_path, only_blank), SFTConfig(), tok, 0)


def test_overlong_truncate_and_drop(tok, tmp_path):
    rng = fresh_rng()
    short = [{"prompt": "q", "completion": "a b"} for _ in range(6)]
    long_prompt = {"prompt": " ".join(["ka"] * 200), "completion": "yes"}  # head keeps no answer token
    long_answer = {"prompt": "q", "completion": " ".join(["lo mi"] * 200)}  # head keeps answer tokens
    records = short + [long_prompt] * 2 + [long_answer] * 3
    rng.shuffle(records)
    path = write_records(tmp_path / "long.jsonl", records)
    cfg = data_config(tmp_path, path, seq_len=48)
    cut = build_sft_data(cfg, SFTConfig(overlong="truncate", val_fraction=0.0), tok, 0)
    assert (cut.stats["truncated"], cut.stats["dropped_long"], cut.stats["examples"]) == (3, 2, 9)
    assert "3 truncated, 2 dropped" in cut.describe()
    assert max(len(t) for t, _ in examples_of(cut.train.rows)) == 49
    drop = build_sft_data(cfg, SFTConfig(overlong="drop", val_fraction=0.0), tok, 0)
    assert (drop.stats["truncated"], drop.stats["dropped_long"], drop.stats["examples"]) == (0, 5, 6)
    only_long = write_records(tmp_path / "only_long.jsonl", [long_answer, long_prompt])
    with pytest.raises(DataError, match="raise data.seq_len, or set sft.overlong=truncate"):
        build_sft_data(data_config(tmp_path, only_long, seq_len=48), SFTConfig(overlong="drop"), tok, 0)
    with pytest.raises(DataError, match=r"fits data.seq_len \+ 1 = 49 tokens .*raise data.seq_len$"):
        build_sft_data(
            data_config(tmp_path, write_records(tmp_path / "p.jsonl", [long_prompt] * 3), seq_len=48),
            SFTConfig(),
            tok,
            0,
        )


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"text": "hello"}, r"has fields 'text'; chat data needs 'messages'"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}, r"role 'bot'"),
        (
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": 5}]},
            r"content is int",
        ),
        ({"messages": [{"role": "assistant", "content": "a"}]}, r"before any user turn"),
        ({"messages": [{"role": "user", "content": "q"}]}, r"no assistant turn"),
    ],
)
def test_a_bad_record_names_itself_in_one_line(tok, tmp_path, bad, message):
    rng = fresh_rng()
    records = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 7
    index = rng.randint(0, len(records))
    if "text" in bad:  # a file of another shape altogether
        records, index = [bad] * 3, 0
    else:
        records = records[:index] + [bad] + records[index:]
    path = write_records(tmp_path / "bad.jsonl", records)
    with pytest.raises(DataError, match=message) as info:
        build_sft_data(data_config(tmp_path, path, seq_len=64), SFTConfig(), tok, 0)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"chat record {index} (from 0) of '{path}'"), text


def test_unreadable_files_are_one_line_errors(tok, tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    line = (
        '{"messages": [{"role": "user", "content": "caf\u00e9"}, {"role": "assistant", "content": "ok"}]}\n'
    )
    latin1.write_bytes(line.encode("utf-8") + line.encode("latin-1"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(line + '{"messages": [\n')
    not_records = tmp_path / "lists.jsonl"
    not_records.write_text(line + '"just a string"\n')
    for path, message in [
        (latin1, f"invalid UTF-8 at byte {len(line.encode()) + 46} \\(e9\\).*data.encoding_errors=replace"),
        (broken, "could not read"),
        (not_records, "could not read"),
    ]:
        with pytest.raises(UserError, match=message) as info:
            build_sft_data(data_config(tmp_path, str(path), seq_len=64), SFTConfig(), tok, 0)
        assert "\n" not in str(info.value) and str(path) in str(info.value), str(info.value)


TRICKY = ["0", "007", "1e5", "-3.50", "NA", "null", "None", "nan", "True", "", "a,b", '"q"', "x\ny", "\u2028"]
"""Texts that ``datasets`` would read as numbers, booleans or nulls, and ones a CSV must quote."""


def test_csv_and_json_cells_are_the_text_written(tok, tmp_path):
    """prompt / completion / system records with tricky texts, written as CSV (plain, with a BOM,
    gzipped) and as a JSON array: the same examples as the jsonl of the same records."""
    rng = fresh_rng()
    records = [
        {
            "prompt": rng.choice([*TRICKY, adversarial_text(rng)]),
            "completion": rng.choice([*TRICKY, answer_text(rng)]),
            "system": rng.choice(["", "1", random_text(rng, 1, 5)]),
        }
        for _ in range(rng.randint(20, 40))
    ]

    def as_csv(path, opener=open, encoding="utf-8"):
        with opener(path, "wt", encoding=encoding, newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["prompt", "completion", "system"])
            writer.writerows([r["prompt"], r["completion"], r["system"]] for r in records)
        return str(path)

    def built(path):
        data = build_sft_data(data_config(tmp_path, path, seq_len=512), SFTConfig(val_fraction=0.0), tok, 0)
        return sorted(examples_of(data.train.rows)), data.stats

    with open(tmp_path / "chat.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records)  # U+2028 unescaped
    (tmp_path / "chat.json").write_text(json.dumps(records, indent=1), encoding="utf-8")
    expected = built(str(tmp_path / "chat.jsonl"))
    assert expected[1]["records"] == len(records), rng.seed_value
    assert expected[1]["skipped_empty"] == sum(not r["completion"].strip() for r in records)
    for path in [
        as_csv(tmp_path / "plain.csv"),
        as_csv(tmp_path / "bom.csv", encoding="utf-8-sig"),
        as_csv(tmp_path / "packed.csv.gz", gzip.open),
        str(tmp_path / "chat.json"),
    ]:
        assert built(path) == expected, (path, rng.seed_value)


def test_ranks_share_the_rows(tok, tmp_path):
    rng = fresh_rng()
    path = write_records(tmp_path / "chat.jsonl", mixed_records(rng, 40))
    cfg = data_config(tmp_path, path, seq_len=128)
    whole = build_sft_data(cfg, SFTConfig(), tok, seed=5)
    parts = [build_sft_data(cfg, SFTConfig(), tok, seed=5, rank=r, world_size=2) for r in range(2)]
    both = whole.train.next_batch(2).input_ids
    assert torch.equal(torch.cat([p.train.next_batch(1).input_ids for p in parts]), both)
    assert np.array_equal(parts[0].train.rows.tokens, whole.train.rows.tokens)


def test_builtin_tasks(tok, tmp_path):
    pytest.importorskip("inkling_fp4.data.builtin_tasks", reason="the built-in tasks module is not there")
    cfg = data_config(tmp_path, "builtin", seq_len=256)
    sft = SFTConfig(builtin_examples=40, val_fraction=0.1)
    data = build_sft_data(cfg, sft, tok, seed=3)
    assert data.stats["records"] == 40 and data.stats["val_records"] == 4
    again = build_sft_data(cfg, sft, tok, seed=3)
    assert np.array_equal(data.train.rows.tokens, again.train.rows.tokens)  # the same on every start
    assert data.train.next_batch(2).loss_mask.any()
