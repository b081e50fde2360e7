"""Continuous batching (infer/continuous.py) against the batch-at-a-time sampler: the same tokens,
log-probabilities and finish reasons for every prompt (BF16 and NVFP4 with row scales; greedy and
sampled; end tokens, stop strings, budgets), whatever the number of rows, with the bucketed caches
and idle rows of the graph path; and fewer decode steps when sequences end at different times."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.infer.continuous import prefill_length
from inkling_fp4.infer.decode_graphs import DecodeGraphs
from test_sampler import BF16, ROW, make


@pytest.fixture(scope="module")
def tok():
    text = ["hello world, the quick brown fox jumps over the lazy dog. " * 20, "stop here and there " * 20]
    return Tokenizer.train_bpe(text, 300, show_progress=False)


def ragged_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]  # fmt: skip


def completions(tok, precision, prompts, *, continuous, rows, graphs=False, eos=(), **sampler):
    s, _ = make(tok, precision, seed=2, batch_size=rows, continuous_batching=continuous, **sampler)
    s.eos_ids = list(eos)
    if graphs:  # the graph path's bucketed caches and idle rows, decoded eagerly on the CPU
        s.graphs = DecodeGraphs(s.model, capture=False)
        s._decode_graphs = lambda: (s.graphs.check(), s.graphs)[1]
    return s.generate(prompts), s.stats


def as_tuples(cs):
    return [(c.tokens, c.text, c.finish_reason, len(c.logprobs)) for c in cs]


@pytest.mark.parametrize("precision", [BF16, ROW], ids=["bf16", "nvfp4-row"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "buckets"])
def test_the_same_completions_as_a_batch_at_a_time(tok, precision, temperature, graphs):
    """11 ragged prompts through 4 rows (idle rows once the queue runs dry), sequences ending at
    different steps on end tokens: every completion equal to the reference's."""
    prompts = ragged_prompts(11, seed=7)
    kw = dict(temperature=temperature, max_new_tokens=20)
    free, _ = completions(tok, precision, prompts, continuous=False, rows=4, **kw)
    kw["eos"] = sorted(
        {c.tokens[3 + i] for i, c in enumerate(free[:6:2])}
    )  # ends at steps 4, 5, 6 or earlier
    ref, ref_stats = completions(tok, precision, prompts, continuous=False, rows=4, **kw)
    got, stats = completions(tok, precision, prompts, continuous=True, rows=4, graphs=graphs, **kw)
    assert {c.finish_reason for c in ref} == {"eos", "length"}  # the ends differ between prompts
    assert as_tuples(got) == as_tuples(ref)
    for a, b in zip(got, ref, strict=True):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert stats.new_tokens == ref_stats.new_tokens
    if not graphs:  # no row waits for the longest member of its batch
        assert stats.decode_steps < ref_stats.decode_steps


def test_a_completion_does_not_depend_on_the_rows_or_the_check_interval(tok):
    prompts = ragged_prompts(9, seed=3)
    base, _ = completions(tok, ROW, prompts, continuous=True, rows=3, temperature=1.0, max_new_tokens=16)
    for rows, every in ((1, 8), (5, 1), (16, 3)):
        got, _ = completions(tok, ROW, prompts, continuous=True, rows=rows, temperature=1.0,
                             max_new_tokens=16, check_every=every)  # fmt: skip
        assert as_tuples(got) == as_tuples(base)


def test_stop_strings_and_the_context(tok):
    """A stop string found across token boundaries frees the row at the next check; the context
    shortens the budget of a long prompt."""
    prompts = [tok.encode("hello world, the quick"), tok.encode("stop here and"), tok.encode("the lazy dog")]
    kw = dict(temperature=1.0, max_new_tokens=24, stop=["o", "e "])
    ref, _ = completions(tok, BF16, prompts * 3, continuous=False, rows=2, **kw)
    got, _ = completions(tok, BF16, prompts * 3, continuous=True, rows=2, **kw)
    assert as_tuples(got) == as_tuples(ref)
    assert any(c.finish_reason == "stop" for c in got)
    s, _ = make(tok, BF16, seed=2, batch_size=2, max_new_tokens=24)
    s.eos_ids, s.context = [], 12
    lengths = [len(c.tokens) for c in s.generate(prompts)]
    assert lengths == [12 - len(p) for p in prompts]


def test_generating_again_reuses_the_rows(tok):
    """The bucket cache of one call is refilled by the next: stale rows change nothing."""
    prompts = ragged_prompts(6, seed=11)
    s, _ = make(tok, ROW, seed=2, batch_size=4, temperature=1.0, max_new_tokens=12)
    s.graphs = DecodeGraphs(s.model, capture=False)
    s._decode_graphs = lambda: (s.graphs.check(), s.graphs)[1]
    first = as_tuples(s.generate(prompts))
    s.generate(ragged_prompts(3, seed=12))
    assert as_tuples(s.generate(prompts)) == first


def test_prefill_lengths_are_a_handful():
    assert [prefill_length(n, 4096) for n in (1, 16, 17, 40, 100, 513)] == [16, 16, 32, 64, 128, 1024]
    assert prefill_length(40, 50) == 50 and prefill_length(60, 50) == 60


def test_rows_auto_on_the_cpu_or_as_set(tok):
    s, _ = make(tok, BF16, batch_size=0)
    assert s.rows_for(64) == 64
    s.cfg = dataclasses.replace(s.cfg, batch_size=5)
    assert s.rows_for(64) == 5


def _tensors(state) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(state).items() if isinstance(v, torch.Tensor)}


def test_write_rows_moves_a_prefilled_row_and_zeroes_the_rest(tok):
    """A staging cache's rows land in the chosen rows of a longer cache: every layer's state and the
    length; KV positions past the staging cache's length are zero; the other rows are untouched."""
    _, model = make(tok, BF16)
    big, small = model.allocate_cache(4, 16), model.allocate_cache(2, 8)
    g = torch.Generator().manual_seed(0)
    for cache in (big, small):
        for state in filter(None, cache.layers):
            for t in _tensors(state).values():
                t.copy_(torch.randn(t.shape, generator=g))
        cache.lengths.copy_(torch.randint(1, 8, cache.lengths.shape, generator=g))
    before = [{k: t.clone() for k, t in _tensors(s).items()} for s in filter(None, big.layers)]
    big.write_rows(torch.tensor([3, 0]), small, torch.tensor([0, 1]))
    assert big.lengths[[3, 0]].tolist() == small.lengths.tolist()
    for state, src_state, old in zip(
        filter(None, big.layers), filter(None, small.layers), before, strict=True
    ):
        for name, t in _tensors(state).items():
            src = _tensors(src_state)[name]
            n = src.shape[1]
            assert torch.equal(t[[3, 0], :n], src[[0, 1]]), name
            assert not t[[3, 0], n:].any(), name  # only KV is longer than the staging cache's
            assert torch.equal(t[[1, 2]], old[name][[1, 2]]), name
