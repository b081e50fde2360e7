"""The sampling filters against hand-computed cases, the log-probabilities they report, and seeding."""

import math

import pytest
import torch

from inkling_fp4.config.sampler import SamplerConfig
from inkling_fp4.errors import ConfigError
from inkling_fp4.infer.sampling import filtered_probs, min_p_mask, sample, top_k_mask, top_p_mask


def logits_of(probs):
    return torch.tensor([probs], dtype=torch.float32).log()


def test_top_k_keeps_the_k_largest_and_breaks_ties_by_id():
    z = torch.tensor([[1.0, 3.0, 2.0, 3.0, 0.0]])
    assert top_k_mask(z, 2).tolist() == [[False, True, False, True, False]]
    assert top_k_mask(z, 1).tolist() == [[False, True, False, False, False]]  # the lower id of the tie
    assert top_k_mask(z, 3).tolist() == [[False, True, True, True, False]]
    assert top_k_mask(z, 0).all() and top_k_mask(z, 9).all()


def test_top_p_keeps_the_fewest_tokens_that_reach_p():
    p = torch.tensor([[0.1, 0.5, 0.25, 0.15]])  # sorted: 0.5, 0.25, 0.15, 0.1
    assert top_p_mask(p, 0.5).tolist() == [[False, True, False, False]]  # 0.5 reaches 0.5 alone
    assert top_p_mask(p, 0.6).tolist() == [[False, True, True, False]]  # 0.75 >= 0.6
    assert top_p_mask(p, 0.9).tolist() == [[False, True, True, True]]  # 0.9 reached at the third
    assert top_p_mask(p, 0.91).tolist() == [[True, True, True, True]]
    assert top_p_mask(p, 0.01).tolist() == [[False, True, False, False]]  # always the most likely
    assert top_p_mask(p, 1.0).all()


def test_min_p_keeps_tokens_within_a_factor_of_the_most_likely():
    p = torch.tensor([[0.1, 0.5, 0.25, 0.15]])
    assert min_p_mask(p, 0.3).tolist() == [[False, True, True, True]]  # >= 0.15
    assert min_p_mask(p, 0.31).tolist() == [[False, True, True, False]]
    assert min_p_mask(p, 0.0).all()


def test_filters_compose_in_order_and_renormalise():
    z = logits_of([0.1, 0.4, 0.3, 0.2])
    logp, probs = filtered_probs(z, 1.0, top_k=3, top_p=0.7)
    # top-k 3: {0.4, 0.3, 0.2} renormalised to 4/9, 3/9, 2/9; top-p 0.7: 4/9 + 3/9 = 7/9 >= 0.7
    assert probs[0].tolist() == pytest.approx([0.0, 4 / 7, 3 / 7, 0.0], abs=1e-6)
    assert logp[0].exp().tolist() == pytest.approx([0.1, 0.4, 0.3, 0.2], abs=1e-6)  # before truncation
    _, probs = filtered_probs(z, 1.0, min_p=0.6)  # >= 0.24: {0.4, 0.3}
    assert probs[0].tolist() == pytest.approx([0.0, 4 / 7, 3 / 7, 0.0], abs=1e-6)


def test_temperature_and_reported_logprobs():
    z = torch.randn(3, 50)
    g = torch.Generator().manual_seed(1)
    tok, lp = sample(z, temperature=0.7, top_k=5, generator=g)
    want = torch.log_softmax(z / 0.7, -1).gather(-1, tok[:, None])[:, 0]  # after T, before top-k
    assert torch.equal(lp, want)
    assert all(t in z[i].topk(5).indices.tolist() for i, t in enumerate(tok.tolist()))
    tok, lp = sample(z, temperature=0.0)
    assert torch.equal(tok, z.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(z, -1).max(-1).values)


def test_sampling_follows_the_filtered_distribution_and_is_seeded():
    z = logits_of([0.1, 0.4, 0.3, 0.2]).expand(20000, 4)
    g = torch.Generator().manual_seed(0)
    tok, _ = sample(z, temperature=1.0, top_p=0.7, generator=g)
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    assert freq.tolist() == pytest.approx([0.0, 4 / 7, 3 / 7, 0.0], abs=0.02)
    again, _ = sample(z, temperature=1.0, top_p=0.7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(tok, again)


@pytest.mark.parametrize(
    "key, value",
    [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.0),
     ("max_new_tokens", 0), ("precision", "fp16"), ("temperature", math.nan)],
)  # fmt: skip
def test_config_refuses_bad_values(key, value):
    with pytest.raises(ValueError, match=f"sampler.{key}"):
        SamplerConfig(**{key: value})


def test_config_overrides_are_config_errors():
    from inkling_fp4.config import RunConfig, apply_overrides, from_dict

    with pytest.raises(ConfigError, match="top_p"):
        from_dict(RunConfig, apply_overrides({}, ["sampler.top_p=2"]))
    assert from_dict(RunConfig, apply_overrides({}, ["sampler.stop=[END]"])).sampler.stop == ["END"]
