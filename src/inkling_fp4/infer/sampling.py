"""Choosing the next token from the logits: temperature, top-k, top-p, min-p, and its log-probability.

For logits z [B, V] and temperature T > 0, the distribution a token is drawn from is built in FP32:

    p      = softmax(z / T)                      the sampled token's logprob is log p[token]
    top-k  keep the k largest p                   (ties at the k-th value: the lower ids first)
    top-p  keep the fewest largest p whose sum reaches top_p, over what top-k kept (renormalised)
    min-p  keep p >= min_p · max(p)               (max p survives every filter, so this is exact)
    token  ~ the kept p, renormalised            (the exponential race below)

Filters run in that order (as Hugging Face and vLLM); each keeps the most likely token. The reported
log-probability is ``log_softmax(z / T)[token]``, before truncation: what a trainer recomputes from
its own forward (the filters belong to the sampler, not the policy). Greedy (T = 0) takes the argmax
(lowest id among ties) and reports the T = 1 ``log_softmax(z)[token]``.

Sampling is the exponential race: with E_i ~ Exp(1) i.i.d., ``argmax_i p_i / E_i`` is distributed as
p (Gumbel-max with exponentials): no cumulative sum, no host sync.

Shape letters: B batch, V vocabulary.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def top_k_mask(logits_BV: torch.Tensor, k: int) -> torch.Tensor:
    """[B, V] bool, True at the k largest logits of each row (all when k is 0 or >= V)."""
    V = logits_BV.shape[-1]
    if k <= 0 or k >= V:
        return torch.ones_like(logits_BV, dtype=torch.bool)
    # a stable sort keeps equal values in id order, so ties at the k-th value go to the lower ids
    order = torch.sort(logits_BV, dim=-1, descending=True, stable=True).indices[:, :k]  # [B, k]
    return torch.zeros_like(logits_BV, dtype=torch.bool).scatter_(-1, order, True)


def top_p_mask(probs_BV: torch.Tensor, p: float) -> torch.Tensor:
    """[B, V] bool: the fewest most likely tokens whose probabilities (rows summing to 1) reach p.

    A token is kept when the probability mass strictly before it (in descending order) is below
    p: the first token always is, and the token that makes the sum reach p is the last one kept."""
    if p >= 1.0:
        return probs_BV > 0
    sorted_p, order = torch.sort(probs_BV, dim=-1, descending=True, stable=True)  # [B, V]
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each sorted token
    keep_sorted = before < p
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)


def min_p_mask(probs_BV: torch.Tensor, min_p: float) -> torch.Tensor:
    """[B, V] bool: tokens whose probability is at least min_p times the row's largest."""
    if min_p <= 0:
        return probs_BV > 0
    return probs_BV >= min_p * probs_BV.amax(dim=-1, keepdim=True)


def filtered_probs(
    logits_BV: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_softmax(z / T) [B, V], the filtered distribution [B, V] renormalised), FP32; T > 0."""
    logp = torch.log_softmax(logits_BV.float() / temperature, dim=-1)  # [B, V]
    masked = logp
    if top_k > 0:
        masked = masked.masked_fill(~top_k_mask(masked, top_k), NEG_INF)
    if top_p < 1.0:
        probs = torch.softmax(masked, dim=-1)
        masked = masked.masked_fill(~top_p_mask(probs, top_p), NEG_INF)
    if min_p > 0:
        probs = torch.softmax(masked, dim=-1)
        masked = masked.masked_fill(~min_p_mask(probs, min_p), NEG_INF)
    return logp, torch.softmax(masked, dim=-1)


def sample(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B] int64, their log-probabilities [B] FP32) for next-token logits [B, V]; ``noise``
    [B, V] holds positive Exp(1) draws for the race (else they are drawn from ``generator``)."""
    if temperature == 0:
        logp = torch.log_softmax(logits_BV.float(), dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logp, probs = filtered_probs(logits_BV, temperature, top_k, top_p, min_p)
    if noise is not None:
        race = noise
    else:
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)  # E ~ Exp(1), [B, V]
        # NOTE: an FP32 draw of E is exactly 0 about once in 2^24 elements (-log(1 - u) at u = 0): 0/0
        # would be NaN, which argmax takes for the largest. The smallest normal in its place keeps p/E finite.
        race.clamp_(min=torch.finfo(torch.float32).tiny)
    tokens = (probs / race).argmax(dim=-1)  # removed tokens have p = 0 and never win
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]
