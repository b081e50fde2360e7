"""Batched generation with the hybrid model's cache, under the run's own forward pass.

    prompts (token lists, any lengths)  ->  right-padded [B, L] + lengths [B]
    logits = model.prefill(tokens, lengths, cache)                  [B, V]
    repeat:  token, logprob = sample(logits)                        [B], [B]   (infer/sampling.py)
             logits = model.decode_step(token, cache)               [B, V]
    every ``check_every`` steps: which sequences have ended (infer/stopping.py); stop when all have

Precision. The model runs a :class:`PrecisionPolicy`: the trainer's own (a rollout hands it over) or
one built from the run's precision config (:func:`sampler_policy`). Weights are quantized once per
policy version (:meth:`PrecisionPolicy.freeze_weights`; call :meth:`Sampler.weights_updated` after
each optimizer step), activations per GEMM as the recipe says. Under ``precision.activation_scale
= tensor`` a token's NVFP4 codes depend on every row of its GEMM, so on the other sequences of the
decode batch (and on the padding of the prefill); ``row`` removes that dependence.

Finished sequences keep decoding until the next check (their tokens are dropped afterwards), so a
sequence's tokens never depend on ``check_every`` or on when its neighbours ended. Sampling draws
from one ``torch.Generator`` seeded with ``sampler.seed`` per :meth:`Sampler.generate` call: the
same prompts and config give the same completions.

Shape letters: B batch, L prompt length, T new tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import UserError
from inkling_fp4.infer.config import SamplerConfig
from inkling_fp4.infer.sampling import sample
from inkling_fp4.infer.stopping import StopChecker
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.policy import PrecisionPolicy


@dataclass
class Completion:
    """One generated continuation of one prompt."""

    prompt_tokens: list[int]
    tokens: list[int]
    """The new tokens, up to and including the end token or the token that completed a stop string."""
    text: str
    """The new tokens' text, without the end token and without the stop string."""
    logprobs: list[float]
    """log p of each new token under the distribution it was drawn from (after the temperature,
    before top-k / top-p / min-p; see ``infer/sampling.py``), one per token."""
    finish_reason: str
    """eos | stop | length (``infer/stopping.py``)."""


@dataclass
class GenerationStats:
    new_tokens: int = 0
    seconds: float = 0.0
    decode_steps: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


def sampler_policy(
    run_precision: PrecisionConfig, precision: str, n_layers: int, switched_scope: str | None = None
) -> PrecisionPolicy:
    """The policy a sampler runs: ``train`` is the run's own precision config, with the checkpoint's
    switch to BF16 (``switched_scope``) where it had switched; a recipe name is that recipe with
    the run's other precision settings (delayed FP8 scaling and row activation scales only where
    the recipe has them)."""
    cfg = run_precision
    if precision != "train":
        cfg = dataclasses.replace(
            cfg,
            recipe=precision,
            fp8_scaling="current",
            activation_scale=cfg.activation_scale if precision == "nvfp4" else "tensor",
        )
    policy = PrecisionPolicy(cfg, n_layers)
    if precision == "train" and switched_scope is not None:
        policy.switched_scope = switched_scope
    return policy


