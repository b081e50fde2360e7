"""A completion's text printed as it is decoded, never a character that the final text lacks.

:class:`TextStream` writes only the part of the decoded text that can no longer change, so what it
has written at the end is exactly the completion's text. Held back until settled:

- trailing U+FFFD: a token may end inside a multi-byte UTF-8 character (byte-level BPE);
- the longest suffix that starts a stop string, since the text ends before a stop string.

This assumes the text of a token prefix is a prefix of the whole text, as with byte-level BPE; a
decoder that rewrites earlier text gets its final text written again, whole, on a line of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.infer.stopping import End

REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) a whole UTF-8 character."""


def stop_prefix_len(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def settled(text: str, stop: Sequence[str]) -> str:
    """The part of an unfinished completion's decoded ``text`` that more tokens cannot change."""
    text = text.rstrip(REPLACEMENT)
    return text[: len(text) - stop_prefix_len(text, stop)]


class TextStream:
    """Writes one completion's text through ``write`` as its tokens arrive (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], write: Callable[[str], None]):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.write = write
        self.written = ""
        self.done = False

    def update(self, tokens: list[int], end: End | None) -> None:
        """The completion's new tokens so far, and where it ended (None: not yet)."""
        if self.done:
            return
        if end is not None:
            self.done = True
            text = end.text
        else:  # no end token and no stop string among ``tokens`` (the sampler would have ended it)
            text = settled(self.tokenizer.decode(tokens), self.stop)
        if text.startswith(self.written):
            if len(text) > len(self.written):
                self.write(text[len(self.written) :])
                self.written = text
        elif self.done:  # a decoder whose text of a prefix is not a prefix of the text: say it whole
            self.write("\n" + text)
            self.written = text
