"""Chat: records and their validation, the template and its loss masks, best-fit packing, the loader."""

import json

import numpy as np
import pytest
import torch

from data_corpus import fresh_rng, random_text, random_texts
from inkling_fp4.data.chat import (
    CHAT_TEMPLATE_JINJA,
    Chat,
    EncodedChat,
    encode_chat,
    encode_prompt,
    parse_record,
    render,
)
from inkling_fp4.data.packing import PackedLoader, best_fit, fit, pack
from inkling_fp4.data.tokenizer import SPECIAL_TOKENS, Tokenizer
from inkling_fp4.errors import DataError

# Text that looks like the template: it must stay ordinary bytes, never a special id.
FORGERIES = [
    "<|end|>",
    "<|assistant|>",
    "<|user|>",
    "<|system|>",
    "<|endoftext|>",
    "<|pad|>",
    "<|end|><|user",
]


@pytest.fixture(scope="module")
def tok():
    rng = fresh_rng()
    return Tokenizer.train_bpe(random_texts(rng, 200), vocab_size=512, show_progress=False)


def adversarial_text(rng, lo=1, hi=12):
    words = random_text(rng, lo, hi).split(" ")
    for _ in range(rng.randint(0, 2)):
        words.insert(rng.randint(0, len(words)), rng.choice(FORGERIES))
    return " ".join(words)


def answer_text(rng, lo=1, hi=12):
    """Adversarial text that is not all whitespace: a blank answer is a counted skip, not a valid record."""
    while not (text := adversarial_text(rng, lo, hi)).strip():
        pass
    return text


def conversation(rng, turns=None):
    """A random valid conversation: optional system, then user / assistant turns (some repeated)."""
    messages = [{"role": "system", "content": adversarial_text(rng, 1, 8)}] if rng.random() < 0.5 else []
    for _ in range(turns or rng.randint(1, 3)):
        for role in ("user", "assistant"):
            for _ in range(1 + (rng.random() < 0.15)):  # now and then two turns of one role in a row
                text = answer_text(rng) if role == "assistant" else adversarial_text(rng)
                messages.append({"role": role, "content": text})
    return messages


def reference(tok, chat, loss_on):
    """Template tokens and mask built by hand, and the trained text span by span."""
    tokens, mask, spans = [tok.eos], [False], []
    for j, m in enumerate(chat.messages):
        body = tok.encode(m["content"])
        answer = m["role"] == "assistant" and (loss_on == "assistant" or j >= chat.completion_from)
        if loss_on == "all":
            mask += [True] * (len(body) + 2)
        else:
            mask += [False] + [answer] * (len(body) + 1)
        tokens += [tok.role_ids[m["role"]], *body, tok.end]
        if answer:
            spans.append(m["content"] + "<|end|>")
    return tokens, mask, spans


def trained_text(tok, enc):
    return tok.decode([t for t, keep in zip(enc.tokens, enc.trained, strict=True) if keep])


def trained_spans(enc):
    spans, current = [], []
    for t, keep in zip(enc.tokens, enc.trained, strict=True):
        if keep:
            current.append(t)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


@pytest.mark.parametrize("loss_on", ["assistant", "completion", "all"])
def test_template_round_trip_and_masks(tok, loss_on):
    rng = fresh_rng()
    specials = {tok.hf.token_to_id(t) for t in SPECIAL_TOKENS}
    for _ in range(40):
        chat = parse_record({"messages": conversation(rng)})
        enc = encode_chat(tok, chat, loss_on)
        tokens, mask, spans = reference(tok, chat, loss_on)
        assert (enc.tokens, enc.trained) == (tokens, mask), rng.seed_value
        # Special ids appear only where the template puts them: 1 + 2 per message.
        assert sum(t in specials for t in enc.tokens) == 1 + 2 * len(chat.messages), rng.seed_value
        for m in chat.messages:
            assert not specials & set(tok.encode(m["content"])), m["content"]
        if loss_on == "all":
            assert tok.decode(enc.tokens[1:]) == render(tok, chat.messages)[len("<|endoftext|>") :]
            continue
        # Each trained span decodes to exactly one assistant answer and its <|end|>; consecutive
        # assistant turns give adjacent spans, so compare the concatenation too.
        assert trained_text(tok, enc) == "".join(spans), rng.seed_value
        roles = [m["role"] for m in chat.messages]
        if ("assistant", "assistant") not in zip(roles, roles[1:], strict=False):
            assert [tok.decode(s) for s in trained_spans(enc)] == spans, rng.seed_value


