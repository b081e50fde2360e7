"""The LM head and the cross-entropy in chunks of tokens, with the gradients made during the forward.

The full logits would be GBs and be read and written several times; here the tokens go through the
head in chunks of ``chunk_tokens``:

    logits = h W^T                                  # h: [m, D], W: [V, D] -> [m, V], FP32 accumulate
    ce     = logsumexp(logits) - logits[target]     # FP32
    dlogits = (softmax(logits) - onehot(target)) * mask

The loss is a plain sum, so dh = dlogits W and dW += dlogits^T h (FP32) are known right there and
only they are kept; the backward scales them. Peak memory is one chunk of logits, none recomputed.
The value is the trainer's ``masked_cross_entropy`` of ``lm_head(hidden)``, summed, not averaged.

Shape letters: M tokens (B L flattened), m tokens of a chunk, D d_model, V vocabulary.
"""

from __future__ import annotations

import torch

from inkling_fp4.model.compiled import cuda_compiled
from inkling_fp4.model.norm import output_dtype
from inkling_fp4.precision.gemm import mm_fp32_out

DEFAULT_CHUNK_TOKENS = 4096


@cuda_compiled
def _ce_and_grad(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor):
    """logits: [m, V]; targets: [m] in range; mask: [m] float -> (sum of mask * ce, FP32 scalar;
    dlogits [m, V] in logits' dtype)."""
    logits = logits.float()
    lse = logits.logsumexp(-1)  # [m]
    picked = logits.gather(1, targets[:, None])[:, 0]  # [m]
    total = ((lse - picked) * mask).sum()
    p = torch.exp(logits - lse[:, None])  # softmax: [m, V]
    onehot = torch.arange(logits.shape[1], device=logits.device)[None, :] == targets[:, None]
    dlogits = (p - onehot.float()) * mask[:, None]
    return total, dlogits


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, chunk_tokens, gemm_dtype):
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        M = hidden.shape[0]
        total = torch.zeros((), device=hidden.device, dtype=torch.float32)
        dh = torch.empty_like(hidden) if need_grad else None
        dW = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            W = weight.to(gemm_dtype)  # [V, D]
            for i in range(0, M, chunk_tokens):
                h = hidden[i : i + chunk_tokens].to(gemm_dtype)  # [m, D]
                logits = h @ W.t()  # [m, V]
                part, dlogits = _ce_and_grad(
                    logits, targets[i : i + chunk_tokens], mask[i : i + chunk_tokens]
                )
                total += part
                if need_grad:
                    dlogits = dlogits.to(gemm_dtype)
                    dh[i : i + chunk_tokens] = dlogits @ W  # [m, V] @ [V, D] -> [m, D]
                    dW += mm_fp32_out(dlogits.t(), h)  # [V, m] @ [m, D] -> [V, D], FP32 out
        ctx.save_for_backward(dh, dW)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        dh, dW = ctx.saved_tensors
        return dh * grad_total.to(dh.dtype), (dW * grad_total).to(ctx.weight_dtype), None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Summed FP32 cross-entropy of ``hidden @ lm_head_weight^T`` over the positions ``loss_mask`` keeps.
    hidden: [..., D]; lm_head_weight: [V, D]; targets: [...] int64 (any value where masked) -> FP32 scalar."""
    if chunk_tokens < 1:
        raise ValueError(f"chunked_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")
    D = hidden.shape[-1]
    hidden = hidden.reshape(-1, D)  # [M, D]
    targets = targets.reshape(-1)
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"chunked_cross_entropy: {targets.shape[0]} targets for {hidden.shape[0]} hidden positions"
        )
    if loss_mask is None:
        mask = torch.ones_like(targets, dtype=torch.float32)
    else:
        mask = loss_mask.reshape(-1).to(torch.float32)
        targets = torch.where(loss_mask.reshape(-1).bool(), targets, 0)
    gemm_dtype = output_dtype(lm_head_weight.dtype, lm_head_weight.device)  # autocast's, as nn.Linear
    return _ChunkedCE.apply(hidden, lm_head_weight, targets, mask, chunk_tokens, gemm_dtype)
