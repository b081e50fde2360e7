"""A sampler for a run directory: what ``fp4train generate`` and ``eval`` start from.

Model and tokenizer come from the newest good checkpoint; overrides may change only the ``sampler``
and ``precision`` sections. Prompts are encoded as the weights saw text: one user turn of the chat
template for a run trained on it (``runs.lineage``), else a document opening with the document token.
The context (``sampler.max_context``, default ``data.seq_len``) bounds prompt plus completion: the
hybrid has no positional embedding and so no hard limit, but it never trained on longer sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from inkling_fp4.config import RunConfig, apply_overrides, from_dict, parse_override, to_dict
from inkling_fp4.data.chat import encode_prompt
from inkling_fp4.data.tokenizer import Tokenizer
from inkling_fp4.errors import ConfigError, UserError
from inkling_fp4.infer.sampler import Sampler, resolve_device, sampler_policy
from inkling_fp4.interop.load_run import load_run_checkpoint
from inkling_fp4.runs.checkpoint import Checkpoint
from inkling_fp4.runs.find import default_from
from inkling_fp4.runs.lineage import trained_on_chat

OVERRIDABLE = ("sampler", "precision")


@dataclass
class RunSampler:
    cfg: RunConfig
    """The run's config with the overrides applied."""
    run_dir: Path
    checkpoint: Checkpoint
    sampler: Sampler
    chat: bool
    """Prompts go in the chat template: the run's weights were trained on it."""

    @property
    def tokenizer(self) -> Tokenizer:
        return self.sampler.tokenizer

    def encode(self, text: str, where: str = "prompt") -> list[int]:
        """A prompt's tokens as this run reads text (see the module docstring)."""
        if not text.strip():
            raise UserError(f"{where} is empty; give some text to continue")
        tok = self.tokenizer
        if self.chat:
            tokens = encode_prompt(tok, [{"role": "user", "content": text}])
        else:
            tokens = [tok.bos, *tok.encode(text)]
        self.sampler.check_prompt(tokens, where)
        return tokens

    def describe(self) -> str:
        policy = self.sampler.policy
        precision = policy.describe(self.sampler.model) if policy is not None else "bf16"
        return (
            f"{self.run_dir} step {self.checkpoint.step} ({self.cfg.stage}); sampler.precision="
            f"{self.cfg.sampler.precision}: {precision}; context {self.sampler.context} tokens; prompts "
            + ("in the chat template" if self.chat else "as raw text")
        )


def load_run_sampler(from_run: Path | None, overrides: list[str] | None = None, echo=print) -> RunSampler:
    """The sampler of ``from_run`` (default: the newest run under runs/)."""
    overrides = list(overrides or [])
    for text in overrides:
        path, _ = parse_override(text)
        if path[0] not in OVERRIDABLE:
            raise ConfigError(
                f"override '{text}': generation takes {' and '.join(s + '.*' for s in OVERRIDABLE)} "
                "overrides (the model and its data are the run's)"
            )
    from_run = from_run or default_from(echo)
    cfg, model, tokenizer, ckpt = load_run_checkpoint(from_run)
    cfg = from_dict(RunConfig, apply_overrides(to_dict(cfg), overrides))
    device = resolve_device(cfg.sampler.device)
    model = model.to(device)
    switched = ckpt.state.get("schedule", {}).get("switched_scope")
    policy = sampler_policy(cfg.precision, cfg.sampler.precision, cfg.model.n_layers, switched)
    policy.apply(model)
    context = cfg.sampler.max_context or cfg.data.seq_len
    sampler = Sampler(model, tokenizer, cfg.sampler, policy, context=context)
    run_dir = ckpt.path.parent.parent if ckpt.path.parent.name == "checkpoints" else ckpt.path
    return RunSampler(cfg, run_dir, ckpt, sampler, trained_on_chat(run_dir))