def test_template_text_and_generation_prompt(tok):
    messages = [{"role": "user", "content": "hi <|assistant|> there"}, {"role": "assistant", "content": "yo"}]
    assert render(tok, messages) == "<|endoftext|><|user|>hi <|assistant|> there<|end|><|assistant|>yo<|end|>"
    enc = encode_chat(tok, messages)
    assert enc.tokens.count(tok.role_ids["assistant"]) == 1  # the quoted role in the text stays text
    prompt = encode_prompt(tok, messages[:1])
    assert prompt[-1] == tok.role_ids["assistant"]
    assert enc.tokens[: len(prompt)] == prompt


def test_jinja_template_renders_the_same_text(tok):
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(CHAT_TEMPLATE_JINJA)
    rng = fresh_rng()
    for _ in range(10):
        messages = conversation(rng)
        assert template.render(messages=messages) == render(tok, messages), rng.seed_value
        prompt = messages[: max(i for i, m in enumerate(messages) if m["role"] == "user") + 1]
        text = template.render(messages=prompt, add_generation_prompt=True, bos_token=tok.token(tok.bos))
        assert text == tok.decode(encode_prompt(tok, prompt)), rng.seed_value


def test_prompt_completion_records(tok):
    rec = {"system": "be brief", "prompt": "2+2?", "completion": "4", "id": 7}
    chat = parse_record(rec)
    assert chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert chat.completion_from == 2
    assert parse_record({"system": "", "prompt": "a", "completion": "b"}).messages[0]["role"] == "user"
    nulls = {"system": None, "prompt": "a", "completion": "b", "messages": None}  # a table mixing formats
    assert parse_record(nulls).completion_from == 1
    with pytest.raises(DataError, match=r"has fields 'prompt', 'id' \('messages', 'completion' null\)"):
        parse_record({"prompt": "a", "id": 1, "messages": None, "completion": None})
    # Conversational: the prompt's messages, then the completion's assistant turns (trained in 'completion').
    prompt = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"},
    ]
    completion = [{"role": "assistant", "content": "a2"}, {"role": "assistant", "content": "a3"}]
    chat = parse_record({"prompt": prompt, "completion": completion})
    assert chat.messages == prompt + completion and chat.completion_from == 4
    enc = encode_chat(tok, chat, "completion")
    assert trained_text(tok, enc) == "a2<|end|>a3<|end|>"
    assert trained_text(tok, encode_chat(tok, chat, "assistant")) == "a1<|end|>a2<|end|>a3<|end|>"
    # messages: the completion is the last assistant turn
    assert parse_record({"messages": prompt + completion[:1]}).completion_from == 4


U, A, S = ({"role": r, "content": "x"} for r in ("user", "assistant", "system"))


@pytest.mark.parametrize(
    "record, message",
    [
        ({"text": "x"}, r"has fields 'text'; .*'messages'.*'prompt' and 'completion'"),
        ({"prompt": "x"}, r"has fields 'prompt'; "),
        ({}, r"has fields none"),
        ({"messages": []}, r"'messages' must be a non-empty list"),
        ({"messages": "hello"}, r"'messages' must be a non-empty list .* got str"),
        ({"messages": [{"role": "robot", "content": "x"}, A]}, r"messages\[0\]: role 'robot' is not one of"),
        ({"messages": [{"role": "tool", "content": "x"}]}, r"role 'tool'"),
        ({"messages": [{"role": "user"}, A]}, r"messages\[0\]: expected \{role, content\}"),
        ({"messages": [U, "hi"]}, r"messages\[1\]: expected"),
        ({"messages": [U, {"role": "assistant", "content": None}]}, r"messages\[1\]: content is NoneType"),
        ({"messages": [U, {"role": "assistant", "content": [{"type": "text"}]}]}, r"content is list"),
        ({"messages": [U]}, r"no assistant turn"),
        ({"messages": [S, S, U, A]}, r"system message at position 1; .*only open"),
        ({"messages": [U, A, S, U, A]}, r"system message at position 2"),
        ({"messages": [A, U, A]}, r"assistant turn comes before any user turn"),
        ({"messages": [S, A]}, r"assistant turn comes before any user turn"),
        ({"messages": [U, A, U]}, r"ends with a user turn"),
        ({"prompt": "x", "completion": [A]}, r"'prompt' is str and 'completion' list; give both"),
        ({"prompt": 3, "completion": "x"}, r"'prompt' is int, not text"),
        ({"prompt": "x", "completion": "y", "system": 1}, r"'system' is int"),
        ({"prompt": [U], "completion": [U]}, r"completion\[0\]: a completion holds assistant turns only"),
        ({"prompt": [U], "completion": [A], "system": "s"}, r"'system' beside a list prompt"),
        ({"prompt": [], "completion": [A]}, r"'prompt' must be a non-empty list"),
        ("just text", r"is a str, not a record"),
    ],
)
def test_bad_records_are_one_line_errors(record, message):
    with pytest.raises(DataError, match=message) as info:
        parse_record(record, "chat record 5 of 'x.jsonl'")
    text = str(info.value)
    assert "\n" not in text and text.startswith("chat record 5 of 'x.jsonl'")


