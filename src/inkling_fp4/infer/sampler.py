"""Generation with the hybrid model's cache, under the run's own forward pass.

    prompts (token lists, any lengths)  ->  right-padded [B, L] + lengths [B]
    logits = model.prefill(tokens, lengths, cache)                  [B, V]
    repeat:  token, logprob = sample(logits, draws)                 [B], [B]   (infer/sampling.py)
             logits = model.decode_step(token, cache)               [B, V]
    every ``check_every`` steps: which sequences have ended (infer/stopping.py)

Rows are continuously batched (``infer/continuous.py``); ``sampler.continuous_batching=false`` and
streaming decode ``batch_size`` prompts at a time: the reference continuous batching is tested
against. Weights are quantized once per policy version: call :meth:`Sampler.weights_updated` after
each optimizer step. Finished sequences keep decoding until the next check, so with per-sequence
draws (``infer/sequence_noise.py``) completions do not depend on ``check_every``, the schedule or
the number of rows. CUDA graphs: ``infer/decode_graphs.py``.

Shape letters: B batch, L prompt length, T new tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from inkling_fp4.config.sampler import SamplerConfig
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import UserError
from inkling_fp4.infer.completion import Completion
from inkling_fp4.infer.continuous import ContinuousDecoder
from inkling_fp4.infer.decode_graphs import DecodeGraphs, log_to_stderr
from inkling_fp4.infer.sampling import sample
from inkling_fp4.infer.sequence_noise import exponential_noise
from inkling_fp4.infer.stopping import End, StopChecker
from inkling_fp4.model.fused_nvfp4_decode import fuse_nvfp4_decode
from inkling_fp4.model.graphed_decoder import cache_tensors
from inkling_fp4.precision.autocast import autocast_for
from inkling_fp4.precision.config import PrecisionConfig
from inkling_fp4.precision.graph_capture import graph_blocker
from inkling_fp4.precision.policy import PrecisionPolicy

AUTO_ROWS = 256
"""The most rows ``sampler.batch_size=0`` (auto) gives on CUDA."""

OnTokens = Callable[[int, list[list[int]], list[End | None]], None]
"""``on_tokens(first, tokens, ends)``: the index of the batch's first prompt, each sequence's new
tokens so far, and where each has ended (None: not yet). The last call of a batch has every end."""


@dataclass
class GenerationStats:
    new_tokens: int = 0
    seconds: float = 0.0
    decode_steps: int = 0
    setup_seconds: float = 0.0
    """Of ``seconds``, the one-off part: graph caches and captures, and each new prefill shape's first
    run on CUDA (Triton compiles and autotunes)."""

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of generation, the one-off set-up left out."""
        working = self.seconds - self.setup_seconds
        return self.new_tokens / working if working > 0 else 0.0

    def describe(self) -> str:
        line = f"{self.new_tokens} new tokens in {self.seconds:.2f} s: {self.tokens_per_s:,.1f} new tokens/s"
        if self.setup_seconds >= 0.005:
            line += f" (not counting {self.setup_seconds:.2f} s of one-off graph capture and compilation)"
        return line


