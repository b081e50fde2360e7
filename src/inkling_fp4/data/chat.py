"""Chat records, the chat template, and the assistant-only loss mask.

Records come in two shapes (one per line of a jsonl file, or one row of any table):

- ``{"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}``
- ``{"prompt": "...", "completion": "..."}`` (optionally ``"system": "..."``): one user turn and the
  assistant's answer.

The template, in tokens (special tokens are single ids, inserted by id, never parsed from text)::

    <|endoftext|> <|user|> content <|end|> <|assistant|> content <|end|> ...

``<|endoftext|>`` opens the conversation as it opens every pretraining document, so the model sees the
same context at the start of a chat as at the start of a document. Generation prompts end with
``<|assistant|>``; the model answers and closes with ``<|end|>``.

Loss mask: a token is trained on (as a target) exactly when it is an assistant message's content or the
``<|end|>`` that closes it: the model learns to answer and to stop, never to imitate the user, the
system prompt or the template's role tokens, which are given at inference time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError

ROLES = ("system", "user", "assistant")


@dataclass
class EncodedChat:
    tokens: list[int]
    trained: list[bool]
    """trained[i]: token i is a target of the loss (an assistant content token or its <|end|>)."""

    def __len__(self) -> int:
        return len(self.tokens)


def record_messages(record: dict, index: int = 0) -> list[dict]:
    """The record's conversation as [{"role", "content"}], validated; a DataError names the record."""
    where = f"chat record {index}"
    if "messages" in record and record["messages"] is not None:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    elif "prompt" in record and "completion" in record:
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["completion"]},
        ]
        if record.get("system"):
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        raise DataError(
            f"{where} has fields {', '.join(record)}; chat data needs 'messages' (a list of role/content) "
            "or 'prompt' and 'completion'"
        )
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}, message {j}: expected {{role: {' | '.join(ROLES)}, content: text}}, got {m!r:.80}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(
            f"{where} has no assistant message, so nothing to train on; drop it or add the answer"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_chat(tokenizer: Tokenizer, messages: Sequence[dict]) -> EncodedChat:
    """Template tokens of a whole conversation with its assistant-only mask."""
    tokens, trained = [tokenizer.bos], [False]
    for m in messages:
        content = tokenizer.encode(m["content"])
        is_answer = m["role"] == "assistant"
        tokens += [tokenizer.role_ids[m["role"]], *content, tokenizer.end]
        trained += [False] + [is_answer] * (len(content) + 1)
    return EncodedChat(tokens, trained)


def encode_prompt(tokenizer: Tokenizer, messages: Sequence[dict]) -> list[int]:
    """Tokens that ask for the next assistant message: the conversation so far, then ``<|assistant|>``."""
    tokens = [tokenizer.bos]
    for m in messages:
        tokens += [tokenizer.role_ids[m["role"]], *tokenizer.encode(m["content"]), tokenizer.end]
    return tokens + [tokenizer.role_ids["assistant"]]


def render(tokenizer: Tokenizer, messages: Sequence[dict]) -> str:
    """The template as text (for logs and docs)."""
    return tokenizer.decode(encode_chat(tokenizer, messages).tokens)
