"""Generation with the inference cache: prefill + decode equal the full forward; padding stays out."""

import pytest
import torch

from inkling_fp4.errors import UserError
from inkling_fp4.model.cache import AttentionState, MambaState
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.hybrid import HybridLM
from model_helpers import exact_model

TOL = dict(atol=1e-10, rtol=1e-10)
CFG = ModelConfig(pattern="M*-M*", chunk_size=8)


def test_prefill_then_decode_equals_the_full_forward():
    model = exact_model(CFG)
    Bsz, total = 4, 26
    ids = torch.randint(0, CFG.vocab_size, (Bsz, total))
    full = model(ids)  # [B, total, V]: causal, so position t only sees the prefix
    lengths = torch.tensor([7, 1, 2, 12])  # 1 and 2 are shorter than the conv window (k - 1 = 3)
    prompts = ids[:, :12].clone()
    prompts[torch.arange(12)[None, :] >= lengths[:, None]] = 5  # right padding
    cache = model.allocate_cache(Bsz, total, dtype=torch.float64)
    rows = torch.arange(Bsz)
    logits = model.prefill(prompts, lengths, cache)
    torch.testing.assert_close(logits, full[rows, lengths - 1], **TOL)
    for s in range(total - 12):
        logits = model.decode_step(ids[rows, lengths + s], cache)
        torch.testing.assert_close(logits, full[rows, lengths + s], **TOL)
    assert cache.lengths.tolist() == (lengths + total - 12).tolist()


def test_bf16_generation_tracks_the_forward():
    torch.manual_seed(0)
    model = HybridLM(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, 14))
    full = model(ids).float()
    cache = model.allocate_cache(2, 14)
    lengths = torch.tensor([10, 6])
    rows = torch.arange(2)
    logits = model.prefill(ids[:, :10], lengths, cache)
    torch.testing.assert_close(logits.float(), full[rows, lengths - 1], atol=3e-2, rtol=3e-2)
    for s in range(4):
        logits = model.decode_step(ids[rows, lengths + s], cache)
        torch.testing.assert_close(logits.float(), full[rows, lengths + s], atol=3e-2, rtol=3e-2)


def test_padding_does_not_touch_the_state():
    model = exact_model(CFG)
    prompt = torch.randint(0, CFG.vocab_size, (1, 9))
    alone = model.allocate_cache(1, 16, dtype=torch.float64)
    model.prefill(prompt, torch.tensor([9]), alone)
    for pad_token in (0, 17):
        padded = torch.cat([prompt, torch.full((1, 7), pad_token)], 1)  # 16 tokens, 9 real
        cache = model.allocate_cache(1, 16, dtype=torch.float64)
        model.prefill(padded, torch.tensor([9]), cache)
        for mine, ref in zip(cache.layers, alone.layers, strict=True):
            if isinstance(mine, MambaState):
                torch.testing.assert_close(mine.conv, ref.conv, **TOL)
                torch.testing.assert_close(mine.ssm, ref.ssm, **TOL)
            elif isinstance(mine, AttentionState):
                torch.testing.assert_close(mine.k, ref.k, **TOL)  # padded positions hold zeros
                torch.testing.assert_close(mine.v, ref.v, **TOL)
                assert mine.k[:, 9:].abs().max() == 0
    # a batch row's padding does not change its neighbour either
    both = model.allocate_cache(2, 16, dtype=torch.float64)
    other = torch.randint(0, CFG.vocab_size, (1, 16))
    model.prefill(torch.cat([padded, other]), torch.tensor([9, 16]), both)
    ssm_layer = next(i for i, s in enumerate(both.layers) if isinstance(s, MambaState))
    torch.testing.assert_close(both.layers[ssm_layer].ssm[:1], alone.layers[ssm_layer].ssm, **TOL)


def test_prefill_resets_and_caches_are_fp32_state():
    model = exact_model(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, 8))
    cache = model.allocate_cache(2, 12, dtype=torch.float64)
    first = model.prefill(ids, torch.tensor([8, 5]), cache)
    model.decode_step(ids[:, 0], cache)
    again = model.prefill(ids, torch.tensor([8, 5]), cache)  # a fresh prefill forgets the old one
    torch.testing.assert_close(first, again, **TOL)
    bf16_cache = HybridLM(CFG).allocate_cache(2, 12, dtype=torch.bfloat16)
    assert all(s.ssm.dtype == torch.float32 for s in bf16_cache.layers if isinstance(s, MambaState))


def test_bad_requests_are_user_errors():
    model = HybridLM(CFG)
    ids = torch.randint(0, CFG.vocab_size, (2, 6))
    cache = model.allocate_cache(2, 7)
    with pytest.raises(UserError, match="lengths"):
        model.prefill(ids, torch.tensor([0, 3]), cache)
    with pytest.raises(UserError, match="lengths"):
        model.prefill(ids, torch.tensor([7, 3]), cache)
    with pytest.raises(UserError, match="batch"):
        model.prefill(ids[:1], torch.tensor([3]), cache)
    with pytest.raises(UserError, match="max_len"):
        model.prefill(torch.randint(0, 9, (2, 8)), torch.tensor([8, 8]), cache)
    model.prefill(ids, torch.tensor([6, 6]), cache)
    model.decode_step(ids[:, 0], cache)
    with pytest.raises(UserError, match="full"):
        model.decode_step(ids[:, 0], cache)
