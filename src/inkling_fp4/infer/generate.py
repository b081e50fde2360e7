"""``fp4train generate``: completions of prompts from a run, printed or written as jsonl.

Prompts come from ``--prompt TEXT`` (repeatable) or ``--prompts FILE`` (``.jsonl`` of ``{"prompt":
...}``, else one prompt per line). ``--out FILE`` is checked before the model loads
(:mod:`~inkling_fp4.output_guard`): an existing file is replaced only with ``--force`` and only if it
is an earlier output of generate; it is written whole, then renamed into place. ``--stream`` (the
default for one prompt without ``--out``) writes the text as it is decoded (``infer/streaming.py``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from inkling_fp4.data.text_encoding import first_invalid_utf8
from inkling_fp4.errors import DataError, UserError
from inkling_fp4.infer.from_run import load_run_sampler
from inkling_fp4.infer.sampler import Completion, Sampler
from inkling_fp4.infer.streaming import TextStream
from inkling_fp4.output_guard import check_output

RECORD_KEYS = ("prompt", "completion", "tokens", "logprobs", "finish_reason")


def read_prompts(path: Path) -> list[str]:
    """The prompts of a ``--prompts`` file (see the module docstring)."""
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file; pass a text file (one prompt a line) or a .jsonl")
    bad = first_invalid_utf8(path)
    if bad is not None:
        raise DataError(
            f"--prompts {path}: not UTF-8 text (byte {bad[1][:4]!r} at offset {bad[0]}); pass a text file, "
            "one prompt a line, or a .jsonl"
        )
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"--prompts {path}, line {i + 1}: not JSON ({e.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise DataError(f'--prompts {path}, line {i + 1}: expected {{"prompt": "text"}}')
            prompts.append(record["prompt"])
    if not prompts:
        raise UserError(f"--prompts {path} holds no prompt")
    return prompts


def not_completions(path: Path) -> str | None:
    """Why ``path`` is not an earlier ``--out`` of generate (None: every line is one of its records)."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        ok = bool(lines) and all(sorted(json.loads(line)) == sorted(RECORD_KEYS) for line in lines)
    except (OSError, UnicodeDecodeError, ValueError, TypeError):
        ok = False
    return None if ok else f"not a jsonl of generate's records, each of {', '.join(RECORD_KEYS)}"


def write_completions(out: Path, texts: list[str], completions: list[Completion]) -> None:
    """The records as jsonl, written to a temporary file and renamed over ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for text, c in zip(texts, completions, strict=True):
                values = (text, c.text, c.tokens, c.logprobs, c.finish_reason)
                f.write(json.dumps(dict(zip(RECORD_KEYS, values, strict=True))) + "\n")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def streamed(sampler: Sampler, text: str, tokens: list[int], echo, write) -> list[Completion]:
    """One prompt's completion, printed as the non-streamed one is, its text written as it is decoded."""
    echo(f"[0] {text}")
    write("  -> ")
    stream = TextStream(sampler.tokenizer, sampler.cfg.stop, write)
    completions = sampler.generate([tokens], on_tokens=lambda _, toks, ends: stream.update(toks[0], ends[0]))
    write("\n")
    echo(f"     ({len(completions[0].tokens)} tokens, {completions[0].finish_reason})")
    return completions


def run_generate(
    from_run: Path | None,
    prompts: list[str] | None,
    prompts_file: Path | None,
    out: Path | None,
    overrides: list[str] | None,
    echo=print,
    stream: bool | None = None,
    write: Callable[[str], None] = write_stdout,
    force: bool = False,
) -> list[Completion]:
    """``stream`` None: stream a single prompt without ``--out``."""
    if prompts and prompts_file is not None:
        raise UserError("--prompt and --prompts: give the prompts one way")
    texts = list(prompts or []) or (read_prompts(prompts_file) if prompts_file is not None else [])
    if not texts:
        raise UserError("nothing to complete: give --prompt TEXT (repeatable) or --prompts FILE")
    if stream and len(texts) > 1:
        raise UserError(f"--stream shows one completion as it is decoded; {len(texts)} prompts given")
    replacing = None
    if out is not None:
        replacing = check_output(out, "--out", "generate", kind="file", force=force, not_own=not_completions,
                                 inputs=[("--prompts", prompts_file), ("--from", from_run)])  # fmt: skip
    stream = len(texts) == 1 and out is None if stream is None else stream
    rs = load_run_sampler(from_run, overrides, echo)
    tokens = [rs.encode(t, f"prompt {i}" if len(texts) > 1 else "the prompt") for i, t in enumerate(texts)]
    echo(f"generate: {rs.describe()}")
    if stream:
        completions = streamed(rs.sampler, texts[0], tokens[0], echo, write)
    else:
        completions = rs.sampler.generate(tokens)
        for i, (text, c) in enumerate(zip(texts, completions, strict=True)):
            echo(f"[{i}] {text}")
            echo(f"  -> {c.text}")
            echo(f"     ({len(c.tokens)} tokens, {c.finish_reason})")
    echo(rs.sampler.stats.describe())
    if out is not None:
        write_completions(out, texts, completions)
        if replacing:
            echo(replacing)
        echo(f"wrote {len(completions)} completions to {out}")
    return completions
