"""Chat: template, assistant-only loss mask, best-fit packing with boundaries, the SFT loader."""

import inspect
import json

import numpy as np
import pytest
import torch

from data_corpus import data_config, fresh_rng, random_text, random_texts, write_jsonl
from inkling_fp4.data.builtin_chat import BuiltinChat
from inkling_fp4.data.builtin_corpus import BuiltinCorpus
from inkling_fp4.data.chat import EncodedChat, encode_chat, encode_prompt, record_messages, render
from inkling_fp4.data.packing import PackedLoader, best_fit, pack
from inkling_fp4.data.sft_data import build_sft_data
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError


@pytest.fixture(scope="module")
def tok():
    rng = fresh_rng()
    return Tokenizer.train_bpe(random_texts(rng, 200), vocab_size=512, show_progress=False)


def _conversation(rng, turns=None):
    messages = [{"role": "system", "content": random_text(rng, 1, 8)}] if rng.random() < 0.5 else []
    for _ in range(turns or rng.randint(1, 3)):
        messages.append({"role": "user", "content": random_text(rng, 1, 12)})
        messages.append({"role": "assistant", "content": random_text(rng, 1, 12)})
    return messages


def test_loss_mask_covers_exactly_the_assistant_tokens(tok):
    rng = fresh_rng()
    for _ in range(30):
        messages = _conversation(rng)
        enc = encode_chat(tok, messages)
        # Independent reference: walk the template and collect the assistant spans by hand.
        expected_tokens, expected_mask = [tok.eos], [False]
        answer_ids = []
        for m in messages:
            body = tok.encode(m["content"])
            expected_tokens += [tok.role_ids[m["role"]], *body, tok.end]
            is_answer = m["role"] == "assistant"
            expected_mask += [False] + [is_answer] * (len(body) + 1)
            if is_answer:
                answer_ids += [*body, tok.end]
        assert enc.tokens == expected_tokens and enc.trained == expected_mask, rng.seed_value
        trained_ids = [t for t, keep in zip(enc.tokens, enc.trained, strict=True) if keep]
        assert trained_ids == answer_ids
        answers = "".join(m["content"] + "<|end|>" for m in messages if m["role"] == "assistant")
        assert tok.decode(trained_ids) == answers


def test_template_text_and_generation_prompt(tok):
    messages = [{"role": "user", "content": "hi <|assistant|> there"}, {"role": "assistant", "content": "yo"}]
    assert render(tok, messages) == "<|endoftext|><|user|>hi <|assistant|> there<|end|><|assistant|>yo<|end|>"
    enc = encode_chat(tok, messages)
    assert enc.tokens.count(tok.role_ids["assistant"]) == 1  # the quoted role in the text stays text
    prompt = encode_prompt(tok, messages[:1])
    assert prompt[-1] == tok.role_ids["assistant"]
    assert enc.tokens[: len(prompt)] == prompt


