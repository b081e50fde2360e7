"""Chat records, the chat template, and the loss mask of supervised fine-tuning.

Records are TRL's formats: ``{"messages": [{role, content}, ...]}`` (completion: the last assistant
turn), ``{"prompt": "...", "completion": "..."}`` (optionally ``"system"``), or prompt and completion
as message lists. ``messages`` (not null) wins, so a table mixing both formats works. A record of
another shape is a one-line :class:`DataError` naming it (``parse_record``). A record with an empty
assistant turn is skipped and counted: training on one would teach the model to answer with nothing.

The template, in tokens (special tokens inserted by id, never parsed from text: see ``tokenizer.py``)::

    <|endoftext|> <|system|> content <|end|> <|user|> content <|end|> <|assistant|> content <|end|> ...

``<|endoftext|>`` opens a chat as it opens every pretraining document. Generation prompts end with
``<|assistant|>``. ``CHAT_TEMPLATE_JINJA`` is the same template for Hugging Face tools.

Loss mask (``sft.loss_on``; ``trained[i]``: token i is a target):

- ``assistant``: every assistant turn's content and its closing ``<|end|>`` (learn to answer and to
  stop, never to imitate what is given at inference); ``completion``: the same for the completion's
  turns only; ``all``: every token after the opening ``<|endoftext|>`` (a seam, never a target).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import DataError

ROLES = ("system", "user", "assistant")
LOSS_ON = ("assistant", "completion", "all")

CHAT_TEMPLATE_JINJA = (
    "{{ bos_token | default('<|endoftext|>') }}"
    "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""The template of :func:`encode_chat` / :func:`encode_prompt` as text (``bos_token``: the document
token's name, ``<|endoftext|>`` unless the tokenizer has another)."""


@dataclass
class Chat:
    """One validated conversation: ``messages`` [{role, content}] and where its completion starts."""

    messages: list[dict]
    completion_from: int
    """Index of the completion's first message; every message from it on is an assistant turn."""

    @property
    def empty_answer(self) -> bool:
        """Some assistant turn is empty or whitespace (the record is skipped)."""
        return any(m["role"] == "assistant" and not m["content"].strip() for m in self.messages)


@dataclass
class EncodedChat:
    tokens: list[int]
    trained: list[bool]
    """trained[i]: token i is a target of the loss (see the loss mask in the module docstring)."""

    def __len__(self) -> int:
        return len(self.tokens)


# ---------------------------------------------------------------------- records


def _fields(record: dict) -> str:
    """The record's fields for an error, those that hold null named apart (a table's missing values)."""
    present = ", ".join(f"'{k}'" for k, v in record.items() if v is not None) or "none"
    nulls = [f"'{k}'" for k in ("messages", "prompt", "completion") if k in record and record[k] is None]
    return present + (f" ({', '.join(nulls)} null)" if nulls else "")


def _messages(value, where: str, field: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise DataError(
            f"{where}: '{field}' must be a non-empty list of {{role, content}} messages, "
            f"got {type(value).__name__}"
        )
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"{where}, {field}[{j}]: expected {{role, content}}, got {m!r:.80}")
        if m["role"] not in ROLES:
            raise DataError(
                f"{where}, {field}[{j}]: role {m['role']!r:.40} is not one of {', '.join(ROLES)}; "
                "map the dataset's roles to these"
            )
        if not isinstance(m["content"], str):
            raise DataError(
                f"{where}, {field}[{j}]: content is {type(m['content']).__name__}, not text; "
                "give each message's content as a string"
            )
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _text(record: dict, field: str, where: str) -> str:
    if not isinstance(record[field], str):
        raise DataError(
            f"{where}: '{field}' is {type(record[field]).__name__}, not text; store it as a string "
            "(quoted in JSON, a string column in parquet)"
        )
    return record[field]


