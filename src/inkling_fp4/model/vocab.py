"""Growing the vocabulary of a trained model: new embedding and LM-head rows for added tokens.

Why: a pretrained tokenizer that lacks the chat template's special tokens (``<|user|>``, ``<|end|>``,
...) gets them appended after its vocabulary (``data/tokenizer.py``), so their ids have no row in the
model's embedding ``embed`` [V, D] or its untied head ``lm_head`` [V, D]. Fine-tuning needs those rows.

New rows start at the mean of the existing rows, each matrix on its own (Hewitt, "Initializing new
word embeddings for pretrained language models", 2021): a zero or random row makes the new token's
logit arbitrary against the trained ones, while the mean row gives it the average token's logit at
every position (the softmax's expected log-probability barely moves) and an input embedding that lies
inside the trained ones' distribution. The mean is taken in FP32 and rounded once to the weight's dtype.

The old rows stay bit-identical. Grow before building the optimizer and before wrapping the model
for DDP / FSDP: both hold the parameters they were given, and growth replaces them.
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
    """Grow ``model.embed`` and ``model.lm_head`` in place to ``new_vocab_size`` rows (see the module
    docstring) and set ``model.cfg.vocab_size``; returns the rows added (0 when the vocabulary fits)."""
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
    """Rows for the tokens a tokenizer gained (its chat tokens, added when it lacked them) and for
    ids past the embedding, at the mean of the trained rows; what was done, for the log, or None."""
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
    """Set the embedding and head rows of ``ids`` to the FP32 mean of the model's other rows, growing
    the vocabulary first where an id has no row (every grown row gets that mean too). For tokens added
    to a tokenizer whose model already had spare rows (a vocabulary padded past the tokenizer): those
    rows were never trained, so they start where new rows do. Returns the number of ids."""
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