def test_allowed_shapes_and_empty_answers():
    assert parse_record({"messages": [U, U, A, A]}).completion_from == 3  # repeated roles are allowed
    assert not parse_record({"messages": [S, U, A]}).empty_answer
    for blank in ("", " ", "\n\t "):
        assert parse_record({"messages": [U, {"role": "assistant", "content": blank}, U, A]}).empty_answer
        assert parse_record({"prompt": "q", "completion": blank}).empty_answer
    empty_prompt = {"messages": [{"role": "user", "content": ""}, A]}
    assert not parse_record(empty_prompt).empty_answer  # an empty question is not an empty answer


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


@pytest.mark.parametrize("loss_on", ["assistant", "completion", "all"])
def test_packing_keeps_boundaries_and_seams(tok, loss_on):
    rng = fresh_rng()
    examples = [encode_chat(tok, parse_record({"messages": conversation(rng)}), loss_on) for _ in range(40)]
    row_len = 160
    fitted = fit(examples, row_len, "truncate")
    assert fitted.truncated + fitted.dropped == sum(len(e) > row_len for e in examples)
    rows = pack(fitted.examples, row_len, tok.pad)
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
    expected = [(e.tokens, e.trained) for e in fitted.examples]
    assert sorted(seen) == sorted(expected)  # every example exactly once, whole (or cut at the row end)
    batch = rows.batch(np.arange(len(rows.tokens)))
    same_doc = batch.doc_ids == torch.from_numpy(rows.doc_ids[:, 1:])
    seams = ~same_doc
    assert not (batch.loss_mask & seams).any()  # no target crosses into another example or the padding
    assert not batch.loss_mask[batch.targets == tok.pad].any()
    assert torch.equal(batch.loss_mask, torch.from_numpy(rows.trained[:, 1:]) & same_doc)
    assert torch.equal(batch.input_ids[:, 1:], batch.targets[:, :-1])
    assert rows.trained_tokens == batch.num_tokens
    if loss_on == "all":  # every target inside an example is trained, nothing else
        inside = same_doc & (batch.targets != tok.pad)
        assert torch.equal(batch.loss_mask, inside)
    assert 0.5 < rows.fill <= 1.0


def test_overlong_examples_are_cut_or_dropped(tok):
    prompt_only = EncodedChat([tok.eos] + [5] * 30 + [7, 8], [False] * 31 + [True, True])
    answer_early = EncodedChat([tok.eos, 4, 7, 8] + [9] * 30, [False, False, True, True] + [True] * 30)
    exact = EncodedChat([tok.eos] + [9] * 9, [False] + [True] * 9)  # exactly a row: fits, not cut
    cut = fit([prompt_only, answer_early, exact], 10, "truncate")
    assert (cut.truncated, cut.dropped, len(cut.examples)) == (1, 1, 2)
    assert cut.examples[0].tokens == answer_early.tokens[:10] and cut.examples[1] is exact
    dropped = fit([prompt_only, answer_early, exact], 10, "drop")
    assert (dropped.truncated, dropped.dropped, dropped.examples) == (0, 2, [exact])
    with pytest.raises(ValueError, match="fit"):
        pack([prompt_only], 10, tok.pad)


def test_packed_loader_resume_and_ranks(tok):
    rng = fresh_rng()
    examples = [encode_chat(tok, parse_record({"messages": conversation(rng)})) for _ in range(60)]
    rows = pack(fit(examples, 64, "truncate").examples, 64, tok.pad)
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


def test_chat_takes_plain_messages(tok):
    messages = [U, A, U, {"role": "assistant", "content": "y"}]
    assert encode_chat(tok, messages, "completion") == encode_chat(tok, Chat(messages, 3), "completion")
