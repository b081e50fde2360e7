"""The SFT loss through the model: exactly the masked targets get a gradient, and packing changes no
example's loss.

The reference mask here is read off the tokens alone: the special ids split each example into turns
(content never holds a special id, see test_chat), so a target is an answer token exactly when it lies
in an assistant turn's content or is its closing ``<|end|>``.
"""

import pytest
import torch
import torch.nn.functional as F

from data_corpus import fresh_rng, random_texts
from inkling_fp4.data.batch import Batch
from inkling_fp4.data.chat import EncodedChat, encode_chat, parse_record
from inkling_fp4.data.packing import fit, pack
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from model_helpers import exact_model
from test_chat import adversarial_text, answer_text, conversation

ROW_LEN = 193
TINY = dict(
    pattern="M*-M",
    d_model=32,
    n_heads=2,
    n_kv_heads=1,
    ffn_dim=64,
    mamba_heads=4,
    mamba_head_dim=16,
    n_groups=1,
    d_state=8,
    chunk_size=16,
)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_bpe(random_texts(fresh_rng(), 200), vocab_size=512, show_progress=False)


def random_records(rng, n):
    """messages records, string prompt / completion and conversational prompt / completion records."""
    out = []
    for _ in range(n):
        kind = rng.randrange(3)
        messages = conversation(rng, rng.randint(1, 2))
        if kind == 0:
            out.append({"messages": messages})
        elif kind == 1:
            out.append({"prompt": adversarial_text(rng), "completion": answer_text(rng)})
        else:
            cut = max(i for i, m in enumerate(messages) if m["role"] == "user") + 1
            out.append({"prompt": messages[:cut], "completion": messages[cut:]})
    return out


def packed_rows(tok, rng, loss_on, n=24):
    chats = [parse_record(r) for r in random_records(rng, n)]
    examples = [encode_chat(tok, c, loss_on) for c in chats]
    # where each example's completion starts (a message index), to read the 'completion' mask off the tokens
    answers = {tuple(e.tokens): c.completion_from for c, e in zip(chats, examples, strict=True)}
    fitted = fit(examples, ROW_LEN, "truncate")
    return pack(fitted.examples, ROW_LEN, tok.pad), answers


def reference_mask(tok, rows, answers, loss_on):
    """[R, L] bool: which targets must be trained, from the token ids and the template's rules."""
    R, n = rows.tokens.shape
    mask = torch.zeros(R, n - 1, dtype=torch.bool)
    roles = {v: k for k, v in tok.role_ids.items()}
    for r in range(R):
        starts = [p for p in range(rows.used[r]) if p == 0 or rows.doc_ids[r, p] != rows.doc_ids[r, p - 1]]
        for s, e in zip(starts, starts[1:] + [int(rows.used[r])], strict=True):
            seg = rows.tokens[r, s:e].tolist()
            if loss_on == "all":
                mask[r, s : e - 1] = True  # every target inside the example
                continue
            turns, p = [], 1  # (role, first content position, position of its <|end|>)
            while p < len(seg):
                q = p + 1
                while q < len(seg) and seg[q] != tok.end:
                    q += 1
                turns.append((roles[seg[p]], p + 1, q))
                p = q + 1
            completion_from = next(k for t, k in answers.items() if list(t[: len(seg)]) == seg)
            answer_turns = [i for i, t in enumerate(turns) if t[0] == "assistant"]
            if loss_on == "completion":
                answer_turns = [i for i in answer_turns if i >= completion_from]
            for i in answer_turns:
                _, first, end = turns[i]
                last = min(end, len(seg) - 1)  # a cut example keeps its head only
                mask[r, s + first - 1 : s + last] = True  # target positions t predict token t + 1
    return mask


def capture_hidden(model):
    """Make model.forward_hidden keep its output's gradient; returns the dict that will hold it."""
    held, inner = {}, model.forward_hidden

    def forward_hidden(*args, **kwargs):
        held["h"] = inner(*args, **kwargs)
        held["h"].retain_grad()
        return held["h"]

    model.forward_hidden = forward_hidden
    return held


