"""What the sampler returns for one prompt."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Completion:
    """One generated continuation of one prompt."""

    prompt_tokens: list[int]
    tokens: list[int]
    """The new tokens, up to and including the end token or the token that completed a stop string."""
    text: str
    """The new tokens' text, without the end token and without the stop string."""
    logprobs: list[float]
    """log p of each new token after the temperature, before top-k / top-p / min-p (``infer/sampling.py``)."""
    finish_reason: str
    """eos | stop | length (``infer/stopping.py``)."""
