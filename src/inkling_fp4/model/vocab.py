"""Growing the vocabulary of a trained model: new embedding and LM-head rows for added tokens (e.g.
chat special tokens appended to a pretrained tokenizer, ``data/tokenizer.py``).

New rows start at the FP32 mean of the existing rows, per matrix (Hewitt, "Initializing new word
embeddings for pretrained language models", 2021): the new token gets the average token's logit and an
in-distribution embedding, where a zero or random row makes its logit arbitrary. Old rows stay
bit-identical. Grow before building the optimizer and wrapping for DDP / FSDP: growth replaces the
parameters they hold.
"""

from __future__ import annotations

import torch
from torch import nn

from inkling_fp4.model.hybrid import HybridLM


def _grown(weight: torch.Tensor, rows: int) -> nn.Parameter:
    """weight [V, D] -> [V + rows, D]: the old rows, then ``rows`` copies of their FP32 mean."""
    mean_1D = weight.detach().float().mean(dim=0, keepdim=True).to(weight.dtype)
    new_rows = mean_1D.expand(rows, -1)  # [rows, D]
    return nn.Parameter(torch.cat([weight.detach(), new_rows]), requires_grad=weight.requires_grad)


@torch.no_grad()
def grow_vocab(model: HybridLM, new_vocab_size: int) -> int:
    """Grow ``model.embed`` and ``model.lm_head`` in place to ``new_vocab_size`` rows and set
    ``model.cfg.vocab_size``; returns the rows added (0 when the vocabulary fits)."""
    old = model.embed.num_embeddings
    if model.lm_head.out_features != old:
        raise AssertionError(f"embedding has {old} rows but the LM head {model.lm_head.out_features}")
    rows = new_vocab_size - old
    if rows <= 0:
        return 0
    model.embed.weight = _grown(model.embed.weight, rows)
    model.embed.num_embeddings = new_vocab_size
    model.lm_head.weight = _grown(model.lm_head.weight, rows)
    model.lm_head.out_features = new_vocab_size
    model.cfg.vocab_size = new_vocab_size
    return rows


def fit_tokenizer(model: HybridLM, tokenizer) -> str | None:
    """Mean-initialised rows for the tokens a tokenizer gained and for ids past the embedding; returns a
    log line, or None."""
    added = [tokenizer.hf.token_to_id(t) for t in tokenizer.added_specials]
    grown = max(0, tokenizer.vocab_size - model.embed.num_embeddings)
    if not added and not grown:
        return None
    grow_vocab(model, tokenizer.vocab_size)
    mean_init_rows(model, added)
    names = ", ".join(tokenizer.added_specials) or "none"
    return (
        f"vocabulary: {len(added)} chat tokens added to the tokenizer ({names}), {grown} new rows; their "
        "embedding and head rows start at the mean of the others"
    )


@torch.no_grad()
def mean_init_rows(model: HybridLM, ids: list[int]) -> int:
    """Set the rows of ``ids`` to the FP32 mean of the other rows, growing the vocabulary where needed
    (spare rows of a padded vocabulary were never trained). Returns the number of ids."""
    if not ids:
        return 0
    V = model.embed.num_embeddings
    keep = torch.ones(V, dtype=torch.bool, device=model.embed.weight.device)
    keep[torch.tensor([i for i in ids if i < V], dtype=torch.long, device=keep.device)] = False
    means = [w[keep].float().mean(dim=0).to(w.dtype) for w in (model.embed.weight, model.lm_head.weight)]
    grow_vocab(model, max(ids) + 1)
    for weight, mean_D in zip((model.embed.weight, model.lm_head.weight), means, strict=True):
        weight[V:] = mean_D
        weight[:V][~keep] = mean_D
    return len(ids)
