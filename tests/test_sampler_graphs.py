"""The sampler's bucketed decode (infer/decode_graphs.py): held weights refreshed in place (what keeps a
captured graph current after an optimizer step), padding rows that change no real row under any
activation scaling, graphs kept across calls and dropped when what they captured changes; on a GPU,
graphed greedy generation equal to eager token for token, before and after a weight update."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from inkling_fp4.config.sampler import SamplerConfig
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.infer.decode_graphs import DecodeGraphs, Slot, cache_len, graph_key
from inkling_fp4.infer.sampler import Sampler, sampler_policy
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.held_operand import operand_tensors, refresh_in_place
from inkling_fp4.precision.quant_linear import QuantLinear
from test_sampler import BF16, PROMPTS, ROW, make

TENSOR = dataclasses.replace(ROW, activation_scale="tensor")
FP8 = PrecisionConfig(recipe="fp8", bf16_first_layers=0, bf16_last_layers=0)
MXFP4 = PrecisionConfig(recipe="mxfp4", bf16_first_layers=0, bf16_last_layers=0)
RECIPES = [(BF16, "bf16"), (ROW, "nvfp4-row"), (TENSOR, "nvfp4-tensor"), (FP8, "fp8")]


@pytest.fixture(scope="module")
def tok():
    text = ["hello world, the quick brown fox jumps over the lazy dog. " * 20, "stop here and there " * 20]
    return Tokenizer.train_bpe(text, 300, show_progress=False)


def quant_layers(model):
    return [m for m in model.modules() if isinstance(m, QuantLinear) and m.frozen_weight() is not None]


def optimizer_like_step(model, seed=5):
    """Every weight changed in place, as an optimizer step changes it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.05 * p.abs().mean())


@pytest.mark.parametrize(
    "precision", [ROW, TENSOR, FP8, MXFP4], ids=["nvfp4-row", "nvfp4-tensor", "fp8", "mxfp4"]
)
def test_held_weights_are_refreshed_in_place(tok, precision):
    """After an optimizer step and a new policy version the held operands keep their addresses
    (a captured graph reads them) and hold the new W's quantization: a forward with them equals the
    forward that quantizes W afresh, bit for bit. Fails if freeze_weights made new tensors."""
    sampler, model = make(tok, precision)
    layers = quant_layers(model)
    assert layers
    before = {m: [(t.data_ptr(), t.clone()) for t in operand_tensors(m.frozen_weight())] for m in layers}
    optimizer_like_step(model)
    sampler.weights_updated()  # a new policy version: quantize once more
    x = torch.randint(0, 320, (2, 9))
    for m in layers:
        now = operand_tensors(m.frozen_weight())
        assert [t.data_ptr() for t in now] == [ptr for ptr, _ in before[m]], m.full_name
        assert any(not torch.equal(t, old) for t, (_, old) in zip(now, before[m], strict=True)), m.full_name
    with torch.no_grad():
        held = model(x)
        sampler.policy.thaw_weights(model)
        fresh = model(x)
    assert torch.equal(held, fresh)


def test_an_operand_of_another_layout_is_not_copied_into():
    a = (torch.zeros(4, 16), torch.zeros(()))
    assert not refresh_in_place(a, (torch.ones(4, 32), torch.ones(())))
    assert not refresh_in_place(a, (torch.ones(4, 16, dtype=torch.bfloat16), torch.ones(())))
    assert not refresh_in_place(None, a)
    new = (torch.ones(4, 16), torch.full((), 2.0))
    assert refresh_in_place(a, new) and torch.equal(a[0], new[0]) and a[1] == 2


def bucketed(sampler):
    """The sampler decoding through bucket caches and padding, eagerly (CPU has no CUDA graphs)."""
    sampler.graphs = DecodeGraphs(sampler.model, capture=False)
    return sampler


def logp_gap(a, b) -> float:
    """The largest |Δ log p| between two generations of the same prompts (all of one length here)."""
    gaps = []
    for ca, cb in zip(a, b, strict=True):
        gaps += [abs(x - y) for x, y in zip(ca.logprobs, cb.logprobs, strict=True)]
    return max(gaps)


