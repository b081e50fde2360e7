"""HybridLM: the Nemotron-H style language model, built from a pattern of Mamba-2, attention and MLP layers.

    h = embed(tokens)                            # nn.Embedding, never quantized
    h = h + mixer_i(RMSNorm(h))   for each layer i of the pattern ('M' Mamba-2, '*' attention, '-' MLP)
                                 # (each add is fused with the next norm: Block.forward)
    logits = lm_head(RMSNorm(h))                 # untied nn.Linear, never quantized

Pre-norm residual blocks, no biases, no dropout, no positional embedding (the Mamba-2 layers carry
order). The fused FP8 training paths are subclasses of these layers, swapped in by the trainer
(:mod:`~inkling_fp4.model.fused_fp8_layers`); nothing here branches on them. Every GEMM inside a
block is a ``QuantLinear(layer_idx=i)``, so a precision policy can set a recipe per layer without
knowing the model. The residual stream stays in the embedding's dtype (FP32): under
``torch.autocast(bf16)`` the mixers return BF16, and the sum is FP32.

Initialisation (Megatron's conventions for Nemotron-H):
- embedding, LM head and every QuantLinear weight ~ normal(0, init_std);
- the projections that write into the residual stream (attention o_proj, MLP down_proj, Mamba
  out_proj) ~ normal(0, init_std / sqrt(2 * n_layers)), so the residual variance does not grow with
  depth (GPT-2 / Megatron scaled init, counted over all layers of the pattern);
- norm gains 1; the Mamba-2 SSM parameters (A_log, dt_bias, D, conv) as in
  :mod:`inkling_fp4.model.mamba2`.

Training loss: ``loss(input_ids, targets, doc_ids, loss_mask)`` is the summed FP32 cross-entropy of the
logits without ever holding them (the LM head and the loss run in chunks of tokens, see
:mod:`inkling_fp4.model.loss`); ``forward_hidden`` gives the final-normed hidden states it starts from.
``forward`` still returns full logits (evaluation, generation, tests).

Generation: ``allocate_cache`` then ``prefill`` with right-padded prompts and their lengths, then
``decode_step`` per token. Both return the next-token logits of each sequence [B, V] and run without
autograd. See :mod:`inkling_fp4.model.cache` for how padding is kept out of the state. A decode step
reads each sequence's position from ``cache.lengths`` on the device and launches one fused kernel
per mixer (:mod:`~inkling_fp4.model.mamba2_decode`, :mod:`~inkling_fp4.model.attention_decode`), so
it can be captured and replayed as one CUDA graph (:mod:`inkling_fp4.model.graphed_decoder`).

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
        """x: the residual stream [B, L, D]; pending: the previous block's mixer output [B, L, D], not
        yet added (None for the first block). Returns (x + pending, this block's mixer output): the
        residual add happens in the same fused kernel as this block's norm, and the caller adds the
        last block's output (:meth:`HybridLM.forward_hidden`)."""
        if pending is None:
            return x, self.mixer(self.norm(x), packing)
        x, normed = self.norm.add_and_norm(x, pending)
        return x, self.mixer(normed, packing)

    def prefill(self, x: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return x + self.mixer.prefill(self.norm(x), cache)

    def step(
        self, x: torch.Tensor, pending: torch.Tensor | None, cache: InferenceCache
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of this block, like :meth:`forward`: x [B, D] the residual stream, pending the
        previous block's mixer output (None for the first block) -> (x + pending, this mixer's output),
        the add fused with this block's norm (one kernel on CUDA instead of two)."""
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
        """input_ids: [B, L] int64; doc_ids: [B, L] (packed documents) or None -> logits [B, L, V].

        With ``targets`` [B, L] it returns :meth:`loss` instead (the summed masked cross-entropy,
        without full logits): training calls it through ``forward`` so that DDP / FSDP wrappers,
        which hook ``forward``, see the whole computation.
        """
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
        """Sum of the FP32 cross-entropy over the positions ``loss_mask`` [B, L] keeps (all when None):
        the same value as a masked cross-entropy of ``forward``'s logits, without materialising them."""
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
        """An empty cache for ``batch`` sequences of up to ``max_len`` tokens. KV and conv states are kept
        in ``dtype`` (default: BF16 on CUDA, where the model runs under autocast, FP32 elsewhere); the
        SSM states are FP32 at least."""
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
        """tokens: [B], the next token of each sequence (appended at position cache.lengths[b]).
        Returns the logits for the token after it, [B, V]."""
        if cache.longest >= cache.max_len:
            raise UserError(f"decode_step: the cache is full ({cache.max_len} tokens); allocate a longer one")
        x = self.embed(tokens)  # [B, D]
        pending = None  # each block's mixer output, added to x inside the next norm's kernel
        for block in self.layers:
            x, pending = block.step(x, pending, cache)
        cache.lengths += 1
        cache.longest += 1
        return self.lm_head(self.norm_f.add_and_norm(x, pending)[1])  # [B, V]
