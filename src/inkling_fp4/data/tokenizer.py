"""The tokenizer: a thin wrapper over a Hugging Face ``tokenizers`` byte-level BPE.

Special tokens (whole tokens, never produced by merges):

- ``<|endoftext|>`` opens every document: the eos of the previous one and the bos of the next;
  loaders increment ``doc_ids`` at it.
- ``<|pad|>`` fills the tail of packed chat rows (never a training target).
- ``<|system|>``, ``<|user|>``, ``<|assistant|>``, ``<|end|>`` frame chat messages (``chat.py``).

NOTE text is encoded with ``encode_special_tokens`` on, so a literal "<|endoftext|>" in a document is
ordinary bytes and can never forge a document boundary or a chat role; special ids enter sequences
only by id.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from inkling_fp4.data.hub import require_hub
from inkling_fp4.errors import DISK_FULL_ERRNOS, DataError, DiskFullError

EOT = "<|endoftext|>"
PAD = "<|pad|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
END = "<|end|>"
SPECIAL_TOKENS = (EOT, PAD, SYSTEM, USER, ASSISTANT, END)
ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}

# Names other tokenizers give their end-of-text token; reused as <|endoftext|> when present.
_KNOWN_EOT = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")

TRAIN_RUN_CHARS = 256
"""Whitespace-free runs longer than this are cut into pieces for BPE training only. NOTE the trainer's
cost within a word is quadratic when its pairs repeat (a 10 MB run of "aaaa..." never finishes);
no useful token is that long, so the pieces learn the same merges."""
_LONG_RUN = re.compile(rf"(?<!\S)\S{{{TRAIN_RUN_CHARS + 1},}}")  # from a run's start: no quadratic rescans
_POLL_S = 0.1


class Tokenizer:
    """Byte-level BPE with the special tokens above; ``.bos == .eos`` is the document token."""

    def __init__(self, hf: HFTokenizer, origin: str = ""):
        self.hf = hf
        self.origin = origin
        self.added_specials = self._ensure_special_tokens()
        self.hf.encode_special_tokens = True
        self.eos = self._eot_id()
        self.bos = self.eos
        self.pad = self.hf.token_to_id(PAD)
        self.role_ids = {role: self.hf.token_to_id(tok) for role, tok in ROLE_TOKENS.items()}
        self.end = self.hf.token_to_id(END)

    # ------------------------------------------------------------------ construction

    @classmethod
    def train_bpe(
        cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2, show_progress: bool | None = None
    ) -> Tokenizer:
        """Train a byte-level BPE of ``vocab_size`` tokens (special tokens included) on ``texts``."""
        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise DataError(
                f"a byte-level BPE needs at least {256 + len(SPECIAL_TOKENS)} tokens, "
                f"got vocab_size={vocab_size}"
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=sys.stderr.isatty() if show_progress is None else show_progress,
        )
        _interruptible(lambda stop: hf.train_from_iterator(_bounded_runs(texts, stop), trainer))
        return cls(hf, origin=f"byte-level BPE trained here (vocab {vocab_size})")

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        """Read a ``tokenizer.json`` (or a folder holding one)."""
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise DataError(
                f"tokenizer file '{p}' not found; pass a path to a tokenizer.json or tokenizer: null"
            )
        try:
            hf = HFTokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises plain Exceptions for malformed files
            raise DataError(
                f"'{p}' is not a valid tokenizer.json ({e}); check the file or retrain it"
            ) from None
        return cls(hf, origin=str(p))

    @classmethod
    def from_pretrained(cls, name: str) -> Tokenizer:
        """A hub repository's ``tokenizer.json`` (from the local hub cache when it is there)."""
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "tokenizer.json")
        if isinstance(cached, str):
            return cls(HFTokenizer.from_file(cached), origin=f"hub:{name}")
        require_hub(
            f"tokenizer '{name}'",
            "pass a path to a tokenizer.json, or tokenizer: null to train a BPE on the data",
        )
        try:
            hf = HFTokenizer.from_pretrained(name)
        except Exception as e:
            raise DataError(
                f"could not load tokenizer '{name}' from the hub ({str(e).splitlines()[0]}); "
                "check the name, or pass a path to a tokenizer.json"
            ) from None
        return cls(hf, origin=f"hub:{name}")

    @classmethod
    def load(cls, spec: str) -> Tokenizer:
        """A path to a tokenizer.json / folder, or else a hub repository name."""
        p = Path(spec).expanduser()
        if p.exists() or spec.endswith(".json") or spec.startswith((".", "/", "~")):
            return cls.from_file(p)
        return cls.from_pretrained(spec)

    def save(self, path: str | Path) -> None:
        """Write ``tokenizer.json`` atomically (ranks may save and read it at once); a full disk is a
        :class:`DiskFullError` that leaves no partial file."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w", encoding="utf-8") as f:  # not hf.save: its errors are not OSErrors
                f.write(self.hf.to_str(pretty=True))
            os.replace(tmp, path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
                raise DiskFullError(
                    f"no room on the disk for {path} (the write failed: {e.strerror}); free some space there "
                    "and run the command again"
                ) from None
            raise

    # ------------------------------------------------------------------ use

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once, in parallel threads inside ``tokenizers``."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(token_id)

    @property
    def content_hash(self) -> str:
        """sha256 of the canonical JSON: equal hashes mean equal token ids for every text."""
        canonical = json.dumps(json.loads(self.hf.to_str()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def describe(self) -> str:
        added = f", added {', '.join(self.added_specials)}" if self.added_specials else ""
        return f"tokenizer: {self.origin}, vocab {self.vocab_size}{added}"

    # ------------------------------------------------------------------ internals

    def _eot_id(self) -> int:
        for name in _KNOWN_EOT:
            tid = self.hf.token_to_id(name)
            if tid is not None:
                return tid
        raise AssertionError("the document token is ensured at construction")

    def _ensure_special_tokens(self) -> list[str]:
        """Add the special tokens a foreign tokenizer lacks (new ids after its vocabulary)."""
        missing = [t for t in SPECIAL_TOKENS if self.hf.token_to_id(t) is None]
        if EOT in missing and any(self.hf.token_to_id(t) is not None for t in _KNOWN_EOT):
            missing.remove(EOT)
        if missing:
            self.hf.add_special_tokens(missing)
        return missing


def _bounded_runs(texts: Iterable[str], stop: threading.Event) -> Iterator[str]:
    """``texts`` with every whitespace-free run cut after each TRAIN_RUN_CHARS characters (a text is
    yielded in pieces at the cuts); ends early once ``stop`` is set."""
    for text in texts:
        if stop.is_set():
            return
        start = 0
        for m in _LONG_RUN.finditer(text):
            for cut in range(m.start() + TRAIN_RUN_CHARS, m.end(), TRAIN_RUN_CHARS):
                yield text[start:cut]
                start = cut
        yield text[start:]


def _interruptible(train) -> None:
    """Run ``train(stop)`` in a worker thread so that Ctrl-C still works.

    NOTE the Rust trainer never returns to Python's main thread, where signal handlers run, so a SIGINT
    would wait for the whole training. The main thread waits in short joins instead: KeyboardInterrupt
    propagates at once, ``stop`` ends the input, and the daemon worker finishes unobserved.
    """
    stop = threading.Event()
    failure: list[BaseException] = []

    def work():
        try:
            train(stop)
        except BaseException as e:  # re-raised in the caller's thread
            failure.append(e)

    worker = threading.Thread(target=work, name="bpe-training", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(_POLL_S)
    except BaseException:
        stop.set()
        raise
    if failure:
        raise failure[0]


def check_vocab(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """Every token id must have a row in the model's embedding; raise a DataError otherwise."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but model.vocab_size is {model_vocab_size}; "
            f"set model.vocab_size={tokenizer.vocab_size} (or larger), or use a tokenizer with at most "
            f"{model_vocab_size} tokens (data.vocab_size={model_vocab_size} when training one)"
        )