@pytest.mark.parametrize("precision", [p for p, _ in RECIPES], ids=[i for _, i in RECIPES])
def test_a_padded_batch_is_the_batch_with_copies_of_its_first_row(tok, precision):
    """3 and 5 prompts decoded in buckets of 4 and 8 give, bit for bit, what the eager sampler gives
    for the batch with copies of prompt 0 appended (greedy: copies stay copies), cut to the real rows."""
    padded = bucketed(make(tok, precision)[0])
    eager, _ = make(tok, precision)
    for batch, bucket in ((PROMPTS, 4), (PROMPTS + [[3, 1, 4, 1, 5], [9, 2, 6]], 8)):
        copies = batch + [batch[0]] * (bucket - len(batch))
        assert padded.generate(batch) == eager.generate(copies)[: len(batch)]
    assert sorted(padded.graphs.slots) == [4, 8]


@pytest.mark.parametrize("precision", [p for p, _ in RECIPES], ids=[i for _, i in RECIPES])
def test_padding_with_copies_changes_no_real_row(tok, precision):
    """Sampled at temperature 1, the padded batch gives the unpadded batch's tokens, and its
    log-probabilities up to the GEMMs' rounding for another row count (CPU GEMMs are not batch
    invariant: measured <= 1e-6). Under tensorwise activation scales another padding row (a
    different prompt) would move them by > 1e-2: the copies leave each GEMM's amax as it was."""
    for seed in (0, 3):
        eager, _ = make(tok, precision, seed=seed, temperature=1.0)
        padded = bucketed(make(tok, precision, seed=seed, temperature=1.0)[0])
        got, want = padded.generate(PROMPTS), eager.generate(PROMPTS)
        assert [c.tokens for c in got] == [c.tokens for c in want] and logp_gap(got, want) < 1e-5
    if precision is TENSOR:
        greedy, _ = make(tok, precision, seed=3)
        assert logp_gap(greedy.generate(PROMPTS + [[1] * 7])[:3], greedy.generate(PROMPTS)) > 1e-2


class BufferDecoder:
    """GraphedDecoder's contract on the CPU: the step's logits in one buffer that the next call
    overwrites, as a graph's output buffer is."""

    def __init__(self, model, cache):
        self.model, self.cache, self.calls = model, cache, 0
        self.logits = None

    def __call__(self, tokens):
        out = self.model.decode_step(tokens, self.cache)  # [R, V]
        self.logits = torch.empty_like(out) if self.logits is None else self.logits
        self.calls += 1
        return self.logits.copy_(out)


def test_a_replayed_steps_buffer_is_read_before_it_is_overwritten(tok):
    sampler, model = make(tok, ROW, temperature=1.0)
    graphs = bucketed(sampler).graphs
    graphs.check()
    cache = model.allocate_cache(4, 64)
    graphs.slots[4] = Slot(cache, BufferDecoder(model, cache))
    replayed = sampler.generate(PROMPTS)
    assert graphs.slots[4].decoder.calls == sampler.stats.decode_steps == 11
    assert replayed == bucketed(make(tok, ROW, temperature=1.0)[0]).generate(PROMPTS)


def test_bucket_caches_are_kept_across_calls_and_weight_updates(tok):
    """An RL loop: generate, optimizer step, generate. The bucket's cache (and graph) is the same
    object throughout, and the second generation sees the new weights (bit for bit the eager
    sampler's, on the batch with a copy of prompt 0 for the bucket's fourth row)."""
    sampler = bucketed(make(tok, ROW)[0])
    reference, ref_model = make(tok, ROW)
    copies = PROMPTS + PROMPTS[:1]
    before = sampler.generate(PROMPTS)
    slot = sampler.graphs.slots[4]
    for s, model in ((sampler, sampler.model), (reference, ref_model)):
        optimizer_like_step(model)
        s.weights_updated()
    after = sampler.generate(PROMPTS)
    assert after == reference.generate(copies)[:3] and after != before
    assert sampler.graphs.slots[4] is slot and slot.cache.max_len == 64
    # a longer generation needs a longer cache: the bucket's slot is replaced
    sampler.cfg = dataclasses.replace(sampler.cfg, max_new_tokens=60)
    sampler.generate(PROMPTS)
    assert sampler.graphs.slots[4].cache.max_len == 128


