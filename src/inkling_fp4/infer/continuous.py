"""Continuous batching: a fixed set of decode rows, each taking the next prompt as soon as its
sequence ends.

A batch at a time, every batch runs until its longest member ends, mostly decoding finished rows.
Here the cache has R rows; at every check (``sampler.check_every`` steps, or when a row reaches its
budget) finished rows are read back and the next prompts prefilled together (count rounded to a
power of two, length to a bucket, so prefill kernels see few shapes) into the free rows. The decode
step always runs R rows, captured once as a graph.

Under row-wise arithmetic (BF16, row activation scales) tokens and log-probabilities match the
batch-at-a-time sampler (tests/test_continuous_batching.py) up to a GEMM kernel's last bit; under
tensorwise scales a row's codes depend on its neighbours, as in any batch. Idle rows copy a live row
and are fed its token, so they add no new value to any amax.

Shape letters: R rows of the cache, T the longest token budget, V vocabulary, L prompt length.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from inkling_fp4.infer.completion import Completion
from inkling_fp4.infer.sampling import sample
from inkling_fp4.infer.sequence_noise import exponential_noise
from inkling_fp4.infer.stopping import StopChecker
from inkling_fp4.model.graphed_decoder import batch_bucket

PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512)
"""Padded lengths a group of newcomers is prefilled at (a longer group: a multiple of 512)."""


def prefill_length(longest: int, cap: int) -> int:
    """The padded length of a prefill whose longest prompt has ``longest`` tokens, at most ``cap``."""
    padded = next((n for n in PREFILL_LENGTHS if n >= longest), -(-longest // 512) * 512)
    return max(longest, min(padded, cap))


@dataclass
class _Sequence:
    index: int
    """The prompt's index in the call: its key for the per-sequence draws."""
    prompt: list[int]
    stops: StopChecker
    """The ends of this one sequence."""
    budget: int
    admitted: int
    """Sampling rounds before this sequence's first: it has ``rounds - admitted`` tokens on the device."""
    tokens: list[int] = field(default_factory=list)
    """Tokens read back so far."""


