"""The sampler: greedy with the cache equals greedy by full forwards, log-probabilities equal the
trainer's forward, stops (end tokens, stop strings across token boundaries, budgets, the context),
seeding, and weights quantized once per policy version."""

import dataclasses

import pytest
import torch

from inkling_fp4.config.sampler import SamplerConfig
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import UserError
from inkling_fp4.infer.sampler import Sampler, sampler_policy
from inkling_fp4.infer.stopping import StopChecker
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from inkling_fp4.precision import gemm
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.quant_linear import QuantLinear

CFG = ModelConfig(pattern="M*-M", vocab_size=320, d_model=32, n_heads=2, n_kv_heads=1, ffn_dim=64,
                  mamba_heads=4, mamba_head_dim=16, n_groups=1, d_state=8, chunk_size=16)  # fmt: skip
BF16 = PrecisionConfig(recipe="bf16")
ROW = PrecisionConfig(recipe="nvfp4", activation_scale="row", bf16_first_layers=0, bf16_last_layers=0)
PROMPTS = [[5, 17, 60, 2, 9, 33, 41], [250], [7, 7, 8, 100]]


@pytest.fixture(scope="module")
def tok():
    text = ["hello world, the quick brown fox jumps over the lazy dog. " * 20, "stop here and there " * 20]
    return Tokenizer.train_bpe(text, 300, show_progress=False)


def make(tok, precision=BF16, seed=0, **sampler):
    torch.manual_seed(seed)
    model = HybridLM(CFG)
    policy = sampler_policy(precision, "train", CFG.n_layers)
    policy.apply(model)
    cfg = SamplerConfig(**{"temperature": 0.0, "max_new_tokens": 12, **sampler})
    return Sampler(model, tok, cfg, policy, eos_ids=[]), model


def greedy_by_full_forward(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.mark.parametrize("precision, tie", [(BF16, 1e-3), (ROW, 1e-2)], ids=["bf16", "nvfp4-row"])
def test_greedy_with_the_cache_equals_greedy_by_full_forwards(tok, precision, tie):
    """Same tokens, for ragged prompts in one batch (one of a single token) and a batch of 1.

    NOTE: the decode step and the full forward round BF16 intermediates in different places (the
    recurrent Mamba-2 step vs the chunked scan, one-query attention vs the causal pass), and NVFP4
    can turn such a last-bit difference into a different E2M1 code. Where two logits lie within
    that difference either token is "the" greedy one; at the fixed seed here there is no such tie
    in 12 tokens, and with the model's own tokens fed back (teacher forcing, 24 tokens, other
    seeds) every token is the full forward's argmax or within ``tie`` of its largest logit."""
    sampler, model = make(tok, precision, seed=1)
    got = sampler.generate(PROMPTS)
    for prompt, c in zip(PROMPTS, got, strict=True):
        assert c.tokens == greedy_by_full_forward(model, prompt, 12)
        assert c.finish_reason == "length" and len(c.logprobs) == 12
    alone = sampler.generate(PROMPTS[:1])  # a batch of 1
    assert alone[0].tokens == got[0].tokens
    for seed in (0, 2):
        sampler, model = make(tok, precision, seed=seed, max_new_tokens=24)
        for prompt, c in zip(PROMPTS, sampler.generate(PROMPTS), strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.tokens]))[0, len(prompt) - 1 : -1].float()
            below = logits.max(-1).values - logits.gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
            assert below.max() <= tie


@pytest.mark.parametrize("precision, tol", [(BF16, 5e-3), (ROW, 1e-2)], ids=["bf16", "nvfp4-row"])
def test_logprobs_match_the_trainers_forward(tok, precision, tol):
    """The same sampled sequences scored by the full forward (as the trainer computes log p):
    max |Δ log p| measured 2.8e-4 (nvfp4, row scales) at these seeds. NOTE: at model seed 3 one
    sampled token sits where a last-bit difference of the two paths flips an E2M1 code (2.6e-2):
    NVFP4's known sensitivity, not a sampler error (tests/test_decode_fprop.py bounds those flips)."""
    sampler, model = make(tok, precision, temperature=0.8, top_k=40, top_p=0.95, seed=4)
    got = sampler.generate(PROMPTS)
    worst = 0.0
    for prompt, c in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + c.tokens]))[0].float()
        logp = torch.log_softmax(logits / 0.8, -1)[len(prompt) - 1 : -1]  # the distribution of each new token
        ref = logp.gather(-1, torch.tensor(c.tokens)[:, None])[:, 0]
        worst = max(worst, (torch.tensor(c.logprobs) - ref).abs().max().item())
    print(f"max |Δ log p| = {worst:.2e}")
    assert worst < tol


def test_seeded_and_reproducible(tok):
    sampler, _ = make(tok, temperature=1.0)
    a, b = sampler.generate(PROMPTS), sampler.generate(PROMPTS)
    assert [c.tokens for c in a] == [c.tokens for c in b]
    c = sampler.generate(PROMPTS, seed=1)
    assert [x.tokens for x in a] != [x.tokens for x in c]