def test_graphs_are_dropped_when_what_they_captured_changes(tok):
    sampler, model = make(tok, ROW)
    key = graph_key(model)
    optimizer_like_step(model)
    assert graph_key(model) != key  # W changed but not quantized again: the held operands are not used
    sampler.weights_updated()
    assert graph_key(model) == key  # quantized again, in place
    sampler.policy.switch_to_bf16(model)
    assert graph_key(model) != key  # other kernels
    graphs = bucketed(sampler).graphs
    sampler.generate(PROMPTS)
    slot = graphs.slots[4]
    sampler.policy.switched_scope = None
    sampler.policy.apply(model)
    sampler.generate(PROMPTS)
    assert graphs.slots[4] is not slot


def test_cache_lengths():
    assert cache_len(10, None) == 64 and cache_len(65, None) == 128 and cache_len(128, None) == 128
    assert cache_len(40, 50) == 50 and cache_len(60, 50) == 60  # at most the bound, at least what's needed


def test_cuda_graph_is_ignored_on_the_cpu(tok):
    sampler, _ = make(tok, cuda_graph=True)
    sampler.generate(PROMPTS)
    assert sampler.graphs is None


# -- on a GPU ---------------------------------------------------------------------------------------

GPU_CFG = ModelConfig(preset="tiny", vocab_size=320)


def gpu_sampler(tok, precision, cuda_graph, max_new_tokens=24):
    torch.manual_seed(0)
    model = HybridLM(GPU_CFG).cuda()
    policy = sampler_policy(precision, "train", GPU_CFG.n_layers)
    policy.apply(model)
    cfg = SamplerConfig(temperature=0.0, max_new_tokens=max_new_tokens, cuda_graph=cuda_graph, device="cuda")
    return Sampler(model, tok, cfg, policy, eos_ids=[]), model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", [BF16, ROW], ids=["bf16", "nvfp4-row"])
def test_graphed_generation_equals_eager_before_and_after_a_weight_update(tok, precision):
    """Greedy tokens with sampler.cuda_graph on and off, for a batch that fills its bucket (4) and
    one padded into it (3: compared with the eager batch with a copy of prompt 0 appended, so that
    both run GEMMs of 4 rows; another row count may round differently in the last bit and flip a
    near tie), then after an optimizer-like step on both models: the graph captured by the first
    call is replayed, not captured again, and decodes with the new weights."""
    graphed, g_model = gpu_sampler(tok, precision, True)
    eager, e_model = gpu_sampler(tok, precision, False)
    distinct, copies = PROMPTS + [[3, 1, 4, 1, 5]], PROMPTS + PROMPTS[:1]

    def same_tokens():
        pairs = ((distinct, distinct), (PROMPTS, copies))  # (graphed batch, eager batch)
        return all(
            [c.tokens for c in graphed.generate(a)] == [c.tokens for c in eager.generate(b)[: len(a)]]
            for a, b in pairs
        )

    assert same_tokens()
    slot = graphed.graphs.slots[4]
    assert slot.decoder is not None and eager.graphs is None
    before = [c.tokens for c in eager.generate(distinct)]
    for s, model in ((graphed, g_model), (eager, e_model)):
        optimizer_like_step(model)
        s.weights_updated()
    assert [c.tokens for c in eager.generate(distinct)] != before  # the update shows: stale weights would
    assert same_tokens()
    assert graphed.graphs.slots[4] is slot  # replayed, not captured again


def test_the_one_off_bucket_set_up_is_counted_apart_from_the_tokens_per_second(tok, monkeypatch):
    """A bucket's cache (and, on CUDA, its capture) is made on the first call only: its time goes to
    setup_seconds, which tokens/s leaves out; the second call adds none."""
    sampler = bucketed(make(tok, ROW)[0])
    allocate = sampler.model.allocate_cache

    def slow_allocate(*args, **kwargs):  # a set-up long enough to tell apart from decoding
        time.sleep(0.05)
        return allocate(*args, **kwargs)

    monkeypatch.setattr(sampler.model, "allocate_cache", slow_allocate)
    sampler.generate(PROMPTS)
    first = dataclasses.replace(sampler.stats)
    assert 0.05 <= first.setup_seconds < first.seconds
    assert first.tokens_per_s == pytest.approx(first.new_tokens / (first.seconds - first.setup_seconds))
    sampler.generate(PROMPTS)
    assert sampler.stats.setup_seconds == first.setup_seconds and sampler.stats.seconds > first.seconds
    assert (
        f"not counting {first.setup_seconds:.2f} s of one-off graph capture and compilation"
        in first.describe()
    )
