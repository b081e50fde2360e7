"""When a sequence is finished: an end token, a stop string, its token budget.

- ``eos``: an end token (the document token, or ``<|end|>`` closing a chat answer). It is kept in
  the tokens and log-probabilities (a trainer learns to stop from it), left out of the text.
- ``stop``: a stop string in the decoded text, matched on text so one split over tokens is found;
  the tokens end with the one that completed the match, the text just before the match.
- ``length``: the token budget (``max_new_tokens``, or less where the context ends).

:class:`StopChecker` finds the *first* end among all tokens it is shown, so calling it every step or
every few steps gives the same result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inkling_fp4.data.tokenizer import Tokenizer

FINISH_REASONS = ("eos", "stop", "length")


@dataclass
class End:
    """Where one completion ends: ``tokens`` kept, the ``text`` length kept, and why."""

    tokens: int
    reason: str
    text: str


class StopChecker:
    """The finished mask of a batch of completions and where each ended (see the module docstring)."""

    def __init__(
        self, tokenizer: Tokenizer, eos_ids: Sequence[int], stop: Sequence[str], budgets: Sequence[int]
    ):
        self.tokenizer = tokenizer
        self.eos_ids = sorted(set(int(i) for i in eos_ids))
        self.stop = list(stop)
        self.budgets = [int(b) for b in budgets]
        """Per sequence: the most new tokens it may have."""
        self.ends: list[End | None] = [None] * len(self.budgets)
        self._checked = [0] * len(self.budgets)
        """Per sequence: how many leading tokens are known to hold no stop string."""
        self._eos_on: tuple[tuple, torch.Tensor] | None = None

    @property
    def finished(self) -> list[bool]:
        return [e is not None for e in self.ends]

    @property
    def all_finished(self) -> bool:
        return all(e is not None for e in self.ends)

    def eos_mask(self, tokens: torch.Tensor) -> torch.Tensor:
        """[...] bool: which of ``tokens`` are end tokens (on their device, no sync). The ids are copied
        to the device once: a blocking copy per step would be a host sync per token."""
        key = (tokens.device, tokens.dtype)
        if self._eos_on is None or self._eos_on[0] != key:
            self._eos_on = (key, torch.tensor(self.eos_ids, dtype=tokens.dtype, device=tokens.device))
        return torch.isin(tokens, self._eos_on[1])

    def update(self, tokens: list[list[int]]) -> None:
        """Look at every unfinished sequence's new tokens so far (``tokens[b]``, all of them)."""
        for b, seq in enumerate(tokens):
            if self.ends[b] is None:
                self.ends[b] = self._end(b, seq)

    def _end(self, b: int, seq: list[int]) -> End | None:
        budget = self.budgets[b]
        eos_at = next((i for i, t in enumerate(seq[:budget]) if t in self.eos_ids), None)
        visible = seq[: budget if eos_at is None else eos_at]  # tokens that make text
        stop_at = self._stop(b, visible)
        if stop_at is not None:
            return stop_at
        if eos_at is not None:
            return End(eos_at + 1, "eos", self.tokenizer.decode(visible))
        if len(seq) >= budget:
            return End(budget, "length", self.tokenizer.decode(visible))
        self._checked[b] = len(visible)
        return None

    def _stop(self, b: int, visible: list[int]) -> End | None:
        """The first token after which the decoded text holds a stop string, or None."""
        if not self.stop:
            return None
        text = self.tokenizer.decode(visible)
        if not any(s in text for s in self.stop):
            return None
        # the shortest prefix whose text holds a match: byte-level text only grows at its end, so the
        # first match found in that prefix's text is the first match of the whole completion
        for n in range(max(self._checked[b], 1), len(visible) + 1):
            prefix = self.tokenizer.decode(visible[:n])
            hits = [i for i in (prefix.find(s) for s in self.stop) if i >= 0]
            if hits:
                return End(n, "stop", prefix[: min(hits)])
        raise AssertionError("a stop string in the whole text is in some prefix's text")
