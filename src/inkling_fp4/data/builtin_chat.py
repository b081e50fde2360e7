"""Built-in chat records for offline fine-tuning: questions about standard-library functions, answered
by their own docstrings.

Why: ``fp4train sft`` must run with nothing downloaded, on the same machines as the built-in pretraining
corpus, and show the whole path (template, assistant-only loss, packing) on real text. The standard
library documents itself: every public function or class with a docstring gives one record,

    user:      What does `json.dumps(obj, *, skipkeys=False, ...)` do?
    assistant: <the first paragraph of its docstring>

The records follow the built-in corpus's file order and each file's source order, so they are the same
on every machine with the same Python version. The answers are short prose that a model pretrained on
the same library has seen in context, which makes fine-tuning visibly work on a tiny model.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

from inkling_fp4.data.builtin_corpus import BuiltinCorpus

MAX_SIGNATURE_CHARS = 80


def _module_name(relative: str) -> str:
    parts = relative[: -len(".py")].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _signature(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        return ""
    text = f"({ast.unparse(node.args)})"
    return text if len(text) <= MAX_SIGNATURE_CHARS else text[: MAX_SIGNATURE_CHARS - 4] + ", ...)"


def _first_paragraph(docstring: str) -> str:
    return inspect.cleandoc(docstring).split("\n\n")[0].strip()


def _records_of(source: str, module: str) -> Iterator[dict]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # a file for another Python version; skip it
        return
    defs = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if not isinstance(node, defs) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node, clean=False)
        answer = _first_paragraph(doc) if doc else ""
        if len(answer) < 20:
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "function"
        question = f"What does the {kind} `{module}.{node.name}{_signature(node)}` do?"
        yield {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


@dataclass
class BuiltinChat:
    """Chat records from the built-in corpus's docstrings (see the module docstring)."""

    corpus: BuiltinCorpus
    name: str = "builtin"

    def iter_rows(self) -> Iterator[dict]:
        for (_, relative, _), text in zip(self.corpus.files, self.corpus.iter_documents(), strict=True):
            module = _module_name(relative)
            if not any(part.startswith("_") for part in module.split(".")):  # public modules only
                yield from _records_of(text, module)

    def describe(self) -> str:
        return f"built-in chat: docstring questions over {self.corpus.describe()}"