@pytest.mark.parametrize(
    "kind, loss_on",
    [("exact", "assistant"), ("exact", "completion"), ("exact", "all"), ("default", "assistant")],
)
def test_gradient_reaches_exactly_the_trained_targets(tok, loss_on, kind):
    rng = fresh_rng()
    rows, answers = packed_rows(tok, rng, loss_on)
    picks = range(min(4, len(rows.tokens)))
    batch = rows.batch(picks)
    expected = reference_mask(tok, rows, answers, loss_on)[: len(picks)]
    assert torch.equal(batch.loss_mask, expected), rng.seed_value
    if loss_on != "all":
        assert (batch.targets[expected] == tok.end).any()  # the closing <|end|> is trained
    cfg = ModelConfig(vocab_size=tok.vocab_size, **TINY)
    torch.manual_seed(rng.randrange(1 << 30))
    model = exact_model(cfg, seed=rng.randrange(1 << 30)) if kind == "exact" else HybridLM(cfg)
    held = capture_hidden(model)
    loss = model.loss(batch.input_ids, batch.targets, batch.doc_ids, batch.loss_mask)
    loss.backward()
    g = held["h"].grad.abs().sum(-1)  # [B, L]
    assert (g[~expected] == 0).all(), rng.seed_value  # exactly zero: no untrained target leaks in
    assert (g[expected] > 0).all(), rng.seed_value
    # The same through full logits (the head on the same hidden states): the masked cross-entropy,
    # and its gradient per logit.
    logits = model.lm_head(held["h"].detach())  # [B, L, V]
    logits.retain_grad()
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), reduction="none")
    masked = (ce * batch.loss_mask.flatten()).sum()
    masked.backward()
    tolerance = dict(rtol=1e-6, atol=1e-5) if kind == "exact" else dict(rtol=1e-5, atol=1e-4)  # FP32 sums
    torch.testing.assert_close(masked.detach(), loss.detach(), **tolerance)
    assert (logits.grad[~expected] == 0).all() and (logits.grad[expected].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("loss_on", ["assistant", "completion", "all"])
def test_packed_examples_get_their_own_loss(tok, loss_on):
    rng = fresh_rng()
    rows, _ = packed_rows(tok, rng, loss_on, n=16)
    model = exact_model(ModelConfig(vocab_size=tok.vocab_size, **TINY), seed=rng.randrange(1 << 30))
    picks = range(min(3, len(rows.tokens)))
    packed = rows.batch(picks)
    owners, examples = [], []  # (row in the packed batch, doc id) of each example, and the example
    for b, r in enumerate(picks):
        for d in sorted(set(rows.doc_ids[r, : rows.used[r]].tolist())):
            at = rows.doc_ids[r] == d
            owners.append((b, d))
            examples.append(EncodedChat(rows.tokens[r, at].tolist(), rows.trained[r, at].tolist()))
    # every example alone in its own row (rows of one example each, padded to the same length)
    alone = [pack([ex], ROW_LEN, tok.pad).batch([0]) for ex in examples]
    alone = Batch(
        *(torch.cat([getattr(a, f) for a in alone]) for f in ("input_ids", "targets", "doc_ids", "loss_mask"))
    )
    with torch.no_grad():

        def per_position_ce(batch):  # [B, L] FP64
            logits = model(batch.input_ids, doc_ids=batch.doc_ids)
            return F.cross_entropy(logits.transpose(1, 2), batch.targets, reduction="none")

        ce_packed, ce_alone = per_position_ce(packed), per_position_ce(alone)
        for i, (b, d) in enumerate(owners):
            in_row = (ce_packed[b] * (packed.loss_mask[b] & (packed.doc_ids[b] == d))).sum()
            own = (ce_alone[i] * alone.loss_mask[i]).sum()
            torch.testing.assert_close(in_row, own, rtol=1e-10, atol=1e-10)
        total = model.loss(packed.input_ids, packed.targets, packed.doc_ids, packed.loss_mask)  # FP32 sums
        separate = model.loss(alone.input_ids, alone.targets, alone.doc_ids, alone.loss_mask)
        torch.testing.assert_close(total, separate, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(total, (ce_packed * packed.loss_mask).sum().float(), rtol=1e-6, atol=1e-5)
    assert len(examples) >= 3, rng.seed_value