def test_prompt_completion_records_and_errors(tok):
    rec = {"system": "be brief", "prompt": "2+2?", "completion": "4"}
    assert record_messages(rec) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    with pytest.raises(DataError, match="record 3 has fields text.*'messages'"):
        record_messages({"text": "x"}, 3)
    with pytest.raises(DataError, match="message 0"):
        record_messages({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(DataError, match="no assistant message"):
        record_messages({"messages": [{"role": "user", "content": "x"}]})
    with pytest.raises(DataError, match="non-empty list"):
        record_messages({"messages": []})


def _reference_best_fit(lengths, capacity):
    bins, rooms = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(bins)) if rooms[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (rooms[b], b))
            bins[b].append(i)
            rooms[b] -= lengths[i]
        else:
            bins.append([i])
            rooms.append(capacity - lengths[i])
    return bins


def test_best_fit_matches_a_reference():
    rng = fresh_rng()
    for _ in range(20):
        capacity = rng.randint(8, 64)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 80))]
        bins = best_fit(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
        # Same bins as the O(n^2) reference (up to which of two equally full bins is picked).
        assert sorted(sorted(lengths[i] for i in b) for b in bins) == sorted(
            sorted(lengths[i] for i in b) for b in _reference_best_fit(lengths, capacity)
        ), rng.seed_value
        assert len(bins) >= -(-sum(lengths) // capacity)


def test_packing_keeps_boundaries(tok):
    rng = fresh_rng()
    examples = [encode_chat(tok, _conversation(rng)) for _ in range(40)]
    row_len = 160
    rows = pack(examples, row_len, tok.pad)
    assert rows.truncated == sum(len(e) > row_len for e in examples)
    seen = []
    for r in range(len(rows.tokens)):
        ids = rows.doc_ids[r]
        assert np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)  # segments, in order
        for d in np.unique(ids):
            seg = slice(*np.flatnonzero(ids == d)[[0, -1]] + [0, 1])
            if d == ids[-1] and rows.used[r] < row_len:  # the padding segment
                assert (rows.tokens[r, seg] == tok.pad).all() and not rows.trained[r, seg].any()
                continue
            seen.append((rows.tokens[r, seg].tolist(), rows.trained[r, seg].tolist()))
            assert rows.tokens[r, seg][0] == tok.eos  # every example opens with its own document token
    expected = [(e.tokens[:row_len], e.trained[:row_len]) for e in examples]
    assert sorted(seen) == sorted(expected)  # every example exactly once, whole (or cut at the row end)
    batch = rows.batch(np.arange(len(rows.tokens)))
    same_doc = batch.doc_ids == torch.from_numpy(rows.doc_ids[:, 1:])
    assert not (batch.loss_mask & ~same_doc).any()  # no target crosses into another example
    assert torch.equal(batch.loss_mask, torch.from_numpy(rows.trained[:, 1:]) & same_doc)
    assert torch.equal(batch.input_ids[:, 1:], batch.targets[:, :-1])
    assert 0.5 < rows.fill <= 1.0


def test_overlong_examples_are_cut_or_dropped(tok):
    prompt_only = EncodedChat([tok.eos] + [5] * 30 + [7, 8], [False] * 31 + [True, True])
    answer_early = EncodedChat([tok.eos, 4, 7, 8] + [9] * 30, [False, False, True, True] + [True] * 30)
    rows = pack([prompt_only, answer_early], 10, tok.pad)
    assert rows.truncated == 2 and rows.dropped == 1 and rows.examples == 1
    with pytest.raises(DataError, match="raise data.seq_len"):
        pack([prompt_only], 10, tok.pad)


def test_packed_loader_resume_and_ranks(tok):
    rng = fresh_rng()
    rows = pack([encode_chat(tok, _conversation(rng)) for _ in range(60)], 64, tok.pad)
    seed = rng.randint(0, 1 << 30)
    straight = PackedLoader(rows, seed)
    expected = [straight.next_batch(3).input_ids for _ in range(3 * len(rows.tokens) // 3 + 2)]
    part = PackedLoader(rows, seed)
    for _ in range(5):
        part.next_batch(3)
    resumed = PackedLoader(rows, seed)
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))
    for i in range(5, len(expected)):
        assert torch.equal(resumed.next_batch(3).input_ids, expected[i])
    ranks = [PackedLoader(rows, seed, rank=r, world_size=3) for r in range(3)]
    got = torch.stack([ranks[r].next_batch(1).input_ids[0] for r in range(3)])
    assert torch.equal(got, expected[0])
    with pytest.raises(DataError, match="seed"):
        PackedLoader(rows, seed + 1).load_state_dict(part.state_dict())


def test_build_sft_data_from_jsonl(tok, tmp_path):
    rng = fresh_rng()
    path = tmp_path / "chat.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            if i % 2:
                f.write(json.dumps({"messages": _conversation(rng)}) + "\n")
            else:
                f.write(
                    json.dumps({"prompt": random_text(rng, 1, 10), "completion": random_text(rng, 1, 10)})
                    + "\n"
                )
    cfg = data_config(tmp_path, str(path), seq_len=96, val_fraction=0.1)
    data = build_sft_data(cfg, tok, seed=1)
    assert "40 records" in data.describe()
    batch = data.train.next_batch(2)
    assert batch.input_ids.shape == (2, 96) and batch.loss_mask.any()
    v = data.val_batches(2, 2)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(v, data.val_batches(2, 2), strict=True))
    write_jsonl(tmp_path / "plain.jsonl", ["just text"])
    with pytest.raises(DataError, match="'messages'"):
        build_sft_data(data_config(tmp_path, str(tmp_path / "plain.jsonl")), tok, seed=1)


def test_builtin_chat_records_from_docstrings(tok, tmp_path):
    cfg = data_config(tmp_path, "builtin", max_documents=30, seq_len=128)
    data = build_sft_data(cfg, tok, seed=0)
    assert data.records > 20 and "built-in chat" in data.describe()
    records = list(BuiltinChat(BuiltinCorpus.open(max_documents=30)).iter_rows())
    assert records == list(BuiltinChat(BuiltinCorpus.open(max_documents=30)).iter_rows())  # deterministic
    for r in records:
        user, answer = r["messages"]
        assert user["content"].startswith("What does the ") and len(answer["content"]) >= 20
    # abc.ABC is documented in place: its answer is the first paragraph of its docstring.
    import abc

    answers = {r["messages"][0]["content"]: r["messages"][1]["content"] for r in records}
    assert answers["What does the class `abc.ABC` do?"] == inspect.cleandoc(abc.ABC.__doc__).split("\n\n")[0]
    assert not any("`_" in question for question in answers)  # private modules are left out