def test_eos_at_the_first_step_and_budgets(tok):
    sampler, _ = make(tok)
    first = sampler.generate(PROMPTS)[0].tokens[0]
    sampler.eos_ids = [first]
    c = sampler.generate(PROMPTS[:1])[0]
    assert (c.tokens, c.text, c.finish_reason, len(c.logprobs)) == ([first], "", "eos", 1)
    sampler.eos_ids = []
    sampler.context = 10  # the context ends first for the 7-token prompt: 3 new tokens
    got = sampler.generate(PROMPTS)
    assert [len(x.tokens) for x in got] == [3, 9, 6] and all(x.finish_reason == "length" for x in got)
    with pytest.raises(UserError, match="prompt 0 has 10 tokens; the model's context is 10"):
        sampler.generate([list(range(10))])
    with pytest.raises(UserError, match="empty"):
        sampler.generate([[]])


def test_stop_strings_across_token_boundaries(tok):
    ids = tok.encode("hello world, the end")
    pieces = [tok.decode([i]) for i in ids]
    assert len(ids) > 3
    # a stop string that begins inside one token and ends inside the next
    first, second = pieces[0], pieces[1]
    stop = first[-1] + second[:1]
    checker = StopChecker(tok, [], [stop], [len(ids)])
    checker.update([ids])
    end = checker.ends[0]
    assert (end.tokens, end.reason) == (2, "stop") and end.text == first[:-1]
    # shown one token at a time, the checker finds the same end
    checker = StopChecker(tok, [], [stop], [len(ids)])
    for n in range(1, len(ids) + 1):
        checker.update([ids[:n]])
    assert checker.ends[0] == end
    # an end token before the stop string wins, and is kept in the tokens only
    checker = StopChecker(tok, [ids[1]], ["the end"], [len(ids)])
    checker.update([ids])
    assert (checker.ends[0].tokens, checker.ends[0].reason, checker.ends[0].text) == (2, "eos", pieces[0])


def test_stop_strings_in_generation_do_not_depend_on_when_they_are_checked(tok):
    sampler, _ = make(tok, temperature=1.0, max_new_tokens=16)
    free = sampler.generate(PROMPTS)
    text = free[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop
    runs = []
    for every in (1, 5, 64):
        sampler.cfg = dataclasses.replace(sampler.cfg, stop=[stop], check_every=every)
        runs.append(sampler.generate(PROMPTS))
    assert runs[0] == runs[1] == runs[2]
    c = runs[0][0]
    assert c.finish_reason == "stop" and stop not in c.text and text.startswith(c.text)
    assert c.tokens == free[0].tokens[: len(c.tokens)]


def count_weight_quantizations(monkeypatch):
    calls = []
    real = gemm.quantize

    def counting(t, spec, **kw):
        if kw.get("name", "").endswith(" W"):
            calls.append(kw["name"])
        return real(t, spec, **kw)

    monkeypatch.setattr(gemm, "quantize", counting)
    return calls


def test_weights_are_quantized_once_per_policy_version(tok, monkeypatch):
    calls = count_weight_quantizations(monkeypatch)
    sampler, model = make(tok, ROW)  # built after the patch: its freeze is counted
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(calls) == len(layers) == 8
    sampler.generate(PROMPTS)  # 12 decode steps and a prefill
    assert len(calls) == 8
    sampler.weights_updated()  # an optimizer step: once more per layer
    sampler.generate(PROMPTS)
    assert len(calls) == 16 and sorted(calls[8:]) == sorted(calls[:8])
    # without held weights every forward quantizes every layer again
    sampler.policy.thaw_weights(model)
    sampler.cfg = dataclasses.replace(sampler.cfg, max_new_tokens=4)
    before = len(calls)
    sampler.policy.freeze_weights = lambda m: 0  # keep them thawed for this generation
    sampler.generate(PROMPTS[:1])
    assert len(calls) - before == 8 * 4  # a prefill and 3 decode steps


def test_held_weights_give_the_same_bits_and_never_go_stale(tok):
    sampler, model = make(tok, ROW)
    x = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        held = model(x)
        sampler.policy.thaw_weights(model)
        fresh = model(x)
    assert torch.equal(held, fresh)
    sampler.policy.freeze_weights(model)
    layer = next(m for m in model.modules() if isinstance(m, QuantLinear))
    assert layer.frozen_weight() is not None
    with torch.no_grad():
        layer.weight.mul_(2.0)  # changed in place without a new policy version
    assert layer.frozen_weight() is None  # the held operand is not used for the new W
    with torch.no_grad():
        changed = model(x)
        sampler.policy.weights_updated()
        sampler.policy.freeze_weights(model)
        assert torch.equal(model(x), changed)


def test_sampler_precision_choices():
    run = PrecisionConfig(recipe="nvfp4", activation_scale="row")
    assert sampler_policy(run, "train", 4).recipe.fprop.a.row_scaled
    fp8 = sampler_policy(run, "fp8", 4)
    assert fp8.cfg.recipe == "fp8" and fp8.cfg.activation_scale == "tensor"
    assert sampler_policy(run, "bf16", 4).recipe is None
    delayed = PrecisionConfig(recipe="fp8-tensorwise", fp8_scaling="delayed")
    assert sampler_policy(delayed, "nvfp4", 4).cfg.fp8_scaling == "current"
    # train follows the checkpoint's switch to BF16
    torch.manual_seed(0)
    model = HybridLM(CFG)
    policy = sampler_policy(ROW, "train", CFG.n_layers, switched_scope="all")
    policy.apply(model)
    assert all(m.recipe is None for m in model.modules() if isinstance(m, QuantLinear))
    assert "switched to BF16" in policy.describe(model)