class ContinuousDecoder:
    """One ``generate`` call's prompts decoded through the rows of ``cache``; ``decode`` is the step on
    it (a graph or eager), ``sampler`` the :class:`~inkling_fp4.infer.sampler.Sampler` it serves."""

    def __init__(self, sampler, cache, decode, seed: int):
        self.s = sampler
        self.cache = cache
        self.decode = decode
        self.seed = seed
        R = cache.batch_size
        self.rows: list[_Sequence | None] = [None] * R
        self.rounds = 0
        """Sampling rounds so far; each but the last is followed by one decode step of every row."""
        self.row_len = [0] * R
        """Tokens in each row when last written (at round ``row_at``): it now holds
        ``row_len + rounds - row_at`` (the device's ``cache.lengths``)."""
        self.row_at = [0] * R
        self.deadline = 0
        """The round at which the first live sequence reaches its budget: a check is due then."""
        device = cache.lengths.device
        self.feed_R = torch.arange(R, device=device)  # the row whose token each row is fed
        self.sequence_R = torch.zeros(R, dtype=torch.long, device=device)
        self.step_R = torch.zeros(R, dtype=torch.long, device=device)
        self.budget_R = torch.ones(R, dtype=torch.long, device=device)
        self.ended_R = torch.ones(R, dtype=torch.bool, device=device)
        self.steps = 0
        self.copies: tuple[int | None, set[int]] = (None, set())
        """(the sequence the idle rows copy, the rows that hold its copy): such a row is fed that
        sequence's token every step, so it stays a copy and is not written again."""

    def run(self, prompts: list[list[int]], budgets: list[int]) -> list[Completion]:
        cfg, R, device = self.s.cfg, self.cache.batch_size, self.cache.lengths.device
        T = max(budgets)
        self.new_RT = torch.zeros(R, T, dtype=torch.long, device=device)
        self.logp_RT = torch.zeros(R, T, dtype=torch.float32, device=device)
        self.queue = deque(range(len(prompts)))
        self.prompts, self.budgets = prompts, budgets
        self.done: list[Completion | None] = [None] * len(prompts)
        logits = self._admit(None, list(range(R)))
        every = cfg.check_every
        since = 0
        while True:
            noise = None
            if cfg.temperature > 0:
                noise = exponential_noise(self.seed, self.sequence_R, self.step_R, logits.shape[-1])  # [R, V]
            tok_R, lp_R = sample(
                logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                noise=noise,
            )  # fmt: skip
            at = self.step_R.clamp(max=T - 1)[:, None]  # [R, 1]
            self.new_RT.scatter_(1, at, tok_R[:, None])
            self.logp_RT.scatter_(1, at, lp_R[:, None])
            self.ended_R |= self.s.eos_mask(tok_R) | (self.budget_R <= self.step_R + 1)
            self.step_R += 1
            self.rounds += 1
            since += 1
            freed: list[int] = []
            if since >= every or self.rounds >= self.deadline:
                since = 0
                freed = self._collect([r for r, q in enumerate(self.rows) if q is not None])
                if not self.queue and all(q is None for q in self.rows):
                    break
            if all(q is None for q in self.rows):  # every row just ended: the newcomers' prefill is all
                logits = None
            else:
                logits = self.decode(tok_R[self.feed_R])  # [R, V]; freed rows are overwritten below
                self.steps += 1
            if freed:
                logits = self._admit(logits, freed)
        return self.done

    def _collect(self, live: list[int]) -> list[int]:
        """Read back ended rows (all live rows under stop strings); returns the rows freed."""
        ended = self.ended_R.tolist()
        read = [r for r in live if ended[r] or self.s.cfg.stop]
        if not read:
            return []
        rows_t = torch.tensor(read, device=self.new_RT.device)
        tokens = self.new_RT[rows_t].tolist()
        freed = []
        for r, row_tokens in zip(read, tokens, strict=True):
            q = self.rows[r]
            q.tokens = row_tokens[: self.rounds - q.admitted]
            q.stops.update([q.tokens])
            if q.stops.ends[0] is not None:
                freed.append(r)
        if freed:
            logps = self.logp_RT[torch.tensor(freed, device=self.new_RT.device)].tolist()
            for r, lp in zip(freed, logps, strict=True):
                q, end = self.rows[r], self.rows[r].stops.ends[0]
                self.done[q.index] = Completion(
                    q.prompt, q.tokens[: end.tokens], end.text, lp[: end.tokens], end.reason
                )
                self.rows[r] = None
        return freed

    def _admit(self, logits: torch.Tensor | None, free: list[int]) -> torch.Tensor:
        """The next prompts prefilled into the ``free`` rows; rows left without one copy a live row.
        Returns the logits [R, V], the newcomers' rows from their prefill."""
        take = [self.queue.popleft() for _ in range(min(len(free), len(self.queue)))]
        if take:
            device = self.cache.lengths.device
            rows_t = torch.tensor(free[: len(take)], device=device)
            staging, first = self._prefill([self.prompts[i] for i in take])  # first: [n, V]
            self.cache.write_rows(rows_t, staging, torch.arange(len(take), device=device))
            if logits is None:  # idle rows sample from zeros; their tokens are never read
                logits = torch.zeros(self.cache.batch_size, first.shape[-1], dtype=first.dtype, device=device)
            logits[rows_t] = first  # into a graph's output buffer too: sampled before the next replay
            self.sequence_R[rows_t] = torch.tensor(take, device=device)
            self.step_R[rows_t] = 0
            self.budget_R[rows_t] = torch.tensor([self.budgets[i] for i in take], device=device)
            self.ended_R[rows_t] = False
            self.feed_R[rows_t] = rows_t
            for r, i in zip(free, take, strict=False):
                stops = StopChecker(self.s.tokenizer, self.s.eos_ids, self.s.cfg.stop, [self.budgets[i]])
                self.rows[r] = _Sequence(i, self.prompts[i], stops, self.budgets[i], self.rounds)
                self.row_len[r], self.row_at[r] = len(self.prompts[i]), self.rounds
        self._copy_into_idle()
        return logits

    def _prefill(self, prompts: list[list[int]]):
        """(a cache holding the prompts' states in its first rows, their logits [n, V])."""
        s, model = self.s, self.s.model
        n, rows = len(prompts), batch_bucket(len(prompts))
        L = prefill_length(max(len(p) for p in prompts), self.cache.max_len)
        timed = self.cache.lengths.is_cuda and (rows, L) not in s.prefill_shapes
        if timed:  # a new shape compiles and autotunes its kernels: a one-off cost, counted apart
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        staging = model.allocate_cache(rows, L)
        tokens, lengths = s.prompt_batch(prompts + [prompts[0]] * (rows - n), L)
        logits = model.prefill(tokens, lengths, staging)  # [rows, V]
        if timed:
            torch.cuda.synchronize()
            s.stats.setup_seconds += time.perf_counter() - t0
            s.prefill_shapes.add((rows, L))
        return staging, logits[:n]

    def _copy_into_idle(self) -> None:
        """Every idle row becomes a copy of the first live row, fed its token (a row that already holds
        that sequence's copy stays as it is)."""
        live = [r for r, q in enumerate(self.rows) if q is not None]
        idle = [r for r, q in enumerate(self.rows) if q is None]
        if not live:
            return
        length = [self.row_len[r] + self.rounds - self.row_at[r] for r in range(len(self.rows))]
        src = live[0]
        same, held = self.copies
        fresh = [r for r in idle if not (same == self.rows[src].index and r in held)]
        self.copies = (self.rows[src].index, set(idle))
        if fresh:
            idle_t = torch.tensor(fresh, device=self.cache.lengths.device)
            self.cache.write_rows(idle_t, self.cache, torch.full_like(idle_t, src))
            self.feed_R[idle_t] = src
            self.ended_R[idle_t] = True
            for r in fresh:
                self.row_len[r], self.row_at[r] = length[src], self.rounds
                length[r] = length[src]
        self.cache.longest = max(length)
        self.deadline = min(self.rows[r].admitted + self.rows[r].budget for r in live)