def resolve_device(name: str) -> torch.device:
    """``sampler.device``: auto is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"sampler.device={name}: no CUDA device here; use sampler.device=cpu or auto")
    return device


class Sampler:
    """Generates from ``model`` (a HybridLM whose policy is applied) with ``cfg``'s filters and stops."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Tokenizer,
        cfg: SamplerConfig,
        policy: PrecisionPolicy | None = None,
        *,
        context: int | None = None,
        eos_ids: Sequence[int] | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.policy = policy
        self.context = context
        """Most tokens of prompt plus completion (None: unbounded, see SamplerConfig.max_context)."""
        self.eos_ids = list(eos_ids) if eos_ids is not None else [tokenizer.eos, tokenizer.end]
        self.stats = GenerationStats()
        if policy is not None:
            policy.freeze_weights(model)

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    def weights_updated(self) -> None:
        """The weights changed (an optimizer step, a load): quantize them once more, now."""
        if self.policy is not None:
            self.policy.weights_updated()
            self.policy.freeze_weights(self.model)

    def check_prompt(self, prompt: Sequence[int], where: str = "prompt") -> None:
        """UserError for an empty prompt or one that leaves no room in the context."""
        if len(prompt) == 0:
            raise UserError(f"{where} is empty; give at least one token of text")
        if self.context is not None and len(prompt) >= self.context:
            raise UserError(
                f"{where} has {len(prompt)} tokens; the model's context is {self.context} (prompt and "
                f"completion), so a prompt may have at most {self.context - 1}; shorten it or set "
                "sampler.max_context"
            )

    def generate(self, prompts: Sequence[Sequence[int]], seed: int | None = None) -> list[Completion]:
        """One completion per prompt (token lists), in batches of ``sampler.batch_size``."""
        for i, p in enumerate(prompts):
            self.check_prompt(p, f"prompt {i}")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(self.cfg.seed if seed is None else seed)
        if self.policy is not None:
            self.policy.freeze_weights(self.model)  # a no-op unless the weights changed
        out: list[Completion] = []
        bs = self.cfg.batch_size
        for start in range(0, len(prompts), bs):
            out += self._generate_batch([list(p) for p in prompts[start : start + bs]], generator)
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], generator: torch.Generator) -> list[Completion]:
        from inkling_fp4.train.trainer import autocast_for

        cfg, model, device = self.cfg, self.model, self.device
        t0 = time.perf_counter()
        B = len(prompts)
        lengths = [len(p) for p in prompts]
        budgets = [
            cfg.max_new_tokens if self.context is None else min(cfg.max_new_tokens, self.context - n)
            for n in lengths
        ]
        T = max(budgets)
        L = max(lengths)
        pad = self.tokenizer.pad if self.tokenizer.pad is not None else 0
        tokens_BL = torch.full((B, L), pad, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens_BL[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        tokens_BL = tokens_BL.to(device)
        lengths_B = torch.tensor(lengths, dtype=torch.long, device=device)
        new_BT = torch.zeros(B, T, dtype=torch.long, device=device)
        logp_BT = torch.zeros(B, T, dtype=torch.float32, device=device)
        stops = StopChecker(self.tokenizer, self.eos_ids, cfg.stop, budgets)
        budget_B = torch.tensor(budgets, dtype=torch.long, device=device)
        ended_B = torch.zeros(B, dtype=torch.bool, device=device)  # an end token or the budget, on device
        cache = model.allocate_cache(B, L + T)
        was_training = model.training
        model.eval()
        steps = 0
        try:
            with autocast_for(device):
                logits = model.prefill(tokens_BL, lengths_B, cache)  # [B, V]
                for t in range(T):
                    tok_B, lp_B = sample(
                        logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        min_p=cfg.min_p, generator=generator,
                    )  # fmt: skip
                    new_BT[:, t] = tok_B
                    logp_BT[:, t] = lp_B
                    ended_B |= stops.eos_mask(tok_B) | (budget_B <= t + 1)
                    last = t + 1 == T
                    if last or (t + 1) % cfg.check_every == 0:
                        if bool(ended_B.all()) and not cfg.stop:
                            break
                        if cfg.stop:
                            stops.update(new_BT[:, : t + 1].tolist())
                            if stops.all_finished:
                                break
                    if last:
                        break
                    logits = model.decode_step(tok_B, cache)  # [B, V]
                    steps += 1
        finally:
            model.train(was_training)
        n = t + 1
        new = new_BT[:, :n].tolist()
        logps = logp_BT[:, :n].tolist()
        stops.update(new)
        completions = []
        for b in range(B):
            end = stops.ends[b]
            assert end is not None, "every sequence ends by its budget"
            completions.append(
                Completion(prompts[b], new[b][: end.tokens], end.text, logps[b][: end.tokens], end.reason)
            )
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.stats.new_tokens += sum(len(c.tokens) for c in completions)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.decode_steps += steps
        return completions