def sampler_policy(
    run_precision: PrecisionConfig, precision: str, n_layers: int, switched_scope: str | None = None
) -> PrecisionPolicy:
    """The policy a sampler runs: ``train`` is the run's own (with the checkpoint's BF16 switch), a
    recipe name that recipe with the run's other settings (current FP8 scaling; row activation
    scales for nvfp4 only)."""
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
        self.graphs: DecodeGraphs | None = None
        """The bucketed caches and decode graphs, made on the first generation on CUDA."""
        self._eager_reason: str | None = None
        self.prefill_shapes: set[tuple[int, int]] = set()
        """(rows, length) prefill shapes run on CUDA so far: the first of each is set-up (compiles)."""
        self._eos: StopChecker | None = None
        if policy is not None:
            fuse_nvfp4_decode(model)  # the pre-norms write NVFP4 rows where the recipe decodes with them
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

    def generate(
        self, prompts: Sequence[Sequence[int]], seed: int | None = None, on_tokens: OnTokens | None = None
    ) -> list[Completion]:
        """One completion per prompt (token lists), under the schedule of the module docstring."""
        for i, p in enumerate(prompts):
            self.check_prompt(p, f"prompt {i}")
        seed = self.cfg.seed if seed is None else seed
        if self.policy is not None:
            self.policy.freeze_weights(self.model)  # a no-op unless the weights changed; in place if so
        graphs = self._decode_graphs()
        batch = [list(p) for p in prompts]
        if not batch:
            return []
        if self.cfg.continuous_batching and on_tokens is None:
            return self._generate_continuous(batch, seed, graphs)
        out: list[Completion] = []
        bs = self.rows_for(max(len(p) for p in batch) + self.cfg.max_new_tokens)
        for start in range(0, len(batch), bs):
            out += self._generate_batch(batch[start : start + bs], seed, graphs, start, on_tokens)
        return out

    def rows_for(self, max_len: int) -> int:
        """Sequences decoded together: ``sampler.batch_size``, or for 0 (auto) 64 on the CPU and on CUDA
        as many (up to ``AUTO_ROWS``) as a quarter of free memory holds at ``max_len`` tokens."""
        if self.cfg.batch_size > 0:
            return self.cfg.batch_size
        if self.device.type != "cuda":
            return 64
        one = self.model.allocate_cache(1, max_len)
        per_row = sum(t.numel() * t.element_size() for t in cache_tensors(one))
        per_row += 16 * self.model.embed.weight.shape[0] * 4  # logits, noise, probabilities: FP32 [V] each
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(1, min(AUTO_ROWS, free // 4 // per_row))

    def budget(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens may get (the context bounds it)."""
        n = self.cfg.max_new_tokens
        return n if self.context is None else min(n, self.context - prompt_len)

    @torch.no_grad()
    def _generate_continuous(self, prompts: list[list[int]], seed: int, graphs: DecodeGraphs | None):
        budgets = [self.budget(len(p)) for p in prompts]
        T, L = max(budgets), max(len(p) for p in prompts)
        rows = min(self.rows_for(L + T), len(prompts))
        model, t0 = self.model, time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            with autocast_for(self.device):  # a capture (in graphs.slot) runs under the same autocast
                slot = None
                if graphs is not None and T > 1:
                    before = graphs.setup_s
                    slot = graphs.slot(rows, L + T, self._longest_sequence())
                    self.stats.setup_seconds += graphs.setup_s - before
                cache = slot.cache if slot is not None else model.allocate_cache(rows, L + T)
                decode = slot.decoder if slot is not None and slot.decoder is not None else None
                decode = decode or (lambda tok_R: model.decode_step(tok_R, cache))
                decoder = ContinuousDecoder(self, cache, decode, seed)
                out = decoder.run(prompts, budgets)
        finally:
            model.train(was_training)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stats.new_tokens += sum(len(c.tokens) for c in out)
        self.stats.seconds += time.perf_counter() - t0
        self.stats.decode_steps += decoder.steps
        return out

    def eos_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """[...] bool: which of ``tokens`` are end tokens (on their device, no sync)."""
        if self._eos is None or self._eos.eos_ids != sorted(set(self.eos_ids)):
            self._eos = StopChecker(self.tokenizer, self.eos_ids, [], [])
        return self._eos.eos_mask(tokens)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The bucketed caches (and graphs) to decode in, or None: each batch allocates its own."""
        use = self.cfg.cuda_graph and self.device.type == "cuda"
        if use and self.graphs is None:
            self.graphs = DecodeGraphs(self.model)
        graphs = self.graphs
        if graphs is None or (graphs.capture and not use):
            return None
        if graphs.capture:
            blocker = graph_blocker(self.model, 1, self.device)
            if blocker is not None:
                if blocker != self._eager_reason:
                    log_to_stderr(f"sampler: decoding eagerly, not as a CUDA graph: {blocker}")
                    self._eager_reason = blocker
                return None
        graphs.check()  # weights refreshed in place keep the graphs; anything else drops them
        return graphs

    def _longest_sequence(self) -> int | None:
        """The most tokens a batch's cache can need, or None without a context."""
        if self.context is None:
            return None
        return self.context - 1 + min(self.cfg.max_new_tokens, self.context - 1)

    def prompt_batch(self, prompts: list[list[int]], L: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded prompts [R, L] and their lengths [R], on the device."""
        pad = self.tokenizer.pad if self.tokenizer.pad is not None else 0
        tokens_RL = torch.full((len(prompts), L), pad, dtype=torch.long)
        for b, p in enumerate(prompts):
            tokens_RL[b, : len(p)] = torch.tensor(p, dtype=torch.long)
        lengths_R = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        return tokens_RL.to(self.device), lengths_R.to(self.device)

    def _prefill(
        self, prompts: list[list[int]], L: int, T: int, graphs: DecodeGraphs | None
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """The prompts prefilled into a cache: logits [B, V] and the decode step (tokens [B] -> logits
        [B, V]); with ``graphs`` in the bucket's R >= B rows, rows past B copies of row 0."""
        model, B = self.model, len(prompts)
        slot = graphs.slot(B, L + T, self._longest_sequence()) if graphs is not None and T > 1 else None
        if slot is None:
            cache = model.allocate_cache(B, L + T)
            tokens_BL, lengths_B = self.prompt_batch(prompts, L)
            return model.prefill(tokens_BL, lengths_B, cache), lambda tok_B: model.decode_step(tok_B, cache)
        cache, R = slot.cache, slot.cache.batch_size
        decode = slot.decoder if slot.decoder is not None else lambda tok_R: model.decode_step(tok_R, cache)
        feed_R = torch.cat([torch.arange(B), torch.zeros(R - B, dtype=torch.long)]).to(self.device)  # [R]
        tokens_RL, lengths_R = self.prompt_batch(prompts + [prompts[0]] * (R - B), L)
        logits_RV = model.prefill(tokens_RL, lengths_R, cache)

        def step(tok_B: torch.Tensor) -> torch.Tensor:
            # a graph returns its logits buffer [R, V]: the real rows are sampled from this view
            # before the next replay overwrites it (the same stream orders the two)
            return decode(tok_B[feed_R] if R > B else tok_B)[:B]

        return logits_RV[:B], step

    @torch.no_grad()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        seed: int,
        graphs: DecodeGraphs | None = None,
        first: int = 0,
        on_tokens: OnTokens | None = None,
    ) -> list[Completion]:
        cfg, model, device = self.cfg, self.model, self.device
        t0 = time.perf_counter()
        B = len(prompts)
        lengths = [len(p) for p in prompts]
        budgets = [self.budget(n) for n in lengths]
        T = max(budgets)
        L = max(lengths)
        new_BT = torch.zeros(B, T, dtype=torch.long, device=device)
        logp_BT = torch.zeros(B, T, dtype=torch.float32, device=device)
        stops = StopChecker(self.tokenizer, self.eos_ids, cfg.stop, budgets)
        budget_B = torch.tensor(budgets, dtype=torch.long, device=device)
        ended_B = torch.zeros(B, dtype=torch.bool, device=device)  # an end token or the budget, on device
        every = 1 if on_tokens is not None else cfg.check_every
        so_far: list[list[int]] = [[] for _ in range(B)]  # the host's copy of new_BT[:, :read]
        read = 0
        was_training = model.training
        model.eval()
        steps = 0
        try:
            with autocast_for(device):  # a capture (in graphs.slot) runs under the same autocast
                setup_before = graphs.setup_s if graphs is not None else 0.0
                logits, step = self._prefill(prompts, L, T, graphs)  # [B, V]
                if graphs is not None:
                    self.stats.setup_seconds += graphs.setup_s - setup_before
                sequence_B = torch.arange(first, first + B, device=device)
                for t in range(T):
                    noise = None
                    if cfg.temperature > 0:
                        noise = exponential_noise(
                            seed, sequence_B, torch.full_like(sequence_B, t), logits.shape[-1]
                        )
                    tok_B, lp_B = sample(
                        logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        min_p=cfg.min_p, noise=noise,
                    )  # fmt: skip
                    new_BT[:, t] = tok_B
                    logp_BT[:, t] = lp_B
                    ended_B |= stops.eos_mask(tok_B) | (budget_B <= t + 1)
                    last = t + 1 == T
                    if last or (t + 1) % every == 0:
                        if bool(ended_B.all()) and not cfg.stop and on_tokens is None:
                            break
                        if cfg.stop or on_tokens is not None:
                            for row, cols in zip(so_far, new_BT[:, read : t + 1].tolist(), strict=True):
                                row.extend(cols)  # only the steps since the last check cross to the host
                            read = t + 1
                            stops.update(so_far)
                            if on_tokens is not None:
                                on_tokens(first, so_far, stops.ends)
                            if stops.all_finished:
                                break
                    if last:
                        break
                    logits = step(tok_B)  # [B, V]
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
