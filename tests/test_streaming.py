"""Streaming (infer/streaming.py, Sampler.generate(on_tokens=...)): the text written as tokens arrive
is the completion's text exactly (multi-byte characters split over tokens, stop strings across token
boundaries and false starts of them, an end token, the budget), and streaming changes no token."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from inkling_fp4.config.sampler import SamplerConfig
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.infer.sampler import Sampler
from inkling_fp4.infer.streaming import TextStream, settled, stop_prefix_len
from inkling_fp4.model.cache import InferenceCache
from test_sampler import PROMPTS, make


@pytest.fixture(scope="module")
def tok():
    text = ["hello world, the quick brown fox jumps over the lazy dog. " * 20, "stop here and there " * 20]
    return Tokenizer.train_bpe(text, 300, show_progress=False)


class ScriptedLM(nn.Module):
    """A stand-in for HybridLM whose greedy continuation of any prompt is ``script``, token by token."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, 1)  # where the sampler finds the device
        self.script = script
        self.vocab = vocab
        self.at = 0

    def allocate_cache(self, batch: int, max_len: int) -> InferenceCache:
        return InferenceCache(layers=[], lengths=torch.zeros(batch, dtype=torch.long), max_len=max_len)

    def _logits(self, batch: int) -> torch.Tensor:
        logits = torch.zeros(batch, self.vocab)  # [B, V]
        logits[:, self.script[min(self.at, len(self.script) - 1)]] = 10.0
        self.at += 1
        return logits

    def prefill(self, tokens, lengths, cache):
        self.at = 0
        return self._logits(tokens.shape[0])

    def decode_step(self, tokens, cache):
        return self._logits(tokens.shape[0])


def stream(tok, script, stop=(), eos_ids=(), max_new_tokens=None):
    """(the completion, the pieces the stream wrote, how often on_tokens was called)."""
    cfg = SamplerConfig(temperature=0.0, max_new_tokens=max_new_tokens or len(script), stop=list(stop))
    sampler = Sampler(ScriptedLM(script, tok.vocab_size), tok, cfg, eos_ids=list(eos_ids))
    pieces, calls = [], []
    text = TextStream(tok, stop, pieces.append)

    def on_tokens(first, tokens, ends):
        calls.append(len(tokens[0]))
        text.update(tokens[0], ends[0])

    (completion,) = sampler.generate([[tok.bos]], on_tokens=on_tokens)
    assert "".join(pieces) == completion.text == text.written
    return completion, pieces, calls


def test_multi_byte_characters_split_over_tokens(tok):
    ids = tok.encode("naïve 日本 café")
    assert "\ufffd" in tok.decode(ids[:3])  # 'ï' is two tokens: its first byte alone is no character
    c, pieces, calls = stream(tok, ids)
    assert c.text == "naïve 日本 café" and c.finish_reason == "length"
    assert not any("\ufffd" in p for p in pieces) and len(pieces) > 5
    assert calls == list(range(1, len(ids) + 1))  # after every step


def test_a_stop_string_across_tokens_is_never_written(tok):
    """'ck, th' begins inside one token and ends inside another; 'the end' has a false start ('the'
    at the beginning, held back until ' qu' shows it is not the stop string)."""
    ids = tok.encode("the quick, the end. more")
    for stop, text in (("ck, th", "the qui"), ("the end", "the quick, ")):
        c, pieces, _ = stream(tok, ids, stop=[stop])
        assert (c.text, c.finish_reason) == (text, "stop")
        assert len(pieces) > 1
    _, pieces, _ = stream(tok, ids, stop=["the end"])
    assert pieces[0] == "the qu"  # 'the' alone was held back


def test_an_end_token_ends_the_stream(tok):
    ids = tok.encode("hello world")
    c, pieces, _ = stream(tok, ids + [tok.end] + tok.encode(" junk"), eos_ids=[tok.end])
    assert (c.text, c.finish_reason, c.tokens[-1]) == ("hello world", "eos", tok.end)
    c, pieces, _ = stream(tok, [tok.end] + ids, eos_ids=[tok.end])  # at the first step: nothing written
    assert (c.text, pieces) == ("", [])


def test_the_budget_ends_the_stream_inside_a_character(tok):
    ids = tok.encode("café")
    c, pieces, _ = stream(tok, ids, max_new_tokens=len(ids) - 1)  # cut between the two bytes of 'é'
    assert c.text == tok.decode(ids[:-1]) and c.text.endswith("\ufffd")  # the final text, as it is


def test_settled_text():
    assert stop_prefix_len("the qu", ["quit"]) == 2 and stop_prefix_len("abc", ["x", "cz", "bcd"]) == 2
    assert stop_prefix_len("xab", ["abc"]) == 2 and stop_prefix_len("xa", ["ab"]) == 1
    assert settled("caf\ufffd", []) == "caf" and settled("a b", ["b c"]) == "a "


def test_streaming_changes_no_token(tok):
    """The same prompts sampled with and without on_tokens (which checks after every step)."""
    sampler, _ = make(tok, temperature=1.0)
    sampler.cfg.stop = ["e t"]
    seen = []
    streamed = sampler.generate(PROMPTS, on_tokens=lambda first, tokens, ends: seen.append(ends[:]))
    assert streamed == sampler.generate(PROMPTS)
    assert all(e is not None for e in seen[-1]) and len(seen) == max(len(c.tokens) for c in streamed)