def _prompt_completion(record: dict, where: str) -> Chat:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) != isinstance(completion, list):
        raise DataError(
            f"{where}: 'prompt' is {type(prompt).__name__} and 'completion' {type(completion).__name__}; "
            "give both as text or both as lists of messages"
        )
    system = record.get("system")
    if isinstance(prompt, list):
        if system not in (None, ""):
            raise DataError(
                f"{where}: 'system' beside a list prompt; put the system message first in 'prompt'"
            )
        before = _messages(prompt, where, "prompt")
        after = _messages(completion, where, "completion")
        for j, m in enumerate(after):
            if m["role"] != "assistant":
                raise DataError(
                    f"{where}, completion[{j}]: a completion holds assistant turns only, got role "
                    f"'{m['role']}'; move it into 'prompt'"
                )
        return Chat(before + after, len(before))
    messages = [
        {"role": "user", "content": _text(record, "prompt", where)},
        {"role": "assistant", "content": _text(record, "completion", where)},
    ]
    if system is not None and _text(record, "system", where):  # an empty system string: no system turn
        messages.insert(0, {"role": "system", "content": system})
    return Chat(messages, len(messages) - 1)


def _check_order(messages: list[dict], where: str) -> None:
    roles = [m["role"] for m in messages]
    if "system" in roles[1:]:
        raise DataError(
            f"{where}: a system message at position {roles.index('system', 1)}; "
            "a system message may only open the conversation"
        )
    if "assistant" not in roles:
        raise DataError(f"{where} has no assistant turn, so nothing to train on; add the answer or drop it")
    if "user" not in roles[: roles.index("assistant")]:
        raise DataError(
            f"{where}: an assistant turn comes before any user turn; start the conversation with the user"
        )
    if roles[-1] != "assistant":
        raise DataError(
            f"{where} ends with a {roles[-1]} turn that no answer follows; end it with an assistant turn "
            "or drop the trailing turns"
        )


def parse_record(record, where: str = "chat record 0") -> Chat:
    """A record (see the module docstring) as a validated :class:`Chat`; a DataError names ``where``."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is a {type(record).__name__}, not a record of fields")
    if record.get("messages") is not None:
        messages = _messages(record["messages"], where, "messages")
        chat = Chat(messages, len(messages) - 1)
    elif record.get("prompt") is not None and record.get("completion") is not None:
        chat = _prompt_completion(record, where)
    else:
        raise DataError(
            f"{where} has fields {_fields(record)}; chat data needs 'messages' (a list of role/content) "
            "or 'prompt' and 'completion'"
        )
    _check_order(chat.messages, where)
    return chat


# ---------------------------------------------------------------------- template


def assemble(tokenizer: Tokenizer, chat: Chat, content_ids: Sequence[list[int]], loss_on: str) -> EncodedChat:
    """Template tokens of ``chat`` from its messages' content tokens, with the ``loss_on`` mask."""
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on must be one of {', '.join(LOSS_ON)}, not '{loss_on}'")
    tokens, trained = [tokenizer.bos], [False]
    for j, (m, content) in enumerate(zip(chat.messages, content_ids, strict=True)):
        if loss_on == "all":
            answer = True
        else:
            answer = m["role"] == "assistant" and (loss_on == "assistant" or j >= chat.completion_from)
        tokens += [tokenizer.role_ids[m["role"]], *content, tokenizer.end]
        trained += [loss_on == "all"] + [answer] * (len(content) + 1)
    return EncodedChat(tokens, trained)


def encode_chat(tokenizer: Tokenizer, chat: Chat | Sequence[dict], loss_on: str = "assistant") -> EncodedChat:
    """Template tokens of a whole conversation (a Chat, or messages whose completion is the last turn)."""
    if not isinstance(chat, Chat):
        chat = Chat(list(chat), len(chat) - 1)
    return assemble(tokenizer, chat, [tokenizer.encode(m["content"]) for m in chat.messages], loss_on)


def encode_prompt(tokenizer: Tokenizer, messages: Sequence[dict]) -> list[int]:
    """Tokens that ask for the next assistant message: the conversation so far, then ``<|assistant|>``."""
    tokens = [tokenizer.bos]
    for m in messages:
        tokens += [tokenizer.role_ids[m["role"]], *tokenizer.encode(m["content"]), tokenizer.end]
    return tokens + [tokenizer.role_ids["assistant"]]


def render(tokenizer: Tokenizer, messages: Sequence[dict]) -> str:
    """The template as text (for logs and docs)."""
    return tokenizer.decode(encode_chat(tokenizer, messages).tokens)
