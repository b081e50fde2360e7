"""Whether a run's weights learnt the chat template: its own stage, then the runs it started from.

sft and rollout train on chat-templated text; a run started from one (``init_from``, any stage) holds
weights trained on the template too, so the chain of ``init_from`` decides. Such a run stores the
template beside its tokenizer (``chat_template.jinja``), which keeps the answer when the runs it came
from are gone. A Nemotron-H directory, a hub id or a base that no longer exists ends the chain.
"""

from __future__ import annotations

from pathlib import Path

from inkling_fp4.errors import UserError
from inkling_fp4.runs.directory import CONFIG_FILE, recorded_config

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_STAGES = ("sft", "rollout")
"""The stages that train on chat-templated text."""


def trained_on_chat(path: str | Path) -> bool:
    """Whether the weights of ``path`` (a run or checkpoint directory) were trained on the chat template."""
    seen: set[Path] = set()
    current = base_run_dir(path)
    while current is not None and current.resolve() not in seen:
        seen.add(current.resolve())
        if (current / CHAT_TEMPLATE_FILE).is_file():
            return True
        try:
            cfg = recorded_config(current)
        except UserError:  # an unreadable config says nothing about the weights
            return False
        if cfg is None:
            return False
        if cfg.stage in CHAT_STAGES:
            return True
        current = base_run_dir(cfg.init_from)
    return False


def base_run_dir(path: str | Path | None) -> Path | None:
    """The run directory of ``path`` (a run or checkpoint directory, as ``init_from`` records it), or
    None when there is no run there (a Nemotron-H directory, a hub id, a base moved or removed)."""
    if path is None:
        return None
    path = Path(path)
    run_dir = path.parent.parent if path.parent.name == "checkpoints" else path
    return run_dir if (run_dir / CONFIG_FILE).is_file() else None
