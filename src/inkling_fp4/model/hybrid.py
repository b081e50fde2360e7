"""HybridLM: the Nemotron-H style language model, built from a pattern of Mamba-2, attention and MLP layers.

    h = embed(tokens)                            # nn.Embedding, never quantized
    h = h + mixer_i(RMSNorm(h))   for each layer i of the pattern ('M' Mamba-2, '*' attention, '-' MLP)
                                 # (each add is fused with the next norm: Block.forward)
    logits = lm_head(RMSNorm(h))                 # untied nn.Linear, never quantized

Pre-norm residual blocks, no biases, no dropout, no positional embedding (the Mamba-2 layers carry
order). Every GEMM in a block is a ``QuantLinear(layer_idx=i)``, so a precision policy can set a recipe
per layer. The residual stream stays FP32 (the embedding's dtype) under autocast.

Init (Megatron's for Nemotron-H): weights ~ normal(0, init_std); the projections into the residual
stream ~ normal(0, init_std / sqrt(2 * n_layers)), so its variance does not grow with depth.

Generation: ``allocate_cache``, ``prefill`` (right-padded prompts), then ``decode_step`` per token; a
step keeps positions on the device, so it can be replayed as one CUDA graph (``graphed_decoder.py``).

Shape letters: B batch, L length, D d_model, V vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from inkling_fp4.errors import UserError
from inkling_fp4.model import flops
from inkling_fp4.model.attention import Attention
from inkling_fp4.model.cache import InferenceCache
from inkling_fp4.model.config import ModelConfig
from inkling_fp4.model.loss import DEFAULT_CHUNK_TOKENS, chunked_cross_entropy
from inkling_fp4.model.mamba2 import Mamba2Mixer
from inkling_fp4.model.mlp import MLP
from inkling_fp4.model.norm import RMSNorm
from inkling_fp4.model.packing import Packing
from inkling_fp4.precision.quant_linear import QuantLinear


class Block(nn.Module):
    """One layer of the pattern: ``x + mixer(RMSNorm(x))``."""

    def __init__(self, kind: str, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.kind = kind
        self.layer_idx = layer_idx
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if kind == "M":
            self.mixer = Mamba2Mixer(cfg, layer_idx)
        elif kind == "*":
            self.mixer = Attention(cfg, layer_idx)
        elif kind == "-":
            self.mixer = MLP(cfg, layer_idx)
        else:
            raise ValueError(f"unknown layer type '{kind}' in the pattern")

    def forward(
        self, x: torch.Tensor, packing: Packing | None = None, pending: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [B, L, D]; pending: the previous block's mixer output, not yet added (None
        for the first block) -> (x + pending, this mixer's output); the add is fused into this norm."""
        if pending is None:
            return x, self.mixer(self.norm(x), packing)
        x, normed = self.norm.add_and_norm(x, pending)
        return x, self.mixer(normed, packing)

    def prefill(self, x: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return x + self.mixer.prefill(self.norm(x), cache)

    def step(
        self, x: torch.Tensor, pending: torch.Tensor | None, cache: InferenceCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step, as :meth:`forward`: x [B, D] and pending -> (x + pending, this mixer's output)."""
        if pending is None:
            return x, self.mixer.step(self.norm(x), cache)
        x, normed = self.norm.add_and_norm(x, pending)
        return x, self.mixer.step(normed, cache)


class HybridLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(kind, cfg, i) for i, kind in enumerate(cfg.pattern))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        if self.embed.weight.is_meta:  # built on the meta device to count parameters: no values to set
            return
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, 0.0, std)
        nn.init.normal_(self.lm_head.weight, 0.0, std)
        for m in self.layers.modules():
            if isinstance(m, QuantLinear):
                nn.init.normal_(m.weight, 0.0, std)
        for block in self.layers:
            for proj in block.mixer.output_projections():
                nn.init.normal_(proj.weight, 0.0, std / math.sqrt(2 * self.cfg.n_layers))

    def forward_hidden(self, input_ids: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [B, L] int64; doc_ids: [B, L] or None -> the final-normed hidden states [B, L, D]."""
        packing = Packing.from_doc_ids(doc_ids, attention="*" in self.cfg.pattern)
        x = self.embed(input_ids)  # [B, L, D]
        pending = None  # each block's mixer output, added to x inside the next norm's kernel
        for block in self.layers:
            x, pending = block(x, packing, pending)
        if pending is None:
            return self.norm_f(x)
        return self.norm_f.add_and_norm(x, pending)[1]

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids: [B, L] int64; doc_ids: [B, L] or None -> logits [B, L, V].

        With ``targets`` it returns :meth:`loss` instead: training calls ``forward`` so that DDP / FSDP, which
        hook ``forward``, see the whole computation."""
        if targets is not None:
            return self.loss(input_ids, targets, doc_ids, loss_mask)
        return self.lm_head(self.forward_hidden(input_ids, doc_ids))  # [B, L, V]

    def loss(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    ) -> torch.Tensor:
        """Summed FP32 cross-entropy over the positions ``loss_mask`` keeps, with no full logits."""
        hidden = self.forward_hidden(input_ids, doc_ids)  # [B, L, D]
        return chunked_cross_entropy(hidden, self.lm_head.weight, targets, loss_mask, chunk_tokens)

    # --- accounting -------------------------------------------------------------------------

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embeddings else n

    def matmul_params(self) -> int:
        """Weights that take part in a GEMM per token: every QuantLinear and the LM head."""
        quant = sum(m.weight.numel() for m in self.modules() if isinstance(m, QuantLinear))
        return quant + self.lm_head.weight.numel()

    def flops_per_token(self, seq_len: int) -> float:
        """Training (forward + backward) FLOPs per token at ``seq_len`` (see :mod:`~.flops`)."""
        return flops.flops_per_token(self.cfg, self.matmul_params(), seq_len)

    # --- generation -------------------------------------------------------------------------

    def allocate_cache(self, batch: int, max_len: int, dtype: torch.dtype | None = None) -> InferenceCache:
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens; KV and conv states in ``dtype``
        (default BF16 on CUDA, else FP32), SSM states FP32 at least."""
        device = self.embed.weight.device
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        states = [block.mixer.allocate_state(batch, max_len, device, dtype) for block in self.layers]
        lengths = torch.zeros(batch, dtype=torch.long, device=device)
        return InferenceCache(layers=states, lengths=lengths, max_len=max_len)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens: [B, L] right-padded prompts with ``lengths`` [B] real tokens each (1 <= lengths <= L).
        Resets and fills ``cache``; returns the logits after each prompt's last real token, [B, V]."""
        Bsz, L = tokens.shape
        if Bsz != cache.batch_size:
            raise UserError(
                f"prefill: {Bsz} prompts for a cache of batch {cache.batch_size}; allocate a matching cache"
            )
        if L > cache.max_len:
            raise UserError(f"prefill: prompts of {L} tokens exceed the cache's max_len {cache.max_len}")
        lengths = lengths.to(device=tokens.device, dtype=torch.long)
        longest, shortest = int(lengths.max()), int(lengths.min())
        if shortest < 1 or longest > L:
            raise UserError(
                f"prefill: lengths must lie in [1, {L}] (the padded prompt length), got {shortest}..{longest}"
            )
        cache.reset()
        cache.lengths.copy_(lengths)
        cache.longest = longest
        x = self.embed(tokens)  # [B, L, D]
        for block in self.layers:
            x = block.prefill(x, cache)
        last = x[torch.arange(Bsz, device=x.device), lengths - 1]  # [B, D]
        return self.lm_head(self.norm_f(last))  # [B, V]

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens: [B], each sequence's next token (at cache.lengths[b]) -> the next logits [B, V]."""
        if cache.longest >= cache.max_len:
            raise UserError(f"decode_step: the cache is full ({cache.max_len} tokens); allocate a longer one")
        x = self.embed(tokens)  # [B, D]
        pending = None  # each block's mixer output, added to x inside the next norm's kernel
        for block in self.layers:
            x, pending = block.step(x, pending, cache)
        cache.lengths += 1
        cache.longest += 1
        return self.lm_head(self.norm_f.add_and_norm(x, pending)[1])  # [B, V]
